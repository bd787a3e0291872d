#include "tandem/server/metrics.h"

#include <cstdio>

namespace tandem::server {

namespace {

std::string number(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.9g", v);
  return buf;
}

void series(std::string* out, const std::string& name, const std::string& type,
            const std::string& help) {
  *out += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
}

}  // namespace

Histogram::Histogram(std::vector<double> upper_bounds)
    : bounds_(std::move(upper_bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double seconds) {
  std::lock_guard lock(mu_);
  size_t b = 0;
  while (b < bounds_.size() && seconds > bounds_[b]) ++b;
  ++counts_[b];
  sum_ += seconds;
  ++count_;
}

void Histogram::render(const std::string& name, const std::string& help, std::string* out) const {
  std::lock_guard lock(mu_);
  series(out, name, "histogram", help);
  uint64_t cumulative = 0;
  for (size_t b = 0; b < counts_.size(); ++b) {
    cumulative += counts_[b];
    const std::string le = b < bounds_.size() ? number(bounds_[b]) : "+Inf";
    *out += name + "_bucket{le=\"" + le + "\"} " + std::to_string(cumulative) + "\n";
  }
  *out += name + "_sum " + number(sum_) + "\n";
  *out += name + "_count " + std::to_string(count_) + "\n";
}

ServerMetrics::ServerMetrics()
    : ttft_({0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40,
             80}),
      itl_({0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.5,
            1, 2.5}),
      e2e_({0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160}) {
  for (const char* o : {"ok", "cancelled", "error", "invalid", "overloaded"}) requests_[o] = 0;
}

void ServerMetrics::count_request(const std::string& outcome) {
  std::lock_guard lock(mu_);
  ++requests_[outcome];
}

std::string ServerMetrics::render(const EngineCounters& e, const std::string& drafter) const {
  std::string out;
  {
    std::lock_guard lock(mu_);
    series(&out, "tandem_requests_total", "counter",
           "Generation requests by outcome (ok, cancelled, error, invalid, overloaded).");
    for (const auto& [outcome, n] : requests_)
      out += "tandem_requests_total{outcome=\"" + outcome + "\"} " + std::to_string(n) + "\n";
  }
  auto scalar = [&](const std::string& name, const std::string& type, const std::string& help,
                    double v) {
    series(&out, name, type, help);
    out += name + " " + number(v) + "\n";
  };
  scalar("tandem_prompt_tokens_total", "counter", "Prompt tokens admitted.",
         static_cast<double>(e.prompt_tokens));
  scalar("tandem_generation_tokens_total", "counter", "Tokens generated.",
         static_cast<double>(e.generated_tokens));
  scalar("tandem_queue_depth", "gauge", "Requests waiting for admission.",
         static_cast<double>(e.queued));
  series(&out, "tandem_running_rows", "gauge", "Rows in the engine, by phase.");
  out += "tandem_running_rows{phase=\"prefill\"} " + std::to_string(e.prefilling) + "\n";
  out += "tandem_running_rows{phase=\"decode\"} " + std::to_string(e.decoding) + "\n";
  scalar("tandem_kv_blocks_used", "gauge", "KV cache blocks held by rows and the prefix cache.",
         static_cast<double>(e.kv_blocks_used));
  scalar("tandem_kv_blocks_total", "gauge", "KV cache blocks in the pool.",
         static_cast<double>(e.kv_blocks_total));
  scalar("tandem_rounds_total", "counter", "Speculative rounds (verify forwards).",
         static_cast<double>(e.rounds));
  scalar("tandem_prefill_forwards_total", "counter", "Prompt prefill forwards.",
         static_cast<double>(e.prefill_forwards));
  series(&out, "tandem_prefix_cache_requests_total", "counter",
         "Admissions by prefix-cache result (memory: hit or miss; disk: hits read back from it).");
  out += "tandem_prefix_cache_requests_total{tier=\"memory\",result=\"hit\"} " +
         std::to_string(e.prefix_hits) + "\n";
  out += "tandem_prefix_cache_requests_total{tier=\"memory\",result=\"miss\"} " +
         std::to_string(e.prefix_misses) + "\n";
  out += "tandem_prefix_cache_requests_total{tier=\"disk\",result=\"hit\"} " +
         std::to_string(e.prefix_disk_hits) + "\n";
  scalar("tandem_prefix_cache_disk_files", "gauge", "Prefix-cache files in the disk tier's folder.",
         static_cast<double>(e.prefix_disk_files));
  scalar("tandem_drafter_disabled", "gauge",
         "1 once the drafter health probe found the drafter's proposals no longer accepted "
         "(the engine decodes without it since).",
         static_cast<double>(e.drafter_disabled));
  scalar("tandem_pipelined_rounds_total", "counter",
         "Rounds run as plain steps queued ahead of the host (no drafter or a retired one).",
         static_cast<double>(e.pipelined_rounds));
  scalar("tandem_queued_draft_rounds_total", "counter",
         "Speculative rounds whose verify read the drafter's proposals in device memory (one host "
         "wait per round).",
         static_cast<double>(e.queued_draft_rounds));
  scalar("tandem_drafted_ahead_rounds_total", "counter",
         "Speculative rounds whose draft was queued at the end of the round before, while the "
         "rows could not change (the device drafted while the host finished that step).",
         static_cast<double>(e.drafted_ahead_rounds));
  scalar("tandem_settled_rounds_total", "counter",
         "Speculative rounds accepted and committed on the device, queued before the host read "
         "the round before them.",
         static_cast<double>(e.settled_rounds));
  scalar("tandem_device_commit_rounds_total", "counter",
         "Host rounds whose target commit the device ran behind the verify's reads, while the "
         "host walked the same tokens.",
         static_cast<double>(e.device_commit_rounds));
  scalar("tandem_cold_graph_runs_total", "counter",
         "CUDA graphs the engine's steps ran cold (a step shape's first run or its capture, each "
         "far dearer for the host than a replay); it should stop growing once the server has "
         "seen its batch shapes. 0 on the CPU.",
         static_cast<double>(e.cold_graph_runs));
  scalar("tandem_graph_evictions_total", "counter",
         "CUDA graphs the engine's steps dropped from a full graph cache; a growing count means "
         "the server's step shapes outnumber the cache and keep being captured again. 0 on the "
         "CPU.",
         static_cast<double>(e.graph_evictions));
  series(&out, "tandem_round_phase_seconds_total", "counter",
         "Host time in the phases of speculative rounds (draft, verify, accept, commit).");
  const std::pair<const char*, double> phases[] = {{"draft", e.draft_seconds},
                                                   {"verify", e.verify_seconds},
                                                   {"accept", e.accept_seconds},
                                                   {"commit", e.commit_seconds}};
  for (const auto& [phase, v] : phases)
    out += std::string("tandem_round_phase_seconds_total{phase=\"") + phase + "\"} " + number(v) +
           "\n";
  scalar("tandem_drafter_first_acceptance", "gauge",
         "Share of the drafter's recent first proposals that were accepted (the probe's window).",
         e.drafter_first_acceptance);
  scalar("tandem_prefix_cache_disk_bytes", "gauge",
         "Bytes of the prefix-cache files in the disk tier's folder.",
         static_cast<double>(e.prefix_disk_bytes));
  scalar("tandem_prefix_cache_disk_writes_total", "counter",
         "Prefix-cache entries written to the disk tier.",
         static_cast<double>(e.prefix_disk_writes));
  scalar("tandem_prefix_cache_disk_removed_total", "counter",
         "Disk-tier files removed as corrupt, truncated or written under another key.",
         static_cast<double>(e.prefix_disk_removed));
  scalar("tandem_prefix_cache_reused_tokens_total", "counter",
         "Prompt tokens restored from the prefix cache instead of prefilled.",
         static_cast<double>(e.prefix_tokens_reused));
  scalar("tandem_prefix_cache_entries", "gauge", "Saved prefix boundaries.",
         static_cast<double>(e.prefix_entries));
  scalar("tandem_prefix_cache_bytes", "gauge",
         "Bytes the prefix cache holds (snapshots, drafter checkpoints, its KV blocks).",
         static_cast<double>(e.prefix_bytes));
  scalar("tandem_prefix_cache_max_bytes", "gauge", "The prefix cache's byte budget.",
         static_cast<double>(e.prefix_max_bytes));
  scalar("tandem_prefix_cache_kv_blocks", "gauge", "KV blocks the prefix cache holds.",
         static_cast<double>(e.prefix_kv_blocks));
  scalar("tandem_prefix_cache_evictions_total", "counter", "Prefix-cache entries evicted.",
         static_cast<double>(e.prefix_evictions));
  series(&out, "tandem_draft_tokens_total", "counter",
         "Proposals drafted, per window position and drafter.");
  for (size_t j = 0; j < e.drafted_by_position.size(); ++j)
    out += "tandem_draft_tokens_total{drafter=\"" + drafter + "\",position=\"" + std::to_string(j) +
           "\"} " + std::to_string(e.drafted_by_position[j]) + "\n";
  series(&out, "tandem_accepted_tokens_total", "counter",
         "Proposals accepted, per window position and drafter.");
  for (size_t j = 0; j < e.accepted_by_position.size(); ++j)
    out += "tandem_accepted_tokens_total{drafter=\"" + drafter + "\",position=\"" +
           std::to_string(j) + "\"} " + std::to_string(e.accepted_by_position[j]) + "\n";
  ttft_.render("tandem_time_to_first_token_seconds", "Time from arrival to the first token.", &out);
  itl_.render("tandem_inter_token_latency_seconds", "Time between consecutive tokens.", &out);
  e2e_.render("tandem_request_latency_seconds", "Time from arrival to the last token.", &out);
  return out;
}

}  // namespace tandem::server
