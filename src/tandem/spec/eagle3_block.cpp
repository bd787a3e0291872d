#include "tandem/spec/eagle3_block.h"

#include <cmath>

#include "tandem/core/error.h"
#include "tandem/spec/draft_block.h"

namespace tandem::spec {

Eagle3Block::Eagle3Block(Eagle3Weights w)
    : context_(ops::Context::for_new_model()), w_(std::move(w)) {
  const ops::ContextScope scope(*context_);
  const Eagle3Config& c = w_.cfg;
  // Llama's default rotary over the whole head: 1 / theta^(2i / hd), in fp32.
  const std::vector<float> f = rope_inv_freq(c.rope_theta, c.head_dim);
  inv_freq_.grow_to(static_cast<int64_t>(f.size()));
  ops::copy_from_host(inv_freq_.data(), f.data(), sizeof(float) * f.size());
  if (ops::backend() == ops::Backend::Cpu) return;
  for (ops::WeightRef* v :
       {&w_.input_layernorm, &w_.hidden_norm, &w_.post_attention_layernorm, &w_.norm})
    *v = arena_.vector(*v);
  for (ops::WeightRef* m : {&w_.fc, &w_.q_proj, &w_.k_proj, &w_.v_proj, &w_.o_proj, &w_.gate_proj,
                            &w_.up_proj, &w_.down_proj, &w_.lm_head})
    *m = arena_.matrix(*m);
  if (w_.has_embedding()) w_.embed_tokens = arena_.matrix(w_.embed_tokens);
}

void Eagle3Block::project(const float* taps, int64_t n, float* g) const {
  const ops::ContextScope scope(*context_);
  if (n > 0) ops::linear(taps, n, w_.fc, g);
}

void Eagle3Block::embed(const int32_t* ids, int64_t n, float* out) const {
  const ops::ContextScope scope(*context_);
  TANDEM_CHECK(w_.has_embedding(), "the head has no embed_tokens");
  if (n > 0) ops::embed_rows(w_.embed_tokens, ids, n, out);
}

void Eagle3Block::forward(const float* embeds, const float* hidden,
                          std::span<const AttentionSegment> segs, const ops::KVLayerView& kv,
                          Workspace& ws, float* out) const {
  const ops::ContextScope scope(*context_);
  const Eagle3Config& c = w_.cfg;
  const int64_t H = c.hidden_size, I = c.intermediate_size, hd = c.head_dim;
  const int64_t nh = c.num_attention_heads, nkv = c.num_key_value_heads;
  const float eps = static_cast<float>(c.rms_norm_eps);
  const int64_t T = upload_segment_positions(segs, ws.pos_host, ws.pos);
  if (T == 0) return;

  // a = [input_layernorm(embedding) | hidden_norm(g)], embedding first.
  concat_normed_pair(embeds, hidden, T, H, w_.input_layernorm, w_.hidden_norm, false, eps, ws.cat);
  grow_to(ws.h, T * H);

  // Attention over each row's own KV: keys and values written first, so a row attends to
  // itself and every earlier row of its history.
  grow_to(ws.q, T * nh * hd);
  grow_to(ws.k, T * nkv * hd);
  grow_to(ws.v, T * nkv * hd);
  grow_to(ws.attn, T * nh * hd);
  ops::linear(ws.cat.data(), T, w_.q_proj, ws.q.data());
  ops::linear(ws.cat.data(), T, w_.k_proj, ws.k.data());
  ops::linear(ws.cat.data(), T, w_.v_proj, ws.v.data());
  ops::rope(ws.q.data(), T, nh, hd, hd, ws.pos.data(), inv_freq_.data());
  ops::rope(ws.k.data(), T, nkv, hd, hd, ws.pos.data(), inv_freq_.data());
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  int64_t t0 = 0;
  for (const AttentionSegment& s : segs) {
    if (s.n == 0) continue;
    ops::kv_write(kv, s.block_table, ws.pos.data() + t0, s.n, ws.k.data() + t0 * nkv * hd,
                  ws.v.data() + t0 * nkv * hd);
    ops::attention(kv, s.block_table, ws.pos.data() + t0, s.n, s.position_bound,
                   ws.q.data() + t0 * nh * hd, nh, scale, ws.attn.data() + t0 * nh * hd);
    t0 += s.n;
  }

  // r = g + o_proj(attn) in out; n = post_attention_layernorm(r); out = r + down(swiglu(n)).
  ops::copy(out, hidden, sizeof(float) * static_cast<size_t>(T * H));
  ops::linear(ws.attn.data(), T, w_.o_proj, ws.h.data());
  ops::add_rms_norm(out, ws.h.data(), T, H, w_.post_attention_layernorm, false, eps, ws.h.data());
  grow_to(ws.g, T * I);
  grow_to(ws.u, T * I);
  ops::linear(ws.h.data(), T, w_.gate_proj, ws.g.data());
  ops::linear(ws.h.data(), T, w_.up_proj, ws.u.data());
  ops::swiglu(ws.g.data(), ws.u.data(), T * I, ws.g.data());
  ops::linear_add(ws.g.data(), T, w_.down_proj, out);
}

void Eagle3Block::logits(const float* out, int64_t n, Workspace& ws, float* logits) const {
  const ops::ContextScope scope(*context_);
  const Eagle3Config& c = w_.cfg;
  if (n == 0) return;
  grow_to(ws.h, n * c.hidden_size);
  ops::rms_norm(out, n, c.hidden_size, w_.norm, false, static_cast<float>(c.rms_norm_eps),
                ws.h.data());
  ops::linear(ws.h.data(), n, w_.lm_head, logits);
}

}  // namespace tandem::spec
