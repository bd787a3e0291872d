// GLM-5's NextN drafter on a random tiny checkpoint that carries one.
// The layer (spec::GlmMtpBlock): binding from the target's checkpoint and its refusals, and the
// properties a drafter relies on — a chain of positions fed one at a time gives the bits of the
// same positions in one call, rows never affect each other, and the output depends on both the
// token and the hidden.
// The rows (spec::GlmMtpRows): proposals are the layer's greedy chain over the target's head;
// a commit keeps exactly the MTP rows of the convention (spec/mtp_rows.h), built from the pairs
// it names; checkpoints restore to the same proposals; bad input is refused unchanged.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "fixture_reference.h"
#include "tandem/core/error.h"
#include "tandem/io/safetensors.h"
#include "tandem/io/weight_store.h"
#include "tandem/model/glm5.h"
#include "tandem/model/glm5_random.h"
#include "tandem/spec/glm_mtp.h"
#include "tandem/spec/glm_mtp_block.h"
#include "tandem/spec/mtp_rows.h"
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
                       int64_t start, PositionCache& cache) {
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
  const int64_t W = block.latent_width();
  PositionCache whole_cache(W), step_cache(W);
  const std::vector<float> whole = run(block, emb.data(), hid.data(), n, 0, whole_cache);
  for (int64_t j = 0; j < n; ++j) {
    const std::vector<float> one =
        run(block, emb.data() + j * H, hid.data() + j * H, 1, j, step_cache);
    ASSERT_EQ(0, std::memcmp(one.data(), whole.data() + j * H, sizeof(float) * H)) << j;
  }
  EXPECT_EQ(step_cache.to_host(), whole_cache.to_host());
  double norm = 0;
  for (float v : whole) norm += double(v) * v;
  EXPECT_GT(norm, 1.0);

  // Two rows in one call: each is what it gives alone.
  Glm5Tokens t;
  t.rows = {{0, 2, 0}, {2, 3, 0}};
  t.pos = {0, 1, 0, 1, 2};
  t.T = 5;
  PositionCache c0(W), c1(W);
  const Glm5RowCache caches[] = {{&c0, nullptr}, {&c1, nullptr}};
  std::vector<float> both(static_cast<size_t>(5 * H));
  block.forward(emb.data(), hid.data(), t, caches, both.data());
  PositionCache a0(W), a1(W);
  const std::vector<float> alone0 = run(block, emb.data(), hid.data(), 2, 0, a0);
  const std::vector<float> alone1 = run(block, emb.data() + 2 * H, hid.data() + 2 * H, 3, 0, a1);
  EXPECT_EQ(0, std::memcmp(both.data(), alone0.data(), sizeof(float) * 2 * H));
  EXPECT_EQ(0, std::memcmp(both.data() + 2 * H, alone1.data(), sizeof(float) * 3 * H));

  // Both inputs matter: another hidden changes the output.
  PositionCache c2(W);
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

// ---------------------------------------------------------------------------------------------
// The drafter rows

// The target's final-normed hiddens of `ids`, from one decode-form forward (a token's bits do
// not depend on the other tokens of its forward, so these are a decode's and a verify's bits).
std::vector<float> target_hidden(const Glm5Model& m, const std::vector<int32_t>& ids) {
  Glm5State state(m.config(), 1);
  const RowInput row{state.open_row(), static_cast<int64_t>(ids.size()), false};
  ForwardRequest req;
  req.tokens = ids;
  req.rows = {&row, 1};
  req.want_hidden = true;
  req.want_logits = false;
  ForwardOutput out;
  m.forward(state, req, &out);
  return out.hidden;
}

// What the drafter must compute, from the layer and the target's head called directly: one
// row's latent cache and the layer's outputs, pair by pair.
struct Reference {
  const Glm5Model& target;
  const GlmMtpBlock& block;
  PositionCache cache{block.latent_width()};
  int64_t length = 0;

  // Appends the MTP row of (token, hidden); returns the layer's output [H].
  std::vector<float> add(int32_t token, const float* hidden) {
    const int64_t H = target.config().hidden_size;
    std::vector<float> emb(static_cast<size_t>(H));
    target.embed(std::span<const int32_t>(&token, 1), emb.data());
    std::vector<float> out = run(block, emb.data(), hidden, 1, length, cache);
    ++length;
    return out;
  }
  std::vector<float> logits(const std::vector<float>& out) const {
    std::vector<float> l(static_cast<size_t>(target.config().vocab_size));
    target.head(out.data(), 1, l.data());
    return l;
  }
};

int32_t argmax(const std::vector<float>& v) {
  return static_cast<int32_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

class GlmMtpRowsTest : public GlmMtpBlockTest {
 protected:
  void SetUp() override {
    target_ = Glm5Model::load(dir_->file("model"));
    view_ = std::make_unique<Glm5TargetView>(*target_, "glm-test-target");
    provider_ = GlmMtpProvider::from_target(*view_);
    block_ = &provider_->block();
    H_ = target_->config().hidden_size;
    hidden_ = target_hidden(*target_, prompt_);
  }
  std::unique_ptr<MtpRows> open(const GlmMtpProvider& p) {
    std::unique_ptr<DraftRows> r = p.open_rows(*view_);
    auto* m = dynamic_cast<MtpRows*>(r.get());
    EXPECT_NE(m, nullptr);
    r.release();
    return std::unique_ptr<MtpRows>(m);
  }
  // A cold row prefilled with the prompt.
  std::unique_ptr<MtpRows> prefilled(const GlmMtpProvider& p) {
    auto rows = open(p);
    rows->append(std::vector<CheckpointPtr>{nullptr});
    const RowPrefill pre{0, prompt_, hidden_.data(), 0};
    rows->prefill({&pre, 1});
    return rows;
  }
  // The reference holding the prompt's MTP rows (one per pair (prompt[p+1], hidden[p])).
  Reference reference_after_prompt() const {
    Reference ref{*target_, *block_};
    for (size_t p = 0; p + 1 < prompt_.size(); ++p)
      ref.add(prompt_[p + 1], hidden_.data() + static_cast<int64_t>(p) * H_);
    return ref;
  }
  static DraftProposal draft_one(MtpRows& rows, int32_t pending, int depth) {
    RowDraft d;
    d.pending = pending;
    d.depth = depth;
    std::vector<DraftProposal> out;
    rows.draft({&d, 1}, &out);
    return out.at(0);
  }

  std::unique_ptr<Glm5Model> target_;
  std::unique_ptr<Glm5TargetView> view_;
  std::unique_ptr<GlmMtpProvider> provider_;
  const GlmMtpBlock* block_ = nullptr;
  int64_t H_ = 0;
  const std::vector<int32_t> prompt_ = {3, 17, 42, 8, 8, 61, 29, 5, 77, 12, 30, 44};
  std::vector<float> hidden_;
};

TEST_F(GlmMtpRowsTest, DraftsTheLayersGreedyChainOverTheTargetsHead) {
  auto rows = prefilled(*provider_);
  const int64_t n = static_cast<int64_t>(prompt_.size());
  EXPECT_EQ(rows->mtp_rows(0), n - 1);
  const int32_t pending = 19;
  const DraftProposal got = draft_one(*rows, pending, 3);

  Reference ref = reference_after_prompt();
  std::vector<float> out = ref.add(pending, hidden_.data() + (n - 1) * H_);
  std::vector<int32_t> want;
  for (int j = 0; j < 3; ++j) {
    const std::vector<float> logits = ref.logits(out);
    const std::span<const float> drafted = rows->last_draft_logits(0, j);
    ASSERT_EQ(drafted.size(), logits.size());
    EXPECT_EQ(0, std::memcmp(drafted.data(), logits.data(), sizeof(float) * logits.size())) << j;
    want.push_back(argmax(logits));
    if (j < 2) out = ref.add(want.back(), out.data());
  }
  EXPECT_EQ(got.tokens, want);
  EXPECT_EQ(rows->mtp_rows(0), n - 1 + 3);  // the chain's rows, until the commit cuts them
}

TEST_F(GlmMtpRowsTest, CommitKeepsTheRowsOfTheConvention) {
  const int64_t n = static_cast<int64_t>(prompt_.size()), k = 3;
  const int32_t pending = 19;
  const std::vector<float> verify = values((k + 1) * H_, 1.2f, 7);  // the target's window taps
  for (int accepted = 0; accepted <= k; ++accepted) {
    SCOPED_TRACE("accepted " + std::to_string(accepted));
    auto rows = prefilled(*provider_);
    const DraftProposal d = draft_one(*rows, pending, static_cast<int>(k));
    std::vector<int32_t> window = {pending};
    window.insert(window.end(), d.tokens.begin(), d.tokens.end());
    const VerifyRow v{window, verify.data(), accepted, 4};
    rows->commit({&v, 1});

    // Kept: the rows of pending and the accepted proposals, built from the chain's hiddens; when
    // every proposal was accepted, the last one's row from the verified hidden.
    Reference ref = reference_after_prompt();
    std::vector<float> out = ref.add(pending, hidden_.data() + (n - 1) * H_);
    const int64_t kept = std::min<int64_t>(accepted + 1, k);
    for (int64_t j = 1; j < kept; ++j)
      out = ref.add(d.tokens[static_cast<size_t>(j - 1)], out.data());
    if (accepted == k) ref.add(d.tokens.back(), verify.data() + (k - 1) * H_);
    EXPECT_EQ(rows->mtp_rows(0), n + accepted);  // target processed n + accepted + 1 tokens
    EXPECT_EQ(ref.length, rows->mtp_rows(0));

    const CheckpointPtr c = rows->capture(0);
    EXPECT_EQ(c->processed_tokens, n + accepted + 1);
    EXPECT_EQ(c->schema, kGlmMtpSchema);
    EXPECT_EQ(c->tensors.at("latent").data, ref.cache.to_host());
    const std::vector<float>& h = c->tensors.at("h_true").data;
    EXPECT_EQ(0, std::memcmp(h.data(), verify.data() + accepted * H_, sizeof(float) * H_));
  }
  // Depth 0: the pending token's row from the hidden before it.
  auto rows = prefilled(*provider_);
  EXPECT_TRUE(draft_one(*rows, pending, 0).tokens.empty());
  const std::vector<int32_t> window = {pending};
  const VerifyRow v{window, verify.data(), 0, 4};
  rows->commit({&v, 1});
  Reference ref = reference_after_prompt();
  ref.add(pending, hidden_.data() + (n - 1) * H_);
  EXPECT_EQ(rows->capture(0)->tensors.at("latent").data, ref.cache.to_host());
}

TEST_F(GlmMtpRowsTest, RowsOfABatchAreTheRowsAlone) {
  const std::vector<int32_t> other = {9, 9, 14, 70, 2};
  const std::vector<float> other_hidden = target_hidden(*target_, other);
  auto both = open(*provider_);
  both->append(std::vector<CheckpointPtr>{nullptr, nullptr});
  const RowPrefill pre[] = {{0, prompt_, hidden_.data(), 0}, {1, other, other_hidden.data(), 0}};
  both->prefill(pre);
  RowDraft d[2];
  d[0].pending = 19;
  d[0].depth = 3;
  d[1].pending = 33;
  d[1].depth = 1;
  std::vector<DraftProposal> out;
  both->draft(d, &out);

  auto alone = prefilled(*provider_);
  EXPECT_EQ(draft_one(*alone, 19, 3).tokens, out[0].tokens);
  auto alone_other = open(*provider_);
  alone_other->append(std::vector<CheckpointPtr>{nullptr});
  const RowPrefill pre_other{0, other, other_hidden.data(), 0};
  alone_other->prefill({&pre_other, 1});
  EXPECT_EQ(draft_one(*alone_other, 33, 1).tokens, out[1].tokens);
  const std::span<const float> l = both->last_draft_logits(1, 0);
  const std::span<const float> la = alone_other->last_draft_logits(0, 0);
  EXPECT_EQ(0, std::memcmp(l.data(), la.data(), sizeof(float) * l.size()));
}

TEST_F(GlmMtpRowsTest, ACheckpointRestoresTheSameProposalsAndBadOnesAreRefused) {
  auto rows = prefilled(*provider_);
  const DraftProposal d = draft_one(*rows, 19, 2);
  std::vector<int32_t> window = {19};
  window.insert(window.end(), d.tokens.begin(), d.tokens.end());
  const std::vector<float> verify = values(3 * H_, 0.8f, 3);
  const VerifyRow v{window, verify.data(), 1, 6};
  rows->commit({&v, 1});
  const CheckpointPtr c = rows->capture(0);

  auto restored = open(*provider_);
  restored->append(std::vector<CheckpointPtr>{c});
  EXPECT_EQ(restored->mtp_rows(0), rows->mtp_rows(0));
  EXPECT_EQ(draft_one(*restored, 6, 3).tokens, draft_one(*rows, 6, 3).tokens);
  for (int j = 0; j < 3; ++j) {
    const std::span<const float> a = restored->last_draft_logits(0, j);
    const std::span<const float> b = rows->last_draft_logits(0, j);
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), sizeof(float) * a.size())) << j;
  }

  auto refused = [&](const Checkpoint& bad, const std::string& needle) {
    auto fresh = open(*provider_);
    try {
      fresh->append(std::vector<CheckpointPtr>{std::make_shared<Checkpoint>(bad)});
      ADD_FAILURE() << "restored a bad checkpoint (" << needle << ")";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_EQ(fresh->row_count(), 0);
  };
  Checkpoint bad = *c;
  bad.schema = "qwen-mtp-v1";
  refused(bad, "schema");
  bad = *c;
  bad.ns += "-other";
  refused(bad, "namespace");
  bad = *c;
  bad.tensors["latent"].shape[1] += 1;
  refused(bad, "latent");
  bad = *c;
  bad.tensors.erase("h_true");
  refused(bad, "h_true");
  bad = *c;
  bad.processed_tokens += 1;
  refused(bad, "tokens");
}

TEST_F(GlmMtpRowsTest, AnEmptyHistoryStartsAtThePromptsLastToken) {
  const auto empty = GlmMtpProvider::from_target(*view_, GlmMtpHistory::Empty);
  EXPECT_NE(empty->checkpoint_namespace(), provider_->checkpoint_namespace());
  auto rows = prefilled(*empty);
  const int64_t n = static_cast<int64_t>(prompt_.size());
  EXPECT_EQ(rows->mtp_rows(0), 0);
  const DraftProposal got = draft_one(*rows, 19, 2);
  Reference ref{*target_, *block_};
  const std::vector<float> out = ref.add(19, hidden_.data() + (n - 1) * H_);
  const int32_t first = argmax(ref.logits(out));
  EXPECT_EQ(got.tokens.at(0), first);
  EXPECT_EQ(got.tokens.at(1), argmax(ref.logits(ref.add(first, out.data()))));
  const std::vector<int32_t> window = {19, got.tokens[0], got.tokens[1]};
  const std::vector<float> verify = values(3 * H_, 1.0f, 5);
  const VerifyRow v{window, verify.data(), 0, 2};
  rows->commit({&v, 1});
  const CheckpointPtr c = rows->capture(0);
  EXPECT_EQ(c->history_from, n - 1);
  EXPECT_EQ(c->processed_tokens, n + 1);
  EXPECT_EQ(c->tensors.at("latent").shape, (std::vector<int64_t>{1, block_->latent_width()}));
}

TEST_F(GlmMtpRowsTest, TargetsOfAnotherFamilyOrWithoutNextNAreRefused) {
  // A checkpoint whose config declares no NextN layer.
  ScratchDir bare("glm-mtp-bare");
  std::string config = kConfig;
  config.replace(config.find("\"num_nextn_predict_layers\": 1"),
                 std::string("\"num_nextn_predict_layers\": 1").size(),
                 "\"num_nextn_predict_layers\": 0");
  testing::write_text(bare.file("config.json"), config);
  write_random_glm5(bare.file("config.json"), bare.file("model"), DType::BF16, 3);
  const auto plain = Glm5Model::load(bare.file("model"));
  const Glm5TargetView plain_view(*plain, "glm-without-nextn");
  try {
    GlmMtpProvider::from_target(plain_view);
    ADD_FAILURE() << "opened a NextN drafter on a checkpoint without one";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("num_nextn_predict_layers = 0"), std::string::npos)
        << e.what();
  }
  // A drafter for another checkpoint's shape.
  ScratchDir wide("glm-mtp-wide");
  config = kConfig;
  config.replace(config.find("\"vocab_size\": 80"), std::string("\"vocab_size\": 80").size(),
                 "\"vocab_size\": 96");
  testing::write_text(wide.file("config.json"), config);
  write_random_glm5(wide.file("config.json"), wide.file("model"), DType::BF16, 3);
  const auto other = Glm5Model::load(wide.file("model"));
  const Glm5TargetView other_view(*other, "glm-wider-vocab");
  try {
    provider_->open_rows(other_view);
    ADD_FAILURE() << "opened rows against a target of another vocabulary";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("vocabulary"), std::string::npos) << e.what();
  }
}

// ---------------------------------------------------------------------------------------------
// Parity with the NextN layer in PyTorch (tools/glm_nextn.py; tests/fixtures/glm5_nextn, written by
// tools/make_glm_nextn_fixture.py with transformers 5.17 running the target)

double worst_relative(const float* got, const std::vector<float>& want, size_t offset, size_t n) {
  double scale = 0, worst = 0;
  for (size_t i = 0; i < n; ++i) scale = std::max(scale, double(std::fabs(want[offset + i])));
  for (size_t i = 0; i < n; ++i)
    worst = std::max(worst, std::fabs(double(got[i]) - want[offset + i]) / scale);
  return worst;
}

TEST(GlmMtpParity, TheNextNLayerMatchesPyTorchOnTheTargetsHiddens) {
  const std::string dir = std::string(TANDEM_FIXTURES_DIR) + "/glm5_nextn";
  const auto target = Glm5Model::load(dir);
  const Glm5TargetView view(*target, "glm5-nextn-fixture");
  const testing::FixtureReference ref{SafetensorsFile::open(dir + "/reference.safetensors")};
  const std::vector<int32_t> prompt = ref.ids("prompt");
  const std::vector<float> hidden = ref.floats("hidden"), want_out = ref.floats("nextn_out");
  const std::vector<float> want_logits = ref.floats("nextn_logits");
  const std::vector<float> gap = ref.floats("nextn_logit_gap");
  const int64_t L = static_cast<int64_t>(prompt.size()), H = target->config().hidden_size;
  const int64_t V = target->config().vocab_size;
  ASSERT_EQ(static_cast<int64_t>(hidden.size()), L * H);
  ASSERT_GT(L, target->config().index_topk) << "the target's indexer must drop positions";

  // The target's final-normed hiddens (the drafter's input) are transformers'.
  EXPECT_LT(worst_relative(target_hidden(*target, prompt).data(), hidden, 0, hidden.size()), 1e-4);

  // The layer over the reference hiddens: row p from (prompt[p+1], hidden[p]) at position p.
  const auto provider = GlmMtpProvider::from_target(view);
  const GlmMtpBlock& block = provider->block();
  std::vector<float> emb(static_cast<size_t>((L - 1) * H));
  PositionCache cache(block.latent_width());
  target->embed(std::span<const int32_t>(prompt).subspan(1), emb.data());
  const std::vector<float> out = run(block, emb.data(), hidden.data(), L - 1, 0, cache);
  EXPECT_LT(worst_relative(out.data(), want_out, 0, want_out.size()), 1e-4);
  std::vector<float> logits(static_cast<size_t>((L - 1) * V));
  target->head(out.data(), L - 1, logits.data());
  int64_t tie_free = 0;
  for (int64_t p = 0; p + 1 < L; ++p) {
    const size_t at = static_cast<size_t>(p * V);
    EXPECT_LT(worst_relative(logits.data() + at, want_logits, at, static_cast<size_t>(V)), 1e-4)
        << "row " << p;
    if (gap[static_cast<size_t>(p)] < 1e-3f) continue;  // a near-tie may go either way
    ++tie_free;
    const auto top = [&](const float* l) { return std::max_element(l, l + V) - l; };
    EXPECT_EQ(top(logits.data() + at), top(want_logits.data() + at)) << "row " << p;
  }
  EXPECT_GT(tie_free, L / 2);

  // The drafter: a prompt of L-1 tokens builds rows 0..L-3; drafting after prompt[L-1] (pending)
  // computes row L-2 from (prompt[L-1], hidden[L-2]).
  std::unique_ptr<DraftRows> rows = provider->open_rows(view);
  rows->append(std::vector<CheckpointPtr>{nullptr});
  const RowPrefill pre{0, std::span<const int32_t>(prompt).first(static_cast<size_t>(L - 1)),
                       hidden.data(), 0};
  rows->prefill({&pre, 1});
  RowDraft d;
  d.pending = prompt.back();
  d.depth = 1;
  std::vector<DraftProposal> proposals;
  rows->draft({&d, 1}, &proposals);
  const auto& mtp = dynamic_cast<const MtpRows&>(*rows);
  const size_t last = static_cast<size_t>((L - 2) * V);
  EXPECT_LT(
      worst_relative(mtp.last_draft_logits(0, 0).data(), want_logits, last, static_cast<size_t>(V)),
      1e-4);
}

}  // namespace
}  // namespace tandem::spec
