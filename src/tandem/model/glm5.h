// The GLM-5 target model (transformers' glm_moe_dsa), written against the backend op set, on the
// CPU or CUDA backend: multi-head latent attention (MLA) over a latent KV cache, the DSA indexer
// choosing the positions each query attends to, dense MLPs in the first layers and mixtures of
// experts with noaux_tc routing and a shared expert after them. On the CPU, weights stay in their
// stored dtype inside the memory-mapped safetensors files: bf16 (or f32 / f16), or the published
// fp8 e4m3 with block scales (`weight_scale_inv`), dequantised row by row as the products stream
// them. On CUDA they are copied to the device as WeightArena places them (matrices bf16). Caches
// and activations live in the backend's memory; outputs are copied to the host.
//
// Attention forms: a prompt forward (ForwardRequest::prompt) forms every cached position's
// per-head keys and values (MLA's expanded form); decode and verify forwards fold the key
// projection into the query and apply the value projection once (the absorbed form). The two
// agree within fp32 rounding. A token's numbers never depend on the other rows or tokens of its
// forward, so a verify window gives decoding's bits and speculation stays byte-identical.
//
// The NextN (MTP) layer model.layers.{num_hidden_layers} is not part of the target: it stays in
// weights() for its drafter.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tandem/backend/context.h"
#include "tandem/backend/ops.h"
#include "tandem/io/weight_store.h"
#include "tandem/model/forward.h"
#include "tandem/model/glm5_config.h"
#include "tandem/model/glm5_layer.h"
#include "tandem/model/glm5_state.h"

namespace tandem {

class Glm5Model {
 public:
  struct LoadOptions {
    bool prefault = true;
  };
  // Loads config.json and the weights of a Hugging Face glm_moe_dsa directory, checking every
  // tensor the target needs (shape, dtype, the fp8 scales' grid). Experts come fused
  // (`mlp.experts.gate_up_proj` / `down_proj`, as transformers writes them) or one tensor per
  // expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`, as the published checkpoints store
  // them; fp8 experts only so). Throws Error naming the file and tensor on anything else.
  static std::unique_ptr<Glm5Model> load(const std::string& dir, const LoadOptions& opts);
  static std::unique_ptr<Glm5Model> load(const std::string& dir) { return load(dir, {}); }

  Glm5Model(const Glm5Model&) = delete;
  Glm5Model& operator=(const Glm5Model&) = delete;

  const Glm5Config& config() const { return cfg_; }
  const WeightStore& weights() const { return store_; }
  // The backend context the model's work runs on (backend/context.h): its own, or its loader's
  // current one (Context::for_new_model). Every entry point below enters it.
  ops::Context& context() const { return *context_; }

  // Runs the rows' new tokens through the model, appending them to each row's caches; outputs
  // go to host memory. Rows must be open, listed once, without an open speculative window, and
  // token ids in [0, vocab): violations throw Error before any state changes. Not supported
  // (refused): tokens_from_argmax and defer_argmax (the device-resident greedy loop).
  void forward(Glm5State& state, const ForwardRequest& req, ForwardOutput* out) const;

  // Cuts speculative rows back to the kept prefix of their last window (a truncation of the
  // caches). All-or-nothing: every row is checked (open, window open, 1 <= kept <= window,
  // listed once) before any changes.
  void commit_windows(Glm5State& state, std::span<const RowKeep> rows) const;

  // out[n, H] (backend memory) = embedding rows of the host ids (checked to be in range).
  void embed(std::span<const int32_t> ids, float* out) const;
  // ids in backend memory; an id out of range embeds as a row of NaN (ops::embed_rows).
  void embed_device(const int32_t* ids, int64_t n, float* out) const;
  // out[n, V] = the head applied to hidden[n, H] (no norm applied here; backend memory).
  // rows > 0: only the head's first `rows` rows (token ids 0..rows-1, a drafter's reduced
  // vocabulary), out[n, rows], as a weight of that shape. Throws if rows > V.
  void head(const float* hidden, int64_t n, float* out, int64_t rows = 0) const;

  // Weights of the target (embedding, layers, final norm, head; not the NextN layer).
  uint64_t parameter_count() const { return tensors_->parameters(); }
  // Bytes of weights, as placed for the backend, one decode step of one row reads: every layer's
  // attention, indexer and MLP (of a mixture, the top-k experts a token is routed to), the final
  // norm and the head; not the embedding table, of which a step reads one row per token.
  uint64_t decode_weight_bytes() const;
  // Bytes of all routed experts of all layers: a step of several rows reads the union of the
  // experts its tokens are routed to.
  uint64_t expert_weight_bytes() const;

 private:
  // First member: destroyed last, after every buffer of the model was freed.
  std::shared_ptr<ops::Context> context_;
  Glm5Config cfg_;
  WeightStore store_;
  std::unique_ptr<Glm5Tensors> tensors_;  // binds store_; owns what binding converted
  ops::WeightRef embed_, final_norm_, lm_head_;
  std::vector<Glm5Layer> layers_;
  Buffer<float> inv_freq_;  // [qk_rope_head_dim / 2]

  // A forward's activations (backend memory), reused across forwards.
  struct Workspace {
    Glm5Scratch layer;
    Buffer<int32_t> ids;      // [T] the input tokens
    Buffer<float> x, normed;  // [T, H] the residual stream; the final-normed hidden
    Buffer<float> last;       // [rows, H] each row's last normed hidden
    Buffer<float> taps;       // [T, taps · H]
    Buffer<float> logits;     // [rows, V]
    Buffer<int32_t> argmax;   // [rows]
    Buffer<ops::SampleRow> sample_rows;  // [rows] ForwardRequest::sample_rows
  };
  mutable Workspace ws_;

  Glm5Model() = default;
  void bind_weights();
};

}  // namespace tandem
