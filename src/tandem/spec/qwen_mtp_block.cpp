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
  } else {
    for (ops::WeightRef* v :
         {&w_.pre_fc_norm_embedding, &w_.pre_fc_norm_hidden, &w_.input_layernorm,
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
  // The target's fused decode forms (one launch for q|k|v with the input norm folded in, one
  // for gate|up with SwiGLU): a draft step is a chain of small launches, so each one counts.
  WeightArena& arena = w_.placed ? w_.arena : arena_;
  in_proj_ = arena.stack_rows({&w_.q_proj.dense, &w_.k_proj.dense, &w_.v_proj.dense});
  if (!c.moe.moe() && c.intermediate_size % ops::kGateUpGroup == 0)
    gate_up_ = arena.interleave_rows(&w_.gate_proj.dense, &w_.up_proj.dense, ops::kGateUpGroup);
}

void QwenMtpBlock::Workspace::add_to(GraphKey& key) const {
  for (const float* p :
       {cat.data(), x.data(), h.data(), g.data(), u.data(), attn.qg.data(), attn.q.data(),
        attn.gate.data(), attn.k.data(), attn.v.data(), attn.o.data()})
    key.add(p);
}

GatedAttentionShape QwenMtpBlock::attention_shape() const {
  GatedAttentionShape shape = gated_attention_shape(w_.cfg);
  shape.zero_centred_norms = w_.cfg.norms_zero_centred;
  return shape;
}

void QwenMtpBlock::reserve(Workspace& ws, int64_t T) const {
  const int64_t H = w_.cfg.hidden_size, I = w_.cfg.intermediate_size;
  grow_to(ws.cat, T * 2 * H);
  grow_to(ws.x, T * H);
  grow_to(ws.h, T * H);
  if (!w_.cfg.moe.moe() && !gate_up_.data) {
    grow_to(ws.g, T * I);
    grow_to(ws.u, T * I);
  }
  ws.attn.reserve(T, attention_shape());
}

void QwenMtpBlock::forward(const float* embeds, const float* hidden, const AttentionBatch& rows,
                           const ops::KVLayerView& kv, Workspace& ws, float* out) const {
  const ops::ContextScope scope(*context_);
  const QwenMtpConfig& c = w_.cfg;
  const int64_t T = rows.tokens;
  if (T == 0) return;
  reserve(ws, T);
  // fc input: [norm_e(embed) | norm_h(h)] per token.
  concat_normed_pair(embeds, hidden, T, c.hidden_size, w_.pre_fc_norm_embedding,
                     w_.pre_fc_norm_hidden, c.norms_zero_centred,
                     static_cast<float>(c.rms_norm_eps), ws.cat);
  forward_from_input(rows, kv, ws, out);
}

void QwenMtpBlock::forward_embedded(const ops::WeightRef& table, const int32_t* ids,
                                    const float* hidden, const AttentionBatch& rows,
                                    const ops::KVLayerView& kv, Workspace& ws, float* out) const {
  const ops::ContextScope scope(*context_);
  const QwenMtpConfig& c = w_.cfg;
  const int64_t T = rows.tokens;
  if (T == 0) return;
  if (table.cols != c.hidden_size)
    fail("qwen-mtp block: an embedding table of ", table.cols, " columns for hidden size ",
         c.hidden_size);
  reserve(ws, T);
  ops::rms_norm_pair_embedded(table, ids, hidden, T, w_.pre_fc_norm_embedding,
                              w_.pre_fc_norm_hidden, c.norms_zero_centred,
                              static_cast<float>(c.rms_norm_eps), ws.cat.data());
  forward_from_input(rows, kv, ws, out);
}

void QwenMtpBlock::forward_from_input(const AttentionBatch& rows, const ops::KVLayerView& kv,
                                      Workspace& ws, float* out) const {
  const QwenMtpConfig& c = w_.cfg;
  const int64_t H = c.hidden_size;
  const bool zc = c.norms_zero_centred;
  const float eps = static_cast<float>(c.rms_norm_eps);
  const int64_t T = rows.tokens;
  w_.fc.apply(ws.cat.data(), T, ws.x.data());

  // Gated full attention (the Qwen3.5 decoder layer's mixer).
  const GatedAttentionShape shape = attention_shape();
  GatedAttentionScratch& x = ws.attn;
  const ops::RowNorm input_norm{w_.input_layernorm, zc, eps};
  if (in_proj_.data) {
    const ops::OutputSlice slices[] = {{x.qg.data(), w_.q_proj.dense.rows},
                                       {x.k.data(), w_.k_proj.dense.rows},
                                       {x.v.data(), w_.v_proj.dense.rows}};
    ops::linear_split(ws.x.data(), T, in_proj_, slices, 3, &input_norm);
  } else {
    ops::rms_norm(ws.x.data(), T, H, w_.input_layernorm, zc, eps, ws.h.data());
    w_.q_proj.apply(ws.h.data(), T, x.qg.data());
    w_.k_proj.apply(ws.h.data(), T, x.k.data());
    w_.v_proj.apply(ws.h.data(), T, x.v.data());
  }
  gated_attention(shape, w_.q_norm, w_.k_norm, inv_freq_.data(), rows.positions, rows.segments, kv,
                  x, rows.kv_slots, &rows.rows);

  // SwiGLU MLP, or the mixture of experts, each adding into the residual stream. Every value is
  // the one the unfused sequence computes (ops.h), so the CPU's and CUDA's forms agree.
  const ops::RowNorm post_norm{w_.post_attention_layernorm, zc, eps};
  if (in_proj_.data) {
    ops::linear_add(x.o.data(), T, w_.o_proj.dense, ws.x.data());
    if (gate_up_.data) {
      ops::swiglu_mlp_add(ws.x.data(), T, gate_up_, w_.down_proj.dense, ws.x.data(), &post_norm);
    } else {
      ops::rms_norm(ws.x.data(), T, H, w_.post_attention_layernorm, zc, eps, ws.h.data());
      mlp_add(ws, T);
    }
    ops::rms_norm(ws.x.data(), T, H, w_.norm, zc, eps, out);
    return;
  }
  w_.o_proj.apply(x.o.data(), T, ws.h.data());
  ops::add_rms_norm(ws.x.data(), ws.h.data(), T, H, w_.post_attention_layernorm, zc, eps,
                    ws.h.data());
  mlp_add(ws, T);
  ops::rms_norm(ws.x.data(), T, H, w_.norm, zc, eps, out);
}

void QwenMtpBlock::mlp_add(Workspace& ws, int64_t T) const {
  const QwenMtpConfig& c = w_.cfg;
  if (c.moe.moe()) return ops::moe_mlp_add(ws.h.data(), T, w_.moe, ws.x.data());
  w_.gate_proj.apply(ws.h.data(), T, ws.g.data());
  w_.up_proj.apply(ws.h.data(), T, ws.u.data());
  ops::swiglu(ws.g.data(), ws.u.data(), T * c.intermediate_size, ws.g.data());
  w_.down_proj.apply(ws.g.data(), T, ws.h.data());
  ops::add_inplace(ws.x.data(), ws.h.data(), T * c.hidden_size);
}

}  // namespace tandem::spec
