// GLM-5 (glm_moe_dsa) foundations: the config as transformers' GlmMoeDsaConfig reads it, with
// named errors, and the noaux_tc router (ops::route_noaux_tc) against hand-worked cases and a
// repeated-argmax reference.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "moe_reference.h"
#include "tandem/backend/ops.h"
#include "tandem/core/dtype.h"
#include "tandem/core/error.h"
#include "tandem/model/glm5_config.h"

namespace tandem {
namespace {

// The published GLM-5 shape's config.json fields (as zai-org writes them, DeepSeek style).
const char* kGlm5 = R"({
  "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
  "vocab_size": 154880, "hidden_size": 6144, "intermediate_size": 12288,
  "moe_intermediate_size": 2048, "num_hidden_layers": 78, "num_attention_heads": 64,
  "num_key_value_heads": 64, "q_lora_rank": 2048, "kv_lora_rank": 512, "qk_nope_head_dim": 192,
  "qk_rope_head_dim": 64, "v_head_dim": 256, "n_routed_experts": 256, "num_experts_per_tok": 8,
  "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5,
  "norm_topk_prob": true, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
  "first_k_dense_replace": 3, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32,
  "rms_norm_eps": 1e-05, "rope_theta": 1000000, "rope_interleave": true,
  "max_position_embeddings": 202752, "num_nextn_predict_layers": 1, "eos_token_id": [154820, 154827],
  "tie_word_embeddings": false,
  "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                          "weight_block_size": [128, 128]}
})";

std::string with(std::string text, const std::string& from, const std::string& to) {
  const size_t at = text.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  if (at != std::string::npos) text.replace(at, from.size(), to);
  return text;
}

void expect_error(const std::string& text, const std::string& words) {
  try {
    parse_glm5_config(text, "glm/config.json");
    ADD_FAILURE() << "accepted; expected an error mentioning: " << words;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("glm/config.json"), std::string::npos) << e.what();
  }
}

TEST(Glm5Config, ThePublishedShapeParses) {
  const Glm5Config c = parse_glm5_config(kGlm5, "glm/config.json");
  EXPECT_EQ(c.hidden_size, 6144);
  EXPECT_EQ(c.q_lora_rank, 2048);
  EXPECT_EQ(c.kv_lora_rank, 512);
  EXPECT_EQ(c.qk_head_dim(), 256);
  EXPECT_EQ(c.n_routed_experts, 256);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 2.5);
  ASSERT_EQ(c.sparse_layers.size(), 78u);
  EXPECT_FALSE(c.sparse_layers[2]);
  EXPECT_TRUE(c.sparse_layers[3]);
  EXPECT_EQ(c.index_topk, 2048);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e6);
  EXPECT_EQ(c.num_nextn_predict_layers, 1);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{154820, 154827}));
  EXPECT_TRUE(c.fp8());
  EXPECT_EQ(c.fp8_block_rows, 128);
  EXPECT_EQ(c.fp8_block_cols, 128);
  // transformers' own spelling of the dense/sparse pattern, and an unquantized release.
  std::string small = with(kGlm5, R"("num_hidden_layers": 78)", R"("num_hidden_layers": 3)");
  small = with(small, R"("first_k_dense_replace": 3)",
               R"("mlp_layer_types": ["dense", "sparse", "sparse"])");
  const Glm5Config s = parse_glm5_config(small, "small");
  EXPECT_EQ(s.sparse_layers, (std::vector<bool>{false, true, true}));
  const std::string plain =
      with(kGlm5, R"("quantization_config": {)", R"("no_quantization_config": {)");
  EXPECT_FALSE(parse_glm5_config(plain, "plain").fp8());
}

TEST(Glm5Config, BadFieldsAreNamed) {
  expect_error(with(kGlm5, R"("model_type": "glm_moe_dsa")", R"("model_type": "glm4_moe")"),
               "unsupported model_type 'glm4_moe'");
  expect_error(with(kGlm5, R"("kv_lora_rank": 512, )", ""), "kv_lora_rank");
  expect_error(with(kGlm5, R"("n_group": 1)", R"("n_group": 3)"), "n_group");
  expect_error(with(kGlm5, R"("topk_group": 1)", R"("topk_group": 2)"), "topk_group");
  expect_error(with(kGlm5, R"("num_experts_per_tok": 8)", R"("num_experts_per_tok": 300)"),
               "num_experts_per_tok");
  expect_error(with(kGlm5, R"("topk_method": "noaux_tc")", R"("topk_method": "greedy")"),
               "topk_method");
  expect_error(with(kGlm5, R"("scoring_func": "sigmoid")", R"("scoring_func": "softmax")"),
               "scoring_func");
  expect_error(with(kGlm5, R"("first_k_dense_replace": 3)", R"("first_k_dense_replace": 79)"),
               "first_k_dense_replace");
  expect_error(with(kGlm5, R"("first_k_dense_replace": 3)", R"("mlp_layer_types": ["dense"])"),
               "mlp_layer_types");
  expect_error(with(kGlm5, R"("quant_method": "fp8")", R"("quant_method": "awq")"),
               "quantization_config.quant_method");
  expect_error(with(kGlm5, R"("weight_block_size": [128, 128])", R"("weight_block_size": [128])"),
               "quantization_config.weight_block_size");
  expect_error(with(kGlm5, R"("qk_rope_head_dim": 64)", R"("qk_rope_head_dim": 63)"),
               "qk_rope_head_dim");
  expect_error(with(kGlm5, R"("first_k_dense_replace": 3)",
                    R"("first_k_dense_replace": 3, "indexer_types": ["full", "sparse"])"),
               "indexer_types");
  expect_error(with(kGlm5, R"("q_lora_rank": 2048)", R"("q_lora_rank": null)"), "q_lora_rank");
  expect_error("[1, 2]", "JSON object");
}

// Which layers reuse the previous layer's DSA choice: indexer_types, else index_topk_pattern,
// else every layer past index_skip_topk_offset whose distance is not a multiple of
// index_topk_freq; layer 0 always runs its own indexer.
TEST(Glm5Config, SharedIndexLayersFollowTransformersRules) {
  auto shared = [](const std::string& extra) {
    std::string text = with(kGlm5, R"("num_hidden_layers": 78)", R"("num_hidden_layers": 6)");
    text = with(text, R"("first_k_dense_replace": 3)", R"("first_k_dense_replace": 3)" + extra);
    const std::vector<bool> s = parse_glm5_config(text, "glm/config.json").shared_index_layers;
    std::string out;
    for (bool b : s) out += b ? 'S' : 'F';
    return out;
  };
  EXPECT_EQ(shared(""), "FFFFFF");
  EXPECT_EQ(shared(R"(, "indexer_types": ["shared", "full", "shared", "shared", "full", "full"])"),
            "FFSSFF");
  EXPECT_EQ(shared(R"(, "index_topk_pattern": "FSSFSS")"), "FSSFSS");
  EXPECT_EQ(shared(R"(, "index_topk_freq": 2)"), "FFSFSF");
  EXPECT_EQ(shared(R"(, "index_topk_freq": 3, "index_skip_topk_offset": 1)"), "FSSFSS");
}

// A reference written another way: sigmoid scores, group worths from the best and second-best
// member found by scans, groups and then experts taken by repeated argmax (the first maximum
// wins, i.e. the lower index), masked choices set to -inf.
void reference(const std::vector<float>& logits, const std::vector<float>& bias, int64_t k,
               int64_t n_group, int64_t topk_group, bool renormalise, float scale,
               std::vector<int32_t>* ids, std::vector<float>* weights) {
  const auto E = static_cast<int64_t>(logits.size());
  const int64_t per = E / n_group;
  std::vector<float> score(logits.size()), choice(logits.size());
  for (size_t e = 0; e < logits.size(); ++e) {
    score[e] = 1.0f / (1.0f + std::exp(-logits[e]));
    choice[e] = score[e] + bias[e];
  }
  auto argmax = [](const std::vector<float>& v, const std::vector<bool>& taken) {
    int64_t best = -1;
    for (size_t i = 0; i < v.size(); ++i)
      if (!taken[i] && (best < 0 || v[i] > v[static_cast<size_t>(best)]))
        best = static_cast<int64_t>(i);
    return best;
  };
  if (n_group > 1) {
    std::vector<float> worth;
    for (int64_t g = 0; g < n_group; ++g) {
      std::vector<float> m(choice.begin() + g * per, choice.begin() + (g + 1) * per);
      std::vector<bool> taken(m.size(), false);
      const int64_t a = argmax(m, taken);
      taken[static_cast<size_t>(a)] = true;
      const int64_t b = argmax(m, taken);
      worth.push_back(m[static_cast<size_t>(a)] + m[static_cast<size_t>(b)]);
    }
    std::vector<bool> taken(worth.size(), false);
    for (int64_t j = 0; j < topk_group; ++j)
      taken[static_cast<size_t>(argmax(worth, taken))] = true;
    for (int64_t e = 0; e < E; ++e)
      if (!taken[static_cast<size_t>(e / per)]) choice[static_cast<size_t>(e)] = -INFINITY;
  }
  std::vector<bool> taken(choice.size(), false);
  ids->clear();
  weights->clear();
  float sum = 0.0f;
  for (int64_t j = 0; j < k; ++j) {
    const int64_t e = argmax(choice, taken);
    taken[static_cast<size_t>(e)] = true;
    ids->push_back(static_cast<int32_t>(e));
    sum += score[static_cast<size_t>(e)];
  }
  for (const int32_t e : *ids) {
    const float w = score[static_cast<size_t>(e)];
    weights->push_back((renormalise ? w / (sum + 1e-20f) : w) * scale);
  }
}

struct Routed {
  std::vector<int32_t> ids;
  std::vector<float> weights;
};
Routed route(const std::vector<float>& logits, const std::vector<float>& bias, int64_t k,
             int64_t n_group, int64_t topk_group, bool renormalise, float scale) {
  Routed r{std::vector<int32_t>(static_cast<size_t>(k)),
           std::vector<float>(static_cast<size_t>(k))};
  ops::route_noaux_tc(logits.data(), bias.data(), static_cast<int64_t>(logits.size()), k, n_group,
                      topk_group, renormalise, scale, r.ids.data(), r.weights.data());
  return r;
}

// Worked by hand: 8 experts in 4 groups of 2, keep 2 groups, 2 experts. The bias moves the choice
// (expert 1's raw score is the highest, but its group loses), weights stay the unbiased scores.
TEST(NoauxTcRouting, GroupsThenExpertsByBiasedScoreWeightedByRawScore) {
  const std::vector<float> logits = {0.0f, 3.0f, -1.0f, -1.0f, 1.0f, 1.0f, 0.5f, 0.5f};
  const std::vector<float> bias = {-2.0f, -2.0f, 0.0f, 0.0f, 0.0f, 0.1f, 0.0f, 0.0f};
  // choices: group 0: 0.5-2, 0.953-2 -> worth -2.547; group 1: 0.269, 0.269 -> 0.538;
  // group 2: 0.731, 0.831 -> 1.562; group 3: 0.622, 0.622 -> 1.245. Kept: groups 2 and 3.
  const Routed r = route(logits, bias, 2, 4, 2, true, 2.5f);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{5, 4}));
  const float s = 1.0f / (1.0f + std::exp(-1.0f));
  EXPECT_FLOAT_EQ(r.weights[0], s / (2 * s + 1e-20f) * 2.5f);
  EXPECT_FLOAT_EQ(r.weights[1], s / (2 * s + 1e-20f) * 2.5f);
  // Without renormalisation the weights are the scores themselves (times the scale).
  const Routed raw = route(logits, bias, 2, 4, 2, false, 1.0f);
  EXPECT_FLOAT_EQ(raw.weights[0], s);
}

// Experts of dropped groups are out even when every kept expert's biased score is negative
// (transformers' masked_fill with -inf; its earlier DeepSeek-V3 code filled 0, which let them in).
TEST(NoauxTcRouting, DroppedGroupsAreNeverChosen) {
  const std::vector<float> logits = {0.0f, 0.0f, 2.0f, 2.0f};
  const std::vector<float> bias = {-5.0f, -5.0f, -1.5f, -1.5f};
  // groups: {0,1} worth 2·(0.5-5) = -9; {2,3} worth 2·(0.881-1.5) = -1.24 -> kept.
  const Routed r = route(logits, bias, 2, 2, 1, true, 1.0f);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{2, 3}));
}

// Equal choices and equal group worths go to the lower index.
TEST(NoauxTcRouting, TiesGoToTheLowerIndex) {
  const std::vector<float> logits(8, 0.25f), bias(8, 0.0f);
  EXPECT_EQ(route(logits, bias, 3, 4, 2, true, 1.0f).ids, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(route(logits, bias, 3, 1, 1, true, 1.0f).ids, (std::vector<int32_t>{0, 1, 2}));
}

TEST(NoauxTcRouting, MatchesTheReferenceOnRandomTokens) {
  std::mt19937 rng(17);
  std::normal_distribution<float> d(0.0f, 1.5f);
  struct Shape {
    int64_t E, k, n_group, topk_group;
  };
  for (const Shape& sh :
       {Shape{16, 4, 4, 2}, Shape{32, 8, 8, 4}, Shape{64, 6, 1, 1}, Shape{12, 3, 3, 1}}) {
    for (int t = 0; t < 200; ++t) {
      std::vector<float> logits, bias;
      for (int64_t e = 0; e < sh.E; ++e) {
        logits.push_back(d(rng));
        bias.push_back(0.3f * d(rng));
      }
      const bool renorm = t % 2 == 0;
      std::vector<int32_t> ids;
      std::vector<float> weights;
      reference(logits, bias, sh.k, sh.n_group, sh.topk_group, renorm, 2.5f, &ids, &weights);
      const Routed r = route(logits, bias, sh.k, sh.n_group, sh.topk_group, renorm, 2.5f);
      ASSERT_EQ(r.ids, ids) << "E " << sh.E << " token " << t;
      for (size_t j = 0; j < ids.size(); ++j) EXPECT_FLOAT_EQ(r.weights[j], weights[j]);
    }
  }
}

TEST(NoauxTcRouting, BadShapesAreRefused) {
  const std::vector<float> v(8, 0.0f);
  int32_t ids[8];
  float w[8];
  EXPECT_THROW(ops::route_noaux_tc(v.data(), v.data(), 8, 2, 3, 1, true, 1.0f, ids, w), Error);
  EXPECT_THROW(ops::route_noaux_tc(v.data(), v.data(), 8, 2, 4, 5, true, 1.0f, ids, w), Error);
  EXPECT_THROW(ops::route_noaux_tc(v.data(), v.data(), 8, 5, 4, 2, true, 1.0f, ids, w), Error);
  EXPECT_THROW(ops::route_noaux_tc(v.data(), v.data(), 8, 2, 8, 2, true, 1.0f, ids, w), Error);
}

// A GLM-5 mixture (noaux_tc routing with groups and a routed scale, a shared expert added
// without a gate) through ops::moe_mlp_add against a plain double-precision reference built on
// route_noaux_tc; each token's row is bitwise the same alone.
TEST(Glm5Mixture, NoauxTcRoutingAndAnUngatedSharedExpert) {
  const int64_t T = 6, H = 16, E = 8, K = 3, I = 8, Is = 12, G = 4, TG = 2;
  const float scale = 2.5f;
  std::mt19937 rng(9);
  auto values = [&](int64_t n) { return test::normal_values(n, rng); };
  const auto& ref = test::f32_ref;
  const auto router = values(E * H), bias = values(E), sgp = values(Is * H), sup = values(Is * H),
             sdn = values(H * Is);
  std::vector<std::vector<float>> gate, up, down;
  for (int64_t e = 0; e < E; ++e) {
    gate.push_back(values(I * H));
    up.push_back(values(I * H));
    down.push_back(values(H * I));
  }
  ops::MoeWeights w;
  w.router = ref(router, E, H);
  w.top_k = K;
  w.routing = ops::MoeRouting::NoauxTc;
  w.score_bias = ref(bias, 1, E);
  w.n_group = G;
  w.topk_group = TG;
  w.routed_scale = scale;
  for (int64_t e = 0; e < E; ++e) {
    w.gate.push_back(ref(gate[static_cast<size_t>(e)], I, H));
    w.up.push_back(ref(up[static_cast<size_t>(e)], I, H));
    w.down.push_back(ref(down[static_cast<size_t>(e)], H, I));
  }
  w.shared_gate_proj = ref(sgp, Is, H);
  w.shared_up_proj = ref(sup, Is, H);
  w.shared_down_proj = ref(sdn, H, Is);
  const auto x = values(T * H);
  std::vector<float> y = values(T * H);
  const std::vector<float> residual = y;
  std::vector<int32_t> ids;
  ops::moe_mlp_add(x.data(), T, w, y.data(), &ids);
  using test::dot;
  auto mlp = [&](const float* xt, const std::vector<float>& g, const std::vector<float>& u,
                 const std::vector<float>& d,
                 int64_t inner) { return test::swiglu_mlp(xt, g, u, d, H, inner); };
  for (int64_t t = 0; t < T; ++t) {
    const float* xt = x.data() + t * H;
    std::vector<float> logits(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e)
      logits[static_cast<size_t>(e)] = static_cast<float>(dot(xt, router.data() + e * H, H));
    int32_t want_ids[K];
    float want_w[K];
    ops::route_noaux_tc(logits.data(), bias.data(), E, K, G, TG, true, scale, want_ids, want_w);
    std::vector<double> want(static_cast<size_t>(H), 0.0);
    for (int64_t j = 0; j < K; ++j) {
      EXPECT_EQ(ids[static_cast<size_t>(t * K + j)], want_ids[j]) << "token " << t;
      const auto e = static_cast<size_t>(want_ids[j]);
      const auto part = mlp(xt, gate[e], up[e], down[e], I);
      for (int64_t i = 0; i < H; ++i)
        want[static_cast<size_t>(i)] += want_w[j] * part[static_cast<size_t>(i)];
    }
    const auto shared = mlp(xt, sgp, sup, sdn, Is);
    for (int64_t i = 0; i < H; ++i)
      EXPECT_NEAR(y[static_cast<size_t>(t * H + i)],
                  residual[static_cast<size_t>(t * H + i)] + want[static_cast<size_t>(i)] +
                      shared[static_cast<size_t>(i)],
                  1e-4)
          << "token " << t << " dim " << i;
    std::vector<float> alone(residual.begin() + t * H, residual.begin() + (t + 1) * H);
    ops::moe_mlp_add(xt, 1, w, alone.data());
    EXPECT_EQ(0, std::memcmp(alone.data(), y.data() + t * H, sizeof(float) * H)) << "token " << t;
  }
  // A correction bias of the wrong size is named.
  ops::MoeWeights bad = w;
  bad.score_bias = ref(bias, 1, E - 1);
  EXPECT_THROW(ops::moe_mlp_add(x.data(), T, bad, y.data()), Error);
}

// The DSA indexer's choice against a double-precision full sort (each head's score through a ReLU
// before the head weights, as transformers computes it): every position up to the
// query's own when there are at most topk of them (dense), else the topk best-scored ones
// (compared where the topk-th and the next score are apart); padding -1; a query's choice the
// same alone and among others.
TEST(DsaSelect, ChoosesTheBestEarlierPositionsOrAllOfThem) {
  const int64_t heads = 3, D = 16, ctx = 40, topk = 8;
  std::mt19937 rng(21);
  const auto keys = test::normal_values(ctx * D, rng);
  std::vector<int64_t> pos;
  for (int64_t p = 0; p < ctx; p += 3) pos.push_back(p);
  const auto n = static_cast<int64_t>(pos.size());
  const auto q = test::normal_values(n * heads * D, rng), w = test::normal_values(n * heads, rng);
  std::vector<int32_t> out(static_cast<size_t>(n * topk));
  ops::dsa_select(q.data(), w.data(), n, heads, D, keys.data(), ctx, pos.data(), topk, out.data());
  int64_t compared = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t len = pos[static_cast<size_t>(i)] + 1;
    std::vector<std::pair<double, int32_t>> scored;
    for (int64_t p = 0; p < len; ++p) {
      double s = 0;
      for (int64_t h = 0; h < heads; ++h)
        s += w[static_cast<size_t>(i * heads + h)] *
             std::max(0.0, test::dot(q.data() + (i * heads + h) * D, keys.data() + p * D, D) /
                               std::sqrt(D));
      scored.push_back({-s, static_cast<int32_t>(p)});
    }
    std::sort(scored.begin(), scored.end());
    const int32_t* got = out.data() + i * topk;
    if (len <= topk) {  // dense: all earlier positions, then padding
      std::vector<int32_t> all(got, got + len);
      std::sort(all.begin(), all.end());
      for (int64_t p = 0; p < len; ++p) EXPECT_EQ(all[static_cast<size_t>(p)], p) << "query " << i;
      for (int64_t j = len; j < topk; ++j) EXPECT_EQ(got[j], -1);
      continue;
    }
    if (scored[static_cast<size_t>(topk - 1)].first - scored[static_cast<size_t>(topk)].first >
        -1e-4)
      continue;  // a near-tie at the boundary may go either way in fp32
    for (int64_t j = 0; j < topk; ++j)
      EXPECT_EQ(got[j], scored[static_cast<size_t>(j)].second) << "query " << i << " rank " << j;
    ++compared;
  }
  EXPECT_GT(compared, 3);
  // The last query alone gives the same choice.
  std::vector<int32_t> alone(static_cast<size_t>(topk));
  const int64_t last = n - 1;
  ops::dsa_select(q.data() + last * heads * D, w.data() + last * heads, 1, heads, D, keys.data(),
                  ctx, pos.data() + last, topk, alone.data());
  EXPECT_TRUE(std::equal(alone.begin(), alone.end(), out.begin() + last * topk));
  // Equal scores go to the lower position; a query past the keys is refused.
  const std::vector<float> same_keys(static_cast<size_t>(ctx * D), 1.0f);
  std::vector<int32_t> ties(static_cast<size_t>(topk));
  const int64_t at = 20;
  ops::dsa_select(q.data(), w.data(), 1, heads, D, same_keys.data(), ctx, &at, topk, ties.data());
  for (int64_t j = 0; j < topk; ++j) EXPECT_EQ(ties[static_cast<size_t>(j)], j);
  const int64_t beyond = ctx;
  EXPECT_THROW(ops::dsa_select(q.data(), w.data(), 1, heads, D, keys.data(), ctx, &beyond, topk,
                               ties.data()),
               Error);
}

// MLA over a latent cache: the decode (absorbed) and prefill (expanded) forms both match a
// double-precision attention over explicitly formed keys and values, with every earlier position
// and with a DSA selection; bf16 kv_b gives what its fp32 widening gives.
TEST(MlaAttention, AbsorbedAndExpandedFormsMatchTheAttention) {
  const int64_t H = 3, dn = 8, dr = 4, dv = 6, R = 12, ctx = 20, n = 4, topk = 5;
  const float scale = 1.0f / std::sqrt(static_cast<float>(dn + dr));
  std::mt19937 rng(31);
  const auto q_nope = test::normal_values(n * H * dn, rng),
             q_pe = test::normal_values(n * H * dr, rng);
  const auto latent = test::normal_values(ctx * (R + dr), rng);
  const auto kv_b = test::normal_values(H * (dn + dv) * R, rng);
  const ops::WeightRef w = test::f32_ref(kv_b, H * (dn + dv), R);
  const std::vector<int64_t> pos = {3, 9, 15, 19};
  std::vector<int32_t> allowed(static_cast<size_t>(n * topk), -1);
  for (int64_t i = 0; i < n; ++i)  // every other earlier position, at most topk, unsorted
    for (int64_t j = 0, p = pos[static_cast<size_t>(i)]; j < topk && p >= 0; ++j, p -= 2)
      allowed[static_cast<size_t>(i * topk + j)] = static_cast<int32_t>(p);
  auto reference = [&](const int32_t* sel) {
    std::vector<double> out(static_cast<size_t>(n * H * dv), 0.0);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = 0; h < H; ++h) {
        std::vector<int64_t> cols;
        for (int64_t p = 0; p <= pos[static_cast<size_t>(i)]; ++p) {
          bool ok = sel == nullptr;
          for (int64_t j = 0; sel && j < topk; ++j) ok = ok || sel[i * topk + j] == p;
          if (ok) cols.push_back(p);
        }
        std::vector<double> score;
        double mx = -1e300;
        for (const int64_t p : cols) {
          const float* lat = latent.data() + p * (R + dr);
          double s = 0;
          for (int64_t d = 0; d < dn; ++d)
            s += q_nope[static_cast<size_t>((i * H + h) * dn + d)] *
                 test::dot(kv_b.data() + (h * (dn + dv) + d) * R, lat, R);
          s += test::dot(q_pe.data() + (i * H + h) * dr, lat + R, dr);
          score.push_back(s * scale);
          mx = std::max(mx, score.back());
        }
        double sum = 0;
        for (double& s : score) sum += (s = std::exp(s - mx));
        for (size_t j = 0; j < cols.size(); ++j) {
          const float* lat = latent.data() + cols[j] * (R + dr);
          for (int64_t d = 0; d < dv; ++d)
            out[static_cast<size_t>((i * H + h) * dv + d)] +=
                score[j] / sum * test::dot(kv_b.data() + (h * (dn + dv) + dn + d) * R, lat, R);
        }
      }
    return out;
  };
  const int32_t* const selections[] = {nullptr, allowed.data()};
  for (const int32_t* sel : selections) {
    const auto want = reference(sel);
    for (const bool absorbed : {true, false}) {
      std::vector<float> got(want.size());
      ops::mla_attention(q_nope.data(), q_pe.data(), n, H, dn, dr, dv, latent.data(), ctx, R, w,
                         pos.data(), sel, topk, scale, absorbed, got.data());
      for (size_t k = 0; k < want.size(); ++k)
        EXPECT_NEAR(got[k], want[k], 1e-4)
            << (absorbed ? "absorbed" : "expanded") << " " << k << (sel ? " with a selection" : "");
    }
  }
  // A bf16 kv_b computes with its widened values.
  std::vector<uint16_t> bits;
  std::vector<float> widened;
  for (const float v : kv_b) {
    bits.push_back(f32_to_bf16(v));
    widened.push_back(bf16_to_f32(bits.back()));
  }
  std::vector<float> a(static_cast<size_t>(n * H * dv)), b(a.size());
  ops::mla_attention(q_nope.data(), q_pe.data(), n, H, dn, dr, dv, latent.data(), ctx, R,
                     ops::WeightRef{DType::BF16, bits.data(), H * (dn + dv), R, {}}, pos.data(),
                     nullptr, topk, scale, true, a.data());
  ops::mla_attention(q_nope.data(), q_pe.data(), n, H, dn, dr, dv, latent.data(), ctx, R,
                     test::f32_ref(widened, H * (dn + dv), R), pos.data(), nullptr, topk, scale,
                     true, b.data());
  EXPECT_EQ(a, b);
  // A kv_b of another shape is named.
  EXPECT_THROW(ops::mla_attention(q_nope.data(), q_pe.data(), n, H, dn, dr, dv, latent.data(), ctx,
                                  R, test::f32_ref(kv_b, H * (dn + dv), R - 1), pos.data(), nullptr,
                                  topk, scale, true, a.data()),
               Error);
}

}  // namespace
}  // namespace tandem
