// Start-up warm-up (`tandem serve --warmup-rows`): synthetic requests run through an engine before
// it takes traffic, at every row count 1..max_rows, greedy and sampled, so that
//  - the CUDA graphs of every (rows, depth) shape a round runs are captured before the first
//    client's rounds need them (a shape's first run and its capture cost the host far more than a
//    replay; without a warm-up a fresh server's first requests pay for each), and
//  - with `--depth auto`, the depth policy starts from measured round costs of every depth at
//    every row count (BatchEngine::set_warmup: the policy walks the depths, two rounds apiece, and
//    learns costs only; acceptance and the drafter health probe ignore the warm-up's prompts).
// Output never depends on it: requests are exact whatever ran before them.
#pragma once

#include <cstdint>
#include <functional>

namespace tandem {

class BatchEngine;

struct WarmupOptions {
  int max_rows = 1;            // batches of 1, 2, ..., max_rows requests
  int64_t prompt_tokens = 16;  // each synthetic prompt's length
  int32_t vocab_size = 0;      // prompt ids are drawn from [0, vocab_size)
  // After each row count's batches: that row count and the seconds since the warm-up began.
  std::function<void(int rows, double seconds)> on_rows;
};

struct WarmupReport {
  int64_t requests = 0, generated_tokens = 0;
  // The engine's counters over the warm-up. Evictions: its shapes outnumbered the graph cache,
  // so the least recently run of them are no longer captured when it ends.
  int64_t rounds = 0, cold_graph_runs = 0, graph_evictions = 0;
  double seconds = 0;
};

// Runs on the calling thread, which must be the engine's (before BatchEngine::serve, say), with
// no other request in flight. Throws Error naming the problem if the options are out of range or
// a warm-up request fails; the engine is left out of warm-up mode either way.
WarmupReport warm_up(BatchEngine& engine, const WarmupOptions& options);

}  // namespace tandem
