// The Qwen MTP drafter (DESIGN.md §5.4): the checkpoint's own multi-token-prediction layer (or a
// companion directory holding it) proposes tokens by chaining its one decoder block.
//
// Row convention: MTP row p (rotary position p) is built from (token_{p+1}, h_p) and predicts
// token_{p+2}, where h_p is the target's hidden at position p at the drafter's tap. Between
// rounds every prefilled row holds exactly (target processed tokens - 1) MTP rows, plus h_true =
// the target's hidden at processed - 1 (the position whose next token is pending). A row that
// adopted a cached prefix of `base` tokens holds processed - 1 - base rows, from position base.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "tandem/spec/draft.h"
#include "tandem/spec/qwen_mtp_block.h"

namespace tandem::spec {

inline constexpr const char* kQwenMtpSchema = "qwen-mtp-v1";

class QwenMtpProvider : public DraftProvider {
 public:
  // The `mtp.*` layer inside the target's checkpoint (HF layout: zero-centred norms). Throws if
  // the config has mtp_num_hidden_layers = 0 or a tensor is missing or misshapen.
  static std::unique_ptr<QwenMtpProvider> from_target(const TargetView& target,
                                                      HiddenTap tap = HiddenTap::FinalNormed);
  // A companion drafter directory (config.json model_type qwen3_5_mtp + model.safetensors; norms
  // in runtime layout; dense or MLX-affine quantized projections). Compatibility with a target
  // (hidden size, vocabulary) is checked by open_rows.
  static std::unique_ptr<QwenMtpProvider> from_companion(const std::string& dir,
                                                         HiddenTap tap = HiddenTap::FinalNormed);
  // An MTP layer of the shape the target's config declares (as from_target derives it; requires
  // mtp_num_hidden_layers = 1) with random weights created directly in the active backend's
  // memory (random_mtp_weights; no files): timing the draft step of targets built with
  // Qwen35Model::random. Its proposals are meaningless but deterministic per seed. The
  // namespace is "qwen-mtp-v1:" + the identity of (block shape, "random-v1:<seed>", tap).
  static std::unique_ptr<QwenMtpProvider> random(const TargetView& target, uint64_t seed,
                                                 HiddenTap tap = HiddenTap::FinalNormed);

  const std::string& id() const override { return id_; }
  uint64_t weights_bytes() const override { return bytes_; }
  // "qwen-mtp-v1:" + artifact identity of the drafter weights (+ tap), computed once at open
  // (random weights: of their shape, seed and draw).
  const std::string& checkpoint_namespace() const override { return ns_; }
  // Refuses a target whose hidden size or vocabulary differs from the drafter's, or that cannot
  // provide the drafter's hidden tap.
  std::unique_ptr<DraftRows> open_rows(const TargetView& target) const override;

  HiddenTap tap() const { return tap_; }
  const QwenMtpConfig& config() const { return block_->config(); }
  // The companion's block_size - 1 (its suggested drafting depth); 0 when it gives none.
  int suggested_depth() const;
  const QwenMtpBlock& block() const { return *block_; }

 private:
  QwenMtpProvider() = default;
  std::string id_ = "qwen-mtp";
  std::string ns_;
  std::string source_;  // where the weights came from, for messages
  uint64_t bytes_ = 0;
  HiddenTap tap_ = HiddenTap::FinalNormed;
  std::shared_ptr<const QwenMtpBlock> block_;
};

// One MTP state per batch row: its own paged KV for the MTP attention layer, the last true target
// hidden, and the proposals of the round in flight.
class QwenMtpRows : public DraftRows {
 public:
  static constexpr int64_t kBlockSize = 16;

  QwenMtpRows(std::shared_ptr<const QwenMtpBlock> block, const TargetView& target, std::string ns,
              HiddenTap tap);

  const std::string& ns() const override { return ns_; }
  PrefillMode prefill_mode() const override { return PrefillMode::Full; }
  std::optional<HiddenTap> tap() const override { return tap_; }
  int row_count() const override { return static_cast<int>(rows_.size()); }

  std::unique_ptr<PreparedChange> prepare_append(std::span<const CheckpointPtr> from) override;
  void filter_rows(std::span<const int> keep) override;
  // Cold row (processed_before = 0): rows 0..n-2 from (tokens[p+1], hidden[p]). A row continuing
  // (processed_before = P > 0, e.g. restored) first adds row P-1 from (tokens[0], h_true).
  // Either way h_true becomes hidden[n-1].
  // The row's history starts at the boundary (its MTP rows before it would need the target's
  // hiddens there, which the cache does not keep): rotary positions count from the boundary,
  // which leaves attention scores as they would be (rotary embeddings are relative).
  void adopt_prefix(int row, std::span<const int32_t> tokens) override;
  bool adopts_exactly() const override { return false; }
  void prefill(std::span<const RowPrefill> rows) override;
  void draft(std::span<const RowDraft> rows, std::vector<DraftProposal>* out) override;
  void commit(std::span<const VerifyRow> rows) override;
  CheckpointPtr capture(int row) const override;

  // Diagnostics (tests, tools): the MTP rows a row holds, and the logits its last draft call
  // computed for proposal `step` ([V], valid until the next draft call).
  int64_t mtp_rows(int row) const { return rows_.at(row).length; }
  std::span<const float> last_draft_logits(int row, int step) const;

 private:
  struct Row {
    std::vector<int32_t> blocks;  // KV blocks in position order
    int64_t base = 0;             // target tokens before the row's history (adopt_prefix)
    int64_t length = 0;           // committed MTP rows, the first one at rotary position 0
    bool has_hidden = false;      // h_true is set (the row was prefilled or restored)
    std::vector<float> h_true;    // [H]
    // The round in flight (between draft and commit).
    bool drafted = false;
    int32_t pending = 0;
    std::vector<int32_t> proposals;
    int64_t round_start = 0;  // length when the round's draft began
  };

  std::shared_ptr<const QwenMtpBlock> block_;
  const TargetView& target_;  // outlives the rows (TargetView's contract)
  std::string ns_;
  HiddenTap tap_;
  int64_t H_ = 0, V_ = 0, kv_heads_ = 0, head_dim_ = 0;

  std::vector<Row> rows_;
  Buffer<float> pool_;  // [n_blocks, 2, kBlockSize, kv_heads, head_dim], backend memory
  int64_t n_blocks_ = 0;
  std::vector<int32_t> free_blocks_;

  // Scratch (grown, reused). Buffers are backend memory; vectors are host staging.
  QwenMtpBlock::Workspace ws_;
  Buffer<float> emb_, hid_dev_, out_;
  Buffer<int32_t> argmax_dev_;
  Buffer<int32_t> tables_dev_;  // the block tables of run_block's rows, concatenated
  std::vector<float> hid_, out_host_;
  std::vector<int32_t> ids_, tables_host_;
  std::vector<float> chain_;  // [rows, H] each row's last step output (host)
  // Per draft step: the logits [active rows, V] in backend memory, and a host copy made when
  // sampling needs it (or a diagnostic asks).
  std::vector<Buffer<float>> step_logits_dev_;
  mutable std::vector<std::vector<float>> step_logits_;
  mutable std::vector<bool> step_logits_on_host_;
  std::vector<std::vector<int>> step_rows_;  // per draft step: the active rows, in order
  int64_t outstanding_appends_ = 0;          // rows of prepared, not yet committed appends
  std::vector<TokenProb> dist_;

  ops::KVLayerView kv_view();
  void copy_step_logits(int step) const;  // the host copy of a draft step's logits
  int64_t floats_per_block() const { return 2 * kBlockSize * kv_heads_ * head_dim_; }
  // Takes `n` free blocks (growing the pool) without giving them to any row.
  std::vector<int32_t> take_blocks(int64_t n);
  void reserve(Row& r, int64_t length);
  // Runs the block over the tokens gathered in ids_ / hid_ (rows in `row_ids` order, counts[i]
  // tokens for row_ids[i]), appending them to each row's KV at its length; out_ receives the
  // block outputs [Σ counts, H].
  void run_block(const std::vector<int>& row_ids, const std::vector<int64_t>& counts);
  // Appends one (token, hidden) pair to the gather buffers.
  void gather(int32_t id, const float* hidden);
};

}  // namespace tandem::spec
