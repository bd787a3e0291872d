// The part of a Qwen3.5 gated full-attention layer between its projections: shared by the target
// model's attention layers and the MTP drafter's decoder layer, so both compute it identically.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "tandem/backend/buffer.h"
#include "tandem/backend/ops.h"

namespace tandem {

// One row's slice of the tokens: positions start..start+n-1 of the row whose KV blocks are
// `block_table` (in the active backend's memory). position_bound > start + n - 1 bounds the
// positions the attention may see; it sizes the CUDA grid and not the arithmetic, so a caller
// picks a value that changes rarely (attention_position_bound) and a captured CUDA graph stays
// valid while the row grows below it.
struct AttentionSegment {
  const int32_t* block_table = nullptr;
  int64_t start = 0;
  int64_t n = 0;
  int64_t position_bound = 0;
};

// Whether a segment's queries go to ops::attention_prompt (a prompt's first chunk, attending to
// its own keys only) rather than to attention over the cache.
constexpr bool served_by_prompt_attention(bool prompt, int64_t segment_start) {
  return prompt && segment_start == 0;
}

// The segments' queries in one attention call (ops::attention_rows): segment i's block table is
// at tables + i · table_stride, and query_rows [T] (backend memory) holds each token's segment,
// -1 for the tokens of a segment served_by_prompt_attention.
struct AttentionRows {
  const int32_t* tables = nullptr;
  int64_t table_stride = 0;
  const int64_t* query_rows = nullptr;
};

// Every row of one forward as the attention of all rows at once reads them (gated_attention
// with kv_slots and rows): the segments on the host, and in backend memory each token's rotary
// position and physical KV slot ([tokens] each) and the rows' block tables (AttentionRows).
struct AttentionBatch {
  std::vector<AttentionSegment> segments;
  const int64_t* positions = nullptr;
  const int64_t* kv_slots = nullptr;
  AttentionRows rows;
  int64_t tokens = 0;  // Σ segments[i].n
};

// The position_bound of a row whose block table reserves `kv_capacity` positions: rounded up to
// a multiple of kPositionBoundStep, so it (and a graph keyed on it) changes once per that many
// positions, not per block.
constexpr int64_t kPositionBoundStep = 1024;
constexpr int64_t attention_position_bound(int64_t kv_capacity) {
  return (kv_capacity + kPositionBoundStep - 1) / kPositionBoundStep * kPositionBoundStep;
}

// The position bound that sizes the attention of all rows at once (gated_attention's batched
// call): the largest of the segments that attend over the cache. It, not each row's bound, is
// what a CUDA graph of that call bakes in. 0 when no segment does.
inline int64_t batched_position_bound(std::span<const AttentionSegment> segments, bool prompt) {
  int64_t bound = 0;
  for (const AttentionSegment& seg : segments)
    if (seg.n > 0 && !served_by_prompt_attention(prompt, seg.start))
      bound = std::max(bound, seg.position_bound);
  return bound;
}

// The window hint of the batched call (ops::attention_rows): the length the attending segments
// share when each starts at a multiple of it in the call's queries (a step of equal verify
// windows, or of single tokens), else 1. Like the bound it sizes the work only, and follows from
// the segments' lengths, which every graph of the call is keyed on.
inline int64_t batched_window(std::span<const AttentionSegment> segments, bool prompt) {
  int64_t window = 0, t0 = 0;
  for (const AttentionSegment& seg : segments) {
    if (seg.n > 0 && !served_by_prompt_attention(prompt, seg.start)) {
      if (window == 0) window = seg.n;
      if (seg.n != window || t0 % window != 0) return 1;
    }
    t0 += seg.n;
  }
  return window > 0 ? window : 1;
}

struct GatedAttentionShape {
  int64_t n_heads = 0, n_kv_heads = 0, head_dim = 0, rotary_dim = 0;
  float eps = 1e-6f;
  bool zero_centred_norms = true;  // HF layout q/k norms: scale by (1 + w)
  bool prompt = false;  // prompt tokens: segments starting at 0 use ops::attention_prompt
};

// The attention core's shape from a Qwen3.5 config: the target's or its MTP block's, which name
// these fields alike. Norms are zero-centred (HF layout) unless the caller says otherwise.
template <class Config>
GatedAttentionShape gated_attention_shape(const Config& c) {
  GatedAttentionShape s;
  s.n_heads = c.num_attention_heads;
  s.n_kv_heads = c.num_key_value_heads;
  s.head_dim = c.head_dim;
  s.rotary_dim = c.rotary_dim;
  s.eps = static_cast<float>(c.rms_norm_eps);
  return s;
}

// Buffers of the attention core for T tokens, grown once per shape and reused.
struct GatedAttentionScratch {
  Buffer<float> qg, q, gate, k, v, o;
  void reserve(int64_t T, const GatedAttentionShape& s);
};

// Rotary inverse frequencies in fp32, as the reference computes them: 1 / theta^(2i / dim).
std::vector<float> rope_inv_freq(double theta, int64_t rotary_dim);

// From the projections of T tokens in `x` — x.qg [T, n_heads, 2, head_dim] (per head: query then
// gate), x.k and x.v [T, n_kv_heads, head_dim] — computes the gated attention output
// x.o [T, n_heads * head_dim] (the o_proj input): q/k RMSNorm, rotary at `positions`, the tokens'
// K/V written into `kv`, causal attention per segment, sigmoid output gate. x.q and x.gate are
// scratch; x.k is normed and rotated in place. inv_freq and positions [T] (the tokens' positions,
// segment after segment) are backend memory; the KV writes and attention read their positions
// from it, so only `positions` changes between replays of a captured step. kv_slots (optional,
// backend memory, [T]): each token's physical KV slot (block · block_size + offset, see
// ops::QkNormRope); given, the query/key pass writes the keys and values itself and no kv_write
// runs (one launch fewer per layer and segment). rows (optional, with kv_slots): every segment
// not served by attention_prompt attends in one call, bitwise as it would alone.
void gated_attention(const GatedAttentionShape& shape, const ops::WeightRef& q_norm,
                     const ops::WeightRef& k_norm, const float* inv_freq, const int64_t* positions,
                     std::span<const AttentionSegment> segments, const ops::KVLayerView& kv,
                     GatedAttentionScratch& x, const int64_t* kv_slots = nullptr,
                     const AttentionRows* rows = nullptr);

}  // namespace tandem
