// The Qwen3.5 MTP block as a computation (DESIGN.md §5.4, models/README.md "MTP convention"):
//   x   = fc(concat(norm_e(embed(t)), norm_h(h)))        2H → H, embedding first
//   x  += attn(input_layernorm(x))                       gated full attention over the row's own
//                                                        paged KV, rotary position = row position
//   x  += mlp(post_attention_layernorm(x))               SwiGLU
//   out = norm(x)                                        what the target's head reads, and the
//                                                        h of the next chained draft step
// Many rows go through one call: every projection runs once over all rows' tokens.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "tandem/backend/buffer.h"
#include "tandem/backend/context.h"
#include "tandem/backend/graph_cache.h"
#include "tandem/backend/ops.h"
#include "tandem/backend/weight_arena.h"
#include "tandem/model/gated_attention.h"
#include "tandem/spec/qwen_mtp_weights.h"

namespace tandem::spec {

// One row's tokens in a block forward: n consecutive MTP rows at positions start..start+n-1,
// written to (and attending over) the KV blocks of `block_table`.
using MtpSegment = AttentionSegment;

class QwenMtpBlock {
 public:
  explicit QwenMtpBlock(QwenMtpWeights w);
  const QwenMtpConfig& config() const { return w_.cfg; }
  const QwenMtpWeights& weights() const { return w_; }

  // Scratch of one caller (grown, never shrunk); a block may serve several callers.
  struct Workspace {
    Buffer<float> cat, x, h, g, u;
    GatedAttentionScratch attn;
    // Adds every buffer's address: what a graph captured around a forward bakes in.
    void add_to(GraphKey& key) const;
  };

  // Grows ws for T tokens: a forward of at most T tokens then allocates nothing (CUDA graph
  // capture forbids it).
  void reserve(Workspace& ws, int64_t T) const;

  // embeds, hidden: [T, H] (T = rows.tokens), rows in segment order; embeds are the target's raw
  // embedding rows. out: [T, H] after the final norm. Writes each token's K/V into `kv` at its
  // slot and attends for all rows in one call. All arrays are backend memory. Queues device work
  // only (no copies from the host), so it can be captured.
  void forward(const float* embeds, const float* hidden, const AttentionBatch& rows,
               const ops::KVLayerView& kv, Workspace& ws, float* out) const;
  // forward() with the embedding rows of ids [T] (backend memory) read where they lie in `table`
  // (the target's, [V, H]) by the first norm (ops::rms_norm_pair_embedded): the same bits, one
  // launch fewer. An id out of range gives NaN rows, as embed_device.
  void forward_embedded(const ops::WeightRef& table, const int32_t* ids, const float* hidden,
                        const AttentionBatch& rows, const ops::KVLayerView& kv, Workspace& ws,
                        float* out) const;

  // The backend context its work runs on (a caller capturing a graph around forward enters it).
  ops::Context& context() const { return *context_; }

 private:
  GatedAttentionShape attention_shape() const;
  // Everything after the fc input (ws.cat, [T, 2H]): fc, attention, MLP, the final norm.
  void forward_from_input(const AttentionBatch& rows, const ops::KVLayerView& kv, Workspace& ws,
                          float* out) const;
  // ws.x += the MLP (or the experts) of ws.h, the post-attention-normed stream; unfused.
  void mlp_add(Workspace& ws, int64_t T) const;

  // The backend context its work runs on: its builder's current one, or its own
  // (Context::for_new_model); its entry points enter it. First: destroyed after the buffers below.
  std::shared_ptr<ops::Context> context_;
  // Placed for the active backend: file-backed weights on CUDA point at bf16/f32 copies in
  // arena_; random weights (w_.placed) already live in backend memory, owned by w_.arena.
  QwenMtpWeights w_;
  WeightArena arena_;
  Buffer<float> inv_freq_;
  // CUDA only (data null elsewhere): q|k|v stacked (the three projections become views of it),
  // and gate|up interleaved for ops::swiglu_mlp_add (dense MLPs whose size allows it).
  ops::WeightRef in_proj_, gate_up_;
};

}  // namespace tandem::spec
