// The EAGLE-3 head as a computation (spec/eagle3_head.h has the layout). One drafter row at
// rotary position p, from token t and hidden g [H]:
//   g   = fc(concat(taps))                  from the target's taps (Eagle3Block::project), or the
//                                           previous chain step's `out` when chaining
//   a   = concat(input_layernorm(embed(t)), hidden_norm(g))                    [2H]
//   r   = g + o_proj(attn(q_proj(a), k_proj(a), v_proj(a)))   rotary at p, causal over the
//                                           row's own KV (GQA, scale 1/sqrt(hd))
//   out = r + down(silu(gate(n)) · up(n)),  n = post_attention_layernorm(r)
//   logits = lm_head(norm(out))             over the draft vocabulary (Eagle3Block::logits)
// Norms are Llama's (weight w, not 1 + w). Many rows go through one call: every projection runs
// once over all rows' tokens, and a row's numbers do not depend on the others (batch-invariant
// ops).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "tandem/backend/buffer.h"
#include "tandem/backend/context.h"
#include "tandem/backend/ops.h"
#include "tandem/backend/weight_arena.h"
#include "tandem/model/gated_attention.h"
#include "tandem/spec/eagle3_head.h"

namespace tandem::spec {

class Eagle3Block {
 public:
  explicit Eagle3Block(Eagle3Weights w);
  const Eagle3Config& config() const { return w_.cfg; }
  const Eagle3Weights& weights() const { return w_; }
  // The backend context its work runs on (backend/context.h): its builder's current one, or
  // its own (Context::for_new_model). Its entry points enter it.
  ops::Context& context() const { return *context_; }

  // Scratch of one caller (grown, never shrunk).
  struct Workspace {
    Buffer<float> cat, h, q, k, v, attn, g, u;
    Buffer<int64_t> pos;
    std::vector<int64_t> pos_host;
  };

  // g[n, H] = fc(taps[n, n_taps · Ht]) (backend memory).
  void project(const float* taps, int64_t n, float* g) const;
  // The decoder layer for T = Σ segs[i].n rows: embeds (the token embeddings, raw) and hidden
  // [T, H] in segment order; out [T, H] (must not alias hidden). Each row's K/V goes into `kv`
  // at its segment's positions, which are also its rotary positions.
  void forward(const float* embeds, const float* hidden, std::span<const AttentionSegment> segs,
               const ops::KVLayerView& kv, Workspace& ws, float* out) const;
  // logits[n, Vd] = lm_head(norm(out[n, H])).
  void logits(const float* out, int64_t n, Workspace& ws, float* logits) const;
  // out[n, H] = the head's own embedding rows of ids (backend memory); needs has_embedding().
  void embed(const int32_t* ids, int64_t n, float* out) const;

 private:
  std::shared_ptr<ops::Context> context_;  // first: destroyed after the buffers below
  // Placed for the active backend: on CUDA the mapped tensors are copied into arena_ (matrices
  // bf16, vectors fp32); the CPU computes on the mapped tensors.
  Eagle3Weights w_;
  WeightArena arena_;
  Buffer<float> inv_freq_;
};

}  // namespace tandem::spec
