#include "tandem/model/glm5_layer.h"

#include <algorithm>
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
  const ops::WeightRef w = stored(name, shape);
  if (shape.size() == 1) return arena_.vector(w);
  return w.dtype == DType::F8_E4M3 ? arena_.fp8_matrix(w) : arena_.matrix(w);
}

ops::WeightRef Glm5Tensors::expert_tensor(const std::string& name,
                                          const std::vector<int64_t>& shape) {
  const ops::WeightRef w = stored(name, shape);
  // fp8 experts stay fp8 where their rows are whole scale blocks (they stack into one grouped
  // weight per projection); otherwise bf16 (CUDA) or as stored (CPU).
  if (w.dtype == DType::F8_E4M3 && w.rows % w.scales.block_rows == 0) return arena_.fp8_matrix(w);
  return arena_.matrix(w);
}

ops::WeightRef Glm5Tensors::stored(const std::string& name, const std::vector<int64_t>& shape) {
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

ops::WeightRef Glm5Tensors::widened(const std::string& name, const std::vector<int64_t>& shape) {
  const ops::WeightRef w = stored(name, shape);
  std::vector<float> v(static_cast<size_t>(w.rows * w.cols));
  for (int64_t i = 0; i < w.rows * w.cols; ++i)
    v[static_cast<size_t>(i)] = ops::weight_element(w, i);
  ops::WeightRef f;
  f.dtype = DType::F32;
  f.data = v.data();
  f.rows = w.rows;
  f.cols = w.cols;
  const ops::WeightRef placed = arena_.vector(f);
  // The CPU reads this copy in place (a moved vector keeps its buffer); CUDA has its own.
  if (placed.data == v.data()) widened_.push_back(std::move(v));
  return placed;
}

ops::MoeWeights Glm5Tensors::mixture(const std::string& p) {
  const Glm5Config& c = cfg_;
  const int64_t H = c.hidden_size, E = c.n_routed_experts, I = c.moe_intermediate_size;
  ops::MoeWeights m;
  m.router = expert_tensor(p + "gate.weight", {E, H});
  m.score_bias = widened(p + "gate.e_score_correction_bias", {E});
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
        return expert_tensor(name, shape);
      },
      &m);
  if (c.n_shared_experts > 0) {
    const int64_t Is = I * c.n_shared_experts;
    m.shared_gate_proj = expert_tensor(p + "shared_experts.gate_proj.weight", {Is, H});
    m.shared_up_proj = expert_tensor(p + "shared_experts.up_proj.weight", {Is, H});
    m.shared_down_proj = expert_tensor(p + "shared_experts.down_proj.weight", {H, Is});
  }
  // The CUDA mixture reads every expert's gate/up rows and down rows as two stacked matrices;
  // the CPU reads the experts where they are stored.
  if (ops::backend() == ops::Backend::Cuda) stack_moe_experts(arena_, &m);
  return m;
}

void for_each_glm5_layer_weight(const Glm5Layer& L,
                                const std::function<void(const ops::WeightRef&)>& fn) {
  for (const ops::WeightRef* w :
       {&L.input_norm, &L.post_norm, &L.q_a_proj, &L.q_a_norm, &L.q_b_proj, &L.kv_a_proj,
        &L.kv_a_norm, &L.kv_b_proj, &L.o_proj, &L.index_wq_b, &L.index_wk, &L.index_k_norm,
        &L.index_k_norm_bias, &L.index_weights_proj, &L.gate_proj, &L.up_proj, &L.down_proj})
    fn(*w);
  if (L.sparse) for_each_moe_matrix(L.moe, fn);
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
  L.kv_b_proj = t.widened(a + "kv_b_proj.weight", {nh * (dn + dv), R});
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
               std::span<const Glm5RowCache> caches, Glm5Scratch& s, float* x,
               std::vector<int32_t>* index_record) {
  const int64_t T = b.T, H = c.hidden_size, nh = c.num_attention_heads;
  const int64_t dn = c.qk_nope_head_dim, dr = c.qk_rope_head_dim, dv = c.v_head_dim;
  const int64_t R = c.kv_lora_rank, W = R + dr, qr = c.q_lora_rank;
  const int64_t Di = c.index_head_dim, ih = c.index_n_heads, topk = c.index_topk;
  const float eps = static_cast<float>(c.rms_norm_eps);
  const int64_t* pos = s.pos.data();

  float* h = s.h.data();
  ops::rms_norm(x, T, H, A.input_norm, false, eps, h);

  // Queries: the LoRA latent (normed; the indexer reads it too), then per head [nope | rope].
  float* qa = s.qa.data();
  ops::linear(h, T, A.q_a_proj, qa);
  ops::rms_norm(qa, T, qr, A.q_a_norm, false, kLatentNormEps, qa);
  float* q = s.q.data();
  ops::linear(qa, T, A.q_b_proj, q);
  ops::rope_slice(q, T, nh, dn + dr, dn, dr, pos, inv_freq, c.rope_interleave);
  float *q_nope = s.q_nope.data(), *q_pe = s.q_pe.data();
  ops::copy_rows(q_nope, dn, q, dn + dr, T * nh, dn);
  ops::copy_rows(q_pe, dr, q + dn, dn + dr, T * nh, dr);

  // The latent cache entries: [normed latent | rotated rotary key] per token. The latent is
  // normed in a packed copy (rms_norm's rows are contiguous), then put back.
  float *kv = s.kv.data(), *kv_latent = s.kv_latent.data();
  ops::linear(h, T, A.kv_a_proj, kv);
  ops::copy_rows(kv_latent, R, kv, W, T, R);
  ops::rms_norm(kv_latent, T, R, A.kv_a_norm, false, kLatentNormEps, kv_latent);
  ops::copy_rows(kv, W, kv_latent, R, T, R);
  ops::rope_slice(kv, T, 1, W, R, dr, pos, inv_freq, c.rope_interleave);
  for (size_t i = 0; i < b.rows.size(); ++i) {
    const Glm5Tokens::Row& r = b.rows[i];
    caches[i].latent->append(kv + r.first * W, r.n);
  }

  // The DSA choice: this layer's own indexer, or the previous layer's choice.
  int32_t* selection = s.selection.data();
  if (A.indexer) {
    float *qi = s.qi.data(), *ki = s.ki.data(), *w = s.wi.data();
    ops::linear(qa, T, A.index_wq_b, qi);
    ops::rope_slice(qi, T, ih, Di, 0, dr, pos, inv_freq, c.indexer_rope_interleave);
    ops::linear(h, T, A.index_wk, ki);
    ops::layer_norm(ki, T, Di, A.index_k_norm, A.index_k_norm_bias, kIndexKeyNormEps, ki);
    ops::rope_slice(ki, T, 1, Di, 0, dr, pos, inv_freq, c.indexer_rope_interleave);
    ops::linear(h, T, A.index_weights_proj, w);
    ops::scale(w, T * ih, 1.0f / std::sqrt(static_cast<float>(ih)));
    for (size_t i = 0; i < b.rows.size(); ++i) {
      const Glm5Tokens::Row& r = b.rows[i];
      PositionCache& keys = *caches[i].index_keys;
      keys.append(ki + r.first * Di, r.n);
      ops::dsa_select(qi + r.first * ih * Di, w + r.first * ih, r.n, ih, Di, keys.data(),
                      r.start + r.n, pos + r.first, topk, selection + r.first * topk);
    }
  }
  if (A.dsa && index_record) {
    const size_t at = index_record->size();
    index_record->resize(at + static_cast<size_t>(T * topk));
    ops::copy_to_host(index_record->data() + at, selection, sizeof(int32_t) * T * topk);
  }

  float* attn = s.attn.data();
  const float scale = 1.0f / std::sqrt(static_cast<float>(dn + dr));
  for (size_t i = 0; i < b.rows.size(); ++i) {
    const Glm5Tokens::Row& r = b.rows[i];
    ops::mla_attention(q_nope + r.first * nh * dn, q_pe + r.first * nh * dr, r.n, nh, dn, dr, dv,
                       caches[i].latent->data(), r.start + r.n, R, A.kv_b_proj, pos + r.first,
                       A.dsa ? selection + r.first * topk : nullptr, topk, scale,
                       /*absorbed=*/!b.prompt, attn + r.first * nh * dv);
  }
  ops::linear_add(attn, T, A.o_proj, x);
}

void mlp(const Glm5Config& c, const Glm5Layer& L, int64_t T, Glm5Scratch& s, float* x,
         std::vector<int32_t>* routing) {
  const int64_t H = c.hidden_size;
  float* h = s.h.data();
  ops::rms_norm(x, T, H, L.post_norm, false, static_cast<float>(c.rms_norm_eps), h);
  if (L.sparse) {
    std::vector<int32_t> ids;
    ops::moe_mlp_add(h, T, L.moe, x, routing ? &ids : nullptr);
    if (routing) routing->insert(routing->end(), ids.begin(), ids.end());
    return;
  }
  const int64_t I = c.intermediate_size;
  float *g = s.g.data(), *u = s.u.data();
  ops::linear(h, T, L.gate_proj, g);
  ops::linear(h, T, L.up_proj, u);
  ops::swiglu(g, u, T * I, g);
  ops::linear_add(g, T, L.down_proj, x);
}

}  // namespace

void Glm5Scratch::prepare(const Glm5Config& c, const Glm5Tokens& tokens) {
  const int64_t T = tokens.T, H = c.hidden_size, nh = c.num_attention_heads;
  const int64_t dn = c.qk_nope_head_dim, dr = c.qk_rope_head_dim, dv = c.v_head_dim;
  const int64_t R = c.kv_lora_rank;
  TANDEM_CHECK(static_cast<int64_t>(tokens.pos.size()) == T, "Glm5Scratch: ", tokens.pos.size(),
               " positions for ", T, " tokens");
  pos.grow_to(T);
  if (T > 0) ops::copy_from_host(pos.data(), tokens.pos.data(), sizeof(int64_t) * T);
  selection.grow_to(T * c.index_topk);
  h.grow_to(T * H);
  qa.grow_to(T * c.q_lora_rank);
  q.grow_to(T * nh * (dn + dr));
  q_nope.grow_to(T * nh * dn);
  q_pe.grow_to(T * nh * dr);
  kv.grow_to(T * (R + dr));
  kv_latent.grow_to(T * R);
  qi.grow_to(T * c.index_n_heads * c.index_head_dim);
  ki.grow_to(T * c.index_head_dim);
  wi.grow_to(T * c.index_n_heads);
  attn.grow_to(T * nh * dv);
  const int64_t I = std::max(c.intermediate_size, c.moe_intermediate_size);
  g.grow_to(T * I);
  u.grow_to(T * I);
}

void glm5_layer_forward(const Glm5Config& c, const Glm5Layer& L, const float* inv_freq,
                        const Glm5Tokens& tokens, std::span<const Glm5RowCache> caches,
                        Glm5Scratch& s, float* x, std::vector<int32_t>* routing,
                        std::vector<int32_t>* index_record) {
  attention(c, L, inv_freq, tokens, caches, s, x, index_record);
  mlp(c, L, tokens.T, s, x, routing);
}

}  // namespace tandem
