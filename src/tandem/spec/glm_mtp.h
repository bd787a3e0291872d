// The GLM-5 MTP drafter (DESIGN.md §5.4): the checkpoint's NextN layer (GlmMtpBlock) proposes
// tokens by chaining itself on its own output, fed the target's final-normed hidden. Its rows
// follow MtpRows' convention; each keeps its own latent cache (one entry per MTP row: the normed
// latent and the shared rotary key), which a commit truncates to the kept rows.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "tandem/spec/draft.h"
#include "tandem/spec/glm_mtp_block.h"
#include "tandem/spec/mtp_rows.h"

namespace tandem::spec {

inline constexpr const char* kGlmMtpSchema = "glm-mtp-v1";

// How a row's drafter history begins. Prefilled: the prompt's MTP rows are built at admission,
// so the first drafts attend to the whole prompt. Empty: the history starts at the prompt's last
// token, as mlx-bun's GLM drafter does (cheaper admission, less context for the first rounds).
enum class GlmMtpHistory { Prefilled, Empty };

class GlmMtpProvider : public DraftProvider {
 public:
  // The NextN layer model.layers.{num_hidden_layers} inside the target's glm_moe_dsa checkpoint.
  // Throws if the target is not a GLM-5 model, its config declares no NextN layer, or a tensor
  // is missing or misshapen.
  static std::unique_ptr<GlmMtpProvider> from_target(
      const TargetView& target, GlmMtpHistory history = GlmMtpHistory::Prefilled);

  const std::string& id() const override { return id_; }
  uint64_t weights_bytes() const override { return block_->weights_bytes(); }
  // "glm-mtp-v1:" + the artifact identity of the checkpoint (+ the history convention).
  const std::string& checkpoint_namespace() const override { return ns_; }
  // Refuses a target of another family or another checkpoint's shape.
  std::unique_ptr<DraftRows> open_rows(const TargetView& target) const override;

  const GlmMtpBlock& block() const { return *block_; }

 private:
  GlmMtpProvider() = default;
  std::string id_ = "glm-mtp";
  std::string ns_;
  std::string source_;  // where the weights came from, for messages
  GlmMtpHistory history_ = GlmMtpHistory::Prefilled;
  std::shared_ptr<const GlmMtpBlock> block_;
};

class GlmMtpRows : public MtpRows {
 public:
  GlmMtpRows(std::shared_ptr<const GlmMtpBlock> block, const TargetView& target, std::string ns,
             GlmMtpHistory history);

 private:
  struct LatentHistory : History {
    explicit LatentHistory(int64_t width) : latent(width) {}
    PositionCache latent;  // [rows, kv_lora_rank + qk_rope_head_dim]
  };

  std::shared_ptr<const GlmMtpBlock> block_;
  int64_t width_ = 0;  // latent entry width

  std::unique_ptr<History> new_history() override;
  void release_history(History& h) override;
  void truncate_history(History& h, int64_t length) override;
  int64_t check_history(const Checkpoint& c) const override;
  std::unique_ptr<History> restore_history(const Checkpoint& c, int64_t length) override;
  void save_history(const History& h, int64_t length, Checkpoint& c) const override;
  void forward_block(const float* embeds, const float* hidden, std::span<History* const> rows,
                     std::span<const int64_t> lengths, std::span<const int64_t> counts,
                     float* out) override;
};

}  // namespace tandem::spec
