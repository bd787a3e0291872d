// An EAGLE-3 draft head as published (SafeAILab EAGLE-3, SpecForge; what vLLM and SGLang load):
// a directory with config.json (architectures LlamaForCausalLMEagle3 / Eagle3LlamaForCausalLM,
// Llama fields, draft_vocab_size, eagle_config.eagle_aux_hidden_state_layer_ids) and
// model.safetensors:
//   fc.weight                                   [H, n_taps · Ht]   the taps' projection
//   midlayer.input_layernorm.weight             [H]                on the token embedding
//   midlayer.hidden_norm.weight                 [H]                on the hidden
//   midlayer.self_attn.{q,k,v}_proj.weight      [heads · hd | kv_heads · hd, 2H]
//   midlayer.self_attn.o_proj.weight            [H, heads · hd]
//   midlayer.post_attention_layernorm.weight    [H]
//   midlayer.mlp.{gate,up}_proj.weight [I, H], down_proj.weight [H, I]
//   norm.weight [H], lm_head.weight [Vd, H]
//   d2t [Vd] int64 (target id = draft id + d2t[draft id]), t2d [V] bool (in the draft vocabulary)
//   embed_tokens.weight [V, H] (optional: else the target's embedding)
// Norms are Llama's (x · rsqrt(mean(x²) + eps) · w); rotary is Llama's default over the whole
// head. Loading checks every field and tensor and names what is wrong; compatibility with a
// target (vocabulary, hidden size, tap layers) is checked when rows open (Eagle3Provider).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tandem/backend/ops.h"
#include "tandem/io/weight_store.h"

namespace tandem::spec {

struct Eagle3Config {
  int64_t hidden_size = 0;        // H
  int64_t intermediate_size = 0;  // I
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;  // hd (default H / heads)
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  int64_t max_position_embeddings = 0;
  int64_t vocab_size = 0;          // V: the target's vocabulary
  int64_t draft_vocab_size = 0;    // Vd (default V)
  int64_t target_hidden_size = 0;  // Ht: width of one tap (default H)
  // The target layers tapped, in order; empty when config.json names none (then the target's
  // default list, eagle3_default_tap_layers, is used: it has kDefaultTapCount entries).
  std::vector<int> tap_layers;
  int64_t tap_count() const {
    return tap_layers.empty() ? kDefaultTapCount : static_cast<int64_t>(tap_layers.size());
  }
  static constexpr int64_t kDefaultTapCount = 3;
};

// Parses config.json (`path` names it in errors). Refuses another architecture, a layer count
// other than 1, an activation other than silu, any rope_scaling, and heads that do not divide.
Eagle3Config parse_eagle3_config(const nlohmann::json& config, const std::string& path);

// The taps when config.json names none, for an L-layer target: [2, L/2, L-3] (as vLLM does).
std::vector<int> eagle3_default_tap_layers(int64_t target_layers);

// The head's tensors (views into the mapped files, which `store` keeps alive) and its vocabulary
// map. Matrices and norms are fp32, bf16 or f16.
struct Eagle3Weights {
  Eagle3Config cfg;
  WeightStore store;
  ops::WeightRef fc;                              // [H, n_taps · Ht]
  ops::WeightRef input_layernorm, hidden_norm;    // [H]
  ops::WeightRef q_proj, k_proj, v_proj, o_proj;  // see the layout above
  ops::WeightRef post_attention_layernorm;        // [H]
  ops::WeightRef gate_proj, up_proj, down_proj;   // [I, H], [I, H], [H, I]
  ops::WeightRef norm;                            // [H]
  ops::WeightRef lm_head;                         // [Vd, H]
  ops::WeightRef embed_tokens;                    // [V, H], or rows = 0 when absent
  std::vector<int32_t> draft_to_target;           // [Vd]: d2t applied (target ids)
  bool has_embedding() const { return embed_tokens.rows > 0; }
  uint64_t bytes() const;  // every weight tensor's bytes
};

// Loads `dir` (config.json + safetensors). d2t must map the draft ids to distinct target ids in
// [0, V), and t2d must mark exactly those.
Eagle3Weights load_eagle3_head(const std::string& dir);

}  // namespace tandem::spec
