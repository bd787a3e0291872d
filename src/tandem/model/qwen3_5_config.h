// The graph-shaping configuration of a Qwen3.5 text model, read from a Hugging Face config.json.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tandem {

enum class LayerKind { LinearAttention, FullAttention };

struct Qwen35Config {
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  // Gated full attention.
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
  double rope_theta = 10000000.0;
  double partial_rotary_factor = 0.25;
  int64_t rotary_dim = 0;  // head_dim * partial_rotary_factor, even
  // Multimodal RoPE split of the rotary_dim/2 frequencies over (t, h, w) position streams; empty
  // if the config has none. For text-only input the three streams carry the same position, so
  // M-RoPE equals plain RoPE over rotary_dim and these only matter for validation.
  std::vector<int64_t> mrope_section;
  bool mrope_interleaved = false;
  bool attention_bias = false;
  // Gated DeltaNet.
  int64_t linear_num_key_heads = 0;
  int64_t linear_num_value_heads = 0;
  int64_t linear_key_head_dim = 0;
  int64_t linear_value_head_dim = 0;
  int64_t linear_conv_kernel_dim = 4;
  std::vector<LayerKind> layer_types;  // size num_hidden_layers
  double rms_norm_eps = 1e-6;
  std::string hidden_act = "silu";
  bool tie_word_embeddings = false;
  int64_t max_position_embeddings = 0;
  int64_t mtp_num_hidden_layers = 0;
  // Mixture of experts (qwen3_5_moe): every layer's MLP (and the MTP layer's) is a router over
  // num_experts experts of moe_intermediate_size, num_experts_per_tok chosen per token, plus a
  // shared expert of shared_expert_intermediate_size scaled by its sigmoid gate (0: none).
  // num_experts 0: the dense MLP of intermediate_size.
  int64_t num_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t moe_intermediate_size = 0;
  int64_t shared_expert_intermediate_size = 0;
  std::vector<int64_t> eos_token_ids;  // config.json, then generation_config.json if present
  // "qwen3_5" / "qwen3_5_moe" (nested text_config) or "qwen3_5_text" / "qwen3_5_moe_text" (flat)
  std::string model_type;

  bool moe() const { return num_experts > 0; }
  // Where the text model's tensors live: nested configs keep them under model.language_model.
  std::string weight_prefix() const {
    return model_type == "qwen3_5" || model_type == "qwen3_5_moe" ? "model.language_model."
                                                                  : "model.";
  }

  int64_t linear_key_dim() const { return linear_num_key_heads * linear_key_head_dim; }
  int64_t linear_value_dim() const { return linear_num_value_heads * linear_value_head_dim; }
  int64_t linear_conv_dim() const { return 2 * linear_key_dim() + linear_value_dim(); }
};

// Parses `dir/config.json` (and `dir/generation_config.json` for eos ids when present).
// Accepts `model_type: qwen3_5` / `qwen3_5_moe` with the text fields under `text_config`, and the
// flat `model_type: qwen3_5_text` / `qwen3_5_moe_text`. rope settings may sit in `rope_parameters`
// (current transformers) or at the top level of the text config (older exports). Missing required
// fields, wrong types, inconsistent head counts or unknown layer types throw tandem::Error naming
// the file and field.
Qwen35Config load_qwen35_config(const std::string& dir);
Qwen35Config parse_qwen35_config(const std::string& json_text, const std::string& source_name);

}  // namespace tandem
