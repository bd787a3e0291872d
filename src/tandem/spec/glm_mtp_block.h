// GLM-5's NextN (MTP) layer as a computation (DESIGN.md 5.4), model.layers.{num_hidden_layers}
// of the target's checkpoint:
//   x   = eh_proj(concat(enorm(embed(t)), hnorm(h)))     2H → H, embedding first
//   x   = layer(x)                                       one GLM-5 decoder layer: MLA over the
//                                                        drafter's own latent cache without the
//                                                        DSA (every position), then its MLP
//   out = shared_head.norm(x)                            what the target's head reads, and the
//                                                        h of the next chained draft step
// h is the target's final-normed hidden. Many rows go through one call, on either backend.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "tandem/backend/context.h"
#include "tandem/io/weight_store.h"
#include "tandem/model/glm5_config.h"
#include "tandem/model/glm5_layer.h"

namespace tandem::spec {

class GlmMtpBlock {
 public:
  // Binds the NextN layer of a glm_moe_dsa checkpoint (`store` must outlive the block). Throws
  // when the config declares no NextN layer or a tensor is missing or misshapen. Its MLP is a
  // mixture when the layer has a router (`mlp.gate.weight`), as the published checkpoints do.
  GlmMtpBlock(const Glm5Config& cfg, const WeightStore& store);

  const Glm5Config& config() const { return cfg_; }
  uint64_t parameter_count() const { return tensors_->parameters(); }
  uint64_t weights_bytes() const { return tensors_->bytes(); }
  int64_t latent_width() const { return cfg_.kv_lora_rank + cfg_.qk_rope_head_dim; }

  // embeds, hidden: [T, H] (the target's raw embedding rows of the tokens, and the target's
  // hiddens), rows of `tokens` in order; each row's new positions are appended to its cache
  // (caches[i].latent for tokens.rows[i]). out: [T, H]. All in backend memory.
  void forward(const float* embeds, const float* hidden, const Glm5Tokens& tokens,
               std::span<const Glm5RowCache> caches, float* out) const;

 private:
  // The backend context its work runs on: its builder's current one, or its own
  // (Context::for_new_model); its entry points enter it. First: destroyed after the buffers below.
  std::shared_ptr<ops::Context> context_;
  Glm5Config cfg_;
  std::unique_ptr<Glm5Tensors> tensors_;
  ops::WeightRef enorm_, hnorm_, eh_proj_, head_norm_;
  Glm5Layer layer_;
  Buffer<float> inv_freq_;
  // A call's activations (backend memory), reused across calls.
  mutable Glm5Scratch scratch_;
  mutable Buffer<float> cat_, x_;
};

}  // namespace tandem::spec
