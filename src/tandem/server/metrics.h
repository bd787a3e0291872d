// The server's Prometheus metrics (text exposition format 0.0.4): request outcomes, token
// counts, latency histograms, and the engine's gauges and speculation counters. Latencies are
// observed by the request streams on the engine thread; render() runs on an HTTP thread.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "tandem/engine/batch_engine.h"

namespace tandem::server {

class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);
  void observe(double seconds);
  // Appends the _bucket, _sum and _count series of `name`.
  void render(const std::string& name, const std::string& help, std::string* out) const;

 private:
  mutable std::mutex mu_;
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bucket, not cumulative; last = +Inf
  double sum_ = 0;
  uint64_t count_ = 0;
};

class ServerMetrics {
 public:
  ServerMetrics();
  // Outcomes: "ok", "cancelled", "error" (failed while running), "invalid" (4xx before running),
  // "overloaded" (503). Every HTTP request to a generation route ends in exactly one.
  void count_request(const std::string& outcome);
  Histogram& time_to_first_token() { return ttft_; }
  Histogram& inter_token_latency() { return itl_; }
  Histogram& request_latency() { return e2e_; }
  std::string render(const EngineCounters& engine, const std::string& drafter) const;

 private:
  mutable std::mutex mu_;
  std::map<std::string, uint64_t> requests_;
  Histogram ttft_, itl_, e2e_;
};

}  // namespace tandem::server
