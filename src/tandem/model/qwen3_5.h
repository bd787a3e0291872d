// The Qwen3.5 hybrid target model (Gated DeltaNet + gated full attention), written against the
// backend op set. Weights stay in their stored dtype inside memory-mapped safetensors files.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tandem/backend/ops.h"
#include "tandem/io/weight_store.h"
#include "tandem/model/qwen3_5_config.h"
#include "tandem/model/qwen3_5_state.h"

namespace tandem {

// One row's slice of a forward: `n_tokens` new tokens appended after the row's current length.
struct RowInput {
  int slot = 0;
  int64_t n_tokens = 0;
};

struct ForwardRequest {
  std::span<const int32_t> tokens;  // Σ n_tokens ids, rows in order
  std::span<const RowInput> rows;
  bool all_logits = false;   // false: only each row's last token gets logits
  bool want_hidden = false;  // final-normed hidden of every token
};

struct ForwardOutput {
  std::vector<float> logits;  // [logits_rows, vocab]
  int64_t logits_rows = 0;
  std::vector<float> hidden;  // [Σ n_tokens, hidden] when requested
};

class Qwen35Model {
 public:
  struct LoadOptions {
    bool prefault = true;
  };
  // Loads config.json + weights of a Hugging Face Qwen3.5 directory and validates every tensor
  // the text model needs (shape and dtype). Vision tensors are ignored; `mtp.*` stay reachable
  // through weights() for the drafter.
  static std::unique_ptr<Qwen35Model> load(const std::string& dir, const LoadOptions& opts);
  static std::unique_ptr<Qwen35Model> load(const std::string& dir) { return load(dir, {}); }

  const Qwen35Config& config() const { return cfg_; }
  const WeightStore& weights() const { return store_; }
  const std::string& prefix() const { return prefix_; }  // "model.language_model." or "model."

  // Runs the rows' new tokens through the model, appending them to each row's state.
  // Token ids must be in [0, vocab) (throws Error otherwise, before any state changes).
  void forward(Qwen35State& state, const ForwardRequest& req, ForwardOutput* out) const;

  // Bytes of weights one decode step reads (every layer + the head; the embedding row is noise).
  uint64_t decode_weight_bytes() const;
  uint64_t parameter_count() const;

 private:
  struct AttnWeights {
    ops::WeightRef q_proj, k_proj, v_proj, o_proj, q_norm, k_norm;
  };
  struct DeltaWeights {
    ops::WeightRef in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, conv1d, A_log, dt_bias, norm,
        out_proj;
  };
  struct Layer {
    LayerKind kind;
    int index_in_kind = 0;  // attention-layer or linear-layer ordinal (state addressing)
    ops::WeightRef input_norm, post_norm, gate_proj, up_proj, down_proj;
    AttnWeights attn;
    DeltaWeights delta;
  };

  Qwen35Config cfg_;
  WeightStore store_;
  std::string prefix_;
  ops::WeightRef embed_, final_norm_, lm_head_;
  std::vector<Layer> layers_;
  std::vector<float> inv_freq_;

  // Scratch reused across calls (grown, never shrunk). A model serves one forward at a time.
  struct Workspace {
    std::vector<float> x, h, a0, a1, a2, a3, a4, a5, mlp_g, mlp_u;
    std::vector<int64_t> pos;
  };
  mutable Workspace ws_;

  Qwen35Model() = default;
  void bind_weights();
  void attention_layer(const Layer& L, Qwen35State& st, const ForwardRequest& req, int64_t T) const;
  void delta_layer(const Layer& L, Qwen35State& st, const ForwardRequest& req, int64_t T) const;
};

}  // namespace tandem
