// GLM-5 (`glm_moe_dsa`) model configuration, parsed from a Hugging Face config.json as
// transformers' GlmMoeDsaConfig reads it: DeepSeek-V3.2-style multi-head latent attention (MLA,
// optional query LoRA), the DSA indexer's shape, a mixture of experts with sigmoid ("noaux_tc")
// routing behind a few dense layers, the NextN (MTP) layers, and the FP8 block quantization of the
// published weights.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tandem {

struct Glm5Config {
  std::string model_type;  // "glm_moe_dsa"
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;      // the dense layers' MLP
  int64_t moe_intermediate_size = 0;  // one expert's
  int64_t num_hidden_layers = 0;      // decoder layers; the NextN layers follow them
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  // MLA: queries through a rank-q_lora_rank bottleneck (0: a plain q_proj), keys and values
  // through a compressed latent of kv_lora_rank plus one shared rotary key of qk_rope_head_dim.
  int64_t q_lora_rank = 0;
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  // Mixture of experts: n_routed_experts in n_group groups; a token takes the best topk_group
  // groups, then num_experts_per_tok experts among them (ops::route_noaux_tc).
  int64_t n_routed_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t n_shared_experts = 0;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  double routed_scaling_factor = 1.0;
  bool norm_topk_prob = true;
  std::vector<bool> sparse_layers;  // per decoder layer: a mixture (true) or the dense MLP
  // DSA indexer: each query attends to its index_topk best-scored positions.
  int64_t index_topk = 0;
  int64_t index_head_dim = 0;
  int64_t index_n_heads = 0;
  // Per decoder layer: true where the layer reuses the previous layer's choice instead of running
  // its own indexer (transformers' indexer_types "shared"; never layer 0).
  std::vector<bool> shared_index_layers;
  bool indexer_rope_interleave = true;  // the indexer's rotary pairs are interleaved
  double rms_norm_eps = 1e-5;
  double rope_theta = 10000.0;
  bool rope_interleave = true;  // the main attention's rotary pairs are interleaved
  int64_t max_position_embeddings = 0;
  int64_t num_nextn_predict_layers = 0;  // MTP layers after the decoder layers
  bool tie_word_embeddings = false;
  std::vector<int64_t> eos_token_ids;
  // FP8 weights (quantization_config quant_method "fp8", e4m3): each matrix carries one fp32
  // `weight_scale_inv` per block of fp8_block_rows x fp8_block_cols weights. 0: not quantized.
  int64_t fp8_block_rows = 0;
  int64_t fp8_block_cols = 0;
  bool fp8() const { return fp8_block_rows > 0; }
};

// Throws Error naming source_name and the field on anything unsupported or inconsistent.
Glm5Config parse_glm5_config(const std::string& json_text, const std::string& source_name);
// dir/config.json, plus the eos ids of dir/generation_config.json when there is one.
Glm5Config load_glm5_config(const std::string& dir);

}  // namespace tandem
