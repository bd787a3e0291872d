// The GLM-5 target (Glm5Model) on the CPU, on random tiny checkpoints in the published layouts:
// loading (fused and per-expert experts, fp8 with block scales) and its errors, and the properties
// speculation relies on — a verify window gives decoding's bits, rows do not affect each other,
// a commit truncates the caches to exactly the kept prefix — plus the prompt (expanded MLA) form
// agreeing with the decode (absorbed) form. Parity with transformers is test_glm5_parity.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "tandem/backend/cpu/weight_element.h"
#include "tandem/core/error.h"
#include "tandem/io/safetensors.h"
#include "tandem/io/weight_store.h"
#include "tandem/model/glm5.h"
#include "tandem/model/glm5_random.h"
#include "test_util.h"

namespace tandem {
namespace {

using testing::ScratchDir;

// 3 layers (dense, sparse, sparse); the second reuses the first's DSA choice; 6 positions kept,
// so prompts of 10+ tokens attend sparsely. The attention's rotary pairs are interleaved, the
// indexer's halves, so both layouts run.
std::string tiny_config(bool fp8) {
  std::string c = R"({
  "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
  "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
  "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
  "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
  "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
  "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": true,
  "mlp_layer_types": ["dense", "sparse", "sparse"], "indexer_types": ["full", "shared", "full"],
  "index_topk": 6, "index_head_dim": 16, "index_n_heads": 4, "rms_norm_eps": 1e-5,
  "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
  "rope_interleave": true, "indexer_rope_interleave": false,
  "tie_word_embeddings": false, "eos_token_id": 1)";
  if (fp8)
    c += R"(, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
  "activation_scheme": "dynamic", "weight_block_size": [16, 16]})";
  return c + "\n}";
}

class Glm5ModelTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new ScratchDir("glm5");
    testing::write_text(dir_->file("bf16.json"), tiny_config(false));
    testing::write_text(dir_->file("fp8.json"), tiny_config(true));
    write_random_glm5(dir_->file("bf16.json"), dir_->file("fused"), DType::BF16, 5);
    write_random_glm5(dir_->file("bf16.json"), dir_->file("per_expert"), DType::BF16, 5, true);
    write_random_glm5(dir_->file("fp8.json"), dir_->file("fp8"), DType::BF16, 6);
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  static std::string path(const char* name) { return dir_->file(name); }
  static ScratchDir* dir_;
};
ScratchDir* Glm5ModelTest::dir_ = nullptr;

std::vector<int32_t> tokens(int64_t n, int32_t seed) {
  std::vector<int32_t> t;
  for (int64_t i = 0; i < n; ++i) t.push_back(static_cast<int32_t>((seed + 37 * i) % 90 + 3));
  return t;
}

// Every token's logits of one forward of `ids` into a fresh row (prompt: the expanded MLA form).
ForwardOutput run(const Glm5Model& m, Glm5State& st, int slot, const std::vector<int32_t>& ids,
                  bool prompt, bool all_logits = true, bool speculative = false) {
  const RowInput row{slot, static_cast<int64_t>(ids.size()), speculative};
  ForwardRequest req;
  req.tokens = ids;
  req.rows = std::span<const RowInput>(&row, 1);
  req.all_logits = all_logits;
  req.prompt = prompt;
  req.want_routing = true;
  req.want_index_selection = true;
  ForwardOutput out;
  m.forward(st, req, &out);
  return out;
}

double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, double(std::fabs(x)));
  return m;
}

bool same_bits(const float* a, const float* b, size_t n) {
  return std::memcmp(a, b, n * sizeof(float)) == 0;
}

TEST_F(Glm5ModelTest, LoadsFusedPerExpertAndFp8Checkpoints) {
  const auto fused = Glm5Model::load(path("fused"));
  const auto per_expert = Glm5Model::load(path("per_expert"));
  const auto fp8 = Glm5Model::load(path("fp8"));
  EXPECT_EQ(fused->config().index_topk, 6);
  EXPECT_TRUE(fused->config().shared_index_layers[1]);
  EXPECT_TRUE(fp8->config().fp8());
  // Same counts of weights whatever the layout (the fp8 scales are not parameters).
  EXPECT_EQ(fused->parameter_count(), per_expert->parameter_count());
  // Embedding and head 2 · 96 · 64, final norm 64; per layer norms 128 and attention 15,936;
  // the two indexers 3,360 each; the dense MLP 18,432; each mixture 55,816 (router 512, bias 8,
  // experts 8 · 3 · 32 · 64, shared expert 6,144).
  EXPECT_EQ(fused->parameter_count(),
            12352u + 3 * (128u + 15936u) + 2 * 3360u + 18432u + 2 * 55816u);
  const int64_t V = fused->config().vocab_size;
  for (const Glm5Model* m : {fused.get(), per_expert.get(), fp8.get()}) {
    Glm5State st(m->config(), 1);
    const int slot = st.open_row();
    const ForwardOutput out = run(*m, st, slot, tokens(12, 1), true);
    ASSERT_EQ(out.logits.size(), static_cast<size_t>(12 * V));
    for (float v : out.logits) ASSERT_TRUE(std::isfinite(v));
    EXPECT_GT(max_abs(out.logits), 0.1);
    EXPECT_EQ(st.length(slot), 12);
  }
}

// Decoding one token at a time and one decode-form forward over all of them give bitwise the
// same logits (batch invariance); the prompt form agrees within fp32 rounding.
// What bench counts as a decode step's weight reads: every stored tensor of the target's layers,
// the final norm and the head, with kv_b read as the fp32 copy the model keeps and the routers'
// correction biases (E values) left out, and of the routed experts the top-k share a token reads;
// the embedding table not at all (untied head). The union a batch touches needs all experts.
TEST_F(Glm5ModelTest, DecodeWeightBytesAreTheTensorsAStepReads) {
  for (const char* layout : {"fused", "per_expert"}) {
    const auto m = Glm5Model::load(path(layout));
    const Glm5Config& c = m->config();
    uint64_t dense = 0, experts = 0;
    for (const std::string& name : m->weights().names()) {
      const TensorView& t = m->weights().get(name);
      if (name == "model.embed_tokens.weight" ||
          name.find("e_score_correction_bias") != std::string::npos)
        continue;
      uint64_t bytes = t.nbytes;
      if (name.find("kv_b_proj") != std::string::npos) bytes = static_cast<uint64_t>(t.numel()) * 4;
      if (name.find(".mlp.experts.") != std::string::npos)
        experts += bytes;
      else
        dense += bytes;
    }
    ASSERT_GT(experts, 0u) << layout;
    EXPECT_EQ(m->expert_weight_bytes(), experts) << layout;
    const uint64_t per_token = experts / static_cast<uint64_t>(c.n_routed_experts) *
                               static_cast<uint64_t>(c.num_experts_per_tok);
    EXPECT_EQ(m->decode_weight_bytes(), dense + per_token) << layout;
  }
}

TEST_F(Glm5ModelTest, DecodeStepsAreBitwiseOneForwardAndNearThePromptForm) {
  for (const char* name : {"fused", "fp8"}) {
    SCOPED_TRACE(name);
    const auto m = Glm5Model::load(path(name));
    const int64_t V = m->config().vocab_size, n = 14;
    const std::vector<int32_t> ids = tokens(n, 2);
    Glm5State st(m->config(), 3);
    const int whole = st.open_row(), steps = st.open_row(), prompt = st.open_row();
    const ForwardOutput all = run(*m, st, whole, ids, false);
    const ForwardOutput pre = run(*m, st, prompt, ids, true);
    const double scale = max_abs(all.logits);
    for (int64_t i = 0; i < n; ++i) {
      const ForwardOutput one = run(*m, st, steps, {ids[static_cast<size_t>(i)]}, false);
      ASSERT_TRUE(same_bits(one.logits.data(), all.logits.data() + i * V, static_cast<size_t>(V)))
          << "position " << i;
      // Its DSA choice is the one the whole forward recorded for it (layer by layer).
      const int64_t topk = m->config().index_topk, layers = m->config().num_hidden_layers;
      for (int64_t l = 0; l < layers; ++l)
        for (int64_t j = 0; j < topk; ++j)
          ASSERT_EQ(one.index_selection[static_cast<size_t>(l * topk + j)],
                    all.index_selection[static_cast<size_t>((l * n + i) * topk + j)]);
      for (int64_t v = 0; v < V; ++v)
        ASSERT_NEAR(pre.logits[static_cast<size_t>(i * V + v)],
                    all.logits[static_cast<size_t>(i * V + v)], 1e-4 * scale)
            << "position " << i;
    }
  }
}

// A verify window's logits are decoding's bits; committing k tokens leaves the row exactly as if
// only those had been decoded.
TEST_F(Glm5ModelTest, VerifyWindowIsDecodingAndCommitTruncates) {
  const auto m = Glm5Model::load(path("fused"));
  const int64_t V = m->config().vocab_size;
  const std::vector<int32_t> prompt = tokens(9, 3), window = {5, 17, 40, 22};
  Glm5State st(m->config(), 2);
  const int a = st.open_row(), b = st.open_row();
  run(*m, st, a, prompt, true);
  run(*m, st, b, prompt, true);
  std::vector<ForwardOutput> steps;
  for (int32_t t : window) steps.push_back(run(*m, st, a, {t}, false));
  const ForwardOutput verify = run(*m, st, b, window, false, true, /*speculative=*/true);
  for (size_t i = 0; i < window.size(); ++i)
    ASSERT_TRUE(
        same_bits(verify.logits.data() + i * V, steps[i].logits.data(), static_cast<size_t>(V)))
        << "window position " << i;
  // A row with an open window takes no forward until it is committed.
  EXPECT_THROW(run(*m, st, b, {3}, false), Error);
  const RowKeep keep{b, 2};
  m->commit_windows(st, std::span<const RowKeep>(&keep, 1));
  EXPECT_EQ(st.length(b), 11);
  EXPECT_EQ(st.window(b), 0);
  // Continuing after the commit: the third window token again, as the decoded row saw it.
  const ForwardOutput again = run(*m, st, b, {window[2]}, false);
  EXPECT_TRUE(same_bits(again.logits.data(), steps[2].logits.data(), static_cast<size_t>(V)));
  // Bad commits change nothing.
  const RowKeep none{b, 1};
  EXPECT_THROW(m->commit_windows(st, std::span<const RowKeep>(&none, 1)), Error);
  EXPECT_EQ(st.length(b), 12);
}

// Two rows of different lengths in one forward: each row's logits are its own, bit for bit.
TEST_F(Glm5ModelTest, RowsInOneForwardAreIndependent) {
  const auto m = Glm5Model::load(path("per_expert"));
  const int64_t V = m->config().vocab_size;
  const std::vector<int32_t> p1 = tokens(11, 4), p2 = tokens(5, 6);
  Glm5State st(m->config(), 4);
  const int a = st.open_row(), b = st.open_row(), a1 = st.open_row(), b1 = st.open_row();
  run(*m, st, a, p1, true);
  run(*m, st, b, p2, true);
  run(*m, st, a1, p1, true);
  run(*m, st, b1, p2, true);
  const std::vector<int32_t> both = {7, 8, 9, 30, 31};
  const RowInput rows[] = {{a, 3, false}, {b, 2, false}};
  ForwardRequest req;
  req.tokens = both;
  req.rows = rows;
  req.all_logits = true;
  ForwardOutput out;
  m->forward(st, req, &out);
  const ForwardOutput alone_a = run(*m, st, a1, {7, 8, 9}, false);
  const ForwardOutput alone_b = run(*m, st, b1, {30, 31}, false);
  EXPECT_TRUE(same_bits(out.logits.data(), alone_a.logits.data(), static_cast<size_t>(3 * V)));
  EXPECT_TRUE(
      same_bits(out.logits.data() + 3 * V, alone_b.logits.data(), static_cast<size_t>(2 * V)));
}

// What the forward records: each sparse layer's experts (valid, distinct ids) and each layer's
// DSA choice — every earlier position while there are at most index_topk, else index_topk of
// them; the shared layer repeats the previous layer's choice.
TEST_F(Glm5ModelTest, RecordsRoutingAndTheDsaChoice) {
  const auto m = Glm5Model::load(path("fused"));
  const Glm5Config& c = m->config();
  const int64_t n = 13, topk = c.index_topk, k = c.num_experts_per_tok;
  Glm5State st(c, 1);
  const ForwardOutput out = run(*m, st, st.open_row(), tokens(n, 7), true);
  ASSERT_EQ(out.routing.size(), static_cast<size_t>(2 * n * k));
  for (int64_t i = 0; i < 2 * n; ++i) {
    const int32_t e0 = out.routing[static_cast<size_t>(i * k)];
    const int32_t e1 = out.routing[static_cast<size_t>(i * k + 1)];
    EXPECT_NE(e0, e1);
    EXPECT_TRUE(e0 >= 0 && e0 < c.n_routed_experts && e1 >= 0 && e1 < c.n_routed_experts);
  }
  ASSERT_EQ(out.index_selection.size(), static_cast<size_t>(3 * n * topk));
  auto sel = [&](int64_t l, int64_t i) {
    const int32_t* p = out.index_selection.data() + (l * n + i) * topk;
    return std::vector<int32_t>(p, p + topk);
  };
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_EQ(sel(1, i), sel(0, i)) << "query " << i;
    for (int64_t l : {0, 2}) {
      std::vector<int32_t> s = sel(l, i);
      const int64_t expect = std::min(topk, i + 1);
      EXPECT_EQ(std::count(s.begin(), s.end(), -1), topk - expect);
      s.erase(std::remove(s.begin(), s.end(), -1), s.end());
      std::sort(s.begin(), s.end());
      EXPECT_TRUE(std::adjacent_find(s.begin(), s.end()) == s.end());
      for (int32_t p : s) EXPECT_TRUE(p >= 0 && p <= i) << "query " << i << " chose " << p;
    }
  }
}

// The fp8 checkpoint gives the logits of the same model with its weights dequantized to fp32
// (every weight is its code times its block's scale).
TEST_F(Glm5ModelTest, Fp8WeightsAreTheirDequantizedValues) {
  const WeightStore fp8 = WeightStore::open(path("fp8"));
  const Glm5Config c = load_glm5_config(path("fp8"));
  std::vector<std::vector<float>> values;
  std::vector<TensorToWrite> out;
  values.reserve(fp8.size());
  for (const std::string& name : fp8.names()) {
    if (name.find("weight_scale_inv") != std::string::npos) continue;
    const TensorView& t = fp8.get(name);
    ops::WeightRef w = ops::weight_ref(t);
    if (t.dtype == DType::F8_E4M3) {
      const TensorView& s = fp8.get(name.substr(0, name.rfind(".weight")) + ".weight_scale_inv");
      w.scales = {s.data, s.dtype, c.fp8_block_rows, c.fp8_block_cols};
    }
    std::vector<float>& v = values.emplace_back(static_cast<size_t>(t.numel()));
    for (int64_t i = 0; i < t.numel(); ++i) v[static_cast<size_t>(i)] = ops::weight_element(w, i);
    out.push_back(
        {name, DType::F32, t.shape, std::as_bytes(std::span<const float>(v.data(), v.size()))});
  }
  const std::string dense = path("fp8_dequantized");
  std::filesystem::create_directories(dense);
  testing::write_text(dense + "/config.json", tiny_config(false));
  write_safetensors(dense + "/model.safetensors", out, {{"format", "pt"}});
  const auto q = Glm5Model::load(path("fp8"));
  const auto d = Glm5Model::load(dense);
  Glm5State sq(c, 1), sd(d->config(), 1);
  const std::vector<int32_t> ids = tokens(10, 8);
  const ForwardOutput a = run(*q, sq, sq.open_row(), ids, true);
  const ForwardOutput b = run(*d, sd, sd.open_row(), ids, true);
  const double scale = max_abs(b.logits);
  for (size_t i = 0; i < a.logits.size(); ++i) ASSERT_NEAR(a.logits[i], b.logits[i], 1e-5 * scale);
}

void expect_load_error(const std::string& dir, const std::string& words) {
  try {
    Glm5Model::load(dir);
    ADD_FAILURE() << "loaded; expected an error mentioning: " << words;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
  }
}

TEST_F(Glm5ModelTest, BadCheckpointsAndRequestsAreNamed) {
  // A config that disagrees with the tensors: the tensor and both shapes are named.
  const std::string wrong = path("wrong_shape");
  std::filesystem::create_directories(wrong);
  std::string cfg = tiny_config(false);
  cfg.replace(cfg.find(R"("kv_lora_rank": 32)"), 18, R"("kv_lora_rank": 24)");
  testing::write_text(wrong + "/config.json", cfg);
  std::filesystem::copy_file(path("fused") + "/model.safetensors", wrong + "/model.safetensors");
  expect_load_error(wrong, "kv_a_proj_with_mqa.weight");
  expect_load_error(wrong, "expected shape [32, 64], got [40, 64]");
  // fp8 tensors under a config without quantization_config.
  const std::string unannounced = path("fp8_unannounced");
  std::filesystem::create_directories(unannounced);
  testing::write_text(unannounced + "/config.json", tiny_config(false));
  std::filesystem::copy_file(path("fp8") + "/model.safetensors",
                             unannounced + "/model.safetensors");
  expect_load_error(unannounced, "has no fp8 quantization_config");

  const auto m = Glm5Model::load(path("fused"));
  Glm5State st(m->config(), 1);
  const int slot = st.open_row();
  EXPECT_THROW(run(*m, st, slot, {3, 96}, false), Error);  // out of the vocabulary
  EXPECT_EQ(st.length(slot), 0);                           // nothing changed
  EXPECT_THROW(run(*m, st, slot + 1, {3}, false), Error);  // a row that is not open
  const RowKeep keep{slot, 1};
  EXPECT_THROW(m->commit_windows(st, std::span<const RowKeep>(&keep, 1)), Error);  // no window
}

}  // namespace
}  // namespace tandem
