// The drafter seam (DESIGN.md §5.2). Drafters differ only in how they fill proposals: one
// verifier, one acceptance walk and one set of state transactions serve every drafter, and a
// drafter never decides what is emitted.
//
// Row lifecycle, driven by the engine between committed rounds:
//   prepare_append(checkpoints) → commit   rows join (cold, or restored from checkpoints)
//   prefill(rows)                          prompt tokens + the target's taps for them
//   draft(pending, depth) → proposals      per round
//   commit(verify rows)                    after the target verified and accepted
//   capture(row) / filter_rows(keep)       between rounds only
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "tandem/core/error.h"
#include "tandem/core/sampler.h"
#include "tandem/model/glm5.h"
#include "tandem/model/qwen3_5.h"
#include "tandem/spec/checkpoint.h"
#include "tandem/spec/prepared_change.h"

namespace tandem::spec {

// Which target hidden state a drafter consumes at each position.
enum class HiddenTap {
  FinalNormed,  // after the final norm (what vLLM / llama.cpp feed published Qwen3.5 MTP heads)
  PreNorm,      // the last decoder layer's output before the final norm (mlx-bun's convention)
};

inline const char* hidden_tap_name(HiddenTap t) {
  return t == HiddenTap::FinalNormed ? "final-normed" : "pre-norm";
}

// The target hidden states a drafter reads at every position: nothing (n-gram), one hidden next
// to the head (`hidden`: an MTP layer's input, [n, H]), or the residual stream entering each of
// a list of target decoder layers (`layers`: a projected-context drafter's input, EAGLE-3). A
// layer tap i (0 <= i < layer count) is transformers' output_hidden_states entry i: entry 0 is
// the embedding output. Listed layers are concatenated per token in the listed order, so a
// position's taps are [layers.size() * H]. Invariant: `hidden` and `layers` are not both set.
struct HiddenTaps {
  std::optional<HiddenTap> hidden;
  std::vector<int> layers;

  bool empty() const { return !hidden && layers.empty(); }
  // Floats per position of the tapped rows handed to prefill and commit.
  int64_t width(int64_t H) const {
    return layers.empty() ? H : static_cast<int64_t>(layers.size()) * H;
  }
  std::string describe() const;  // "final-normed", "layers [2, 4, 5]", "none"
};

// `full`: the target prefills the whole prompt and samples the first token from it.
// `tail_split`: the last prompt token is not prefilled; it heads the first verify window.
enum class PrefillMode { Full, TailSplit };

// What a drafter may use of the target, and nothing else (DESIGN.md 5.4: the seam is
// model-agnostic; every target implements it). Drafters hold a reference: a view outlives the
// drafter rows opened against it.
class TargetView {
 public:
  explicit TargetView(std::string identity) : identity_(std::move(identity)) {}
  virtual ~TargetView() = default;
  TargetView(const TargetView&) = delete;
  TargetView& operator=(const TargetView&) = delete;

  const std::string& identity() const { return identity_; }
  virtual int64_t hidden_size() const = 0;
  virtual int64_t vocab_size() const = 0;
  virtual int64_t layer_count() const = 0;
  // The target's checkpoint, for drafters shipped inside it (`mtp.*`, GLM-5's NextN layer).
  virtual const WeightStore& weights() const = 0;
  // out[n, H] = embedding rows of ids (host ids, in range; out in the backend's memory).
  virtual void embed(std::span<const int32_t> ids, float* out) const = 0;
  // The same for ids already in the backend's memory (a draft step's argmax); an id out of range
  // gives a row of NaN instead of an error, since the host has not seen it.
  virtual void embed_device(const int32_t* ids, int64_t n, float* out) const = 0;
  // The embedding table embed_device reads ([V, H], backend memory), for a drafter that reads its
  // rows inside its first kernel (ops::rms_norm_pair_embedded); null where the target keeps none
  // a drafter may read.
  virtual const ops::WeightRef* embedding_table() const { return nullptr; }
  // out[n, V] = the target's head applied to already-normed hidden[n, H] (backend memory).
  virtual void logits(const float* hidden, int64_t n, float* out) const = 0;
  // out[n, rows] = the logits of token ids 0..rows-1 only (a drafter's reduced vocabulary,
  // rows <= V): the first rows of the head as a weight of its own (on CUDA its reduction order
  // follows that shape, so a logit may differ from logits()' in the last bits). Views that
  // cannot cut their head take the whole vocabulary only.
  virtual void logits_prefix(const float* hidden, int64_t n, int64_t rows, float* out) const {
    if (rows != vocab_size())
      fail("this target cannot score a reduced draft vocabulary (", rows, " of ", vocab_size(),
           " tokens)");
    logits(hidden, n, out);
  }
  virtual bool can_tap(HiddenTap tap) const = 0;
  // Whether the target's forwards capture the residual stream entering decoder layer `layer`
  // (ForwardRequest::tap_layers).
  virtual bool can_tap_layer(int64_t layer) const {
    (void)layer;
    return false;
  }
  // The target's family config, for drafters built for one family (their block copies its
  // shapes); null when the target is of another family, which such a drafter refuses.
  virtual const Qwen35Config* qwen35_config() const { return nullptr; }
  virtual const Glm5Config* glm5_config() const { return nullptr; }

 private:
  std::string identity_;
};

// A view of a loaded model of either family (Qwen35Model, Glm5Model): everything but the taps
// and the family config. Borrows the model, which must outlive it.
template <class Model>
class ModelTargetView : public TargetView {
 public:
  ModelTargetView(const Model& model, std::string identity)
      : TargetView(std::move(identity)), model_(model) {}
  int64_t hidden_size() const override { return model_.config().hidden_size; }
  int64_t vocab_size() const override { return model_.config().vocab_size; }
  int64_t layer_count() const override { return model_.config().num_hidden_layers; }
  const WeightStore& weights() const override { return model_.weights(); }
  void embed(std::span<const int32_t> ids, float* out) const override { model_.embed(ids, out); }
  void embed_device(const int32_t* ids, int64_t n, float* out) const override {
    model_.embed_device(ids, n, out);
  }
  const ops::WeightRef* embedding_table() const override {
    if constexpr (requires { model_.embedding_table(); })
      return model_.embedding_table();
    else
      return nullptr;
  }
  void logits(const float* hidden, int64_t n, float* out) const override {
    model_.head(hidden, n, out);
  }
  void logits_prefix(const float* hidden, int64_t n, int64_t rows, float* out) const override {
    model_.head(hidden, n, out, rows);
  }

 protected:
  const Model& model_;
};

// A Qwen3.5 target (dense or MoE): it taps either hidden and the input of any layer.
class QwenTargetView final : public ModelTargetView<Qwen35Model> {
 public:
  using ModelTargetView::ModelTargetView;
  bool can_tap(HiddenTap) const override { return true; }
  bool can_tap_layer(int64_t layer) const override { return layer >= 0 && layer < layer_count(); }
  const Qwen35Config* qwen35_config() const override { return &model_.config(); }
};

// A GLM-5 target: of the hiddens next to the head, the final-normed one only (the NextN layer's
// input); the input of any layer.
class Glm5TargetView final : public ModelTargetView<Glm5Model> {
 public:
  using ModelTargetView::ModelTargetView;
  bool can_tap(HiddenTap tap) const override { return tap == HiddenTap::FinalNormed; }
  bool can_tap_layer(int64_t layer) const override { return layer >= 0 && layer < layer_count(); }
  const Glm5Config* glm5_config() const override { return &model_.config(); }
};

// Throws Error naming `who` unless the target captures every tap in `taps`.
void check_target_taps(const TargetView& target, const HiddenTaps& taps, const std::string& who);

// One row's prompt, handed to prefill: the tokens the target processed for it and the target's
// taps at every one of them (the drafter's HiddenTaps; null when it has none).
struct RowPrefill {
  int row = 0;
  std::span<const int32_t> tokens;  // positions processed_before .. processed_before + n - 1
  const float* hidden = nullptr;    // [tokens.size(), taps().width(H)]
  int64_t processed_before = 0;     // tokens the row already covered (0 for a cold prompt)
  // The same hiddens in backend memory, where the target left them (a drafter whose
  // prefills_from_device() is true may be given these alone, `hidden` null); valid during the
  // call.
  const float* hidden_device = nullptr;
};

// Per-row inputs of a draft call.
struct RowDraft {
  int32_t pending = 0;             // last emitted token, not yet processed by the target
  int depth = 0;                   // proposals wanted (0..max depth); 0 still keeps the row aligned
  SamplingParams sampling;         // the request's sampling; draws use keys (seed, first_index + j)
  uint64_t first_index = 0;        // output index of the token proposal 0 stands for
  bool want_distribution = false;  // rejection mode needs q for each proposal
};

struct DraftProposal {
  std::vector<int32_t> tokens;            // 0..depth proposals
  std::vector<std::vector<TokenProb>> q;  // per proposal, when asked: the drafter's distribution
};

// A draft whose proposals are still in backend memory (DraftRows::draft_queued): row b's
// proposal j is ids[slots[b][j]]; every row proposes exactly its depth. `ids` stays valid and
// unchanged until the drafter's next draft.
struct QueuedDraft {
  const int32_t* ids = nullptr;
  std::vector<std::vector<int32_t>> slots;
  // Where given (the last round settled on the device): row b's pending token is
  // ids[pending_slots[b]], not RowDraft::pending, which the host does not know yet.
  std::vector<int32_t> pending_slots;
  // Where given (a draft for a settled round, DraftRows::draft_settled): backend memory, [rows];
  // row b proposed counts[b] tokens, its slots past them pad the window (valid ids, never to be
  // accepted: ops::accept_windows' limits).
  const int32_t* counts = nullptr;
};

// A verify whose acceptance stays where the tokens are (DraftRows::settle): every row verified
// [pending, its `depth` proposals], rows in order.
struct SettledVerify {
  const int32_t* accepted = nullptr;  // [rows] proposals accepted (ops::accept_windows)
  const int32_t* next = nullptr;      // [rows] the token now pending
  // [rows · (depth + 1), taps().width(H)] the verify's taps; null for a drafter without taps.
  const float* hidden = nullptr;
  int depth = 0;
};

// One row's verify outcome, handed to commit.
struct VerifyRow {
  std::span<const int32_t> window;  // [pending, proposals...] as the target processed them
  const float* hidden = nullptr;    // [window.size(), taps().width(H)] the target's taps
  int accepted = 0;                 // proposals accepted (0..window.size()-1)
  int32_t next_pending = 0;         // the correction or bonus token now pending
};

class DraftRows {
 public:
  virtual ~DraftRows() = default;
  virtual const std::string& ns() const = 0;
  virtual PrefillMode prefill_mode() const = 0;
  virtual HiddenTaps taps() const = 0;  // empty: the drafter needs no hiddens
  virtual int row_count() const = 0;

  // Appends one row per entry (null = cold row); rows keep their append order. Restoring refuses
  // a checkpoint of another schema or namespace. Nothing changes until the change commits.
  virtual std::unique_ptr<PreparedChange> prepare_append(std::span<const CheckpointPtr> from) = 0;
  // prepare_append + commit, for callers with no other change to make atomically with it.
  void append(std::span<const CheckpointPtr> from) {
    apply_changes({[&] { return prepare_append(from); }});
  }
  // Appends copies of rows `rows` of `from` (rows the same provider opened for the same
  // target, e.g. an engine's prefill group), in order: the states capture() + prepare_append
  // would carry over, all or nothing; `from` is left as it was. The default goes through those
  // checkpoints (host memory); a drafter that can copy a row where its state lives overrides it.
  virtual std::unique_ptr<PreparedChange> prepare_copy_rows(const DraftRows& from,
                                                            std::span<const int> rows);
  // prepare_copy_rows + commit.
  void copy_rows(const DraftRows& from, std::span<const int> rows) {
    apply_changes({[&] { return prepare_copy_rows(from, rows); }});
  }
  // Keeps the listed rows, in the listed order; the others are released.
  virtual void filter_rows(std::span<const int> keep) = 0;

  // Row `row` (just appended cold) joins at a cached prefix boundary whose drafter state is
  // missing or of another namespace: the target restored `tokens`, the drafter rebuilds what the
  // tokens alone allow, and the next prefill continues after them.
  virtual void adopt_prefix(int row, std::span<const int32_t> tokens) = 0;
  // Whether adopt_prefix reaches the state a cold prefill of the same tokens would (a drafter
  // that needs only tokens); otherwise its history starts at the boundary, so its proposals
  // differ — harmless where output does not depend on proposals (match verification).
  virtual bool adopts_exactly() const = 0;

  virtual void prefill(std::span<const RowPrefill> rows) = 0;
  // Whether prefill takes the target's hiddens in backend memory (RowPrefill::hidden_device)
  // in place of host copies.
  virtual bool prefills_from_device() const { return false; }
  // rows.size() == row_count(); out[b] receives row b's proposals.
  virtual void draft(std::span<const RowDraft> rows, std::vector<DraftProposal>* out) = 0;
  // draft() with the host's read of the proposals put off: the drafting is queued on the caller's
  // backend stream, `queued` says where each proposal will be, and finish_queued() reads them
  // once the caller has queued what consumes them there (the verify forward: one wait per round
  // instead of two). Returns false, having changed nothing, where the drafter cannot (its work is
  // not all on the caller's stream, a row wants its distribution); then call draft(). After
  // true, finish_queued() must come before commit.
  virtual bool draft_queued(std::span<const RowDraft> rows, QueuedDraft* queued) {
    (void)rows, (void)queued;
    return false;
  }
  // The proposals of the last draft_queued, as draft() would have given them (Error: none
  // pending, or a draw that failed on NaN logits).
  virtual void finish_queued(std::vector<DraftProposal>* out) {
    (void)out;
    fail("finish_queued: this drafter queues no drafts");
  }
  // rows.size() == row_count(); each row's window is the one its last draft proposed.
  virtual void commit(std::span<const VerifyRow> rows) = 0;

  // --- Rounds settled on the device (the engine's overlapped rounds) ---
  // After draft_settled, where every row's window held `depth` slots and the target walked the
  // verify where the tokens are: settle commits from the counts there (no host read), and the
  // next draft_settled reads the pending tokens (and hiddens) there too, so the next round is
  // queued before the host reads this one. Later, oldest round first, settled_proposals reads a
  // round's proposals and resolve tells the drafter what the host found accepted. While a round
  // is unresolved the rows take no other call but draft_settled and settle (Error).
  //
  // Whether a queued draft of `rows` may be settled (the drafter's work all on the caller's
  // stream, every row the same depth > 0, no distributions wanted).
  virtual bool can_settle(std::span<const RowDraft> rows) const {
    (void)rows;
    return false;
  }
  // The draft of a round to be settled (can_settle said yes): draft_queued, except that a row may
  // propose fewer tokens than its depth, the rest of its slots padding (QueuedDraft::counts).
  virtual bool draft_settled(std::span<const RowDraft> rows, QueuedDraft* queued) {
    return draft_queued(rows, queued);
  }
  virtual void settle(const SettledVerify& v) {
    (void)v;
    fail("settle: this drafter cannot commit on the device");
  }
  // The oldest unresolved round's proposals (waits for their copy; Error on a failed draw).
  virtual void settled_proposals(std::vector<DraftProposal>* out) {
    (void)out;
    fail("settled_proposals: this drafter settles nothing");
  }
  // The oldest unresolved round kept accepted[b] proposals of row b.
  virtual void resolve(std::span<const int> accepted) {
    (void)accepted;
    fail("resolve: this drafter settles nothing");
  }
  virtual int unresolved_rounds() const { return 0; }
  // Forgets unresolved rounds (an engine unwinding from an error drops every row next).
  virtual void drop_settled() {}

  // The drafter's state of `row` after its last commit, restorable into a fresh row.
  virtual CheckpointPtr capture(int row) const = 0;
};

// Process-lifetime owner of a drafter's weights.
class DraftProvider {
 public:
  virtual ~DraftProvider() = default;
  virtual const std::string& id() const = 0;  // "qwen-mtp", "ngram", "eagle3"
  virtual uint64_t weights_bytes() const = 0;
  virtual const std::string& checkpoint_namespace() const = 0;
  // Refuses (tandem::Error) a target it cannot serve: wrong hidden size or vocabulary, a tap
  // the target lacks (check_target_taps).
  virtual std::unique_ptr<DraftRows> open_rows(const TargetView& target) const = 0;
};

}  // namespace tandem::spec
