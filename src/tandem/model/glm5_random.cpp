#include "tandem/model/glm5_random.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <vector>

#include "tandem/core/error.h"
#include "tandem/io/json_file.h"
#include "tandem/io/random_tensors.h"
#include "tandem/io/safetensors.h"
#include "tandem/model/config_fields.h"
#include "tandem/model/glm5_config.h"

namespace tandem {

namespace {

struct Builder : RandomTensors {
  int64_t block_rows = 0, block_cols = 0;  // fp8 blocks; 0: no fp8

  Builder(DType t, int64_t br, int64_t bc, uint64_t seed)
      : RandomTensors(t, seed), block_rows(br), block_cols(bc) {}

  // A Linear weight [out, in] of scale 1/sqrt(in); fp8 with block scales when `quantize`.
  void linear(const std::string& name, int64_t out, int64_t in, bool quantize = true) {
    const float a = 1.0f / std::sqrt(static_cast<float>(in));
    if (!quantize || block_rows == 0) return add(name, {out, in}, -a, a);
    const std::vector<float> v = uniform(out * in, -a, a);
    const int64_t br = (out + block_rows - 1) / block_rows, bc = (in + block_cols - 1) / block_cols;
    std::vector<float> scale(static_cast<size_t>(br * bc), 0.0f);
    // Each block row on one thread: its scales (the block's largest magnitude maps to 448), then
    // its codes. Rows go through in column blocks, so no element pays a division.
    std::vector<std::byte> codes(static_cast<size_t>(out * in));
    parallel_range(br, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        float* s = scale.data() + b * bc;
        const int64_t r1 = std::min(out, (b + 1) * block_rows);
        for (int64_t r = b * block_rows; r < r1; ++r)
          for (int64_t j = 0; j < bc; ++j) {
            const float* x = v.data() + r * in;
            for (int64_t c = j * block_cols; c < std::min(in, (j + 1) * block_cols); ++c)
              s[j] = std::max(s[j], std::fabs(x[c]));
          }
        for (int64_t j = 0; j < bc; ++j) s[j] = std::max(s[j], 1e-12f) / 448.0f;
        for (int64_t r = b * block_rows; r < r1; ++r)
          for (int64_t j = 0; j < bc; ++j)
            for (int64_t c = j * block_cols; c < std::min(in, (j + 1) * block_cols); ++c)
              codes[static_cast<size_t>(r * in + c)] = static_cast<std::byte>(
                  f32_to_fp8_e4m3(v[static_cast<size_t>(r * in + c)] / s[j]));
      }
    });
    std::vector<std::byte> scale_bytes(scale.size() * sizeof(float));
    std::memcpy(scale_bytes.data(), scale.data(), scale_bytes.size());
    put(name, DType::F8_E4M3, {out, in}, std::move(codes));
    put(name.substr(0, name.rfind(".weight")) + ".weight_scale_inv", DType::F32, {br, bc},
        std::move(scale_bytes));
  }
};

}  // namespace

void write_random_glm5(const std::string& config_path, const std::string& out_dir, DType dtype,
                       uint64_t seed, bool per_expert_tensors) {
  if (dtype != DType::F32 && dtype != DType::BF16 && dtype != DType::F16)
    fail("random model: dtype must be f32, bf16 or f16");
  const Glm5Config c = parse_glm5_config(read_text_file(config_path), config_path);
  namespace fs = std::filesystem;
  fs::create_directories(out_dir);
  const fs::path model_path = fs::path(out_dir) / "model.safetensors";
  if (fs::exists(model_path)) fail(model_path.string(), " already exists; not overwriting");

  const int64_t H = c.hidden_size, nh = c.num_attention_heads;
  const int64_t dn = c.qk_nope_head_dim, dr = c.qk_rope_head_dim, dv = c.v_head_dim;
  const int64_t R = c.kv_lora_rank, Di = c.index_head_dim, E = c.n_routed_experts;
  const int64_t I = c.moe_intermediate_size;
  Builder b(dtype, c.fp8_block_rows, c.fp8_block_cols, seed);
  b.storage.reserve(static_cast<size_t>((40 + 6 * E) * c.num_hidden_layers + 16));
  b.add("model.embed_tokens.weight", {c.vocab_size, H}, -1.0f, 1.0f);
  b.add("model.norm.weight", {H}, 0.9f, 1.1f);
  if (!c.tie_word_embeddings) b.linear("lm_head.weight", c.vocab_size, H, false);
  // Layers 0 .. N-1 are the target's; layer N (with num_nextn_predict_layers) is the NextN
  // drafter layer: a mixture, attention without an indexer, plus its own norms and projection.
  const int64_t n_layers = c.num_hidden_layers + std::min<int64_t>(c.num_nextn_predict_layers, 1);
  for (int64_t i = 0; i < n_layers; ++i) {
    const std::string l = "model.layers." + std::to_string(i) + ".";
    const bool nextn = i == c.num_hidden_layers;
    if (nextn) {
      b.add(l + "enorm.weight", {H}, 0.9f, 1.1f);
      b.add(l + "hnorm.weight", {H}, 0.9f, 1.1f);
      b.linear(l + "eh_proj.weight", H, 2 * H);
      b.add(l + "shared_head.norm.weight", {H}, 0.9f, 1.1f);
    }
    b.add(l + "input_layernorm.weight", {H}, 0.9f, 1.1f);
    b.add(l + "post_attention_layernorm.weight", {H}, 0.9f, 1.1f);
    const std::string a = l + "self_attn.";
    b.linear(a + "q_a_proj.weight", c.q_lora_rank, H);
    b.add(a + "q_a_layernorm.weight", {c.q_lora_rank}, 0.9f, 1.1f);
    b.linear(a + "q_b_proj.weight", nh * (dn + dr), c.q_lora_rank);
    b.linear(a + "kv_a_proj_with_mqa.weight", R + dr, H);
    b.add(a + "kv_a_layernorm.weight", {R}, 0.9f, 1.1f);
    b.linear(a + "kv_b_proj.weight", nh * (dn + dv), R);
    b.linear(a + "o_proj.weight", H, nh * dv);
    if (!nextn && !c.shared_index_layers[static_cast<size_t>(i)]) {
      const std::string x = a + "indexer.";
      b.linear(x + "wq_b.weight", c.index_n_heads * Di, c.q_lora_rank);
      b.linear(x + "wk.weight", Di, H);
      b.add(x + "k_norm.weight", {Di}, 0.9f, 1.1f);
      b.add(x + "k_norm.bias", {Di}, -0.1f, 0.1f);
      b.linear(x + "weights_proj.weight", c.index_n_heads, H, false);
    }
    const std::string m = l + "mlp.";
    if (!nextn && !c.sparse_layers[static_cast<size_t>(i)]) {
      b.linear(m + "gate_proj.weight", c.intermediate_size, H);
      b.linear(m + "up_proj.weight", c.intermediate_size, H);
      b.linear(m + "down_proj.weight", H, c.intermediate_size);
      continue;
    }
    // Router logits of O(1) spread, so that routing decisions have clear margins.
    const float g = 2.0f / std::sqrt(static_cast<float>(H));
    b.add(m + "gate.weight", {E, H}, -g, g);
    b.add(m + "gate.e_score_correction_bias", {E}, -0.1f, 0.1f, true);
    if (per_expert_tensors || c.fp8()) {
      for (int64_t e = 0; e < E; ++e) {
        const std::string x2 = m + "experts." + std::to_string(e) + ".";
        b.linear(x2 + "gate_proj.weight", I, H);
        b.linear(x2 + "up_proj.weight", I, H);
        b.linear(x2 + "down_proj.weight", H, I);
      }
    } else {
      const float ga = 1.0f / std::sqrt(static_cast<float>(H));
      const float da = 1.0f / std::sqrt(static_cast<float>(I));
      b.add(m + "experts.gate_up_proj", {E, 2 * I, H}, -ga, ga);
      b.add(m + "experts.down_proj", {E, H, I}, -da, da);
    }
    if (c.n_shared_experts > 0) {
      const int64_t Is = I * c.n_shared_experts;
      b.linear(m + "shared_experts.gate_proj.weight", Is, H);
      b.linear(m + "shared_experts.up_proj.weight", Is, H);
      b.linear(m + "shared_experts.down_proj.weight", H, Is);
    }
  }
  fs::copy_file(config_path, fs::path(out_dir) / "config.json",
                fs::copy_options::overwrite_existing);
  write_safetensors(model_path.string(), b.tensors, {{"format", "pt"}});
}

}  // namespace tandem
