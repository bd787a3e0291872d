#include "tandem/model/gated_attention.h"

#include <cmath>
#include <cstring>

namespace tandem {

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
                     const float* qg, float* k, const float* v, float* q, float* gate, float* o) {
  const int64_t nh = s.n_heads, nkv = s.n_kv_heads, hd = s.head_dim;
  int64_t T = 0;
  for (const AttentionSegment& seg : segments) T += seg.n;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < nh; ++h) {
      const float* src = qg + (t * nh + h) * 2 * hd;
      std::memcpy(q + (t * nh + h) * hd, src, sizeof(float) * hd);
      std::memcpy(gate + (t * nh + h) * hd, src + hd, sizeof(float) * hd);
    }
  ops::rms_norm(q, T * nh, hd, q_norm, s.zero_centred_norms, s.eps, q);
  ops::rms_norm(k, T * nkv, hd, k_norm, s.zero_centred_norms, s.eps, k);
  ops::rope(q, T, nh, hd, s.rotary_dim, positions, inv_freq);
  ops::rope(k, T, nkv, hd, s.rotary_dim, positions, inv_freq);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  int64_t t0 = 0;
  for (const AttentionSegment& seg : segments) {
    if (seg.n == 0) continue;
    ops::kv_write(kv, seg.block_table, seg.start, seg.n, k + t0 * nkv * hd, v + t0 * nkv * hd);
    ops::attention(kv, seg.block_table, seg.start, seg.n, q + t0 * nh * hd, nh, scale,
                   o + t0 * nh * hd);
    t0 += seg.n;
  }
  ops::sigmoid_gate(o, gate, T * nh * hd);
}

}  // namespace tandem
