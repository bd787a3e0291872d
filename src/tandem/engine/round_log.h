// A line per speculative round of a BatchEngine (every round of an engine with a drafter, its
// depth-0 rounds under --depth auto included), for finding where a round's time goes and what the
// depth policy learns from it (TANDEM_ROUND_LOG=FILE, any backend and command): the rows and
// depth it ran, the depth before it, whether its draft was queued ahead by the round before,
// whether the policy took its time, and the host's time in each phase. A round whose time the
// policy did not take ran a CUDA graph cold or waited for a prefill queued before it.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>

namespace tandem {

struct RoundRecord {
  int64_t rows = 0;
  int depth = 0;
  int previous_depth = -1;  // the engine's round before (-1: none)
  bool drafted_ahead = false;
  bool timed = false;  // the depth policy took its time
  // Host seconds: the whole round, then its phases (drafting, the verify forward with the wait
  // for its reads, the accept walk, the commit, queueing the next round's draft), and of the
  // whole the time blocked on the device. Phases a round does not have stay 0.
  double seconds = 0, draft = 0, verify = 0, accept = 0, commit = 0, next_draft = 0, wait = 0;
  int64_t cold_graph_runs = 0;
};

// Lines append to one file, from any number of engines (a mutex orders them); the first line
// names the columns. Times are written in microseconds.
class RoundLog {
 public:
  explicit RoundLog(const std::string& path);  // throws Error naming the path
  ~RoundLog();
  RoundLog(const RoundLog&) = delete;
  RoundLog& operator=(const RoundLog&) = delete;

  // The process's log named by TANDEM_ROUND_LOG, opened on first use; null when it is unset.
  static std::shared_ptr<RoundLog> from_env();
  void write(const RoundRecord& r);

 private:
  std::mutex mu_;
  std::FILE* file_ = nullptr;
};

}  // namespace tandem
