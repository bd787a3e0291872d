// The continuously batched speculative engine (DESIGN.md §5.1, §7): one loop owns the target, the
// drafter and every row's state. Requests are queued from any thread; between rounds the loop
// admits them (their prompts prefilled in fixed chunks under a per-step token budget,
// interleaved with decode rounds; while rows decode, a chunk's forward may itself be spread over
// several steps a few layers at a time, EngineOptions::prefill_layers) and retires finished,
// cancelled and failed ones.
//
// Membership changes are transactions (principle 4): a join opens the row's target state (slot +
// every KV block it can ever need) and its drafter row together or not at all; a prompt whose
// prefill is done moves from the prefill drafter group to the decoding group through the
// drafter's own checkpoint (capture -> prepare_append), also all-or-nothing.
//
// Exactness (principle 2): a request's tokens depend only on its prompt, sampling parameters and
// seed. Prompts are prefilled in chunks of a fixed size (SpecOptions::prefill_chunk, by default
// kPrefillChunkTokens) counted from the prompt's start,
// one chunk per row per forward, whatever the budget or the neighbours; decode and verify
// kernels are batch-invariant; sampling keys are (seed, output index). `tandem generate` runs
// through this same engine, so serving and the command line agree byte for byte.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "tandem/engine/engine_target.h"
#include "tandem/engine/prefix_cache.h"
#include "tandem/engine/request_sink.h"
#include "tandem/engine/round_log.h"
#include "tandem/engine/speculative.h"
#include "tandem/model/qwen3_5.h"
#include "tandem/spec/draft.h"

namespace tandem {

struct EngineOptions {
  int max_rows = 0;       // rows admitted at once (prefilling + decoding); 0 = no limit
  int64_t kv_blocks = 0;  // fixed KV pool in blocks; 0 = grow on demand (no budget)
  DType kv_dtype = Qwen35State::kDefaultKvDType;  // KV storage: BF16 or F32 (--kv-dtype)
  size_t max_queue = 0;                           // requests waiting for admission; 0 = no limit
  int64_t prefill_budget = 0;  // prompt tokens per step (at least one chunk runs); 0 = all
  // Layers of a prefill forward run per step while other rows decode (layer-sliced prefill:
  // Qwen35Model::PromptForward); 0 = the whole forward in one step. A chunk's cost is then spread
  // over several rounds, so a long prompt raises the decoding rows' inter-token latency by a
  // fraction of a chunk instead of a whole one; the numbers are the same either way. With no row
  // decoding a forward always runs whole.
  int prefill_layers = 0;
  // Which forwards are sliced. A prompt longer than one chunk would stall the decoding rows once
  // per chunk, so a forward holding one of its chunks is always sliced. A forward of prompts that
  // fit one chunk each stalls them once per prompt: it is sliced only while at least this many
  // rows decode per row prefilling, since a whole chunk delays each decoding row by a chunk
  // (~2-3 rounds at 32 rows × 256 tokens on the H200) and a forward cut into S slices delays
  // each prefilling row's first token by S - 1 rounds. So an admission burst (many short
  // prompts, few streams yet) runs whole forwards. 0: slice whenever a row decodes.
  int prefill_slice_ratio = 3;
  // The prefix cache's byte budget (PrefixCache); 0 = no cache. Saved boundaries: every multiple
  // of the prefill chunk a prompt's prefill reaches (the state a cold prefill of any longer prompt
  // has there, on every backend), and, where prompt forwards equal decoding
  // (EngineTarget::prompt_matches_decode: Qwen3.5 on the CPU), the end of each prompt too.
  size_t prefix_cache_bytes = 0;
  // The prefix cache's disk tier (PrefixDisk): a folder ("" = none), the hash of the tokenizer
  // the prompts' ids come from (part of the files' key with the target identity and KV scheme),
  // and whether every entry is written there when the engine is destroyed (a clean shutdown);
  // otherwise only evicted ones are. Needs prefix_cache_bytes and a target identity.
  std::string prefix_cache_dir;
  std::string tokenizer_hash;
  // With SpecOptions::auto_depth: the depth policy to learn in, for engines that run one after
  // another on the same model and drafter (SpeculativeGenerator's runs), so that what one learnt
  // (round costs, acceptance) carries over instead of being relearnt within each short run. Its
  // max depth must be SpecOptions::depth. Null: the engine learns in its own.
  std::shared_ptr<spec::DepthPolicy> depth_policy;
  // A line per decode round (round_log.h). Null: the process's TANDEM_ROUND_LOG, if set.
  std::shared_ptr<RoundLog> round_log;
  bool prefix_cache_persist = false;
  SpecOptions spec;
  // Where the engine's warnings go (a collapsed drafter); null: standard error.
  std::function<void(const std::string&)> on_warning;
};

// A snapshot of the engine's counters (Prometheus /metrics, tests).
struct EngineCounters {
  int64_t queued = 0, prefilling = 0, decoding = 0;
  int64_t kv_blocks_used = 0, kv_blocks_total = 0;  // total 0: the pool grows on demand
  int64_t rounds = 0, prefill_forwards = 0;
  // Of the rounds, those run as plain steps queued ahead of the host (no drafter, or a retired
  // one, and no log-probabilities): the fastest plain path.
  int64_t pipelined_rounds = 0;
  // Of the rounds, those whose verify forward read the drafter's proposals where its chain left
  // them (DraftRows::draft_queued: one host wait per round).
  int64_t queued_draft_rounds = 0;
  // Of those, the rounds whose draft was queued at the end of the round before (the rows could not
  // change in between), so the device ran it while the host finished that step.
  int64_t drafted_ahead_rounds = 0;
  // Of the rounds, those settled on the device and queued before the host read the round before
  // (SpecOptions::settled_rounds).
  int64_t settled_rounds = 0;
  // Of the host rounds, those whose target commit the device ran behind the verify's reads
  // (SpecOptions::device_commit).
  int64_t device_commit_rounds = 0;
  int64_t prompt_tokens = 0, generated_tokens = 0;
  int64_t finished = 0, cancelled = 0, failed = 0;
  double prefill_seconds = 0, decode_seconds = 0;  // time in prefill forwards and in rounds
  // Of decode_seconds, the time the engine's thread was blocked on the device
  // (ops::device_wait_seconds); the rest is host work, which the device waits for unless it is
  // queued ahead of it.
  double decode_wait_seconds = 0;
  // The drafter's pass over finished prompt chunks and the rows' move into the decoding group;
  // and the rest of the engine's steps: admissions, reads of queued work when rows change,
  // rows leaving, requests finishing.
  double drafter_prefill_seconds = 0, row_change_seconds = 0;
  double drafter_move_seconds = 0;  // of drafter_prefill_seconds: the rows' move
  // Of decode_seconds, the speculative rounds' phases: drafting, the verify forward, the accept
  // walk (and emitting), the commit of target and drafter. Host wall time: without
  // SpecOptions::sync_phases, device work a phase queues may be waited for in a later one.
  double draft_seconds = 0, verify_seconds = 0, accept_seconds = 0, commit_seconds = 0;
  std::vector<int64_t> drafted_by_position, accepted_by_position;  // [depth]
  // Rounds by the depth they ran at ([0..depth]; pipelined plain steps at 0): what an adaptive
  // depth chose.
  std::vector<int64_t> rounds_by_depth;
  // CUDA graphs run cold in the engine's steps (GraphCache::cold_runs: a shape's first run or its
  // capture; each costs the host far more than a replay). 0 on the CPU.
  int64_t cold_graph_runs = 0;
  // CUDA graphs the engine's steps dropped from a full graph cache (GraphCache::evicted_graphs):
  // shapes that run cold again when they recur. 0 on the CPU.
  int64_t graph_evictions = 0;
  // Prefix cache: admissions that reused a saved prefix or found none (none counted when the
  // cache is off), prompt tokens not prefilled thanks to it, and its contents.
  int64_t prefix_hits = 0, prefix_misses = 0, prefix_tokens_reused = 0;
  int64_t prefix_entries = 0, prefix_evictions = 0, prefix_kv_blocks = 0;
  int64_t prefix_bytes = 0, prefix_max_bytes = 0;
  int64_t prefix_disk_hits = 0, prefix_disk_files = 0, prefix_disk_writes = 0;
  int64_t prefix_disk_removed = 0;
  int64_t prefix_disk_bytes = 0;  // of the files in the disk tier's folder
  // The drafter health probe: 1 once the drafter collapsed (its rows are released and the
  // engine runs as without a drafter since), and the first-proposal acceptance over the probe's
  // window.
  int64_t drafter_disabled = 0;
  double drafter_first_acceptance = 0.0;
};

class BatchEngine {
 public:
  // `drafter` may be null (plain decoding through the round machinery) and must outlive the
  // engine. With a fixed pool (options.kv_blocks > 0) options.max_rows must be set.
  BatchEngine(const Qwen35Model& model, const spec::DraftProvider* drafter,
              std::string target_identity, EngineOptions options);
  // Any target (QwenEngineTarget, Glm5EngineTarget). Options the target cannot serve (a fixed
  // pool, the prefix cache) are refused with an Error naming them.
  BatchEngine(std::unique_ptr<EngineTarget> target, const spec::DraftProvider* drafter,
              EngineOptions options);
  ~BatchEngine();
  BatchEngine(const BatchEngine&) = delete;
  BatchEngine& operator=(const BatchEngine&) = delete;

  enum class Submit { Queued, QueueFull };
  // Any thread. Checks the request against the model and the pool first and throws Error naming
  // the problem (empty prompt, ids out of range, bad sampling, a prompt + max_tokens that can
  // never fit the pool); QueueFull leaves the sink untouched. Otherwise the sink belongs to the
  // engine until its on_finish.
  Submit submit(EngineRequest request, std::shared_ptr<RequestSink> sink);

  // One scheduling step on the calling thread: retire cancelled rows, admit from the queue,
  // prefill chunks up to the budget, then one speculative round of every decoding row.
  // Returns whether work remains (rows or queued requests).
  bool step();
  // Steps until every submitted request has finished (the command line's batch).
  void run_to_completion();
  // Steps until stop(), sleeping while there is nothing to do (the server's loop). On return
  // every request still held has finished with RequestEnd::Cancelled and `reason` as error.
  void serve(const std::string& shutdown_reason = "the server is shutting down");
  void stop();  // any thread

  EngineCounters counters() const;  // any thread
  // Tokens (prompt + generated + the largest window) a request with this prompt and max_tokens
  // needs in the KV pool; compared with capacity_tokens() at submit.
  int64_t tokens_needed(int64_t prompt_tokens, int64_t max_tokens) const;
  int64_t capacity_tokens() const;  // the fixed pool's tokens; 0 when it grows on demand
  int depth() const { return depth_; }
  const spec::DraftProvider* drafter() const { return drafter_; }
  // Start-up warm-up (engine/warmup.h), on the engine's thread between steps: while on, the depth
  // policy walks every depth and learns round costs only, and the drafter health probe ignores
  // the rounds (warm-up prompts are not the traffic the drafter is judged on).
  void set_warmup(bool on);
  // The depth policy rounds consult (SpecOptions::auto_depth with a drafter), else null.
  const spec::DepthPolicy* depth_policy() const { return policy_.get(); }

 private:
  struct Row;
  struct Pending {
    EngineRequest request;
    std::shared_ptr<RequestSink> sink;
  };

  std::unique_ptr<EngineTarget> target_;  // the model's state; before the cache that shares it
  const spec::DraftProvider* drafter_;
  EngineOptions options_;
  int depth_ = 0;        // configured proposals per round (reservations, stats)
  int draft_depth_ = 0;  // proposals rounds ask for: depth_, or 0 once the drafter collapsed
  spec::DrafterHealth health_;
  bool warmup_ = false;  // set_warmup
  // With SpecOptions::auto_depth and a drafter: EngineOptions::depth_policy, or the engine's own.
  std::shared_ptr<spec::DepthPolicy> policy_;
  // What the drafter reads of the target's forwards (spec::HiddenTaps), and where the last
  // forward's output holds it: [tokens, taps_.width(H)], or null without taps.
  bool want_final_ = false, want_prenorm_ = false;
  bool prompt_hidden_on_device_ = false;  // prefill forwards leave the drafter's hiddens there
  spec::HiddenTaps taps_;
  const float* tapped_rows() const;
  // Whether a round the depth policy runs at depth 0 can be a pipelined plain step: a drafter of
  // tokens alone (no taps), match verification, greedy rows that need no logits, no prefix cache.
  bool depth_zero_pipelines() const;
  // Hands a token drafter the tokens its rows' targets processed in such plain steps.
  void catch_up_drafter();

  std::unique_ptr<PrefixDisk> disk_;
  std::unique_ptr<PrefixStore> cache_;  // after target_ and disk_: it uses both until destroyed
  // Drafter rows of the prompts being prefilled, and of the rows decoding: a row's index in
  // prefilling_ / decoding_ is its row in the matching group.
  std::unique_ptr<spec::DraftRows> prefill_drafts_, decode_drafts_;
  std::vector<std::unique_ptr<Row>> prefilling_, decoding_;

  mutable std::mutex mu_;  // guards queue_, stopping_ and counters_
  std::condition_variable wake_;
  std::deque<Pending> queue_;
  bool stopping_ = false;
  EngineCounters counters_;

  // Scratch reused across steps (the round path allocates nothing once warm).
  ForwardOutput out_;
  std::vector<int32_t> tokens_;
  std::vector<RowInput> inputs_;
  std::vector<spec::RowDraft> drafts_;
  std::vector<spec::DraftProposal> proposals_;
  std::vector<std::vector<int32_t>> windows_;
  std::vector<RowKeep> keeps_;
  std::vector<spec::VerifyRow> verified_;
  std::vector<TokenWeight> dist_scratch_;
  std::vector<ops::SampleRow> sample_rows_;  // a forward's draws (ForwardRequest::sample_rows)
  spec::QueuedDraft queued_;                 // a draft whose proposals the verify reads in place
  std::vector<int32_t> draft_from_;          // ForwardRequest::draft_from of that verify
  std::vector<int64_t> drafted_pos_, accepted_pos_;  // this round's counts per window position
  std::vector<int32_t> collected_;

  // The prefill forward in flight is the target's (EngineTarget::begin_prompt; layer-sliced: it
  // may span several steps; its RowInputs hold each row's chunk size); here are its rows (Row::id,
  // in forward order) and whether it copies logits to the host. Its rows stay in prefilling_ and
  // are never retired while it runs: their slots are being written.
  std::vector<uint64_t> inflight_ids_;
  bool inflight_logits_ = false;
  bool inflight_long_ = false;  // it holds a chunk of a prompt longer than one chunk

  // Plain rounds (no drafter, no log-probabilities; greedy or sampled rows, whose tokens are drawn
  // on the device) are pipelined one deep: step S+1 is queued taking S's tokens from device memory
  // before the host reads S's, so the device never waits for the host's turnaround. `chained_`:
  // a step is queued whose tokens were not collected yet; chain_ids_ are its rows (Row::id).
  bool chained_ = false;
  std::vector<uint64_t> chain_ids_;
  // A host round's next draft, queued right after its commit (queue_draft_ahead): the device
  // runs the chain while the host finishes the step, instead of waiting for the next round to
  // queue it. Only when the rows cannot change before that round, which the next step runs
  // before anything else (no request waits, none is prefilling, cancelled or finished).
  // `ahead_depth_`: its round's depth; drafts_ and queued_ hold its inputs and slots.
  bool draft_ahead_ = false;
  int ahead_depth_ = 0;
  // The depth the policy chose for the next round of `chosen_rows_` rows where queue_draft_ahead
  // queued nothing (depth 0): that round takes it instead of choosing twice. -1: none.
  int chosen_depth_ = -1;
  size_t chosen_rows_ = 0;
  std::shared_ptr<RoundLog> round_log_;  // null: no log
  int previous_depth_ = -1;              // the depth of the last round logged
  void log_round(RoundRecord r);         // fills in previous_depth
  // Device work queued outside the rounds since the last round began (a prefill forward or a
  // slice of one, drafter rows moved in): the next round's wait includes it, so its time says
  // nothing about its depth, and the depth policy does not learn from it. A server whose prompts
  // keep arriving queues a prefill before most rounds: after kMostUntimedRounds such rounds in a
  // row one is timed anyway, so the policy keeps learning (a cost with some prefill in it beats
  // none). untimed_rounds_: how many ran in a row.
  static constexpr int kMostUntimedRounds = 32;
  bool work_between_rounds_ = false;
  int untimed_rounds_ = 0;
  bool next_round_untimed() const {
    return work_between_rounds_ && untimed_rounds_ < kMostUntimedRounds;
  }
  // Whether the round starting now is not timed (next_round_untimed); clears the mark.
  bool start_round_clock();
  // Queues the next round's draft (depth chosen as round() would) if nothing can change the
  // rows before it; sets draft_ahead_.
  void queue_draft_ahead();
  // Fills drafts_ for a round at `depth` and queues it where the drafter can (draft_queued).
  bool queue_draft(int depth);
  // Rounds settled on the device (SpecOptions::settled_rounds): queued, their accept walks and
  // commits where the tokens are, not read by the host yet; oldest first. At most two: a round is
  // read once the next is queued. Their rows are decoding_'s (Row::id, in order): the rows
  // change only once every settled round is read.
  struct SettledRound {
    std::vector<uint64_t> ids;
    int depth = 0;
  };
  std::deque<SettledRound> settled_;
  Buffer<int32_t> accepted_dev_, next_dev_;  // the last settled verify's accept_windows
  // A host round's device commit (SpecOptions::device_commit): its own, so no settled round's
  // counts that a drafter still reads are overwritten.
  Buffer<int32_t> commit_accepted_dev_, commit_next_dev_;
  std::vector<ops::SettledRow> settled_rows_;  // scratch of settled_round, read_settled, round
  std::vector<RowKeep> settled_keeps_;         // round: what its device commit kept
  std::vector<int> settled_accepted_;
  // Whether this round (every row at `depth`) may be settled; fills drafts_ for it.
  bool settles(int depth);
  void settled_round(int depth);
  // The output index of a row's next token as the host counts it while rounds are unread: its
  // tokens, plus one for each unread round (the rest of their tokens are counted where the
  // tokens are, ops::PositionShift).
  uint64_t settled_index(const Row& row) const;
  // Reads the oldest settled round: its tokens, proposals and acceptance; emits and resolves.
  void read_settled();
  // A verify round's counts for a row and this round's per-position totals.
  void count_round(Row& row, int64_t proposals, int accepted);
  // A verify round into the engine's counters (mu_ held): the round, the per-position totals.
  void add_round_counters(int depth);  // a round at `depth` ended
  // A plain step or settled rounds are queued that the host has not read.
  bool work_queued() const { return chained_ || !settled_.empty(); }
  // The health probe over this round's first proposals: true (drafting stops, draft_depth_ 0)
  // when the drafter collapsed; then release_collapsed_drafter reports it and releases it.
  bool probe_collapsed();
  void release_collapsed_drafter();
  uint64_t next_row_id_ = 0;

  void validate(const EngineRequest& r) const;
  void admit();
  void prefill_step();
  // Picks the next chunk of each prefilling row under the budget and begins their forward.
  void begin_prefill();
  // After the in-flight forward's last layer: drafter prefill, first tokens, moves to decoding.
  void finish_prefill();
  // Runs the next slice of the forward in flight (beginning one first when none runs), and
  // finishes it after its last layer; returns whether it finished. whole: all its remaining
  // layers now (a row in it is being cancelled: its slot may be closed only after the forward
  // stops writing it).
  bool advance_prefill(bool whole);
  bool in_flight(const Row& row) const;
  // After a prefill chunk: saves the row's state in the prefix cache when its length is a
  // boundary (EngineOptions::prefix_cache_bytes). prefill_index: its row in prefill_drafts_.
  void save_boundary(const Row& row, size_t prefill_index);
  // When a decoding row retires finished: saves its state (prompt + the answer tokens the target
  // processed) as a boundary, where decoding equals prefill (EngineTarget::prompt_matches_decode).
  void save_turn(const Row& row, size_t decode_index);
  // Both save through here: the drafter's checkpoint of row `draft_row` of `drafts` (null: none)
  // with the target state of `slot` at tokens.size(); a failure only skips the boundary.
  void save_state(std::span<const int32_t> tokens, int slot, spec::DraftRows* drafts,
                  size_t draft_row);
  void round();
  // A step's usual work around its round: reads of queued work when rows change, cancellations,
  // admissions, the prefill forward, the round, rows leaving.
  void step_rows();
  // round(); a round that throws fails every decoding row (its work is abandoned).
  void round_or_fail();
  // The health probe found the drafter collapsed: its rows are released (no more drafting,
  // committing or hidden taps) and the engine runs as without a drafter from then on, in
  // pipelined plain rounds, so a collapsed drafter costs no more than none.
  void retire_drafter();
  bool plain_pipelines() const;
  void pipelined_round();
  // Collects the queued step's tokens and emits them to its rows that are still live.
  void drain();
  // drain() outside a timed round: the wait for the queued steps' or settled rounds' device work
  // counts as decode time (EngineCounters::decode_seconds), not as the row change that forced it.
  void drain_timed();
  // After an error: forgets the queued step and its pending copies.
  void abandon_chain();
  // Emits a token to a row's sink; returns whether the row goes on.
  bool emit(Row& row, int32_t id, const float* logits);
  void finish(Row& row, RequestEnd end, const std::string& error = {});
  // Drops finished rows (their outcome already sent) from both groups.
  void retire();
  void fail_rows(std::vector<std::unique_ptr<Row>>& rows, const std::string& what);
  void publish_counters();
};

}  // namespace tandem
