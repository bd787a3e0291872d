// The EAGLE-3 drafter (DESIGN.md 5.4, projected-context drafters): a published EAGLE-3 head
// (spec/eagle3_head.h) reads the residual stream entering several target layers, projects it
// into its own context rows and drafts chains through one decoder layer with its own KV and a
// head over a reduced draft vocabulary, whose ids d2t maps to the target's.
//
// Row convention (as the MTP drafters, spec/mtp_rows.h): drafter row p (rotary position p) is
// built from (token x_{p+1}, g_p) and predicts x_{p+2}, where g_p = fc(taps of x_p). Between
// rounds a prefilled row holds exactly (target processed tokens - 1 - base) rows plus g_true =
// fc(taps of the last processed token). A draft chain from pending x_{P+1}: step 0 is row P from
// (pending, g_true); step j >= 1 is row P + j from (d_{j-1}, out_{j-1}), the previous step's
// output hidden, without fc. Unlike MTP, the context grows only by rows of verified taps: a
// commit keeps row P (built from true taps), drops the chain's later rows and rebuilds rows
// P + 1 .. P + a from (d_j, fc(verify taps at window position j)), j < a; the next g_true is fc of
// the taps at window position a.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tandem/spec/draft.h"
#include "tandem/spec/draft_kv_pool.h"
#include "tandem/spec/eagle3_block.h"

namespace tandem::spec {

inline constexpr const char* kEagle3Schema = "eagle3-v1";

class Eagle3Provider : public DraftProvider {
 public:
  // Loads a head directory (load_eagle3_head's checks); its namespace is "eagle3-v1:" + the
  // artifact identity of config.json's contents and the weight files.
  static std::unique_ptr<Eagle3Provider> open(const std::string& dir);

  const std::string& id() const override { return id_; }
  uint64_t weights_bytes() const override { return block_->weights().bytes(); }
  const std::string& checkpoint_namespace() const override { return ns_; }
  // Refuses a target whose vocabulary differs, whose hidden size is not the head's
  // target_hidden_size (or, without the head's own embed_tokens, not its hidden size), or that
  // cannot tap every layer the head reads.
  std::unique_ptr<DraftRows> open_rows(const TargetView& target) const override;

  // The layers the head taps on `target`: config.json's list, else eagle3_default_tap_layers.
  std::vector<int> tap_layers(const TargetView& target) const;
  const Eagle3Block& block() const { return *block_; }
  const std::string& source() const { return source_; }

 private:
  Eagle3Provider() = default;
  std::string id_ = "eagle3";
  std::string ns_, source_;
  std::shared_ptr<const Eagle3Block> block_;
};

// One EAGLE-3 state per batch row (the convention above).
class Eagle3Rows : public DraftRows {
 public:
  Eagle3Rows(std::shared_ptr<const Eagle3Block> block, const TargetView& target, std::string ns,
             std::vector<int> tap_layers);

  const std::string& ns() const override { return ns_; }
  PrefillMode prefill_mode() const override { return PrefillMode::Full; }
  HiddenTaps taps() const override { return {std::nullopt, tap_layers_}; }
  int row_count() const override { return static_cast<int>(rows_.size()); }

  std::unique_ptr<PreparedChange> prepare_append(std::span<const CheckpointPtr> from) override;
  void filter_rows(std::span<const int> keep) override;
  // Not exact: the row's history starts at the boundary (its earlier rows would need the
  // target's taps there, which the prefix cache does not keep); rotary positions count from the
  // boundary.
  void adopt_prefix(int row, std::span<const int32_t> tokens) override;
  bool adopts_exactly() const override { return false; }
  // Rows from (tokens[p + 1], fc(taps[p])); a continuing row first adds (tokens[0], g_true).
  // g_true becomes fc(taps[n - 1]).
  void prefill(std::span<const RowPrefill> rows) override;
  void draft(std::span<const RowDraft> rows, std::vector<DraftProposal>* out) override;
  void commit(std::span<const VerifyRow> rows) override;
  CheckpointPtr capture(int row) const override;

  // Diagnostics (tests, tools): the rows a row holds, the draft logits [Vd] of its last draft's
  // step `step`, and that step's output hidden [H] (valid until the next draft call).
  int64_t context_rows(int row) const { return rows_.at(static_cast<size_t>(row)).length; }
  std::vector<float> last_draft_logits(int row, int step) const;
  std::vector<float> last_draft_hidden(int row, int step) const;

 private:
  struct Row {
    std::vector<int32_t> blocks;  // KV blocks in position order (DraftKvPool)
    int64_t base = 0;             // target tokens before the row's history (adopt_prefix)
    int64_t length = 0;           // committed rows, the first at rotary position 0
    bool has_hidden = false;      // g_true is set (prefilled or restored)
    std::vector<float> g_true;    // [H]
    // The round in flight (between draft and commit).
    bool drafted = false;
    int32_t pending = 0;
    std::vector<int32_t> proposals;
    int64_t round_start = 0;  // length when the round's draft began
  };

  std::shared_ptr<const Eagle3Block> block_;
  const TargetView& target_;  // outlives the rows (TargetView's contract)
  std::string ns_;
  std::vector<int> tap_layers_;
  int64_t H_ = 0, V_ = 0, Vd_ = 0, W_ = 0;  // hidden, target vocab, draft vocab, taps per token
  // The draft-to-target map keeps id order (d2t strictly increasing, as the published heads'
  // sorted vocabularies have it): a draw over the draft logits then maps to the token the host's
  // draw over them spread on the target vocabulary gives (same weights, same canonical order),
  // so sampled rows can draw on the device.
  bool d2t_increasing_ = false;
  std::vector<Row> rows_;
  int64_t outstanding_appends_ = 0;  // rows of prepared, not yet committed appends
  DraftKvPool kv_;

  // Scratch (grown, reused). Buffers are backend memory; vectors are host staging.
  Eagle3Block::Workspace ws_;
  Buffer<float> taps_dev_, proj_, emb_, hid_, out_;
  Buffer<int32_t> ids_dev_, argmax_dev_;
  Buffer<ops::SampleRow> draws_dev_;  // a step's draws (ops::sample_rows)
  std::vector<ops::SampleRow> draws_;
  std::vector<int32_t> ids_;
  std::vector<float> full_;  // [V] draft logits spread over the target vocabulary
  std::vector<TokenWeight> dist_;
  // Per draft step: its active rows in order, its logits [A, Vd] and output hiddens [A, H].
  std::vector<std::vector<int>> step_rows_;
  std::vector<Buffer<float>> step_logits_, step_out_;

  // Runs the block over T = Σ counts pairs gathered into ids_ and hid_ ([T, H], rows in
  // row_ids order), appending counts[i] rows to row row_ids[i]; out_ receives [T, H].
  void run_block(const std::vector<int>& row_ids, const std::vector<int64_t>& counts);
  // proj_[total, H] = fc of the tap rows: taps[i] = (host rows [n_i, W], n_i), total = Σ n_i.
  void project(std::span<const std::pair<const float*, int64_t>> taps, int64_t total);
  // The index among step `step`'s active rows of row `row` (the last draft's diagnostics).
  int64_t step_row(int row, int step) const;
  void embed(int64_t T);  // emb_[T, H] = embedding of ids_
  void release(Row& r) { kv_.release(r.blocks); }
};

}  // namespace tandem::spec
