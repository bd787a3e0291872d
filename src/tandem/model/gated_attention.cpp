#include "tandem/model/gated_attention.h"

#include <algorithm>
#include <cmath>

#include "tandem/core/error.h"
#include "tandem/core/tensor.h"

namespace tandem {

void GatedAttentionScratch::reserve(int64_t T, const GatedAttentionShape& s) {
  const int64_t q_len = T * s.n_heads * s.head_dim, kv_len = T * s.n_kv_heads * s.head_dim;
  grow_to(qg, 2 * q_len);
  grow_to(q, q_len);
  grow_to(gate, q_len);
  grow_to(k, kv_len);
  grow_to(v, kv_len);
  grow_to(o, q_len);
}

std::vector<float> rope_inv_freq(double theta, int64_t rotary_dim) {
  std::vector<float> f(static_cast<size_t>(rotary_dim / 2));
  const float base = static_cast<float>(theta);
  for (int64_t i = 0; i < rotary_dim / 2; ++i)
    f[i] = 1.0f / std::pow(base, static_cast<float>(2 * i) / static_cast<float>(rotary_dim));
  return f;
}

void gated_attention(const GatedAttentionShape& s, const ops::WeightRef& q_norm,
                     const ops::WeightRef& k_norm, const float* inv_freq, const int64_t* positions,
                     std::span<const AttentionSegment> segments, const ops::KVLayerView& kv,
                     GatedAttentionScratch& x, const int64_t* kv_slots, const AttentionRows* rows) {
  const float* qg = x.qg.data();
  const float* v = x.v.data();
  float *q = x.q.data(), *gate = x.gate.data(), *k = x.k.data(), *o = x.o.data();
  const int64_t nh = s.n_heads, nkv = s.n_kv_heads, hd = s.head_dim;
  int64_t T = 0;
  for (const AttentionSegment& seg : segments) T += seg.n;
  // Per (token, head) the projection holds [query | gate]: split, per-head norms, rotary.
  ops::QkNormRope prep;
  prep.n_tokens = T;
  prep.n_heads = nh;
  prep.n_kv_heads = nkv;
  prep.head_dim = hd;
  prep.rotary_dim = s.rotary_dim;
  prep.zero_centred = s.zero_centred_norms;
  prep.eps = s.eps;
  if (kv_slots) {
    prep.kv = &kv;
    prep.kv_slots = kv_slots;
    prep.v = v;
  }
  ops::qk_norm_rope(prep, qg, q_norm, k_norm, positions, inv_freq, q, gate, k);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (const AttentionSegment& seg : segments)
    if (seg.n > 0 && seg.position_bound < seg.start + seg.n)
      fail("gated_attention: position bound ", seg.position_bound, " is below the segment's end ",
           seg.start + seg.n);
  // With the keys already written, the segments that attend over the cache do it in one call.
  const bool batched = rows != nullptr && kv_slots != nullptr;
  if (batched) {
    const int64_t bound = batched_position_bound(segments, s.prompt);
    if (bound > 0)
      ops::attention_rows(kv, rows->tables, rows->table_stride, rows->query_rows, positions, T,
                          bound, batched_window(segments, s.prompt), q, nh, scale, o, gate);
  }
  int64_t t0 = 0;
  for (const AttentionSegment& seg : segments) {
    if (seg.n == 0) continue;
    const int64_t* pos = positions + t0;
    if (!kv_slots)
      ops::kv_write(kv, seg.block_table, pos, seg.n, k + t0 * nkv * hd, v + t0 * nkv * hd);
    // The output gate: in the attention's own pass, or after the prompt kernels.
    float* out = o + t0 * nh * hd;
    const float* g = gate + t0 * nh * hd;
    if (served_by_prompt_attention(s.prompt, seg.start)) {
      ops::attention_prompt(kv, seg.block_table, pos, seg.n, q + t0 * nh * hd, k + t0 * nkv * hd,
                            v + t0 * nkv * hd, nh, scale, out);
      ops::sigmoid_gate(out, g, seg.n * nh * hd);
    } else if (!batched) {
      ops::attention(kv, seg.block_table, pos, seg.n, seg.position_bound, q + t0 * nh * hd, nh,
                     scale, out, g);
    }
    t0 += seg.n;
  }
}

}  // namespace tandem
