#include "tandem/engine/speculative.h"

#include <algorithm>
#include <chrono>

#include "tandem/core/env_switch.h"
#include "tandem/core/error.h"
#include "tandem/engine/batch_engine.h"
#include "tandem/engine/qwen_engine_target.h"

namespace tandem {

bool SpecOptions::draft_ahead_default() {
  static const bool on = env_switch_on("TANDEM_DRAFT_AHEAD");
  return on;
}

bool SpecOptions::device_commit_default() {
  static const bool on = env_switch_on("TANDEM_DEVICE_COMMIT");
  return on;
}

double SpecStats::mean_accepted_length() const {
  return rounds > 0 ? static_cast<double>(accepted + rounds) / static_cast<double>(rounds) : 0.0;
}

double SpecStats::tokens_per_target_forward() const {
  return target_forwards > 0 ? static_cast<double>(emitted) / static_cast<double>(target_forwards)
                             : 0.0;
}

double SpecStats::acceptance_rate() const {
  return drafted > 0 ? static_cast<double>(accepted) / static_cast<double>(drafted) : 0.0;
}

SpeculativeGenerator::SpeculativeGenerator(const Qwen35Model& model,
                                           const spec::DraftProvider* drafter,
                                           std::string target_identity, SpecOptions options,
                                           DType kv_dtype)
    : SpeculativeGenerator(
          [&model, identity = std::move(target_identity), kv_dtype] {
            return std::make_unique<QwenEngineTarget>(model, identity, kv_dtype);
          },
          model.config().vocab_size, drafter, options) {}

SpeculativeGenerator::SpeculativeGenerator(EngineTargetFactory make_target, int64_t vocab_size,
                                           const spec::DraftProvider* drafter, SpecOptions options)
    : make_target_(std::move(make_target)),
      vocab_size_(vocab_size),
      drafter_(drafter),
      options_(options) {
  if (options_.depth < 0 || options_.depth > 16) fail("--depth must be in 0..16");
  if (options_.auto_depth && drafter_ && options_.depth > 0)
    policy_ =
        std::make_shared<spec::DepthPolicy>(spec::DepthPolicyOptions{.max_depth = options_.depth});
}

SpeculativeGenerator::~SpeculativeGenerator() = default;

void SpeculativeGenerator::set_keep_engine(bool keep) {
  keep_engine_ = keep;
  if (!keep) engine_.reset();
}

std::vector<GenerateResult> SpeculativeGenerator::run(const std::vector<GenerateRequest>& requests,
                                                      const TokenCallback& on_token,
                                                      GenerateStats* stats,
                                                      std::vector<SpecStats>* spec_stats) {
  validate_requests(requests, vocab_size_);
  const size_t B = requests.size();
  std::vector<GenerateResult> results(B);
  std::vector<SpecStats> sstats(B);
  std::vector<std::string> errors(B);
  // One closed batch through the serving engine: every request admitted at once, every prompt
  // chunk prefilled before the first round (no budget), the pool grown on demand.
  // An engine whose health probe released the drafter runs without it from then on; each run
  // gets the drafter back and probes it anew, as it did with an engine of its own.
  if (engine_ && engine_->counters().drafter_disabled) engine_.reset();
  if (!engine_ || !keep_engine_) {
    engine_.reset();
    EngineOptions eo;
    eo.spec = options_;
    eo.depth_policy = policy_;
    engine_ = std::make_unique<BatchEngine>(make_target_(), drafter_, eo);
  }
  BatchEngine& engine = *engine_;
  const EngineCounters before = engine.counters();

  class Collect : public RequestSink {
   public:
    Collect(size_t i, GenerateResult* r, SpecStats* s, std::string* error, const TokenCallback& cb)
        : i_(i), r_(r), s_(s), error_(error), cb_(cb) {}
    bool on_token(const TokenOutput& t) override {
      r_->tokens.push_back(t.id);
      if (cb_) cb_(i_, t.id);
      return true;
    }
    void on_finish(const RequestOutcome& o) override {
      r_->finish = o.finish;
      *s_ = o.speculation;
      if (o.end != RequestEnd::Finished) *error_ = o.error.empty() ? "cancelled" : o.error;
    }

   private:
    size_t i_;
    GenerateResult* r_;
    SpecStats* s_;
    std::string* error_;
    const TokenCallback& cb_;
  };
  try {
    for (size_t i = 0; i < B; ++i) {
      EngineRequest er;
      er.gen = requests[i];
      engine.submit(std::move(er),
                    std::make_shared<Collect>(i, &results[i], &sstats[i], &errors[i], on_token));
    }
    engine.run_to_completion();
  } catch (...) {
    engine_.reset();
    throw;
  }
  const EngineCounters after = engine.counters();
  if (!keep_engine_) engine_.reset();
  for (size_t i = 0; i < B; ++i)
    if (!errors[i].empty()) fail("request ", i, ": ", errors[i]);

  const EngineCounters& c = after;  // this run's share: after - before
  GenerateStats st;
  st.prefill_seconds = c.prefill_seconds - before.prefill_seconds;
  st.decode_seconds = c.decode_seconds - before.decode_seconds;
  st.decode_wait_seconds = c.decode_wait_seconds - before.decode_wait_seconds;
  st.drafter_prefill_seconds = c.drafter_prefill_seconds - before.drafter_prefill_seconds;
  st.row_change_seconds = c.row_change_seconds - before.row_change_seconds;
  st.drafter_move_seconds = c.drafter_move_seconds - before.drafter_move_seconds;
  st.decode_steps = c.rounds - before.rounds;
  st.draft_seconds = c.draft_seconds - before.draft_seconds;
  st.verify_seconds = c.verify_seconds - before.verify_seconds;
  st.accept_seconds = c.accept_seconds - before.accept_seconds;
  st.commit_seconds = c.commit_seconds - before.commit_seconds;
  st.rounds_by_depth = c.rounds_by_depth;
  st.cold_graph_runs = c.cold_graph_runs - before.cold_graph_runs;
  st.device_commit_rounds = c.device_commit_rounds - before.device_commit_rounds;
  for (size_t d = 0; d < st.rounds_by_depth.size() && d < before.rounds_by_depth.size(); ++d)
    st.rounds_by_depth[d] -= before.rounds_by_depth[d];
  for (size_t i = 0; i < B; ++i) {
    st.prompt_tokens += static_cast<int64_t>(requests[i].prompt.size());
    st.generated_tokens += static_cast<int64_t>(results[i].tokens.size());
    st.decode_tokens += static_cast<int64_t>(results[i].tokens.size()) - 1;
  }
  if (stats) *stats = st;
  if (spec_stats) *spec_stats = std::move(sstats);
  return results;
}

}  // namespace tandem
