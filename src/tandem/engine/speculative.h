// Speculative generation (DESIGN.md §5.1): every round drafts up to `depth` proposals per row,
// verifies all rows' windows [pending, proposals...] in one target forward, walks acceptance,
// then commits target and drafter state to the kept prefix. B rows or one: the same code.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tandem/engine/engine_target.h"
#include "tandem/engine/generator.h"
#include "tandem/spec/accept.h"
#include "tandem/spec/depth_policy.h"
#include "tandem/spec/draft.h"
#include "tandem/spec/drafter_health.h"

namespace tandem {

class BatchEngine;

struct SpecOptions {
  int depth = 3;  // proposals per round (0 = plain decoding through the round machinery)
  spec::VerifyMode verify = spec::VerifyMode::Match;
  int64_t prefill_chunk = kPrefillChunkTokens;  // prompt tokens per prefill forward and row
  // The drafter health probe (spec::DrafterHealth): a drafter whose first proposals stop being
  // accepted is reported once (EngineOptions::on_warning) and rounds propose nothing from then on.
  bool health_probe = true;
  spec::DrafterHealthOptions health = {};
  // Adaptive depth (spec::DepthPolicy): each round proposes 0..depth tokens, whichever the running
  // acceptance and the measured round times say emits the most tokens per second.
  bool auto_depth = false;
  // Waits for the device at the end of each phase of a speculative round (draft, verify, accept,
  // commit), so that the phase times (EngineCounters) hold the device work each phase queued.
  // Costs a sync per phase: for measuring where a round's time goes, not for serving.
  bool sync_phases = false;
  // Rounds settled on the device (issue 19): with an MTP drafter and match verification, each
  // round's accept walk and commits stay where the tokens are, and the next round is queued
  // before the host reads this one (one host read per round, overlapped with the device's work).
  // Where a round cannot be (a row near its max_tokens, log-probabilities, rows changing), it
  // runs as before. Off by default until measured on a GPU.
  bool settled_rounds = false;
  // A host round queues the next round's draft right after its commit, where nothing can change
  // the rows before that round (BatchEngine::queue_draft_ahead): the device runs the draft chain
  // while the host finishes the step. Same tokens and proposals; TANDEM_DRAFT_AHEAD=0 turns it
  // off (for A/B measurements).
  bool draft_ahead = draft_ahead_default();
  static bool draft_ahead_default();
  // A host round's commit queued on the device behind the verify's reads (BatchEngine): the
  // device walks the windows where their tokens are (ops::accept_windows) and commits the target's
  // state, while the host waits for the tokens and walks them too; the host then only resolves
  // the lengths. Taken with match verification, a target that settles windows and no prefix cache
  // (a row ending mid-window keeps its whole accepted window in its state, which a cached turn
  // must not). Same tokens; TANDEM_DEVICE_COMMIT=0 turns it off (for A/B measurements).
  bool device_commit = device_commit_default();
  static bool device_commit_default();
};

// Per-request speculation counters.
struct SpecStats {
  int64_t rounds = 0;                         // verify forwards the request took part in
  int64_t drafted = 0;                        // proposals drafted
  int64_t accepted = 0;                       // proposals accepted
  std::vector<int64_t> accepted_by_position;  // [depth]: times window position j was accepted
  std::vector<int64_t> drafted_by_position;   // [depth]: times a proposal j was drafted
  int64_t target_forwards = 0;                // prefill + rounds
  int64_t emitted = 0;                        // tokens emitted (== generated tokens)
  // Tokens emitted per round, bonus/correction included (AL).
  double mean_accepted_length() const;
  double tokens_per_target_forward() const;
  double acceptance_rate() const;  // accepted / drafted
};

// Opens a fresh target state (QwenEngineTarget, Glm5EngineTarget) for one run.
using EngineTargetFactory = std::function<std::unique_ptr<EngineTarget>()>;

class SpeculativeGenerator {
 public:
  // `drafter` may be null: rounds then carry no proposals (a plain decode step each).
  // kv_dtype: the KV's storage (EngineOptions::kv_dtype).
  SpeculativeGenerator(const Qwen35Model& model, const spec::DraftProvider* drafter,
                       std::string target_identity, SpecOptions options,
                       DType kv_dtype = Qwen35State::kDefaultKvDType);
  // Any target; vocab_size: the target's, which requests are checked against.
  SpeculativeGenerator(EngineTargetFactory make_target, int64_t vocab_size,
                       const spec::DraftProvider* drafter, SpecOptions options);
  ~SpeculativeGenerator();
  SpeculativeGenerator(const SpeculativeGenerator&) = delete;
  SpeculativeGenerator& operator=(const SpeculativeGenerator&) = delete;

  // Same contract as Generator::run; `spec_stats` (optional) receives one entry per request.
  std::vector<GenerateResult> run(const std::vector<GenerateRequest>& requests,
                                  const TokenCallback& on_token = {},
                                  GenerateStats* stats = nullptr,
                                  std::vector<SpecStats>* spec_stats = nullptr);

  // Runs share one engine by default, as requests to a server do: its state pools, the
  // drafter's rows and the CUDA graphs captured for their buffers carry over, so a run pays for
  // its prompts and rounds, not for opening a target. false: every run opens a fresh engine
  // (what a cold start costs; bench-spec --fresh-engines).
  void set_keep_engine(bool keep);
  // With SpecOptions::auto_depth: the depth policy the runs learn in (shared by them); else null.
  const spec::DepthPolicy* depth_policy() const { return policy_.get(); }

 private:
  EngineTargetFactory make_target_;
  int64_t vocab_size_ = 0;
  const spec::DraftProvider* drafter_;
  SpecOptions options_;
  // With auto_depth: one policy for all runs, so each run starts from what the ones before
  // learnt (a run of a few short requests is over before a fresh policy settles).
  std::shared_ptr<spec::DepthPolicy> policy_;
  bool keep_engine_ = true;
  // The engine of the last run while keep_engine_; dropped when a run fails midway, so that no
  // request of a failed run stays queued in it.
  std::unique_ptr<BatchEngine> engine_;
};

}  // namespace tandem
