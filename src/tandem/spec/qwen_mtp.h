// The Qwen MTP drafter (DESIGN.md §5.4): the checkpoint's own multi-token-prediction layer (or a
// companion directory holding it) proposes tokens by chaining its one decoder block.
//
// The rows follow MtpRows' convention (spec/mtp_rows.h).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "tandem/spec/draft.h"
#include "tandem/spec/draft_kv_pool.h"
#include "tandem/spec/mtp_rows.h"
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

  // Rows opened from now on score token ids 0..tokens-1 only (MtpRows::set_draft_vocabulary;
  // 0: the whole vocabulary). Changes what is proposed, never the output. Throws if tokens is
  // outside 0..vocab.
  void set_draft_vocabulary(int64_t tokens);
  int64_t draft_vocabulary() const { return draft_vocab_; }

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
  int64_t draft_vocab_ = 0;  // 0: the whole vocabulary
  std::shared_ptr<const QwenMtpBlock> block_;
};

// One MTP state per batch row (the convention of MtpRows): its own paged KV for the MTP attention
// layer.
class QwenMtpRows : public MtpRows {
 public:
  static constexpr int64_t kBlockSize = DraftKvPool::kBlockSize;

  QwenMtpRows(std::shared_ptr<const QwenMtpBlock> block, const TargetView& target, std::string ns,
              HiddenTap tap);

 private:
  struct KvHistory : History {
    std::vector<int32_t> blocks;  // KV blocks in position order
  };

  std::shared_ptr<const QwenMtpBlock> block_;
  DraftKvPool kv_;

  QwenMtpBlock::Workspace ws_;  // scratch (grown, reused)
  // Block forwards of at most kGraphRowTokens tokens a row, captured per shape (forward_block).
  static constexpr int64_t kGraphRowTokens = 4;
  GraphCache graphs_;
  // The batches of the draft chain being prepared or run (prepare_chain), one per step.
  std::vector<AttentionBatch> chain_;

  // Reserves KV for rows[i] to hold lengths[i] + added[i] positions; their block tables.
  std::vector<const std::vector<int32_t>*> reserve_tables(std::span<History* const> rows,
                                                          std::span<const int64_t> lengths,
                                                          std::span<const int64_t> added);
  // What a graph around a forward of batch b bakes in: shapes, bounds, the arrays' addresses.
  static void add_batch_key(const AttentionBatch& b, GraphKey& key);

  std::unique_ptr<History> new_history() override;
  void release_history(History& h) override;
  void truncate_history(History&, int64_t) override {}  // blocks stay reserved for reuse
  int64_t check_history(const Checkpoint& c) const override;
  std::unique_ptr<History> restore_history(const Checkpoint& c, int64_t length) override;
  void save_history(const History& h, int64_t length, Checkpoint& c) const override;
  // Rows of another QwenMtpRows of the same block: their KV blocks copied pool to pool.
  std::vector<std::unique_ptr<History>> copy_histories(const MtpRows& source,
                                                       std::span<const History* const> from,
                                                       std::span<const int64_t> lengths) override;
  void forward_block(const float* embeds, const float* hidden, std::span<History* const> rows,
                     std::span<const int64_t> lengths, std::span<const int64_t> counts,
                     float* out) override;
  // Whole chains run where the block shares the caller's context (a graph captures one stream).
  bool prepare_chain(std::span<History* const> rows, std::span<const int64_t> lengths,
                     std::span<const int> depths, StagedUpload::Part* tables_upload) override;
  void chain_step(int j, const float* embeds, const float* hidden, float* out) override;
  bool chain_step_embedded(int j, const int32_t* ids, const float* hidden, float* out) override;
  void add_chain_key(GraphKey& key) const override;
  void shift_chain(const ops::PositionShift& s) override;
  // Moves batch b's positions and KV slots by `shift` (its layout filled in from b).
  static void shift_batch(const ops::PositionShift& shift, const AttentionBatch& b);
  bool chains_share_context() const override;
};

}  // namespace tandem::spec
