// Qwen3.5-MoE (qwen3_5_moe) on the CPU: config parsing, routing as transformers computes it,
// both published expert layouts, the mixture against a plain reference, batch invariance, and
// lossless speculation, on random-weight checkpoints written in the published layout.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>

#include "fixture_reference.h"
#include "moe_reference.h"
#include "recording_sink.h"
#include "tandem/backend/cpu/cpu_ops.h"
#include "tandem/backend/weight_arena.h"
#include "tandem/core/error.h"
#include "tandem/engine/batch_engine.h"
#include "tandem/engine/generator.h"
#include "tandem/engine/speculative.h"
#include "tandem/io/safetensors.h"
#include "tandem/model/moe_weights.h"
#include "tandem/model/qwen3_5.h"
#include "tandem/model/qwen3_5_random.h"
#include "tandem/spec/ngram.h"
#include "tandem/spec/qwen_mtp.h"
#include "tandem/spec/qwen_mtp_weights.h"
#include "test_util.h"

namespace tandem {
namespace {

using tandem::testing::ScratchDir;
using tandem::testing::write_text;

const char* kConfig = R"({
  "model_type": "qwen3_5_moe",
  "tie_word_embeddings": false,
  "text_config": {
    "model_type": "qwen3_5_moe_text", "vocab_size": 97, "hidden_size": 48,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
    "linear_value_head_dim": 12, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6,
    "num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 24,
    "shared_expert_intermediate_size": 40,
    "hidden_act": "silu", "max_position_embeddings": 4096, "eos_token_id": 1,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                        "partial_rotary_factor": 0.5}
  }
})";

// The same checkpoint with one tensor per expert projection: slices of the fused tensors, so
// both layouts hold the very same values.
void write_per_expert_copy(const std::string& src_dir, const std::string& dst_dir,
                           const Qwen35Config& c) {
  const auto f = SafetensorsFile::open(src_dir + "/model.safetensors");
  std::vector<TensorToWrite> out;
  const int64_t E = c.num_experts, I = c.moe_intermediate_size, H = c.hidden_size;
  for (const TensorView& t : f->tensors()) {
    const auto* bytes = static_cast<const std::byte*>(t.data);
    const size_t es = dtype_size(t.dtype);
    const std::string suffix_gu = "mlp.experts.gate_up_proj", suffix_d = "mlp.experts.down_proj";
    auto ends = [&](const std::string& s) {
      return t.name.size() >= s.size() &&
             t.name.compare(t.name.size() - s.size(), s.size(), s) == 0;
    };
    if (ends(suffix_gu)) {
      const std::string base = t.name.substr(0, t.name.size() - std::string("gate_up_proj").size());
      for (int64_t e = 0; e < E; ++e) {
        const size_t at = static_cast<size_t>(e * 2 * I * H) * es,
                     n = static_cast<size_t>(I * H) * es;
        out.push_back(
            {base + std::to_string(e) + ".gate_proj.weight", t.dtype, {I, H}, {bytes + at, n}});
        out.push_back(
            {base + std::to_string(e) + ".up_proj.weight", t.dtype, {I, H}, {bytes + at + n, n}});
      }
    } else if (ends(suffix_d)) {
      const std::string base = t.name.substr(0, t.name.size() - std::string("down_proj").size());
      for (int64_t e = 0; e < E; ++e) {
        const size_t n = static_cast<size_t>(H * I) * es;
        out.push_back({base + std::to_string(e) + ".down_proj.weight",
                       t.dtype,
                       {H, I},
                       {bytes + static_cast<size_t>(e) * n, n}});
      }
    } else {
      out.push_back({t.name, t.dtype, t.shape, {bytes, t.nbytes}});
    }
  }
  std::filesystem::create_directories(dst_dir);
  std::filesystem::copy_file(src_dir + "/config.json", dst_dir + "/config.json");
  write_safetensors(dst_dir + "/model.safetensors", out, {{"format", "pt"}});
}

class MoeModel : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new ScratchDir("qwen35-moe");
    write_text(dir_->file("source_config.json"), kConfig);
    write_random_qwen35(dir_->file("source_config.json"), dir_->file("fused"), DType::BF16, 11);
    model_ = Qwen35Model::load(dir_->file("fused")).release();
  }
  static void TearDownTestSuite() {
    delete model_;
    delete dir_;
  }
  static ScratchDir* dir_;
  static Qwen35Model* model_;
};
ScratchDir* MoeModel::dir_ = nullptr;
Qwen35Model* MoeModel::model_ = nullptr;

std::vector<int32_t> sequence(int n, int seed) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) v[static_cast<size_t>(i)] = (seed * 31 + i * 17) % 97;
  return v;
}

std::vector<float> prefill_logits(const Qwen35Model& m, const std::vector<int32_t>& ids) {
  Qwen35State st(m.config());
  const RowInput row{st.open_row(), static_cast<int64_t>(ids.size())};
  ForwardOutput out;
  m.forward(st, {ids, {&row, 1}, true, false}, &out);
  return out.logits;
}

TEST(MoeConfig, NestedAndFlatFormsParseAndBadFieldsAreNamed) {
  const Qwen35Config c = parse_qwen35_config(kConfig, "cfg");
  EXPECT_TRUE(c.moe());
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_EQ(c.num_experts_per_tok, 3);
  EXPECT_EQ(c.moe_intermediate_size, 24);
  EXPECT_EQ(c.shared_expert_intermediate_size, 40);
  EXPECT_EQ(c.weight_prefix(), "model.language_model.");
  const Qwen35Config flat = parse_qwen35_config(
      R"({"model_type": "qwen3_5_moe_text", "vocab_size": 16, "hidden_size": 8,
          "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
          "head_dim": 8, "layer_types": ["full_attention"], "max_position_embeddings": 64,
          "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
          "shared_expert_intermediate_size": 8, "norm_topk_prob": false})",
      "flat");
  EXPECT_EQ(flat.weight_prefix(), "model.");
  auto error_of = [](const std::string& from, const std::string& to) {
    std::string text = kConfig;
    const size_t at = text.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    text.replace(at, from.size(), to);
    try {
      parse_qwen35_config(text, "cfg");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error_of("\"num_experts_per_tok\": 3", "\"num_experts_per_tok\": 9")
                .find("num_experts_per_tok: 9 exceeds num_experts (8)"),
            std::string::npos);
  EXPECT_NE(error_of("\"num_experts\": 8,", "").find("num_experts"), std::string::npos);
  EXPECT_NE(error_of("\"moe_intermediate_size\": 24,", "").find("moe_intermediate_size"),
            std::string::npos);
  EXPECT_NE(error_of("\"eos_token_id\": 1", "\"eos_token_id\": 1, \"mlp_only_layers\": [0]")
                .find("mlp_only_layers"),
            std::string::npos);
  EXPECT_NE(error_of("\"model_type\": \"qwen3_5_moe_text\"", "\"model_type\": \"qwen3_5_text\"")
                .find("expected qwen3_5_moe_text"),
            std::string::npos);
}

// transformers: softmax over every expert in fp32, topk, the chosen probabilities renormalised.
TEST(MoeRouting, SoftmaxTopKRenormalisedAndTiesGoToTheLowerExpert) {
  const std::vector<float> logits = {0.5f, 2.0f, -1.0f, 2.0f, 1.0f, 2.0f};
  int32_t ids[3];
  float w[3];
  ops::route_top_k(logits.data(), 6, 3, true, ids, w);
  // Three equal maxima at experts 1, 3 and 5: the lower ids first, weights a third each.
  EXPECT_EQ(ids[0], 1);
  EXPECT_EQ(ids[1], 3);
  EXPECT_EQ(ids[2], 5);
  for (float x : w) EXPECT_NEAR(x, 1.0f / 3, 1e-6f);
  ops::route_top_k(logits.data(), 6, 2, true, ids, w);
  EXPECT_EQ(ids[0], 1);
  EXPECT_EQ(ids[1], 3);
  // Without renormalisation the weights are the softmax probabilities themselves.
  double z = 0;
  for (float l : logits) z += std::exp(static_cast<double>(l));
  ops::route_top_k(logits.data(), 6, 2, false, ids, w);
  EXPECT_NEAR(w[0], std::exp(2.0) / z, 1e-6);
  const std::vector<float> skew = {3.0f, 0.0f, 1.0f, -2.0f};
  ops::route_top_k(skew.data(), 4, 2, true, ids, w);
  EXPECT_EQ(ids[0], 0);
  EXPECT_EQ(ids[1], 2);
  EXPECT_NEAR(w[0], std::exp(3.0) / (std::exp(3.0) + std::exp(1.0)), 1e-6);
  EXPECT_NEAR(w[0] + w[1], 1.0f, 1e-6f);
  EXPECT_THROW(ops::route_top_k(skew.data(), 4, 5, true, ids, w), Error);
}

// The mixture against a plain double-precision reference of the same definition, with the
// routing it recorded; with a shared expert and without one.
class MoeOp : public ::testing::TestWithParam<bool> {};

TEST_P(MoeOp, MatchesAPlainReferenceAndReportsItsRouting) {
  const bool with_shared = GetParam();
  const int64_t T = 5, H = 16, E = 6, K = 2, I = 8, Is = 12;
  std::mt19937 rng(3);
  auto values = [&](int64_t n) { return test::normal_values(n, rng); };
  const auto& ref = test::f32_ref;
  const auto router = values(E * H), sg = values(H), sgp = values(Is * H), sup = values(Is * H),
             sdn = values(H * Is);
  std::vector<std::vector<float>> gate, up, down;
  ops::MoeWeights w;
  w.router = ref(router, E, H);
  w.top_k = K;
  for (int64_t e = 0; e < E; ++e) {
    gate.push_back(values(I * H));
    up.push_back(values(I * H));
    down.push_back(values(H * I));
  }
  for (int64_t e = 0; e < E; ++e) {
    w.gate.push_back(ref(gate[static_cast<size_t>(e)], I, H));
    w.up.push_back(ref(up[static_cast<size_t>(e)], I, H));
    w.down.push_back(ref(down[static_cast<size_t>(e)], H, I));
  }
  if (with_shared) {
    w.shared_gate_proj = ref(sgp, Is, H);
    w.shared_up_proj = ref(sup, Is, H);
    w.shared_down_proj = ref(sdn, H, Is);
    w.shared_gate = ref(sg, 1, H);
  }
  const auto x = values(T * H);
  std::vector<float> y = values(T * H);
  const std::vector<float> residual = y;
  std::vector<int32_t> ids;
  std::vector<float> weights;
  ops::moe_mlp_add(x.data(), T, w, y.data(), &ids, &weights);
  ASSERT_EQ(ids.size(), static_cast<size_t>(T * K));
  using test::dot;
  auto mlp = [&](const float* xt, const std::vector<float>& g, const std::vector<float>& u,
                 const std::vector<float>& d, int64_t inner,
                 std::vector<double>& out) { out = test::swiglu_mlp(xt, g, u, d, H, inner); };
  for (int64_t t = 0; t < T; ++t) {
    const float* xt = x.data() + t * H;
    std::vector<float> logits(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e)
      logits[static_cast<size_t>(e)] = static_cast<float>(dot(xt, router.data() + e * H, H));
    int32_t want_ids[K];
    float want_w[K];
    ops::route_top_k(logits.data(), E, K, true, want_ids, want_w);
    for (int64_t j = 0; j < K; ++j) {
      EXPECT_EQ(ids[static_cast<size_t>(t * K + j)], want_ids[j]) << "token " << t;
      EXPECT_NEAR(weights[static_cast<size_t>(t * K + j)], want_w[j], 1e-5);
    }
    std::vector<double> want(static_cast<size_t>(H), 0.0), part;
    for (int64_t j = 0; j < K; ++j) {
      const auto e = static_cast<size_t>(want_ids[j]);
      mlp(xt, gate[e], up[e], down[e], I, part);
      for (int64_t i = 0; i < H; ++i)
        want[static_cast<size_t>(i)] += want_w[j] * part[static_cast<size_t>(i)];
    }
    mlp(xt, sgp, sup, sdn, Is, part);
    const double g = with_shared ? 1 / (1 + std::exp(-dot(xt, sg.data(), H))) : 0.0;
    for (int64_t i = 0; i < H; ++i) {
      const double expect = residual[static_cast<size_t>(t * H + i)] +
                            want[static_cast<size_t>(i)] + g * part[static_cast<size_t>(i)];
      EXPECT_NEAR(y[static_cast<size_t>(t * H + i)], expect, 1e-4) << "token " << t << " dim " << i;
    }
  }
  // Misuse is named.
  ops::MoeWeights bad = w;
  bad.top_k = E + 1;
  EXPECT_THROW(ops::moe_mlp_add(x.data(), T, bad, y.data()), Error);
  bad = w;
  bad.down.pop_back();
  EXPECT_THROW(ops::moe_mlp_add(x.data(), T, bad, y.data()), Error);
  EXPECT_THROW(ops::moe_mlp_add(y.data(), T, w, y.data()), Error);

  // The input norm inside the op: the raw residual rows in, updated in place, equal to the norm
  // first and the op on its output; the normalised rows left in the caller's buffer.
  const auto norm_w = values(H);
  const ops::MoeInputNorm bad_norm{{ref(norm_w, 1, H - 1), true, 1e-6f}, nullptr};
  std::vector<float> stream = residual, normed(static_cast<size_t>(T * H));
  ops::MoeInputNorm norm{{ref(norm_w, 1, H), true, 1e-6f}, normed.data()};
  std::vector<float> want_normed(normed.size()), want = residual;
  ops::rms_norm(residual.data(), T, H, norm.norm.w, true, 1e-6f, want_normed.data());
  std::vector<int32_t> want_ids, got_ids;
  ops::moe_mlp_add(want_normed.data(), T, w, want.data(), &want_ids);
  ops::moe_mlp_add(stream.data(), T, w, stream.data(), &got_ids, nullptr, &norm);
  EXPECT_EQ(got_ids, want_ids);
  EXPECT_EQ(normed, want_normed);
  EXPECT_EQ(stream, want);
  EXPECT_THROW(ops::moe_mlp_add(stream.data(), T, w, stream.data(), nullptr, nullptr, &bad_norm),
               Error);
  norm.normed = stream.data();
  EXPECT_THROW(ops::moe_mlp_add(stream.data(), T, w, stream.data(), nullptr, nullptr, &norm),
               Error);
}

INSTANTIATE_TEST_SUITE_P(SharedExpert, MoeOp, ::testing::Values(true, false),
                         [](const ::testing::TestParamInfo<bool>& i) {
                           return i.param ? std::string("with") : std::string("without");
                         });

// shared_expert_intermediate_size 0: no shared expert; the model loads without its tensors and
// decodes as the rest of the suite checks (prefill == decode, lossless n-gram rounds).
TEST(MoeNoShared, AModelWithoutASharedExpertLoadsAndDecodesConsistently) {
  ScratchDir dir("qwen35-moe-noshared");
  std::string config = kConfig;
  const std::string from = "\"shared_expert_intermediate_size\": 40";
  config.replace(config.find(from), from.size(), "\"shared_expert_intermediate_size\": 0");
  write_text(dir.file("source_config.json"), config);
  write_random_qwen35(dir.file("source_config.json"), dir.file("model"), DType::BF16, 9);
  const auto model = Qwen35Model::load(dir.file("model"));
  EXPECT_FALSE(model->weights().find(model->config().weight_prefix() +
                                     "layers.0.mlp.shared_expert_gate.weight"));
  const auto ids = sequence(17, 4);
  const auto whole = prefill_logits(*model, ids);
  const int64_t V = model->config().vocab_size;
  Qwen35State st(model->config());
  const int slot = st.open_row();
  for (size_t p = 0; p < ids.size(); ++p) {
    const RowInput row{slot, 1};
    ForwardOutput out;
    model->forward(st, {std::span(ids).subspan(p, 1), {&row, 1}, true, false}, &out);
    ASSERT_EQ(0, std::memcmp(out.logits.data(), whole.data() + p * V, V * sizeof(float)))
        << "position " << p;
  }
  spec::NgramProvider ngram(spec::NgramOptions{});
  GenerateRequest r;
  for (int rep = 0; rep < 3; ++rep)
    for (int32_t id : sequence(6, 2)) r.prompt.push_back(id);
  r.max_tokens = 20;
  r.ignore_eos = true;
  Generator plain(*model);
  SpeculativeGenerator spec_gen(*model, &ngram, "moe-target", {3, spec::VerifyMode::Match});
  EXPECT_EQ(spec_gen.run({r}).at(0).tokens, plain.run({r}).at(0).tokens);
}

TEST_F(MoeModel, FusedAndPerExpertLayoutsGiveTheSameBits) {
  write_per_expert_copy(dir_->file("fused"), dir_->file("per_expert"), model_->config());
  const auto per_expert = Qwen35Model::load(dir_->file("per_expert"));
  const auto ids = sequence(19, 2);
  const auto a = prefill_logits(*model_, ids), b = prefill_logits(*per_expert, ids);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));
  EXPECT_EQ(model_->parameter_count(), per_expert->parameter_count());
}

TEST_F(MoeModel, PrefillEqualsDecodeAndRowsDoNotInfluenceEachOther) {
  const auto ids = sequence(21, 3);
  const auto whole = prefill_logits(*model_, ids);
  const int64_t V = model_->config().vocab_size;
  Qwen35State st(model_->config());
  const int slot = st.open_row();
  for (size_t p = 0; p < ids.size(); ++p) {
    const RowInput row{slot, 1};
    ForwardOutput out;
    model_->forward(st, {std::span(ids).subspan(p, 1), {&row, 1}, true, false}, &out);
    ASSERT_EQ(0, std::memcmp(out.logits.data(), whole.data() + p * V, V * sizeof(float)))
        << "position " << p;
  }
  // Three rows of different lengths in one forward: each row's logits are those of the row alone,
  // though their tokens share experts.
  const std::vector<std::vector<int32_t>> seqs = {sequence(7, 1), sequence(13, 5), sequence(3, 9)};
  Qwen35State batch(model_->config());
  std::vector<RowInput> rows;
  std::vector<int32_t> all;
  for (const auto& s : seqs) {
    rows.push_back({batch.open_row(), static_cast<int64_t>(s.size())});
    all.insert(all.end(), s.begin(), s.end());
  }
  ForwardOutput out;
  model_->forward(batch, {all, rows, true, false}, &out);
  int64_t t = 0;
  for (const auto& s : seqs) {
    const auto alone = prefill_logits(*model_, s);
    EXPECT_EQ(0,
              std::memcmp(out.logits.data() + t * V, alone.data(), alone.size() * sizeof(float)));
    t += static_cast<int64_t>(s.size());
  }
}

TEST_F(MoeModel, NgramSpeculationIsLosslessAloneAndBatched) {
  spec::NgramOptions o;
  spec::NgramProvider ngram(o);
  std::vector<GenerateRequest> reqs;
  for (int i = 0; i < 4; ++i) {
    GenerateRequest r;
    // Repetitive prompts give the n-gram drafter proposals to verify.
    for (int rep = 0; rep < 3; ++rep)
      for (int32_t id : sequence(6, i)) r.prompt.push_back(id);
    r.max_tokens = 24;
    r.ignore_eos = true;
    r.sampling.temperature = i % 2 ? 0.8f : 0.0f;
    r.sampling.seed = 5 + static_cast<uint64_t>(i);
    reqs.push_back(r);
  }
  Generator plain(*model_);
  SpeculativeGenerator spec(*model_, &ngram, "moe-target", {3, spec::VerifyMode::Match});
  std::vector<SpecStats> stats;
  const auto batched = spec.run(reqs, {}, nullptr, &stats);
  int64_t drafted = 0;
  for (size_t i = 0; i < reqs.size(); ++i) {
    const auto want = plain.run({reqs[i]}).at(0).tokens;
    EXPECT_EQ(batched[i].tokens, want) << "request " << i << " batched";
    EXPECT_EQ(spec.run({reqs[i]}).at(0).tokens, want) << "request " << i << " alone";
    drafted += stats[i].drafted;
  }
  EXPECT_GT(drafted, 0) << "no proposal was verified: the test would not exercise rollback";
}

TEST_F(MoeModel, DecodeBytesCountTheChosenExpertsOnly) {
  const Qwen35Config& c = model_->config();
  const int64_t expert = 3 * c.moe_intermediate_size * c.hidden_size * 2;  // bf16 gate+up+down
  uint64_t all = 0;
  // The whole checkpoint's matrices minus the embedding (not streamed per step) vs the bytes a
  // step reads: the difference is (E - k) experts per layer.
  const uint64_t step = model_->decode_weight_bytes();
  all = step + static_cast<uint64_t>((c.num_experts - c.num_experts_per_tok) * expert *
                                     c.num_hidden_layers);
  uint64_t bound = 0;
  for (const std::string& n : model_->weights().names())
    if (n != c.weight_prefix() + "embed_tokens.weight") bound += model_->weights().get(n).nbytes;
  EXPECT_EQ(all, bound);
}

// The CUDA layout stack_moe_experts makes (checked on the CPU, where the arena is host memory):
// a bf16 shared expert of the routed experts' inner size becomes one more expert (its gate rows
// then its up rows, the separate refs viewing them: shared_in_groups, which the grouped CUDA
// products take as an extra group); any other size keeps the pair layout of gate_up_swiglu; a
// second call changes nothing.
TEST(MoeStacking, ASharedExpertOfTheRoutedShapeIsStackedAsAnExpert) {
  const int64_t E = 4, H = 32, I = 16;
  for (const int64_t Is : {I, 2 * I}) {
    SCOPED_TRACE("shared expert of " + std::to_string(Is));
    WeightArena arena;
    ops::MoeWeights m;
    m.top_k = 2;
    m.router = arena.random_matrix(E, H, 1, 1.0f);
    for (int64_t e = 0; e < E; ++e) {
      m.gate.push_back(arena.random_matrix(I, H, 10 + 3 * e, 1.0f));
      m.up.push_back(arena.random_matrix(I, H, 11 + 3 * e, 1.0f));
      m.down.push_back(arena.random_matrix(H, I, 12 + 3 * e, 1.0f));
    }
    m.shared_gate_proj = arena.random_matrix(Is, H, 2, 1.0f);
    m.shared_up_proj = arena.random_matrix(Is, H, 3, 1.0f);
    m.shared_down_proj = arena.random_matrix(H, Is, 4, 1.0f);
    m.shared_gate = arena.random_matrix(1, H, 5, 1.0f);
    auto copy = [](const ops::WeightRef& w) {
      std::vector<uint16_t> v(static_cast<size_t>(w.rows * w.cols));
      std::memcpy(v.data(), w.data, v.size() * sizeof(uint16_t));
      return v;
    };
    const std::vector<uint16_t> gate = copy(m.shared_gate_proj), up = copy(m.shared_up_proj);
    stack_moe_experts(arena, &m);
    ASSERT_EQ(m.shared_gate_up.rows, 2 * Is);
    ASSERT_EQ(m.shared_gate_up.cols, H);
    const std::vector<uint16_t> stacked = copy(m.shared_gate_up);
    if (Is == I) {
      EXPECT_TRUE(m.shared_in_groups);
      // Gate rows, then up rows, as a routed expert's; the separate refs view them.
      EXPECT_EQ(0, std::memcmp(stacked.data(), gate.data(), gate.size() * sizeof(uint16_t)));
      EXPECT_EQ(0, std::memcmp(stacked.data() + gate.size(), up.data(), up.size() * 2));
      EXPECT_EQ(m.shared_gate_proj.data, m.shared_gate_up.data);
      EXPECT_EQ(m.shared_up_proj.data,
                static_cast<const char*>(m.shared_gate_up.data) + gate.size() * sizeof(uint16_t));
    } else {
      EXPECT_FALSE(m.shared_in_groups);
      // gate_up_swiglu's pair layout: 8 gate rows, then the same 8 up rows.
      for (int64_t r = 0; r < 2 * Is; ++r) {
        const std::vector<uint16_t>& src = (r / ops::kGateUpGroup) % 2 == 0 ? gate : up;
        const int64_t row =
            (r / (2 * ops::kGateUpGroup)) * ops::kGateUpGroup + r % ops::kGateUpGroup;
        EXPECT_EQ(0, std::memcmp(stacked.data() + r * H, src.data() + row * H, H * 2)) << r;
      }
      EXPECT_EQ(m.shared_gate_proj.data, nullptr);
    }
    EXPECT_EQ(m.router_shared_gate.rows, E + 1);
    const ops::MoeWeights before = m;
    stack_moe_experts(arena, &m);
    EXPECT_EQ(m.shared_gate_up.data, before.shared_gate_up.data);
    EXPECT_EQ(m.shared_in_groups, before.shared_in_groups);
  }
}

TEST(MoeLoad, MissingExpertsAndMisshapenTensorsAreNamed) {
  ScratchDir dir("qwen35-moe-bad");
  write_text(dir.file("source_config.json"), kConfig);
  write_random_qwen35(dir.file("source_config.json"), dir.file("good"), DType::BF16, 3);
  const Qwen35Config c = load_qwen35_config(dir.file("good"));
  // Drop or reshape one tensor of a copy.
  auto variant = [&](const std::string& name, const std::string& drop, bool reshape) {
    const auto f = SafetensorsFile::open(dir.file("good") + "/model.safetensors");
    std::vector<TensorToWrite> out;
    for (const TensorView& t : f->tensors()) {
      if (t.name == drop && !reshape) continue;
      TensorToWrite w{t.name, t.dtype, t.shape, {static_cast<const std::byte*>(t.data), t.nbytes}};
      if (t.name == drop) w.shape = {t.numel()};
      out.push_back(w);
    }
    std::filesystem::create_directories(dir.file(name));
    std::filesystem::copy_file(dir.file("good") + "/config.json", dir.file(name) + "/config.json");
    write_safetensors(dir.file(name) + "/model.safetensors", out, {{"format", "pt"}});
    try {
      Qwen35Model::load(dir.file(name));
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string p = c.weight_prefix() + "layers.";
  const std::string no_experts = variant("no_experts", p + "0.mlp.experts.gate_up_proj", false);
  EXPECT_NE(no_experts.find("no experts"), std::string::npos) << no_experts;
  EXPECT_NE(no_experts.find("0.gate_proj.weight"), std::string::npos) << no_experts;
  const std::string down = variant("no_down", p + "2.mlp.experts.down_proj", false);
  EXPECT_NE(down.find("layers.2.mlp.experts.down_proj"), std::string::npos) << down;
  const std::string shape = variant("bad_router", p + "1.mlp.gate.weight", true);
  EXPECT_NE(shape.find("layers.1.mlp.gate.weight"), std::string::npos) << shape;
  EXPECT_NE(shape.find("expected shape"), std::string::npos) << shape;
  const std::string shared = variant("no_shared", p + "3.mlp.shared_expert_gate.weight", false);
  EXPECT_NE(shared.find("shared_expert_gate.weight"), std::string::npos) << shared;
}

// The in-checkpoint MTP layer of a MoE model is itself a mixture of experts: loaded from the
// published mtp.* tensors (either expert layout) or drawn at random, it drafts losslessly.
TEST(MoeMtp, TheMixtureOfExpertsMtpLayerDraftsLosslessly) {
  ScratchDir dir("qwen35-moe-mtp");
  std::string config = kConfig;
  config.replace(config.find("\"eos_token_id\": 1"), std::string("\"eos_token_id\": 1").size(),
                 "\"eos_token_id\": 1, \"mtp_num_hidden_layers\": 1");
  write_text(dir.file("source_config.json"), config);
  write_random_qwen35(dir.file("source_config.json"), dir.file("fused"), DType::BF16, 21);
  write_random_qwen35(dir.file("source_config.json"), dir.file("split"), DType::BF16, 21, true);
  for (const char* layout : {"fused", "split"}) {
    SCOPED_TRACE(layout);
    const auto model = Qwen35Model::load(dir.file(layout));
    const spec::QwenTargetView target(*model, "moe-target");
    const auto own = spec::QwenMtpProvider::from_target(target, spec::HiddenTap::FinalNormed);
    const auto drawn = spec::QwenMtpProvider::random(target, 4);
    std::vector<GenerateRequest> reqs;
    for (int i = 0; i < 3; ++i) {
      GenerateRequest r;
      r.prompt = sequence(9 + 4 * i, i);
      r.max_tokens = 20;
      r.ignore_eos = true;
      r.sampling.temperature = i == 1 ? 0.7f : 0.0f;
      r.sampling.seed = 3 + static_cast<uint64_t>(i);
      reqs.push_back(r);
    }
    Generator plain(*model);
    for (const spec::DraftProvider* drafter :
         std::vector<const spec::DraftProvider*>{own.get(), drawn.get()}) {
      SpecOptions o{3, spec::VerifyMode::Match};
      o.health_probe = false;  // random layers accept little; this checks losslessness
      SpeculativeGenerator gen(*model, drafter, "moe-target", o);
      std::vector<SpecStats> stats;
      const auto got = gen.run(reqs, {}, nullptr, &stats);
      int64_t drafted = 0;
      for (size_t i = 0; i < reqs.size(); ++i) {
        EXPECT_EQ(got[i].tokens, plain.run({reqs[i]}).at(0).tokens) << "request " << i;
        drafted += stats[i].drafted;
      }
      EXPECT_GT(drafted, 0);
    }
  }
}

// The serving engine on a MoE target: a prompt that extends a saved prefix reuses it (the prefix
// cache holds KV and recurrent state, which experts do not change) and gets the tokens a cold
// engine gives, with n-gram drafting on.
TEST_F(MoeModel, ThePrefixCacheServesAMoeTargetExactly) {
  spec::NgramProvider ngram(spec::NgramOptions{});
  EngineOptions o;
  o.spec.depth = 3;
  o.spec.prefill_chunk = 16;
  o.max_rows = 4;
  o.prefix_cache_bytes = size_t(64) << 20;
  EngineOptions cold = o;
  cold.prefix_cache_bytes = 0;
  auto serve = [](BatchEngine& engine, const std::vector<int32_t>& prompt) {
    EngineRequest er;
    er.gen.prompt = prompt;
    er.gen.max_tokens = 10;
    er.gen.ignore_eos = true;
    er.gen.sampling.temperature = 0.7f;
    er.gen.sampling.top_p = 0.9f;
    er.gen.sampling.seed = 8;
    auto sink = std::make_shared<test::RecordingSink>();
    EXPECT_EQ(engine.submit(er, sink), BatchEngine::Submit::Queued);
    engine.run_to_completion();
    return std::make_pair(sink->tokens, sink->outcome.value_or(RequestOutcome{}));
  };
  std::vector<int32_t> first = sequence(40, 6), longer = first;
  for (int32_t id : sequence(9, 7)) longer.push_back(id);
  BatchEngine warm(*model_, &ngram, "moe-target", o);
  serve(warm, first);
  const auto [hot_tokens, hot] = serve(warm, longer);
  EXPECT_GE(hot.cached_tokens, 32);  // the chunk boundaries the first prompt reached
  BatchEngine fresh(*model_, &ngram, "moe-target", cold);
  const auto [cold_tokens, cold_outcome] = serve(fresh, longer);
  EXPECT_EQ(cold_outcome.cached_tokens, 0);
  EXPECT_EQ(hot_tokens, cold_tokens);
}

// --- Parity with transformers (tests/fixtures/qwen35_moe_*, tools/make_qwen35_moe_fixtures.py) --

using MoeReference = testing::FixtureReference;

class MoeParity : public ::testing::TestWithParam<std::string> {};

// One fp32-KV forward over prompt + greedy continuation: logits within 1e-3 of the logit scale,
// every layer's routing equal to transformers' wherever the k-th and (k+1)-th probabilities are
// apart, and the greedy tokens (engine, both prompts batched, bf16 KV) equal at tie-free steps.
TEST_P(MoeParity, LogitsRoutingAndGreedyMatchTransformers) {
  const std::string dir = std::string(TANDEM_FIXTURES_DIR) + "/" + GetParam();
  auto model = Qwen35Model::load(dir);
  const MoeReference ref{SafetensorsFile::open(dir + "/reference.safetensors")};
  const Qwen35Config& c = model->config();
  const int64_t V = c.vocab_size, K = c.num_experts_per_tok, L = c.num_hidden_layers;
  std::vector<GenerateRequest> reqs(2);
  int64_t routed_checked = 0;
  for (int i = 0; i < 2; ++i) {
    const auto tokens = ref.ids("tokens_" + std::to_string(i));
    const auto want = ref.floats("logits_" + std::to_string(i));
    const auto want_routing = ref.ids("routing_" + std::to_string(i));
    const auto margin = ref.floats("routing_margin_" + std::to_string(i));
    const auto n = static_cast<int64_t>(tokens.size());
    Qwen35State st(c, RecurrentRollback::PerPositionStates, DType::F32);
    const RowInput row{st.open_row(), n};
    ForwardRequest req{tokens, {&row, 1}, true, false};
    req.want_routing = true;
    ForwardOutput out;
    model->forward(st, req, &out);
    ASSERT_EQ(out.logits.size(), want.size());
    double scale = 0, worst = 0;
    for (float x : want) scale = std::max(scale, static_cast<double>(std::fabs(x)));
    for (size_t k = 0; k < want.size(); ++k)
      worst = std::max(worst, std::fabs(out.logits[k] - want[k]) / scale);
    EXPECT_LT(worst, 1e-3) << GetParam() << " prompt " << i << ": logit scale " << scale;
    RecordProperty("max_rel_logit_error_" + std::to_string(i), std::to_string(worst));
    routed_checked +=
        testing::expect_same_routing(out.routing, want_routing, margin, L, n, K, 1e-4f,
                                     GetParam() + " prompt " + std::to_string(i));
    reqs[static_cast<size_t>(i)].prompt = ref.ids("prompt_" + std::to_string(i));
    reqs[static_cast<size_t>(i)].max_tokens = 8;
    reqs[static_cast<size_t>(i)].ignore_eos = true;
    (void)V;
  }
  EXPECT_GT(routed_checked, 0);
  Generator gen(*model);
  const auto results = gen.run(reqs);
  int tie_free = 0;
  for (int i = 0; i < 2; ++i) {
    const auto want = ref.ids("greedy_" + std::to_string(i));
    const auto gaps = ref.floats("greedy_gap_" + std::to_string(i));
    ASSERT_EQ(results[static_cast<size_t>(i)].tokens.size(), want.size());
    for (size_t j = 0; j < want.size(); ++j) {
      if (gaps[j] <= 1e-2)
        break;  // bf16 KV moves logits by ~1e-3 of the scale; later tokens differ
      EXPECT_EQ(results[static_cast<size_t>(i)].tokens[j], want[j])
          << "prompt " << i << " step " << j;
      ++tie_free;
    }
  }
  EXPECT_GT(tie_free, 0);
}

// The third fixture has no shared expert (transformers writes its zero-size tensors and gate,
// which add nothing) and unnormalised top-1 weights.
INSTANTIATE_TEST_SUITE_P(Fixtures, MoeParity,
                         ::testing::Values("qwen35_moe_fused", "qwen35_moe_per_expert",
                                           "qwen35_moe_no_shared"));

}  // namespace
}  // namespace tandem
