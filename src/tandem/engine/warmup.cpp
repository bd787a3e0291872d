#include "tandem/engine/warmup.h"

#include <chrono>
#include <memory>
#include <string>
#include <utility>

#include "tandem/core/error.h"
#include "tandem/engine/batch_engine.h"

namespace tandem {

namespace {

// Counts a warm-up request's tokens and keeps the first failure.
class WarmupSink : public RequestSink {
 public:
  bool on_token(const TokenOutput&) override {
    ++tokens;
    return true;
  }
  void on_finish(const RequestOutcome& outcome) override {
    if (outcome.end != RequestEnd::Finished)
      error = outcome.error.empty() ? "cancelled" : outcome.error;
  }
  int64_t tokens = 0;
  std::string error;
};

// Leaves the engine out of warm-up mode however warm_up ends.
struct WarmupMode {
  BatchEngine& engine;
  explicit WarmupMode(BatchEngine& e) : engine(e) { engine.set_warmup(true); }
  ~WarmupMode() { engine.set_warmup(false); }
  WarmupMode(const WarmupMode&) = delete;
  WarmupMode& operator=(const WarmupMode&) = delete;
};

}  // namespace

WarmupReport warm_up(BatchEngine& engine, const WarmupOptions& options) {
  if (options.max_rows < 1) fail("warm-up: at least one row, got ", options.max_rows);
  if (options.prompt_tokens < 1) fail("warm-up: prompts of at least one token");
  if (options.vocab_size < 1) fail("warm-up: a vocabulary of ", options.vocab_size, " ids");
  const auto t0 = std::chrono::steady_clock::now();
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  const EngineCounters before = engine.counters();
  const WarmupMode mode(engine);
  // Enough tokens for a row to run every depth twice even when each proposal is accepted (a
  // round at depth d emits up to d + 1), plus the token the prefill samples.
  const int64_t D = engine.depth();
  const int64_t max_tokens = (D + 1) * (D + 2) + 1;
  WarmupReport report;
  for (int rows = 1; rows <= options.max_rows; ++rows) {
    // Greedy and sampled rounds run different graphs (sampling draws on the device): both.
    for (const bool sampled : {false, true}) {
      std::vector<std::shared_ptr<WarmupSink>> sinks;
      for (int r = 0; r < rows; ++r) {
        EngineRequest req;
        req.gen.prompt.resize(static_cast<size_t>(options.prompt_tokens));
        for (int64_t i = 0; i < options.prompt_tokens; ++i)
          req.gen.prompt[static_cast<size_t>(i)] =
              static_cast<int32_t>((7919 * (i + 31 * r) + 1) % options.vocab_size);
        req.gen.max_tokens = max_tokens;
        req.gen.ignore_eos = true;
        if (sampled) {
          req.gen.sampling.temperature = 1.0f;
          req.gen.sampling.seed = static_cast<uint64_t>(r + 1);
        }
        auto sink = std::make_shared<WarmupSink>();
        try {
          // A queue shorter than the batch: admit what waits, then try again.
          while (engine.submit(req, sink) == BatchEngine::Submit::QueueFull)
            if (!engine.step()) fail("warm-up: the engine's queue refuses requests while idle");
        } catch (...) {
          engine.run_to_completion();  // no warm-up request outlives the warm-up
          throw;
        }
        sinks.push_back(std::move(sink));
      }
      engine.run_to_completion();
      for (const auto& s : sinks) {
        if (!s->error.empty())
          fail("warm-up: a request of the ", rows, "-row batch failed: ", s->error);
        report.generated_tokens += s->tokens;
      }
      report.requests += rows;
    }
    if (options.on_rows) options.on_rows(rows, elapsed());
  }
  const EngineCounters after = engine.counters();
  report.rounds = after.rounds - before.rounds;
  report.cold_graph_runs = after.cold_graph_runs - before.cold_graph_runs;
  report.graph_evictions = after.graph_evictions - before.graph_evictions;
  report.seconds = elapsed();
  return report;
}

}  // namespace tandem
