#include "tandem/engine/round_log.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "tandem/core/error.h"

namespace tandem {

RoundLog::RoundLog(const std::string& path) : file_(std::fopen(path.c_str(), "w")) {
  if (!file_) fail("round log: cannot open '", path, "' for writing: ", std::strerror(errno));
  std::fputs(
      "rows depth previous_depth drafted_ahead timed us draft_us verify_us accept_us commit_us "
      "next_draft_us wait_us cold_graph_runs\n",
      file_);
}

RoundLog::~RoundLog() {
  if (file_) std::fclose(file_);
}

std::shared_ptr<RoundLog> RoundLog::from_env() {
  static const std::shared_ptr<RoundLog> log = []() -> std::shared_ptr<RoundLog> {
    const char* path = std::getenv("TANDEM_ROUND_LOG");
    if (!path || !*path) return nullptr;
    return std::make_shared<RoundLog>(path);
  }();
  return log;
}

void RoundLog::write(const RoundRecord& r) {
  const double us = 1e6;
  std::lock_guard lock(mu_);
  std::fprintf(file_, "%lld %d %d %d %d %.1f %.1f %.1f %.1f %.1f %.1f %.1f %lld\n",
               static_cast<long long>(r.rows), r.depth, r.previous_depth, r.drafted_ahead ? 1 : 0,
               r.timed ? 1 : 0, us * r.seconds, us * r.draft, us * r.verify, us * r.accept,
               us * r.commit, us * r.next_draft, us * r.wait,
               static_cast<long long>(r.cold_graph_runs));
  std::fflush(file_);
}

}  // namespace tandem
