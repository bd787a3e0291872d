// The random-weight Qwen MTP drafter (QwenMtpProvider::random) beside a random-weight target
// (Qwen35Model::random): the block has the shapes and scales the target's config implies, draws
// deterministically per seed, names its namespace after (shape, seed, tap), and speculative
// decoding with it stays lossless.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>

#include "tandem/core/error.h"
#include "tandem/engine/generator.h"
#include "tandem/engine/speculative.h"
#include "tandem/model/qwen3_5.h"
#include "tandem/model/qwen3_5_config.h"
#include "tandem/spec/qwen_mtp.h"

namespace tandem::spec {
namespace {

using json = nlohmann::json;

// A tiny Qwen3.5 shape (3 DeltaNet + 1 attention layer) with one MTP layer. A small vocabulary
// and an untied head (a tied random model only repeats its last token) let random drafts match
// the target's tokens now and then, so the lossless test also walks accepted windows.
json tiny_config(int64_t mtp_layers) {
  return json{{"model_type", "qwen3_5_text"},
              {"vocab_size", 24},
              {"hidden_size", 32},
              {"intermediate_size", 64},
              {"num_hidden_layers", 4},
              {"num_attention_heads", 2},
              {"num_key_value_heads", 1},
              {"head_dim", 16},
              {"layer_types",
               {"linear_attention", "linear_attention", "linear_attention", "full_attention"}},
              {"linear_num_key_heads", 2},
              {"linear_num_value_heads", 2},
              {"linear_key_head_dim", 8},
              {"linear_value_head_dim", 8},
              {"max_position_embeddings", 512},
              {"tie_word_embeddings", false},
              {"mtp_num_hidden_layers", mtp_layers}};
}

std::unique_ptr<Qwen35Model> tiny_model(int64_t mtp_layers = 1) {
  return Qwen35Model::random(parse_qwen35_config(tiny_config(mtp_layers).dump(), "tiny.json"), 7);
}

struct Tiny {
  std::unique_ptr<Qwen35Model> model;
  std::unique_ptr<TargetView> target;
};

Tiny& tiny() {
  static Tiny* t = [] {
    auto* x = new Tiny;
    x->model = tiny_model();
    x->target = std::make_unique<QwenTargetView>(*x->model, "tiny-random");
    return x;
  }();
  return *t;
}

const std::vector<std::vector<int32_t>> kPrompts = {
    {3, 9, 1, 17, 4, 4, 12},
    {20, 2, 7},
    {5, 11, 5, 11, 5, 11, 5, 11, 8, 1, 23},
};

// The target's final-normed hidden at every position of `tokens` (one fresh forward).
std::vector<float> target_hidden(std::span<const int32_t> tokens) {
  Qwen35State st(tiny().model->config());
  const RowInput row{st.open_row(), static_cast<int64_t>(tokens.size())};
  ForwardOutput out;
  tiny().model->forward(st, {tokens, {&row, 1}, false, true}, &out);
  return out.hidden;
}

std::unique_ptr<QwenMtpRows> prefilled_rows(const QwenMtpProvider& p) {
  std::unique_ptr<DraftRows> r = p.open_rows(*tiny().target);
  std::unique_ptr<QwenMtpRows> rows(dynamic_cast<QwenMtpRows*>(r.release()));
  EXPECT_NE(rows, nullptr);
  std::vector<CheckpointPtr> cold(kPrompts.size());
  rows->append(cold);
  std::vector<std::vector<float>> hidden;
  std::vector<RowPrefill> pre;
  for (const auto& prompt : kPrompts) hidden.push_back(target_hidden(prompt));
  for (size_t i = 0; i < kPrompts.size(); ++i)
    pre.push_back({static_cast<int>(i), kPrompts[i], hidden[i].data(), 0});
  rows->prefill(pre);
  return rows;
}

struct Drafted {
  std::vector<int32_t> tokens;  // every row's proposals, concatenated
  std::vector<float> logits;    // every row's and step's draft logits, concatenated
};

// One greedy drafting round of depth 4 on every prompt (pending = the prompt's first token).
Drafted draft_round(const QwenMtpProvider& p) {
  auto rows = prefilled_rows(p);
  std::vector<RowDraft> in(kPrompts.size());
  for (size_t i = 0; i < kPrompts.size(); ++i) {
    in[i].pending = kPrompts[i].front();
    in[i].depth = 4;
  }
  std::vector<DraftProposal> out;
  rows->draft(in, &out);
  Drafted d;
  for (size_t i = 0; i < kPrompts.size(); ++i) {
    EXPECT_EQ(out[i].tokens.size(), 4u);
    d.tokens.insert(d.tokens.end(), out[i].tokens.begin(), out[i].tokens.end());
    for (int j = 0; j < 4; ++j) {
      const std::span<const float> l = rows->last_draft_logits(static_cast<int>(i), j);
      for (float x : l) EXPECT_TRUE(std::isfinite(x));
      d.logits.insert(d.logits.end(), l.begin(), l.end());
    }
  }
  return d;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), sizeof(float) * a.size()) == 0;
}

TEST(RandomMtp, BlockHasTheTargetsShapeAndRandomScales) {
  const Qwen35Config& t = tiny().model->config();
  auto p = QwenMtpProvider::random(*tiny().target, 1);
  const QwenMtpConfig& c = p->config();
  EXPECT_EQ(c.hidden_size, t.hidden_size);
  EXPECT_EQ(c.vocab_size, t.vocab_size);
  EXPECT_EQ(c.intermediate_size, t.intermediate_size);
  EXPECT_EQ(c.num_attention_heads, t.num_attention_heads);
  EXPECT_EQ(c.num_key_value_heads, t.num_key_value_heads);
  EXPECT_EQ(c.head_dim, t.head_dim);
  EXPECT_EQ(c.rotary_dim, t.rotary_dim);
  EXPECT_TRUE(c.norms_zero_centred);
  EXPECT_EQ(c.quant_bits, 0);
  EXPECT_EQ(p->tap(), HiddenTap::FinalNormed);
  EXPECT_EQ(p->id(), "qwen-mtp");

  const QwenMtpWeights& w = p->block().weights();
  EXPECT_TRUE(w.placed);
  EXPECT_TRUE(w.store.names().empty());  // no files: the arena owns every tensor
  EXPECT_EQ(w.arena.bytes(), w.bytes());
  EXPECT_EQ(p->weights_bytes(), w.bytes());
  const int64_t H = c.hidden_size, I = c.intermediate_size, hd = c.head_dim;
  const int64_t nh = c.num_attention_heads, nkv = c.num_key_value_heads;
  struct Want {
    const char* name;
    const MtpLinear* l;
    int64_t out, in;
  };
  uint64_t bytes = 0;
  for (const Want& x :
       {Want{"fc", &w.fc, H, 2 * H}, Want{"q_proj", &w.q_proj, 2 * nh * hd, H},
        Want{"k_proj", &w.k_proj, nkv * hd, H}, Want{"v_proj", &w.v_proj, nkv * hd, H},
        Want{"o_proj", &w.o_proj, H, nh * hd}, Want{"gate_proj", &w.gate_proj, I, H},
        Want{"up_proj", &w.up_proj, I, H}, Want{"down_proj", &w.down_proj, H, I}}) {
    const ops::WeightRef& r = x.l->dense;
    ASSERT_FALSE(x.l->quant) << x.name;
    ASSERT_NE(r.data, nullptr) << x.name;
    EXPECT_EQ(r.dtype, DType::BF16) << x.name;
    EXPECT_EQ(r.rows, x.out) << x.name;
    EXPECT_EQ(r.cols, x.in) << x.name;
    bytes += static_cast<uint64_t>(r.rows * r.cols) * 2;
    // Uniform in ±1/sqrt(in) (bf16 rounding may step one ulp past the bound), not all zero.
    const float bound = 1.0f / std::sqrt(static_cast<float>(x.in)) * (1.0f + 1.0f / 128);
    const auto* v = static_cast<const uint16_t*>(r.data);
    double sum_abs = 0;
    for (int64_t i = 0; i < r.rows * r.cols; ++i) {
      const float f = bf16_to_f32(v[i]);
      ASSERT_LE(std::fabs(f), bound) << x.name << " element " << i;
      sum_abs += std::fabs(f);
    }
    // The mean |u| of uniform ±a is a/2.
    EXPECT_NEAR(sum_abs / static_cast<double>(r.rows * r.cols), 0.5 * bound, 0.1 * bound) << x.name;
  }
  struct Norm {
    const char* name;
    const ops::WeightRef* w;
    int64_t n;
  };
  for (const Norm& x : {Norm{"pre_fc_norm_embedding", &w.pre_fc_norm_embedding, H},
                        Norm{"pre_fc_norm_hidden", &w.pre_fc_norm_hidden, H},
                        Norm{"norm", &w.norm, H}, Norm{"input_layernorm", &w.input_layernorm, H},
                        Norm{"post_attention_layernorm", &w.post_attention_layernorm, H},
                        Norm{"q_norm", &w.q_norm, hd}, Norm{"k_norm", &w.k_norm, hd}}) {
    EXPECT_EQ(x.w->dtype, DType::F32) << x.name;
    EXPECT_EQ(x.w->rows * x.w->cols, x.n) << x.name;
    bytes += static_cast<uint64_t>(x.n) * 4;
    // Zero-centred RMSNorm weights: small offsets around 0 (scale = 1 + w).
    const auto* v = static_cast<const float*>(x.w->data);
    bool all_zero = true;
    for (int64_t i = 0; i < x.n; ++i) {
      EXPECT_LE(std::fabs(v[i]), 0.1f) << x.name << " element " << i;
      all_zero = all_zero && v[i] == 0.0f;
    }
    EXPECT_FALSE(all_zero) << x.name;
  }
  EXPECT_EQ(w.bytes(), bytes);
}

TEST(RandomMtp, DraftsAreDeterministicPerSeed) {
  auto a = QwenMtpProvider::random(*tiny().target, 1);
  auto b = QwenMtpProvider::random(*tiny().target, 1);
  auto c = QwenMtpProvider::random(*tiny().target, 2);
  const Drafted da = draft_round(*a), db = draft_round(*b), dc = draft_round(*c);
  EXPECT_EQ(da.tokens, db.tokens);
  EXPECT_TRUE(same_bits(da.logits, db.logits)) << "the same seed gave other draft logits";
  EXPECT_NE(da.tokens, dc.tokens) << "seeds 1 and 2 drafted the same tokens";
  EXPECT_FALSE(same_bits(da.logits, dc.logits));
  // A drafter that drafts one token over and over would make the comparisons above weak.
  std::vector<int32_t> distinct = da.tokens;
  std::sort(distinct.begin(), distinct.end());
  EXPECT_GT(std::unique(distinct.begin(), distinct.end()) - distinct.begin(), 2);
}

TEST(RandomMtp, NamespaceNamesShapeSeedAndTap) {
  auto a = QwenMtpProvider::random(*tiny().target, 1);
  auto b = QwenMtpProvider::random(*tiny().target, 1);
  auto c = QwenMtpProvider::random(*tiny().target, 2);
  auto pre = QwenMtpProvider::random(*tiny().target, 1, HiddenTap::PreNorm);
  const std::string& ns = a->checkpoint_namespace();
  EXPECT_EQ(ns.rfind(std::string(kQwenMtpSchema) + ":", 0), 0u) << ns;
  EXPECT_GT(ns.size(), std::string(kQwenMtpSchema).size() + 16);
  EXPECT_EQ(ns, b->checkpoint_namespace());
  EXPECT_NE(ns, c->checkpoint_namespace());
  EXPECT_NE(ns, pre->checkpoint_namespace());
  // Another shape, same seed.
  json other = tiny_config(1);
  other["intermediate_size"] = 96;
  auto wider = Qwen35Model::random(parse_qwen35_config(other.dump(), "wider.json"), 7);
  const QwenTargetView wider_target(*wider, "wider");
  EXPECT_NE(ns, QwenMtpProvider::random(wider_target, 1)->checkpoint_namespace());

  // The namespace guards checkpoints: a state restores into a drafter with the same weights and
  // is refused by one with other weights.
  auto rows = prefilled_rows(*a);
  const CheckpointPtr cp = rows->capture(0);
  EXPECT_EQ(cp->ns, ns);
  auto same = b->open_rows(*tiny().target);
  const CheckpointPtr one[] = {cp};
  EXPECT_NO_THROW(same->append(one));
  auto other_rows = c->open_rows(*tiny().target);
  try {
    other_rows->append(one);
    FAIL() << "a checkpoint of seed 1 restored into the drafter of seed 2";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("namespace"), std::string::npos) << e.what();
  }
}

TEST(RandomMtp, RefusesTargetsWithoutExactlyOneMtpLayer) {
  auto none = tiny_model(0);
  const QwenTargetView t0(*none, "no-mtp");
  try {
    QwenMtpProvider::random(t0, 1);
    FAIL() << "built an MTP layer for a config that declares none";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("declares no MTP layer (mtp_num_hidden_layers = 0)"),
              std::string::npos)
        << e.what();
  }
  auto two = tiny_model(2);
  const QwenTargetView t2(*two, "two-mtp");
  try {
    QwenMtpProvider::random(t2, 1);
    FAIL() << "built a drafter for two MTP layers";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("mtp_num_hidden_layers = 2 is not supported"),
              std::string::npos)
        << e.what();
  }
}

TEST(RandomMtp, SpeculativeDecodingWithARandomLayerIsLossless) {
  const Qwen35Model& model = *tiny().model;
  auto drafter = QwenMtpProvider::random(*tiny().target, 3);
  std::vector<GenerateRequest> reqs;
  for (size_t p = 0; p < kPrompts.size(); ++p)
    for (float temperature : {0.0f, 1.0f}) {
      GenerateRequest r;
      r.prompt = kPrompts[p];
      r.sampling.temperature = temperature;
      r.sampling.seed = 11 + p;
      r.max_tokens = 20 + 3 * static_cast<int64_t>(p);
      r.ignore_eos = true;
      reqs.push_back(r);
    }
  std::vector<std::vector<int32_t>> want;
  Generator plain(model);
  for (const auto& r : reqs) want.push_back(plain.run({r}).at(0).tokens);
  int64_t accepted = 0, rejected = 0;
  for (int depth : {1, 2, 3}) {
    SpeculativeGenerator gen(model, drafter.get(), "tiny-random", {depth, VerifyMode::Match});
    for (size_t i = 0; i < reqs.size(); ++i)
      EXPECT_EQ(gen.run({reqs[i]}).at(0).tokens, want[i]) << "depth " << depth << " request " << i;
    std::vector<SpecStats> st;
    const auto got = gen.run(reqs, {}, nullptr, &st);
    for (size_t i = 0; i < reqs.size(); ++i) {
      EXPECT_EQ(got[i].tokens, want[i]) << "depth " << depth << " batched request " << i;
      accepted += st[i].accepted;
      rejected += st[i].drafted - st[i].accepted;
    }
  }
  // Both outcomes happened, so the test walked accepted windows and rollbacks.
  EXPECT_GT(accepted, 0);
  EXPECT_GT(rejected, 0);
}

}  // namespace
}  // namespace tandem::spec
