// The rows of a multi-token-prediction drafter (DESIGN.md §5.4): one block, chained on its own
// output, proposes tokens from the target's hidden states. Qwen3.5's `mtp.*` layer and GLM-5's
// NextN layer follow the same row convention and differ only in their block and the cache it
// keeps, so this class owns the convention and a subclass supplies the block and its cache.
//
// Row convention: MTP row p (rotary position p) is built from (token_{p+1}, h_p) and predicts
// token_{p+2}, where h_p is the target's hidden at position p at the drafter's tap. Between
// rounds every prefilled row holds exactly (target processed tokens - 1) MTP rows, plus h_true =
// the target's hidden at processed - 1 (the position whose next token is pending). A row that
// adopted a cached prefix of `base` tokens holds processed - 1 - base rows, from position base.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tandem/backend/buffer.h"
#include "tandem/backend/graph_cache.h"
#include "tandem/backend/readback.h"
#include "tandem/backend/staged_upload.h"
#include "tandem/spec/draft.h"

namespace tandem::spec {

class MtpRows : public DraftRows {
 public:
  const std::string& ns() const override { return ns_; }
  PrefillMode prefill_mode() const override { return PrefillMode::Full; }
  HiddenTaps taps() const override { return {tap_, {}}; }
  int row_count() const override { return static_cast<int>(rows_.size()); }

  std::unique_ptr<PreparedChange> prepare_append(std::span<const CheckpointPtr> from) override;
  // From rows of the same subclass and weights whose caches it copies where they live
  // (copy_histories): the caches copied in backend memory, lengths and h_true on the host, no
  // checkpoint and no wait for the device. Other sources, or rows with device-side state still
  // to settle, go through checkpoints (DraftRows' default).
  std::unique_ptr<PreparedChange> prepare_copy_rows(const DraftRows& from,
                                                    std::span<const int> rows) override;
  void filter_rows(std::span<const int> keep) override;
  // The row's history starts at the boundary (its MTP rows before it would need the target's
  // hiddens there, which the prefix cache does not keep): rotary positions count from the
  // boundary, which leaves attention scores as they would be (rotary embeddings are relative).
  void adopt_prefix(int row, std::span<const int32_t> tokens) override;
  bool adopts_exactly() const override { return false; }
  // Cold row (processed_before = 0): rows 0..n-2 from (tokens[p+1], hidden[p]). A row continuing
  // (processed_before = P > 0, e.g. restored) first adds row P-1 from (tokens[0], h_true).
  // Either way h_true becomes hidden[n-1]. Without prefill_history, a row that holds no MTP rows
  // yet runs no block: its history starts at the prefill's last token, as adopt_prefix starts it
  // at a boundary (the seeds' convention for GLM's NextN layer).
  void prefill(std::span<const RowPrefill> rows) override;
  // Given the hiddens in backend memory, the block's input rows are copied there, and only each
  // row's last hidden (its h_true) comes to the host.
  bool prefills_from_device() const override { return true; }
  void draft(std::span<const RowDraft> rows, std::vector<DraftProposal>* out) override;
  // Where chains_share_context() and no drafting row wants its distribution: the device chain
  // (queue_device_chain), its proposals read back after the caller's next work.
  bool draft_queued(std::span<const RowDraft> rows, QueuedDraft* queued) override;
  void finish_queued(std::vector<DraftProposal>* out) override;
  // Keeps the drafted rows of pending + accepted proposals, then appends what is still missing:
  // the last proposal's row from the verified (true) hidden when all were accepted, or the
  // pending token's row when nothing was drafted.
  void commit(std::span<const VerifyRow> rows) override;
  CheckpointPtr capture(int row) const override;

  // Settled rounds: the rows' pending tokens and h_true stay in backend memory, and each commit's
  // last row (the last proposal's, from its true hidden, when every proposal was accepted) is
  // computed for every row, where not all were accepted past its rows, where the next chain
  // overwrites it before anything reads it. Until resolve, a row's MTP rows past `length` are
  // counted on the device only (ops::PositionShift), as the target's are (Qwen35State's settled
  // commits).
  bool can_settle(std::span<const RowDraft> rows) const override;
  void settle(const SettledVerify& v) override;
  void settled_proposals(std::vector<DraftProposal>* out) override;
  void resolve(std::span<const int> accepted) override;
  int unresolved_rounds() const override { return static_cast<int>(settled_.size()); }
  void drop_settled() override;

  // A reduced draft vocabulary (FR-Spec style): each draft step scores token ids
  // 0..tokens-1 only, reading that share of the target's head, and proposes among them
  // (0: the whole vocabulary, the default). Byte-level BPE vocabularies such as Qwen's number
  // their tokens roughly by merge order, so a prefix holds the frequent ones. Verification
  // still scores the whole vocabulary: the output is unchanged, only what gets proposed.
  // Throws if tokens is outside 0..V.
  void set_draft_vocabulary(int64_t tokens);
  int64_t draft_vocabulary() const { return draft_vocab_; }

  // Diagnostics (tests, tools): the MTP rows a row holds, and the logits its last draft call
  // computed for proposal `step` ([draft_vocabulary()], valid until the next draft call).
  int64_t mtp_rows(int row) const {
    const Row& r = rows_.at(static_cast<size_t>(row));
    return r.length + (r.completion_id >= 0 ? 1 : 0);  // a folded completion row counts
  }
  std::span<const float> last_draft_logits(int row, int step) const;
  // Greedy draft chains run whole (prepare_chain; on CUDA one graph each) since the rows opened.
  int64_t whole_chains() const { return whole_chains_; }
  // Of those, the chains whose step 0 also computed the last commit's completion rows.
  int64_t folded_chains() const { return folded_chains_; }
  // Rows prepare_copy_rows copied in backend memory rather than through checkpoints (counted
  // when prepared, whether or not the change then committed).
  int64_t rows_copied_in_place() const { return rows_copied_in_place_; }
  // false: each commit computes its completion rows itself, as before folding (tests compare).
  void set_fold_completions(bool on) {
    flush_host_completions();
    fold_completions_ = on;
  }

 protected:
  // A row's cache of its MTP rows, kept by the subclass's block (paged KV, a latent cache). The
  // class tracks the length; a history holds at least that many rows.
  struct History {
    virtual ~History() = default;
  };

  // who: the drafter's name in messages ("qwen-mtp"); schema: its checkpoints' schema.
  MtpRows(const TargetView& target, std::string who, std::string schema, std::string ns,
          HiddenTap tap, int64_t hidden_size, int64_t vocab_size);

  virtual std::unique_ptr<History> new_history() = 0;
  // Returns a row's storage to the subclass (the row is dropped); called once per history.
  virtual void release_history(History& h) = 0;
  // Drops the rows from `length` on.
  virtual void truncate_history(History& h, int64_t length) = 0;
  // Checks a checkpoint's cache tensors (schema, namespace and h_true are checked here) and
  // returns the MTP rows they hold; throws Error naming what is wrong.
  virtual int64_t check_history(const Checkpoint& c) const = 0;
  virtual std::unique_ptr<History> restore_history(const Checkpoint& c, int64_t length) = 0;
  // Adds the cache tensors (and any metadata) of the first `length` rows to a checkpoint.
  virtual void save_history(const History& h, int64_t length, Checkpoint& c) const = 0;
  // Copies of the first lengths[i] rows of histories `from`, which belong to `source`, in order,
  // where this subclass can copy them in place (same subclass, same block); empty where not (the
  // caller then uses checkpoints). All or nothing: after a throw nothing stays allocated.
  virtual std::vector<std::unique_ptr<History>> copy_histories(const MtpRows& source,
                                                               std::span<const History* const> from,
                                                               std::span<const int64_t> lengths) {
    (void)source, (void)from, (void)lengths;
    return {};
  }
  // Runs the block over T = Σ counts new rows: rows[i] (holding lengths[i] rows) gets counts[i]
  // rows appended to its history. embeds, hidden, out: [T, H] in backend memory, rows in order.
  virtual void forward_block(const float* embeds, const float* hidden,
                             std::span<History* const> rows, std::span<const int64_t> lengths,
                             std::span<const int64_t> counts, float* out) = 0;

  // A greedy draft chain captured whole as one CUDA graph (queue_device_chain): the subclass lays
  // out every step's block forward before the chain, then queues them with no host work. Rows
  // `rows` (holding lengths[i] MTP rows) draft depths[i] steps. Returns false where it cannot
  // (the chain then runs step by step through forward_block); the base class never can.
  // tables_upload: where the subclass describes the upload of the chain's tables and positions
  // instead of starting it (or leaves it empty); the caller starts it together with the chain's
  // inputs (one copy kernel for the graph's inputs).
  virtual bool prepare_chain(std::span<History* const> rows, std::span<const int64_t> lengths,
                             std::span<const int> depths, StagedUpload::Part* tables_upload) {
    (void)rows, (void)lengths, (void)depths, (void)tables_upload;
    return false;
  }
  // Queues step j's block forward as prepare_chain laid it out: [A_j, H] in and out, A_j the rows
  // with depths[i] > j in order. Device work only.
  virtual void chain_step(int j, const float* embeds, const float* hidden, float* out) {
    (void)j, (void)embeds, (void)hidden, (void)out;
  }
  // chain_step from the step's token ids [A_j] (backend memory) instead of their embeddings,
  // where the block reads the target's embedding rows itself (one launch fewer a step); false
  // where it cannot (the caller embeds them and calls chain_step).
  virtual bool chain_step_embedded(int j, const int32_t* ids, const float* hidden, float* out) {
    (void)j, (void)ids, (void)hidden, (void)out;
    return false;
  }
  // Adds what the prepared steps' launches bake in (buffer addresses, shapes) to a chain's key.
  virtual void add_chain_key(GraphKey& key) const { (void)key; }
  // Settled rounds: moves the positions and KV slots of every prepared chain step by s (its
  // shift, row_slot and known fields; its park fields for step 0's leading completion rows only;
  // the subclass fills in its batches' layout). Device work only, queued before the chain's first
  // step.
  virtual void shift_chain(const ops::PositionShift& s) { (void)s; }
  // Positions a row's KV must hold past what the host counts (settled rounds: the unresolved
  // accepted tokens, and completion rows parked past a chain); reserve it too.
  int64_t reserve_extra_ = 0;
  // The chain being prepared starts step 0 with one completion row per row (the last settled
  // round's, or the last commit's), at completion_position (prepare_chain lays it out there), then
  // the chain's own rows; the block's output rows follow the same order.
  bool chain_completion_ = false;
  // Where row i's completion row goes, the row's chain starting at `length`: length - 1, or, for
  // a row whose last commit left none, past its chain (length + depth). Step 0 then computes a
  // row for it only to keep one completion row per row; nothing reads what it writes there
  // before a later round writes that position again.
  int64_t completion_position(size_t i, int64_t length, int depth) const {
    return folding_ && rows_[i].completion_id < 0 ? length + depth : length - 1;
  }
  // Whether every launch of a draft chain goes to the caller's stream (the block shares the
  // caller's backend context): only then may a later launch there read the chain's proposals
  // without a host wait (draft_queued). The base class cannot tell: no.
  virtual bool chains_share_context() const { return false; }

  const TargetView& target_;  // outlives the rows (TargetView's contract)
  int64_t H_ = 0, V_ = 0;
  int64_t draft_vocab_ = 0;      // the ids a draft step scores: 0..draft_vocab_-1 (V_ by default)
  bool prefill_history_ = true;  // prefill builds MTP rows for the prompt (see prefill)

 private:
  struct Row {
    std::unique_ptr<History> history;
    int64_t base = 0;           // target tokens before the row's history (adopt_prefix)
    int64_t length = 0;         // committed MTP rows, the first one at rotary position 0
    bool has_hidden = false;    // h_true is set (the row was prefilled or restored)
    std::vector<float> h_true;  // [H]
    // The round in flight (between draft and commit).
    bool drafted = false;
    int32_t pending = 0;
    std::vector<int32_t> proposals;
    int64_t round_start = 0;  // length when the round's draft began
    // The last commit's completion row, still to be computed at position `length`: token
    // completion_id with the hidden before it (-1: none). The next chain's step 0 computes it
    // ahead of its own rows, or flush_host_completions does.
    int32_t completion_id = -1;
    std::vector<float> completion_h;  // [H]
  };

  std::string who_, schema_, ns_;
  HiddenTap tap_;
  std::vector<Row> rows_;
  // The change that appends `built` (fully built rows) on commit and releases their histories
  // on dispose.
  std::unique_ptr<PreparedChange> stage_appended(std::shared_ptr<std::vector<Row>> built);

  // Settled rounds, oldest first: their depth and which picks read holds their proposals.
  struct SettledRound {
    int depth = 0;
    int read = 0;
  };
  std::deque<SettledRound> settled_;
  // The last commit was settled: the rows' pending tokens are picks_dev_[0, rows) and their h_true
  // the second half of step0_hidden_dev_ (the host copies are stale until sync_h_true).
  bool pending_on_device_ = false;
  bool chain_device_inputs_ = false;  // the last chain read them there
  bool h_true_stale_ = false;
  // A settled chain's step-0 inputs: ids [2 · rows] (the last settled round's completion ids, then
  // the pending tokens) and hiddens [2 · rows, H] (the hiddens before the last proposals, then
  // h_true).
  Buffer<int32_t> step0_ids_dev_;
  Buffer<float> step0_hidden_dev_;
  // The last settled round's completion rows are still to be computed (by the next chain's step
  // 0, or flush_completion), with that round's depth and accepted counts (the caller's array,
  // valid until the next chain is queued).
  bool completion_pending_ = false;
  int completion_depth_ = 0;
  const int32_t* completion_accepted_ = nullptr;
  // Computes the pending completion rows where the host now knows they belong (every round
  // resolved, the last with `accepted`).
  void flush_completion(std::span<const int> accepted);
  Buffer<int64_t> shift_dev_;   // [rows] Σ accepted over settled commits
  std::vector<int64_t> known_;  // per row: the part of it lengths count
  // The settled chain's per-row arrays in backend memory (row b's slot is b; known_), uploaded
  // with the chain's inputs, and the shift built on them.
  const int32_t* shift_rows_dev_ = nullptr;
  const int64_t* known_dev_ = nullptr;
  ops::SettledRow* settled_rows_dev_ = nullptr;
  // Copies the device h_true into the rows' host h_true where it is stale (a host path needs it).
  void sync_h_true();
  // Refuses (Error naming `what`) while a settled round is unresolved.
  void check_resolved(const char* what) const;
  // Before the rows change or a host path reads them: every settled round must be resolved; the
  // pending tokens and h_true come back to the host and the shifts start again at 0.
  void leave_device_rows();
  // The host-known completion rows of the last commit (Row::completion_id) are computed by the
  // next chain's step 0 where it runs whole on the device for every row (a block call fewer a
  // round), else by flush_host_completions first.
  // On unless TANDEM_MTP_FOLD=0 (A/B timing; the bits are the same either way).
  bool fold_completions_ = fold_completions_default();
  static bool fold_completions_default();
  int64_t folded_chains_ = 0;
  bool folding_ = false;          // the chain being queued computes them (take_completions)
  bool owes_completions() const;  // some row's completion_id is set
  void flush_host_completions();
  // At a draft: whether its chain computes the pending completion rows (then each row's length
  // counts its own); otherwise they are computed now.
  bool take_completions(std::span<const RowDraft> rows);
  int64_t outstanding_appends_ = 0;  // rows of prepared, not yet committed appends
  int64_t rows_copied_in_place_ = 0;

  // Scratch (grown, reused). Buffers are backend memory; vectors are host staging.
  Buffer<float> emb_, hid_dev_, out_;
  Buffer<int32_t> argmax_dev_;
  std::vector<float> hid_, out_host_;
  // A prefill from the target's hiddens in backend memory: each row's last one gathered
  // ([rows, H]) and read back in one copy, as the rows' h_true.
  Buffer<float> last_dev_;
  std::vector<float> last_host_;
  std::vector<int32_t> ids_;
  std::vector<float> chain_;  // [rows, H] each row's last step output (host)
  // The greedy chain on the device (queue_device_chain): two block outputs used in turn, every
  // step's argmax ([depth, rows], step j's at j · rows), a compacted id copy, and the host read.
  Buffer<float> chain_dev_[2];
  Buffer<int32_t> picks_dev_, ids_dev_;
  std::vector<int32_t> picks_;
  // draft_queued: the proposals' read, the rows' outputs so far, and the chain's depth until
  // finish_queued (-1: none pending).
  // A ring: a queued draft's read, and up to two settled rounds' reads still to be collected.
  static constexpr int kPickReads = 3;
  Readback picks_reads_[kPickReads];
  int picks_read_ = 0;  // the read of the draft in flight
  std::vector<DraftProposal> queued_;
  int queued_depth_ = -1;
  // A chain's step-0 inputs (the drafting rows' pending ids, then their h_true, then for sampled
  // chains every step's draws [depth][rows] at the stride of picks_dev_) in one upload, on either
  // path; the graphs of whole chains (draft_chain_graph). chain_draws_: where the draws sit in
  // chain_in_dev_ (null: every row greedy, each step takes the argmax).
  Buffer<uint8_t> chain_in_dev_;
  ops::SampleRow* chain_draws_ = nullptr;
  bool chain_shifted_ = false;  // the chain's positions and draws move on first (queue_chain)
  StagedUpload chain_in_upload_;
  GraphCache chain_graphs_;
  int64_t whole_chains_ = 0;
  // Per draft step: the logits [active rows, V] in backend memory, and a host copy made when
  // sampling needs it (or a diagnostic asks).
  std::vector<Buffer<float>> step_logits_dev_;
  mutable std::vector<std::vector<float>> step_logits_;
  mutable std::vector<bool> step_logits_on_host_;
  std::vector<std::vector<int>> step_rows_;  // per draft step: the active rows, in order
  std::vector<TokenWeight> dist_;

  void copy_step_logits(int step) const;  // the host copy of a draft step's logits
  // out[n, draft_vocab_] = the draft vocabulary's logits of block outputs hidden[n, H].
  void draft_logits(const float* hidden, int64_t n, float* out) const;
  // Appends one (token, hidden) pair to the gather buffers.
  void gather(int32_t id, const float* hidden);
  // Runs the block over the pairs gathered in ids_ / hid_ (rows in `row_ids` order, counts[i]
  // pairs for row_ids[i]), appending them to each row's history; out_ receives [Σ counts, H].
  void run_block(const std::vector<int>& row_ids, const std::vector<int64_t>& counts);
  // The same with the pairs' hiddens already in hid_dev_ ([ids_.size(), H], backend memory).
  void run_block_on_device(const std::vector<int>& row_ids, const std::vector<int64_t>& counts);
  // Runs the block over embeds / hidden ([Σ counts, H], backend memory) for rows `row_ids`,
  // appending counts[i] rows to row_ids[i]'s history; out receives [Σ counts, H].
  void block_rows(const std::vector<int>& row_ids, const std::vector<int64_t>& counts,
                  const float* embeds, const float* hidden, float* out);
  // draft()'s checks and the rows' set-up for a round; out gets one empty proposal per row.
  // Returns the deepest row's depth.
  int begin_draft(std::span<const RowDraft> rows, std::vector<DraftProposal>* out);
  // Whether no drafting row wants its distribution: the chain can draw on the device.
  static bool draws_on_device(std::span<const RowDraft> rows);
  // The chain for rows that draw on the device (greedy or sampled): each step draws its tokens
  // where the logits are (argmax, or ops::sample_rows with the key of the step's output index:
  // the token sample_token gives), embeds them and reads its output there; all steps' ids land
  // in picks_dev_ ([depth][rows]), for the host to read once (one wait per round instead of two
  // per step). max_depth > 0.
  void queue_device_chain(std::span<const RowDraft> rows, int max_depth);
  // The proposals from a host copy of picks_dev_: into the rows and `out`; Error on a draw of -1.
  void take_picks(const int32_t* picks, int max_depth, std::vector<DraftProposal>* out);
  // draft() for rows that want their distributions: each step's logits go to the host, which
  // draws and fills q.
  void draft_on_host(std::span<const RowDraft> rows, int max_depth,
                     std::vector<DraftProposal>* out);
  // queue_device_chain's chain as one graph where the subclass prepares it (prepare_chain); false,
  // with none of the chain queued, when it does not. ids0, hidden0: step 0's inputs.
  // inputs: the chain's step-0 inputs, filled and not yet started (started here, with the
  // chain's tables where prepare_chain held theirs back; left unstarted when it returns false).
  bool draft_chain_graph(std::span<const RowDraft> rows, int max_depth, const int32_t* ids0,
                         const float* hidden0, const StagedUpload::Part& inputs);
  // Queues the chain of step_rows_ from step 0's ids [A_0] and hiddens [A_0, H] (backend
  // memory): per step the embedding, the block (prepared by prepare_chain, or through
  // block_rows), the draft head and the draw (argmax or chain_draws_) into picks_dev_. Device work
  // only when prepared.
  void queue_chain(const int32_t* ids, const float* hidden, bool prepared);
};

}  // namespace tandem::spec
