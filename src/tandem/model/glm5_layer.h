// One GLM-5 decoder layer — multi-head latent attention with its DSA indexer, then a dense MLP or
// a noaux_tc mixture of experts — with the checkpoint binding it needs. Shared by the target's
// layers (Glm5Model) and the NextN drafter layer, which is the same layer without an indexer.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "tandem/backend/buffer.h"
#include "tandem/backend/ops.h"
#include "tandem/backend/weight_arena.h"
#include "tandem/io/weight_store.h"
#include "tandem/model/glm5_config.h"
#include "tandem/model/position_cache.h"

namespace tandem {

// Binds a GLM-5 checkpoint's tensors: exact shapes, float dtypes or fp8 matrices with their
// `weight_scale_inv` block scales (errors name the file and tensor), placed where the active
// backend computes with them (WeightArena: in place on the CPU, device copies on CUDA). Owns
// what binding converts (the routers' correction biases and kv_b, widened to fp32) and counts the
// bound parameters as stored.
class Glm5Tensors {
 public:
  Glm5Tensors(const Glm5Config& cfg, const WeightStore& store) : cfg_(cfg), store_(store) {}
  Glm5Tensors(const Glm5Tensors&) = delete;
  Glm5Tensors& operator=(const Glm5Tensors&) = delete;

  // The tensor as stored (checked and counted), then placed: 1-D tensors as fp32 vectors,
  // matrices as the backend's matrices (WeightArena).
  ops::WeightRef tensor(const std::string& name, const std::vector<int64_t>& shape);
  // A mixture under prefix ("...mlp."): router and bias, experts fused or per expert, the
  // shared experts.
  ops::MoeWeights mixture(const std::string& prefix);
  // An fp32 copy of the stored tensor (its values exactly; fp8 dequantised by its block scales),
  // owned here and placed: for weights every call reads whole, which would otherwise be widened
  // per call.
  ops::WeightRef widened(const std::string& name, const std::vector<int64_t>& shape);
  uint64_t parameters() const { return parameters_; }
  uint64_t bytes() const { return bytes_; }  // as stored, fp8 scales included

 private:
  const Glm5Config& cfg_;
  const WeightStore& store_;
  // The CPU's widened copies (heap buffers: stable when the outer vector grows).
  std::vector<std::vector<float>> widened_;
  WeightArena arena_;
  ops::WeightRef stored(const std::string& name, const std::vector<int64_t>& shape);
  // A mixture's matrix, placed as the backend's mixture kernels read it: on CUDA fp8 stays fp8
  // when its rows are whole scale blocks (the grouped fp8 kernels), anything else becomes bf16;
  // in place on the CPU.
  ops::WeightRef expert_tensor(const std::string& name, const std::vector<int64_t>& shape);
  uint64_t parameters_ = 0;
  uint64_t bytes_ = 0;
};

struct Glm5Layer {
  ops::WeightRef input_norm, post_norm;
  ops::WeightRef q_a_proj, q_a_norm, q_b_proj;     // the query LoRA
  ops::WeightRef kv_a_proj, kv_a_norm, kv_b_proj;  // the latent and its expansion
  ops::WeightRef o_proj;
  // The DSA indexer: runs where `indexer` (its weights bound); otherwise the layer reuses the
  // choice the previous layer made (shared), or attends to every position (no DSA: the NextN
  // layer).
  bool indexer = false;
  bool dsa = true;
  ops::WeightRef index_wq_b, index_wk, index_k_norm, index_k_norm_bias, index_weights_proj;
  bool sparse = false;
  ops::WeightRef gate_proj, up_proj, down_proj;  // dense
  ops::MoeWeights moe;                           // sparse
};

// fn(ref) on every weight the layer holds (empty refs where it has none): norms, attention,
// indexer, then its dense MLP or, through for_each_moe_matrix, its mixture.
void for_each_glm5_layer_weight(const Glm5Layer& L,
                                const std::function<void(const ops::WeightRef&)>& fn);

// The layer under prefix ("model.layers.{i}."): with_indexer binds its indexer; dsa = false
// makes it attend to every position.
Glm5Layer bind_glm5_layer(Glm5Tensors& t, const Glm5Config& c, const std::string& prefix,
                          bool sparse, bool with_indexer, bool dsa);

// The tokens of one forward through a layer: rows of consecutive tokens.
struct Glm5Tokens {
  struct Row {
    int64_t first = 0;  // index of the row's first token in the forward
    int64_t n = 0;
    int64_t start = 0;  // the row's first token's position (its cache length before)
  };
  std::vector<Row> rows;
  std::vector<int64_t> pos;  // [T] each token's position
  int64_t T = 0;
  bool prompt = false;  // MLA's expanded form (else absorbed)
};

// A row's caches for one layer, appended to by the forward: the latent entries [len, R + dr] and,
// where the layer runs its indexer, the index keys [len, index_head_dim].
struct Glm5RowCache {
  PositionCache* latent = nullptr;
  PositionCache* index_keys = nullptr;
};

// The activations of one forward through GLM-5 layers, in backend memory: sized for the
// forward's tokens by prepare() and reused (buffers never shrink, so steady decoding does not
// allocate).
struct Glm5Scratch {
  Buffer<int64_t> pos;        // [T] each token's position (Glm5Tokens::pos, uploaded)
  Buffer<int32_t> selection;  // [T, index_topk] the DSA choice of the last layer with an indexer
  Buffer<float> h, qa, q, q_nope, q_pe, kv, kv_latent, qi, ki, wi, attn, g, u;
  // Grows every buffer for `tokens` and uploads their positions.
  void prepare(const Glm5Config& c, const Glm5Tokens& tokens);
};

// x[T, H] (backend memory) += attention(rms_norm(x)), then x += mlp(rms_norm(x)), appending each
// row's new positions to its caches (caches[i] for tokens.rows[i]). The DSA choice this layer
// makes (or reuses) is s.selection. routing / index_record (optional, host): appended with the
// mixture's expert ids and the DSA choice. `s` is prepared for `tokens`; inv_freq is in backend
// memory.
void glm5_layer_forward(const Glm5Config& c, const Glm5Layer& L, const float* inv_freq,
                        const Glm5Tokens& tokens, std::span<const Glm5RowCache> caches,
                        Glm5Scratch& s, float* x, std::vector<int32_t>* routing,
                        std::vector<int32_t>* index_record);

}  // namespace tandem
