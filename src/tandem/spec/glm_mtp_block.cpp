#include "tandem/spec/glm_mtp_block.h"

#include "tandem/core/error.h"
#include "tandem/model/gated_attention.h"

namespace tandem::spec {

GlmMtpBlock::GlmMtpBlock(const Glm5Config& cfg, const WeightStore& store) : cfg_(cfg) {
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
  inv_freq_ = rope_inv_freq(cfg_.rope_theta, cfg_.qk_rope_head_dim);
}

void GlmMtpBlock::forward(const float* embeds, const float* hidden, const Glm5Tokens& tokens,
                          std::span<const Glm5RowCache> caches, float* out) const {
  const int64_t T = tokens.T, H = cfg_.hidden_size;
  const float eps = static_cast<float>(cfg_.rms_norm_eps);
  std::vector<float> cat(static_cast<size_t>(T * 2 * H));
  std::vector<float> e(static_cast<size_t>(T * H)), h(static_cast<size_t>(T * H));
  ops::rms_norm(embeds, T, H, enorm_, false, eps, e.data());
  ops::rms_norm(hidden, T, H, hnorm_, false, eps, h.data());
  ops::copy_rows(cat.data(), 2 * H, e.data(), H, T, H);
  ops::copy_rows(cat.data() + H, 2 * H, h.data(), H, T, H);
  std::vector<float> x(static_cast<size_t>(T * H));
  ops::linear(cat.data(), T, eh_proj_, x.data());
  std::vector<int32_t> selection;  // unused: the layer attends to every position
  glm5_layer_forward(cfg_, layer_, inv_freq_.data(), tokens, caches, selection, x, nullptr,
                     nullptr);
  ops::rms_norm(x.data(), T, H, head_norm_, false, eps, out);
}

}  // namespace tandem::spec
