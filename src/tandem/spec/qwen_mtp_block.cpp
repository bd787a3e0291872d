#include "tandem/spec/qwen_mtp_block.h"

#include <cmath>

#include "tandem/core/error.h"
#include "tandem/model/moe_weights.h"
#include "tandem/spec/draft_block.h"

namespace tandem::spec {

QwenMtpBlock::QwenMtpBlock(QwenMtpWeights w)
    : context_(ops::Context::for_new_model()), w_(std::move(w)) {
  const ops::ContextScope scope(*context_);
  const QwenMtpConfig& c = w_.cfg;
  // In fp32, as the target (and the reference) compute them: 1 / theta^(2i / rotary_dim).
  const std::vector<float> f = rope_inv_freq(c.rope_theta, c.rotary_dim);
  inv_freq_.grow_to(static_cast<int64_t>(f.size()));
  ops::copy_from_host(inv_freq_.data(), f.data(), sizeof(float) * f.size());
  // The CPU computes on the mapped tensors; random weights were created where they are used.
  if (ops::backend() == ops::Backend::Cpu) return;
  if (w_.placed) {
    if (c.moe.moe()) stack_moe_experts(w_.arena, &w_.moe);
    return;
  }
  for (ops::WeightRef* v : {&w_.pre_fc_norm_embedding, &w_.pre_fc_norm_hidden, &w_.input_layernorm,
                            &w_.post_attention_layernorm, &w_.q_norm, &w_.k_norm, &w_.norm})
    *v = arena_.vector(*v);
  if (c.moe.moe()) {
    for_each_moe_matrix(w_.moe, [&](ops::WeightRef& r) {
      if (r.rows > 0) r = arena_.matrix(r);
    });
    stack_moe_experts(arena_, &w_.moe);
  }
  for (MtpLinear* l : {&w_.fc, &w_.q_proj, &w_.k_proj, &w_.v_proj, &w_.o_proj, &w_.gate_proj,
                       &w_.up_proj, &w_.down_proj}) {
    if (l->quant) {
      l->dense = arena_.dequantized(*l->quant);
      l->quant.reset();
    } else {
      l->dense = arena_.matrix(l->dense);
    }
  }
}

void QwenMtpBlock::forward(const float* embeds, const float* hidden,
                           std::span<const MtpSegment> segs, const ops::KVLayerView& kv,
                           Workspace& ws, float* out) const {
  const ops::ContextScope scope(*context_);
  const QwenMtpConfig& c = w_.cfg;
  const int64_t H = c.hidden_size, I = c.intermediate_size, hd = c.head_dim;
  const int64_t nh = c.num_attention_heads, nkv = c.num_key_value_heads;
  const bool zc = c.norms_zero_centred;
  const float eps = static_cast<float>(c.rms_norm_eps);
  const int64_t T = upload_segment_positions(segs, ws.pos_host, ws.pos);
  if (T == 0) return;

  // fc input: [norm_e(embed) | norm_h(h)] per token.
  concat_normed_pair(embeds, hidden, T, H, w_.pre_fc_norm_embedding, w_.pre_fc_norm_hidden, zc, eps,
                     ws.cat, ws.h);
  grow_to(ws.x, T * H);
  w_.fc.apply(ws.cat.data(), T, ws.x.data());

  // Gated full attention (the Qwen3.5 decoder layer's mixer).
  ops::rms_norm(ws.x.data(), T, H, w_.input_layernorm, zc, eps, ws.h.data());
  GatedAttentionShape shape;
  shape.n_heads = nh;
  shape.n_kv_heads = nkv;
  shape.head_dim = hd;
  shape.rotary_dim = c.rotary_dim;
  shape.eps = eps;
  shape.zero_centred_norms = zc;
  GatedAttentionScratch& x = ws.attn;
  x.reserve(T, shape);
  w_.q_proj.apply(ws.h.data(), T, x.qg.data());
  w_.k_proj.apply(ws.h.data(), T, x.k.data());
  w_.v_proj.apply(ws.h.data(), T, x.v.data());
  gated_attention(shape, w_.q_norm, w_.k_norm, inv_freq_.data(), ws.pos.data(), segs, kv, x);
  w_.o_proj.apply(x.o.data(), T, ws.h.data());

  // SwiGLU MLP, or the mixture of experts (the residual add fused with its norm).
  ops::add_rms_norm(ws.x.data(), ws.h.data(), T, H, w_.post_attention_layernorm, zc, eps,
                    ws.h.data());
  if (c.moe.moe()) {
    ops::moe_mlp_add(ws.h.data(), T, w_.moe, ws.x.data());  // adds into the residual stream
    ops::rms_norm(ws.x.data(), T, H, w_.norm, zc, eps, out);
    return;
  }
  grow_to(ws.g, T * I);
  grow_to(ws.u, T * I);
  w_.gate_proj.apply(ws.h.data(), T, ws.g.data());
  w_.up_proj.apply(ws.h.data(), T, ws.u.data());
  ops::swiglu(ws.g.data(), ws.u.data(), T * I, ws.g.data());
  w_.down_proj.apply(ws.g.data(), T, ws.h.data());
  ops::add_rms_norm(ws.x.data(), ws.h.data(), T, H, w_.norm, zc, eps, out);
}

}  // namespace tandem::spec
