#include "tandem/spec/eagle3_random.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "tandem/core/error.h"
#include "tandem/io/random_tensors.h"
#include "tandem/io/safetensors.h"

namespace tandem::spec {

namespace {

// Llama norms scale by w: around 1.
void add_norm(RandomTensors& b, const std::string& name, int64_t n) {
  b.add(name, {n}, 0.9f, 1.1f);
}

}  // namespace

void write_random_eagle3_head(const Eagle3RandomShape& s, const std::string& out_dir, DType dtype,
                              uint64_t seed) {
  if (dtype != DType::F32 && dtype != DType::BF16 && dtype != DType::F16)
    fail("random eagle3 head: dtype must be f32, bf16 or f16");
  const int64_t H = s.hidden_size, V = s.vocab_size;
  if (H <= 0 || s.intermediate_size <= 0 || s.num_attention_heads <= 0 ||
      s.num_key_value_heads <= 0 || V <= 0)
    fail("random eagle3 head: sizes must be positive");
  const int64_t hd = s.head_dim > 0 ? s.head_dim : H / s.num_attention_heads;
  const int64_t Ht = s.target_hidden_size > 0 ? s.target_hidden_size : H;
  const int64_t n_taps = s.tap_layers.empty() ? 3 : static_cast<int64_t>(s.tap_layers.size());
  namespace fs = std::filesystem;
  fs::create_directories(out_dir);
  const fs::path model_path = fs::path(out_dir) / "model.safetensors";
  if (fs::exists(model_path)) fail(model_path.string(), " already exists; not overwriting");

  RandomTensors b(dtype, seed);
  // The draft vocabulary: the given ids, or a random sorted subset that includes id 0.
  std::vector<int32_t> ids = s.draft_ids;
  if (ids.empty()) {
    const int64_t Vd = s.draft_vocab_size > 0 ? s.draft_vocab_size : V;
    if (Vd > V) fail("random eagle3 head: draft_vocab_size ", Vd, " exceeds vocab_size ", V);
    std::vector<int32_t> all(static_cast<size_t>(V - 1));
    for (int64_t i = 1; i < V; ++i) all[static_cast<size_t>(i - 1)] = static_cast<int32_t>(i);
    std::shuffle(all.begin(), all.end(), b.rng);
    ids.assign(all.begin(), all.begin() + (Vd - 1));
    ids.push_back(0);
    std::sort(ids.begin(), ids.end());
  }
  const int64_t Vd = static_cast<int64_t>(ids.size());
  std::vector<std::byte> d2t(static_cast<size_t>(Vd) * 8), t2d(static_cast<size_t>(V));
  for (int64_t d = 0; d < Vd; ++d) {
    const int32_t t = ids[static_cast<size_t>(d)];
    if (t < 0 || t >= V) fail("random eagle3 head: draft id ", d, " maps to target id ", t);
    if (t2d[static_cast<size_t>(t)] != std::byte{0})
      fail("random eagle3 head: target id ", t, " is listed twice");
    t2d[static_cast<size_t>(t)] = std::byte{1};
    const int64_t off = t - d;
    std::memcpy(d2t.data() + d * 8, &off, 8);
  }

  b.storage.reserve(20);
  b.linear("fc.weight", H, n_taps * Ht);
  add_norm(b, "midlayer.input_layernorm.weight", H);
  add_norm(b, "midlayer.hidden_norm.weight", H);
  b.linear("midlayer.self_attn.q_proj.weight", s.num_attention_heads * hd, 2 * H);
  b.linear("midlayer.self_attn.k_proj.weight", s.num_key_value_heads * hd, 2 * H);
  b.linear("midlayer.self_attn.v_proj.weight", s.num_key_value_heads * hd, 2 * H);
  b.linear("midlayer.self_attn.o_proj.weight", H, s.num_attention_heads * hd);
  add_norm(b, "midlayer.post_attention_layernorm.weight", H);
  b.linear("midlayer.mlp.gate_proj.weight", s.intermediate_size, H);
  b.linear("midlayer.mlp.up_proj.weight", s.intermediate_size, H);
  b.linear("midlayer.mlp.down_proj.weight", H, s.intermediate_size);
  add_norm(b, "norm.weight", H);
  // Logits of O(1) spread, so greedy choices have clear margins.
  b.add("lm_head.weight", {Vd, H}, -4.0f / std::sqrt(static_cast<float>(H)),
        4.0f / std::sqrt(static_cast<float>(H)));
  if (s.own_embedding) b.add("embed_tokens.weight", {V, H}, -1.0f, 1.0f);
  b.put("d2t", DType::I64, {Vd}, std::move(d2t));
  b.put("t2d", DType::BOOL, {V}, std::move(t2d));

  nlohmann::json config = {{"architectures", {"LlamaForCausalLMEagle3"}},
                           {"model_type", "llama"},
                           {"hidden_size", H},
                           {"intermediate_size", s.intermediate_size},
                           {"num_attention_heads", s.num_attention_heads},
                           {"num_key_value_heads", s.num_key_value_heads},
                           {"num_hidden_layers", 1},
                           {"hidden_act", "silu"},
                           {"rms_norm_eps", s.rms_norm_eps},
                           {"rope_theta", s.rope_theta},
                           {"rope_scaling", nullptr},
                           {"max_position_embeddings", 4096},
                           {"vocab_size", V},
                           {"draft_vocab_size", Vd},
                           {"target_hidden_size", Ht},
                           {"tie_word_embeddings", false}};
  if (s.head_dim > 0) config["head_dim"] = s.head_dim;
  if (!s.tap_layers.empty())
    config["eagle_config"] = {{"eagle_aux_hidden_state_layer_ids", s.tap_layers}};
  write_safetensors(model_path.string(), b.tensors);
  std::ofstream f(fs::path(out_dir) / "config.json");
  f << config.dump(2) << "\n";
  if (!f) fail("cannot write ", (fs::path(out_dir) / "config.json").string());
}

}  // namespace tandem::spec
