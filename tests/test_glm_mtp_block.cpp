// GLM-5's NextN drafter layer (spec::GlmMtpBlock) on a random tiny checkpoint that carries one:
// binding from the target's checkpoint and its refusals, and the properties a drafter relies on
// — a chain of positions fed one at a time gives the bits of the same positions in one call,
// rows never affect each other, and the output depends on both the token and the hidden.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "tandem/core/error.h"
#include "tandem/io/weight_store.h"
#include "tandem/model/glm5.h"
#include "tandem/model/glm5_random.h"
#include "tandem/spec/glm_mtp_block.h"
#include "test_util.h"

namespace tandem::spec {
namespace {

using testing::ScratchDir;

const char* kConfig = R"({
  "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
  "vocab_size": 80, "hidden_size": 48, "intermediate_size": 64, "moe_intermediate_size": 24,
  "num_hidden_layers": 2, "num_attention_heads": 2, "q_lora_rank": 24, "kv_lora_rank": 16,
  "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "n_routed_experts": 4,
  "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 2, "topk_group": 1,
  "routed_scaling_factor": 2.0, "first_k_dense_replace": 1, "index_topk": 4, "index_head_dim": 16,
  "index_n_heads": 2, "num_nextn_predict_layers": 1, "eos_token_id": 1
})";

class GlmMtpBlockTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new ScratchDir("glm-mtp");
    testing::write_text(dir_->file("config.json"), kConfig);
    write_random_glm5(dir_->file("config.json"), dir_->file("model"), DType::BF16, 3);
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  static ScratchDir* dir_;
};
ScratchDir* GlmMtpBlockTest::dir_ = nullptr;

std::vector<float> values(int64_t n, float scale, int seed) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = scale * std::sin(0.37f * (i + seed));
  return v;
}

// One row: n positions from `start`, appended to `cache`.
std::vector<float> run(const GlmMtpBlock& b, const float* emb, const float* hid, int64_t n,
                       int64_t start, std::vector<float>& cache) {
  Glm5Tokens t;
  t.rows.push_back({0, n, start});
  for (int64_t j = 0; j < n; ++j) t.pos.push_back(start + j);
  t.T = n;
  const Glm5RowCache c{&cache, nullptr};
  std::vector<float> out(static_cast<size_t>(n * b.config().hidden_size));
  b.forward(emb, hid, t, std::span<const Glm5RowCache>(&c, 1), out.data());
  return out;
}

TEST_F(GlmMtpBlockTest, ChainedPositionsAreOneCallsBitsAndRowsAreIndependent) {
  const auto target = Glm5Model::load(dir_->file("model"));
  const GlmMtpBlock block(target->config(), target->weights());
  const int64_t H = target->config().hidden_size, n = 6;
  const std::vector<int32_t> ids = {5, 9, 13, 2, 40, 7};
  std::vector<float> emb(static_cast<size_t>(n * H));
  target->embed(ids, emb.data());
  const std::vector<float> hid = values(n * H, 1.5f, 1);
  std::vector<float> whole_cache, step_cache;
  const std::vector<float> whole = run(block, emb.data(), hid.data(), n, 0, whole_cache);
  for (int64_t j = 0; j < n; ++j) {
    const std::vector<float> one =
        run(block, emb.data() + j * H, hid.data() + j * H, 1, j, step_cache);
    ASSERT_EQ(0, std::memcmp(one.data(), whole.data() + j * H, sizeof(float) * H)) << j;
  }
  EXPECT_EQ(step_cache, whole_cache);
  double norm = 0;
  for (float v : whole) norm += double(v) * v;
  EXPECT_GT(norm, 1.0);

  // Two rows in one call: each is what it gives alone.
  Glm5Tokens t;
  t.rows = {{0, 2, 0}, {2, 3, 0}};
  t.pos = {0, 1, 0, 1, 2};
  t.T = 5;
  std::vector<float> c0, c1;
  const Glm5RowCache caches[] = {{&c0, nullptr}, {&c1, nullptr}};
  std::vector<float> both(static_cast<size_t>(5 * H));
  block.forward(emb.data(), hid.data(), t, caches, both.data());
  std::vector<float> a0, a1;
  const std::vector<float> alone0 = run(block, emb.data(), hid.data(), 2, 0, a0);
  const std::vector<float> alone1 = run(block, emb.data() + 2 * H, hid.data() + 2 * H, 3, 0, a1);
  EXPECT_EQ(0, std::memcmp(both.data(), alone0.data(), sizeof(float) * 2 * H));
  EXPECT_EQ(0, std::memcmp(both.data() + 2 * H, alone1.data(), sizeof(float) * 3 * H));

  // Both inputs matter: another hidden changes the output.
  std::vector<float> c2;
  const std::vector<float> other_hidden = values(H, 1.5f, 99);
  const std::vector<float> moved = run(block, emb.data(), other_hidden.data(), 1, 0, c2);
  EXPECT_NE(0, std::memcmp(moved.data(), whole.data(), sizeof(float) * H));
}

TEST_F(GlmMtpBlockTest, ATargetWithoutANextNLayerIsRefused) {
  const auto target = Glm5Model::load(dir_->file("model"));
  Glm5Config none = target->config();
  none.num_nextn_predict_layers = 0;
  try {
    GlmMtpBlock block(none, target->weights());
    ADD_FAILURE() << "built a NextN block for a config without one";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("num_nextn_predict_layers = 0"), std::string::npos)
        << e.what();
  }
  // A NextN layer of another shape: the tensor and both shapes are named.
  Glm5Config wider = target->config();
  wider.hidden_size = 64;
  try {
    GlmMtpBlock block(wider, target->weights());
    ADD_FAILURE() << "bound a NextN layer of another shape";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("enorm.weight"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tandem::spec
