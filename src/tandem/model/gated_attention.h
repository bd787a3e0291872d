// The part of a Qwen3.5 gated full-attention layer between its projections: shared by the target
// model's attention layers and the MTP drafter's decoder layer, so both compute it identically.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "tandem/backend/ops.h"

namespace tandem {

// One row's slice of the tokens: positions start..start+n-1 of the row whose KV blocks are
// `block_table`.
struct AttentionSegment {
  const int32_t* block_table = nullptr;
  int64_t start = 0;
  int64_t n = 0;
};

struct GatedAttentionShape {
  int64_t n_heads = 0, n_kv_heads = 0, head_dim = 0, rotary_dim = 0;
  float eps = 1e-6f;
  bool zero_centred_norms = true;  // HF layout q/k norms: scale by (1 + w)
};

// Rotary inverse frequencies in fp32, as the reference computes them: 1 / theta^(2i / dim).
std::vector<float> rope_inv_freq(double theta, int64_t rotary_dim);

// From the projections of T tokens — qg [T, n_heads, 2, head_dim] (per head: query then gate),
// k and v [T, n_kv_heads, head_dim] — computes the gated attention output o [T, n_heads * head_dim]
// (the o_proj input): q/k RMSNorm, rotary at `positions`, the tokens' K/V written into `kv`, causal
// attention per segment, sigmoid output gate. q and gate are scratch [T, n_heads * head_dim];
// k is normed and rotated in place.
void gated_attention(const GatedAttentionShape& shape, const ops::WeightRef& q_norm,
                     const ops::WeightRef& k_norm, const float* inv_freq, const int64_t* positions,
                     std::span<const AttentionSegment> segments, const ops::KVLayerView& kv,
                     const float* qg, float* k, const float* v, float* q, float* gate, float* o);

}  // namespace tandem
