#include "tandem/model/qwen3_5_random.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "tandem/core/error.h"
#include "tandem/io/json_file.h"
#include "tandem/io/random_tensors.h"
#include "tandem/io/safetensors.h"
#include "tandem/model/qwen3_5_config.h"

namespace tandem {

void write_random_qwen35(const std::string& config_path, const std::string& out_dir, DType dtype,
                         uint64_t seed, bool per_expert_tensors) {
  if (dtype != DType::F32 && dtype != DType::BF16 && dtype != DType::F16)
    fail("random model: dtype must be f32, bf16 or f16");
  const Qwen35Config c = parse_qwen35_config(read_text_file(config_path), config_path);
  namespace fs = std::filesystem;
  fs::create_directories(out_dir);
  const fs::path model_path = fs::path(out_dir) / "model.safetensors";
  if (fs::exists(model_path)) fail(model_path.string(), " already exists; not overwriting");

  const std::string p = c.weight_prefix();
  const int64_t H = c.hidden_size;
  RandomTensors b(dtype, seed);
  b.storage.reserve(static_cast<size_t>((16 + 3 * c.num_experts) * (c.num_hidden_layers + 1) + 16));
  b.add(p + "embed_tokens.weight", {c.vocab_size, H}, -1.0f, 1.0f);
  b.add(p + "norm.weight", {H}, -0.1f, 0.1f);
  if (!c.tie_word_embeddings) b.linear("lm_head.weight", c.vocab_size, H);
  // A layer's MLP under m ("...mlp."): dense SwiGLU, or the mixture of experts.
  auto mlp = [&](const std::string& m) {
    if (c.moe()) {
      const int64_t E = c.num_experts, I = c.moe_intermediate_size;
      const int64_t Is = c.shared_expert_intermediate_size;
      // Router logits of O(1) spread, so that routing decisions have clear margins.
      b.add(m + "gate.weight", {E, H}, -2.0f / std::sqrt(static_cast<float>(H)),
            2.0f / std::sqrt(static_cast<float>(H)));
      if (per_expert_tensors) {
        for (int64_t e = 0; e < E; ++e) {
          const std::string x = m + "experts." + std::to_string(e) + ".";
          b.linear(x + "gate_proj.weight", I, H);
          b.linear(x + "up_proj.weight", I, H);
          b.linear(x + "down_proj.weight", H, I);
        }
      } else {
        const float a = 1.0f / std::sqrt(static_cast<float>(H)), d = 1.0f / std::sqrt(float(I));
        b.add(m + "experts.gate_up_proj", {E, 2 * I, H}, -a, a);
        b.add(m + "experts.down_proj", {E, H, I}, -d, d);
      }
      if (Is > 0) {
        b.linear(m + "shared_expert.gate_proj.weight", Is, H);
        b.linear(m + "shared_expert.up_proj.weight", Is, H);
        b.linear(m + "shared_expert.down_proj.weight", H, Is);
        b.linear(m + "shared_expert_gate.weight", 1, H);
      }
    } else {
      b.linear(m + "gate_proj.weight", c.intermediate_size, H);
      b.linear(m + "up_proj.weight", c.intermediate_size, H);
      b.linear(m + "down_proj.weight", H, c.intermediate_size);
    }
  };
  // Gated full attention under a ("...self_attn.").
  auto attention = [&](const std::string& a) {
    b.linear(a + "q_proj.weight", c.num_attention_heads * c.head_dim * 2, H);
    b.linear(a + "k_proj.weight", c.num_key_value_heads * c.head_dim, H);
    b.linear(a + "v_proj.weight", c.num_key_value_heads * c.head_dim, H);
    b.linear(a + "o_proj.weight", H, c.num_attention_heads * c.head_dim);
    b.add(a + "q_norm.weight", {c.head_dim}, -0.1f, 0.1f);
    b.add(a + "k_norm.weight", {c.head_dim}, -0.1f, 0.1f);
  };
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string l = p + "layers." + std::to_string(i) + ".";
    b.add(l + "input_layernorm.weight", {H}, -0.1f, 0.1f);
    b.add(l + "post_attention_layernorm.weight", {H}, -0.1f, 0.1f);
    mlp(l + "mlp.");
    if (c.layer_types[static_cast<size_t>(i)] == LayerKind::FullAttention) {
      attention(l + "self_attn.");
    } else {
      const std::string a = l + "linear_attn.";
      const int64_t nv = c.linear_num_value_heads;
      b.linear(a + "in_proj_qkv.weight", c.linear_conv_dim(), H);
      b.linear(a + "in_proj_z.weight", c.linear_value_dim(), H);
      b.linear(a + "in_proj_b.weight", nv, H);
      b.linear(a + "in_proj_a.weight", nv, H);
      b.add(a + "conv1d.weight", {c.linear_conv_dim(), 1, c.linear_conv_kernel_dim}, -0.5f, 0.5f);
      // Published checkpoints keep the decay parameters in fp32.
      b.add(a + "A_log", {nv}, 0.0f, 2.7f, true);
      b.add(a + "dt_bias", {nv}, 0.5f, 1.5f, true);
      b.add(a + "norm.weight", {c.linear_value_head_dim}, 0.9f, 1.1f);
      b.linear(a + "out_proj.weight", H, c.linear_value_dim());
    }
  }
  // The native MTP layer (mtp.*), as published: its norms, the fc over [embedding | hidden],
  // one gated-attention decoder layer with the target's MLP kind.
  if (c.mtp_num_hidden_layers >= 1) {
    b.add("mtp.pre_fc_norm_embedding.weight", {H}, -0.1f, 0.1f);
    b.add("mtp.pre_fc_norm_hidden.weight", {H}, -0.1f, 0.1f);
    b.add("mtp.norm.weight", {H}, -0.1f, 0.1f);
    b.linear("mtp.fc.weight", H, 2 * H);
    b.add("mtp.layers.0.input_layernorm.weight", {H}, -0.1f, 0.1f);
    b.add("mtp.layers.0.post_attention_layernorm.weight", {H}, -0.1f, 0.1f);
    attention("mtp.layers.0.self_attn.");
    mlp("mtp.layers.0.mlp.");
  }
  fs::copy_file(config_path, fs::path(out_dir) / "config.json",
                fs::copy_options::overwrite_existing);
  write_safetensors(model_path.string(), b.tensors, {{"format", "pt"}});
}

}  // namespace tandem
