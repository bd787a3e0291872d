#include "tandem/spec/glm_mtp_block.h"

#include "tandem/core/error.h"
#include "tandem/model/gated_attention.h"
#include "tandem/spec/draft_block.h"

namespace tandem::spec {

GlmMtpBlock::GlmMtpBlock(const Glm5Config& cfg, const WeightStore& store)
    : context_(ops::Context::for_new_model()), cfg_(cfg) {
  const ops::ContextScope scope(*context_);
  if (cfg_.num_nextn_predict_layers < 1)
    fail("glm-mtp drafter: ", store.dir(),
         "/config.json declares no NextN layer (num_nextn_predict_layers = ",
         cfg_.num_nextn_predict_layers, ")");
  tensors_ = std::make_unique<Glm5Tensors>(cfg_, store);
  Glm5Tensors& t = *tensors_;
  const int64_t H = cfg_.hidden_size;
  const std::string p = "model.layers." + std::to_string(cfg_.num_hidden_layers) + ".";
  enorm_ = t.tensor(p + "enorm.weight", {H});
  hnorm_ = t.tensor(p + "hnorm.weight", {H});
  eh_proj_ = t.tensor(p + "eh_proj.weight", {H, 2 * H});
  head_norm_ = t.tensor(p + "shared_head.norm.weight", {H});
  const bool sparse = store.find(p + "mlp.gate.weight") != nullptr;
  layer_ = bind_glm5_layer(t, cfg_, p, sparse, /*with_indexer=*/false, /*dsa=*/false);
  const std::vector<float> inv_freq = rope_inv_freq(cfg_.rope_theta, cfg_.qk_rope_head_dim);
  inv_freq_.grow_to(static_cast<int64_t>(inv_freq.size()));
  ops::copy_from_host(inv_freq_.data(), inv_freq.data(), sizeof(float) * inv_freq.size());
}

void GlmMtpBlock::forward(const float* embeds, const float* hidden, const Glm5Tokens& tokens,
                          std::span<const Glm5RowCache> caches, float* out) const {
  const ops::ContextScope scope(*context_);
  const int64_t T = tokens.T, H = cfg_.hidden_size;
  const float eps = static_cast<float>(cfg_.rms_norm_eps);
  x_.grow_to(T * H);
  concat_normed_pair(embeds, hidden, T, H, enorm_, hnorm_, false, eps, cat_);
  ops::linear(cat_.data(), T, eh_proj_, x_.data());
  scratch_.prepare(cfg_, tokens);
  glm5_layer_forward(cfg_, layer_, inv_freq_.data(), tokens, caches, scratch_, x_.data(), nullptr,
                     nullptr);
  ops::rms_norm(x_.data(), T, H, head_norm_, false, eps, out);
}

}  // namespace tandem::spec
