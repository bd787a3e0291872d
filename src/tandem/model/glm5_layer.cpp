#include "tandem/model/glm5_layer.h"

#include <cmath>

#include "tandem/backend/cpu/weight_element.h"
#include "tandem/core/error.h"
#include "tandem/model/moe_weights.h"

namespace tandem {

namespace {

// transformers builds the MLA's inner norms (q_a_layernorm, kv_a_layernorm) with GlmMoeDsaRMSNorm's
// default eps and the indexer's key norm with its own; neither reads rms_norm_eps.
constexpr float kLatentNormEps = 1e-6f;
constexpr float kIndexKeyNormEps = 1e-6f;

bool is_float(DType t) {
  return t == DType::F32 || t == DType::BF16 || t == DType::F16;
}

}  // namespace

ops::WeightRef Glm5Tensors::tensor(const std::string& name, const std::vector<int64_t>& shape) {
  const TensorView& t = store_.get(name);
  if (t.shape != shape)
    fail("tensor '", name, "' in ", store_.dir(), ": expected shape ", shape_str(shape), ", got ",
         shape_str(t.shape));
  ops::WeightRef w = ops::weight_ref(t);
  parameters_ += static_cast<uint64_t>(t.numel());
  bytes_ += w.bytes();
  if (is_float(t.dtype)) return w;
  if (t.dtype != DType::F8_E4M3 || shape.size() != 2)
    fail("tensor '", name, "' in ", store_.dir(), ": dtype ", dtype_name(t.dtype),
         " is not supported (expected F32, BF16 or F16, or F8_E4M3 for a matrix)");
  if (!cfg_.fp8())
    fail("tensor '", name, "' in ", store_.dir(),
         " is fp8 (F8_E4M3) but config.json has no fp8 quantization_config");
  const std::string scale_name = name.substr(0, name.rfind(".weight")) + ".weight_scale_inv";
  const TensorView* s = store_.find(scale_name);
  if (!s)
    fail("tensor '", name, "' in ", store_.dir(), " is fp8 but its scales '", scale_name,
         "' are missing");
  const std::vector<int64_t> grid = {(shape[0] + cfg_.fp8_block_rows - 1) / cfg_.fp8_block_rows,
                                     (shape[1] + cfg_.fp8_block_cols - 1) / cfg_.fp8_block_cols};
  if (s->shape != grid)
    fail("tensor '", scale_name, "' in ", store_.dir(), ": expected shape ", shape_str(grid),
         " (blocks of ", cfg_.fp8_block_rows, " x ", cfg_.fp8_block_cols, " over ",
         shape_str(shape), "), got ", shape_str(s->shape));
  if (s->dtype != DType::F32 && s->dtype != DType::BF16)
    fail("tensor '", scale_name, "' in ", store_.dir(), ": dtype ", dtype_name(s->dtype),
         " is not supported (expected F32 or BF16)");
  bytes_ += static_cast<uint64_t>(s->numel()) * dtype_size(s->dtype);
  w.scales.data = s->data;
  w.scales.dtype = s->dtype;
  w.scales.block_rows = cfg_.fp8_block_rows;
  w.scales.block_cols = cfg_.fp8_block_cols;
  return w;
}

ops::WeightRef Glm5Tensors::widened(const ops::WeightRef& w) {
  std::vector<float>& v = widened_.emplace_back(static_cast<size_t>(w.rows * w.cols));
  for (int64_t i = 0; i < w.rows * w.cols; ++i)
    v[static_cast<size_t>(i)] = ops::weight_element(w, i);
  ops::WeightRef f;
  f.dtype = DType::F32;
  f.data = v.data();
  f.rows = w.rows;
  f.cols = w.cols;
  return f;
}

ops::MoeWeights Glm5Tensors::mixture(const std::string& p) {
  const Glm5Config& c = cfg_;
  const int64_t H = c.hidden_size, E = c.n_routed_experts, I = c.moe_intermediate_size;
  ops::MoeWeights m;
  m.router = tensor(p + "gate.weight", {E, H});
  const ops::WeightRef bias = tensor(p + "gate.e_score_correction_bias", {E});
  std::vector<float>& b = score_biases_.emplace_back(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) b[static_cast<size_t>(e)] = ops::weight_element(bias, e);
  m.score_bias.dtype = DType::F32;
  m.score_bias.data = b.data();
  m.score_bias.rows = 1;
  m.score_bias.cols = E;
  m.routing = ops::MoeRouting::NoauxTc;
  m.top_k = c.num_experts_per_tok;
  m.renormalise = c.norm_topk_prob;
  m.n_group = c.n_group;
  m.topk_group = c.topk_group;
  m.routed_scale = static_cast<float>(c.routed_scaling_factor);
  const std::string ex = p + "experts.";
  const bool fused = store_.find(ex + "gate_up_proj") != nullptr;
  if (!fused && !store_.find(ex + "0.gate_proj.weight"))
    fail("no experts in ", store_.dir(), ": expected '", ex,
         "gate_up_proj' (fused, as transformers writes them) or '", ex,
         "0.gate_proj.weight' (one tensor per expert)");
  bind_routed_experts(
      ex, E, I, H, fused,
      [&](const std::string& name, const std::vector<int64_t>& shape) {
        return tensor(name, shape);
      },
      &m);
  if (c.n_shared_experts > 0) {
    const int64_t Is = I * c.n_shared_experts;
    m.shared_gate_proj = tensor(p + "shared_experts.gate_proj.weight", {Is, H});
    m.shared_up_proj = tensor(p + "shared_experts.up_proj.weight", {Is, H});
    m.shared_down_proj = tensor(p + "shared_experts.down_proj.weight", {H, Is});
  }
  return m;
}

Glm5Layer bind_glm5_layer(Glm5Tensors& t, const Glm5Config& c, const std::string& p, bool sparse,
                          bool with_indexer, bool dsa) {
  const int64_t H = c.hidden_size, nh = c.num_attention_heads;
  const int64_t dn = c.qk_nope_head_dim, dr = c.qk_rope_head_dim, dv = c.v_head_dim;
  const int64_t R = c.kv_lora_rank, Di = c.index_head_dim;
  Glm5Layer L;
  L.input_norm = t.tensor(p + "input_layernorm.weight", {H});
  L.post_norm = t.tensor(p + "post_attention_layernorm.weight", {H});
  const std::string a = p + "self_attn.";
  L.q_a_proj = t.tensor(a + "q_a_proj.weight", {c.q_lora_rank, H});
  L.q_a_norm = t.tensor(a + "q_a_layernorm.weight", {c.q_lora_rank});
  L.q_b_proj = t.tensor(a + "q_b_proj.weight", {nh * (dn + dr), c.q_lora_rank});
  L.kv_a_proj = t.tensor(a + "kv_a_proj_with_mqa.weight", {R + dr, H});
  L.kv_a_norm = t.tensor(a + "kv_a_layernorm.weight", {R});
  // Every attention call reads kv_b whole (it expands or absorbs the latent for each head): kept
  // in fp32 rather than widened per call.
  L.kv_b_proj = t.widened(t.tensor(a + "kv_b_proj.weight", {nh * (dn + dv), R}));
  L.o_proj = t.tensor(a + "o_proj.weight", {H, nh * dv});
  L.dsa = dsa;
  L.indexer = dsa && with_indexer;
  if (L.indexer) {
    const std::string x = a + "indexer.";
    L.index_wq_b = t.tensor(x + "wq_b.weight", {c.index_n_heads * Di, c.q_lora_rank});
    L.index_wk = t.tensor(x + "wk.weight", {Di, H});
    L.index_k_norm = t.tensor(x + "k_norm.weight", {Di});
    L.index_k_norm_bias = t.tensor(x + "k_norm.bias", {Di});
    L.index_weights_proj = t.tensor(x + "weights_proj.weight", {c.index_n_heads, H});
  }
  L.sparse = sparse;
  if (sparse) {
    L.moe = t.mixture(p + "mlp.");
  } else {
    L.gate_proj = t.tensor(p + "mlp.gate_proj.weight", {c.intermediate_size, H});
    L.up_proj = t.tensor(p + "mlp.up_proj.weight", {c.intermediate_size, H});
    L.down_proj = t.tensor(p + "mlp.down_proj.weight", {H, c.intermediate_size});
  }
  return L;
}

namespace {

void attention(const Glm5Config& c, const Glm5Layer& A, const float* inv_freq, const Glm5Tokens& b,
               std::span<const Glm5RowCache> caches, std::vector<int32_t>& selection,
               std::vector<float>& x, std::vector<int32_t>* index_record) {
  const int64_t T = b.T, H = c.hidden_size, nh = c.num_attention_heads;
  const int64_t dn = c.qk_nope_head_dim, dr = c.qk_rope_head_dim, dv = c.v_head_dim;
  const int64_t R = c.kv_lora_rank, W = R + dr, qr = c.q_lora_rank;
  const int64_t Di = c.index_head_dim, ih = c.index_n_heads, topk = c.index_topk;
  const float eps = static_cast<float>(c.rms_norm_eps);
  const int64_t* pos = b.pos.data();

  std::vector<float> h(static_cast<size_t>(T * H));
  ops::rms_norm(x.data(), T, H, A.input_norm, false, eps, h.data());

  // Queries: the LoRA latent (normed; the indexer reads it too), then per head [nope | rope].
  std::vector<float> qa(static_cast<size_t>(T * qr));
  ops::linear(h.data(), T, A.q_a_proj, qa.data());
  ops::rms_norm(qa.data(), T, qr, A.q_a_norm, false, kLatentNormEps, qa.data());
  std::vector<float> q(static_cast<size_t>(T * nh * (dn + dr)));
  ops::linear(qa.data(), T, A.q_b_proj, q.data());
  ops::rope_slice(q.data(), T, nh, dn + dr, dn, dr, pos, inv_freq, c.rope_interleave);
  std::vector<float> q_nope(static_cast<size_t>(T * nh * dn)),
      q_pe(static_cast<size_t>(T * nh * dr));
  ops::copy_rows(q_nope.data(), dn, q.data(), dn + dr, T * nh, dn);
  ops::copy_rows(q_pe.data(), dr, q.data() + dn, dn + dr, T * nh, dr);

  // The latent cache entries: [normed latent | rotated rotary key] per token.
  std::vector<float> kv(static_cast<size_t>(T * W));
  ops::linear(h.data(), T, A.kv_a_proj, kv.data());
  for (int64_t t = 0; t < T; ++t)
    ops::rms_norm(kv.data() + t * W, 1, R, A.kv_a_norm, false, kLatentNormEps, kv.data() + t * W);
  ops::rope_slice(kv.data(), T, 1, W, R, dr, pos, inv_freq, c.rope_interleave);
  for (size_t i = 0; i < b.rows.size(); ++i) {
    const Glm5Tokens::Row& r = b.rows[i];
    std::vector<float>& cache = *caches[i].latent;
    cache.insert(cache.end(), kv.begin() + r.first * W, kv.begin() + (r.first + r.n) * W);
  }

  // The DSA choice: this layer's own indexer, or the previous layer's choice.
  if (A.indexer) {
    std::vector<float> qi(static_cast<size_t>(T * ih * Di)), ki(static_cast<size_t>(T * Di));
    ops::linear(qa.data(), T, A.index_wq_b, qi.data());
    ops::rope_slice(qi.data(), T, ih, Di, 0, dr, pos, inv_freq, c.indexer_rope_interleave);
    ops::linear(h.data(), T, A.index_wk, ki.data());
    ops::layer_norm(ki.data(), T, Di, A.index_k_norm, A.index_k_norm_bias, kIndexKeyNormEps,
                    ki.data());
    ops::rope_slice(ki.data(), T, 1, Di, 0, dr, pos, inv_freq, c.indexer_rope_interleave);
    std::vector<float> w(static_cast<size_t>(T * ih));
    ops::linear(h.data(), T, A.index_weights_proj, w.data());
    const float head_scale = 1.0f / std::sqrt(static_cast<float>(ih));
    for (float& v : w) v *= head_scale;
    selection.assign(static_cast<size_t>(T * topk), -1);
    for (size_t i = 0; i < b.rows.size(); ++i) {
      const Glm5Tokens::Row& r = b.rows[i];
      std::vector<float>& keys = *caches[i].index_keys;
      keys.insert(keys.end(), ki.begin() + r.first * Di, ki.begin() + (r.first + r.n) * Di);
      ops::dsa_select(qi.data() + r.first * ih * Di, w.data() + r.first * ih, r.n, ih, Di,
                      keys.data(), r.start + r.n, pos + r.first, topk,
                      selection.data() + r.first * topk);
    }
  }
  if (A.dsa && index_record)
    index_record->insert(index_record->end(), selection.begin(), selection.end());

  std::vector<float> attn(static_cast<size_t>(T * nh * dv));
  const float scale = 1.0f / std::sqrt(static_cast<float>(dn + dr));
  for (size_t i = 0; i < b.rows.size(); ++i) {
    const Glm5Tokens::Row& r = b.rows[i];
    const std::vector<float>& cache = *caches[i].latent;
    ops::mla_attention(q_nope.data() + r.first * nh * dn, q_pe.data() + r.first * nh * dr, r.n, nh,
                       dn, dr, dv, cache.data(), r.start + r.n, R, A.kv_b_proj, pos + r.first,
                       A.dsa ? selection.data() + r.first * topk : nullptr, topk, scale,
                       /*absorbed=*/!b.prompt, attn.data() + r.first * nh * dv);
  }
  ops::linear_add(attn.data(), T, A.o_proj, x.data());
}

void mlp(const Glm5Config& c, const Glm5Layer& L, int64_t T, std::vector<float>& x,
         std::vector<int32_t>* routing) {
  const int64_t H = c.hidden_size;
  std::vector<float> h(static_cast<size_t>(T * H));
  ops::rms_norm(x.data(), T, H, L.post_norm, false, static_cast<float>(c.rms_norm_eps), h.data());
  if (L.sparse) {
    std::vector<int32_t> ids;
    ops::moe_mlp_add(h.data(), T, L.moe, x.data(), routing ? &ids : nullptr);
    if (routing) routing->insert(routing->end(), ids.begin(), ids.end());
    return;
  }
  const int64_t I = c.intermediate_size;
  std::vector<float> g(static_cast<size_t>(T * I)), u(static_cast<size_t>(T * I));
  ops::linear(h.data(), T, L.gate_proj, g.data());
  ops::linear(h.data(), T, L.up_proj, u.data());
  ops::swiglu(g.data(), u.data(), T * I, g.data());
  ops::linear_add(g.data(), T, L.down_proj, x.data());
}

}  // namespace

void glm5_layer_forward(const Glm5Config& c, const Glm5Layer& L, const float* inv_freq,
                        const Glm5Tokens& tokens, std::span<const Glm5RowCache> caches,
                        std::vector<int32_t>& selection, std::vector<float>& x,
                        std::vector<int32_t>* routing, std::vector<int32_t>* index_record) {
  attention(c, L, inv_freq, tokens, caches, selection, x, index_record);
  mlp(c, L, tokens.T, x, routing);
}

}  // namespace tandem
