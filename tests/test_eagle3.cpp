// The EAGLE-3 drafter (issue 22): the head's published layout and its errors, layer taps against
// the target's own hidden states, the block against a direct computation, the commit convention
// (context rows rebuilt from verified taps equal a prefill of the same tokens), checkpoints,
// batches, lossless speculation on the demo model, the prefix cache, and the PyTorch oracle.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "demo_model.h"
#include "fixture_reference.h"
#include "recording_sink.h"
#include "tandem/core/error.h"
#include "tandem/engine/batch_engine.h"
#include "tandem/engine/generator.h"
#include "tandem/engine/glm5_engine_target.h"
#include "tandem/engine/speculative.h"
#include "tandem/io/json_file.h"
#include "tandem/io/safetensors.h"
#include "tandem/model/glm5.h"
#include "tandem/model/glm5_state.h"
#include "tandem/model/qwen3_5_state.h"
#include "tandem/spec/eagle3.h"
#include "tandem/spec/eagle3_random.h"
#include "test_util.h"

namespace tandem {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using spec::Eagle3Provider;
using spec::Eagle3RandomShape;
using spec::Eagle3Rows;

test::DemoModel& demo() {
  static test::DemoModel* f = test::load_demo_model().release();  // lives for the whole run
  return *f;
}

Eagle3RandomShape demo_shape() {
  return test::demo_eagle3_shape();
}

testing::ScratchDir& scratch() {
  static testing::ScratchDir d("eagle3");  // removed at exit (mapped heads stay readable)
  return d;
}

// A random head on the demo (fp32 weights, so the direct computation reads the same numbers).
const Eagle3Provider& head() {
  static std::unique_ptr<Eagle3Provider> p = [] {
    const std::string dir = scratch().file("head");
    spec::write_random_eagle3_head(demo_shape(), dir, DType::F32, 11);
    return Eagle3Provider::open(dir);
  }();
  return *p;
}

// A random head whose draft vocabulary is the eight tokens the demo emits most on its prompts,
// so that a fair share of its proposals is accepted and the engine's rollback of accepted rows
// runs, whatever values its random weights happen to have.
const Eagle3Provider& lucky_head() {
  static std::unique_ptr<Eagle3Provider> p = [] {
    std::map<int32_t, int> count;
    Generator gen(*demo().model);
    for (const std::string& prompt : test::kDemoPrompts) {
      GenerateRequest r;
      r.prompt = demo().tok->encode(prompt);
      r.max_tokens = 40;
      const std::vector<GenerateResult> res = gen.run({r});
      for (int32_t t : res.at(0).tokens) ++count[t];
    }
    std::vector<std::pair<int, int32_t>> by_count;
    for (const auto& [t, n] : count) by_count.push_back({-n, t});
    std::sort(by_count.begin(), by_count.end());  // most emitted first, then lower id
    std::vector<int32_t> ids;
    for (size_t i = 0; i < std::min<size_t>(8, by_count.size()); ++i)
      ids.push_back(by_count[i].second);
    std::sort(ids.begin(), ids.end());
    Eagle3RandomShape s = demo_shape();
    s.draft_ids = ids;
    s.tap_layers = {};  // the default list [2, 4, 5]
    const std::string dir = scratch().file("lucky");
    spec::write_random_eagle3_head(s, dir, DType::BF16, 5);
    return Eagle3Provider::open(dir);
  }();
  return *p;
}

std::unique_ptr<Eagle3Rows> open_rows(const Eagle3Provider& p) {
  std::unique_ptr<spec::DraftRows> r = p.open_rows(*demo().target);
  return std::unique_ptr<Eagle3Rows>(static_cast<Eagle3Rows*>(r.release()));
}

std::vector<float> random_taps(int64_t n, int64_t width, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n * width));
  for (float& x : v) x = normal(rng);
  return v;
}

std::vector<int32_t> random_ids(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (int32_t& x : v) x = static_cast<int32_t>(rng() % 4096);
  return v;
}

// The head's files rewritten through `edit` (config.json and the tensors) into a new directory.
std::string edited_head(const std::string& name, const std::function<void(json&)>& edit_config,
                        const std::function<void(std::vector<TensorToWrite>&)>& edit_tensors) {
  const std::string src = scratch().file("head"), dst = scratch().file(name);
  head();  // written
  fs::create_directories(dst);
  json config = read_json_file(src + "/config.json");
  edit_config(config);
  std::ofstream(dst + "/config.json") << config.dump(2);
  const auto file = SafetensorsFile::open(src + "/model.safetensors");
  std::vector<TensorToWrite> tensors;
  for (const TensorView& t : file->tensors())
    tensors.push_back(
        {t.name, t.dtype, t.shape, std::span(static_cast<const std::byte*>(t.data), t.nbytes)});
  edit_tensors(tensors);
  write_safetensors(dst + "/model.safetensors", tensors);
  return dst;
}

void expect_error(const std::function<void()>& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one mentioning '" << parts.front() << "'";
  } catch (const Error& e) {
    for (const std::string& p : parts)
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what() << "\n  lacks: " << p;
  }
}

// --- Layout --------------------------------------------------------------------------------------

TEST(Eagle3Layout, LoadsThePublishedLayout) {
  const Eagle3Provider& p = head();
  EXPECT_EQ(p.id(), "eagle3");
  EXPECT_EQ(p.checkpoint_namespace().rfind("eagle3-v1:", 0), 0u);
  EXPECT_EQ(p.block().config().draft_vocab_size, 512);
  EXPECT_EQ(p.tap_layers(*demo().target), (std::vector<int>{1, 3, 6}));
  EXPECT_EQ(lucky_head().tap_layers(*demo().target), (std::vector<int>{2, 4, 5}));
  EXPECT_EQ(p.block().weights().draft_to_target.front(), 0);
  auto rows = p.open_rows(*demo().target);
  EXPECT_EQ(rows->taps().layers, (std::vector<int>{1, 3, 6}));
  EXPECT_EQ(rows->taps().width(384), 3 * 384);
}

TEST(Eagle3Layout, ErrorsNameTheProblem) {
  auto keep = [](std::vector<TensorToWrite>&) {};
  auto same = [](json&) {};
  auto drop = [](const char* name) {
    return [name](std::vector<TensorToWrite>& t) {
      std::erase_if(t, [&](const TensorToWrite& x) { return x.name == name; });
    };
  };
  expect_error([&] { Eagle3Provider::open(edited_head("no_d2t", same, drop("d2t"))); },
               {"'d2t' is missing"});
  std::vector<std::byte> flags;
  expect_error(
      [&] {
        Eagle3Provider::open(edited_head("disagree", same, [&](std::vector<TensorToWrite>& t) {
          for (TensorToWrite& x : t)
            if (x.name == "t2d") {
              flags.assign(x.bytes.begin(), x.bytes.end());
              flags[7] = flags[7] == std::byte{0} ? std::byte{1} : std::byte{0};
              x.bytes = flags;
            }
        }));
      },
      {"d2t and t2d disagree at target id 7"});
  expect_error(
      [&] {
        auto p = Eagle3Provider::open(edited_head(
            "range",
            [](json& c) {
              c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = {1, 3, 8};
            },
            keep));
        p->open_rows(*demo().target);
      },
      {"cannot tap the input of layer 8", "8 layers"});
  expect_error([&] { Eagle3Provider::open(edited_head("no_t2d", same, drop("t2d"))); },
               {"'t2d' is missing"});
  expect_error(
      [&] {
        auto p = Eagle3Provider::open(edited_head(
            "rope",
            [](json& c) {
              c["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}};
            },
            keep));
      },
      {"rope_scaling", "not supported"});
  expect_error(
      [&] {
        Eagle3Provider::open(edited_head(
            "taps2",
            [](json& c) {
              c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = {1, 3};
            },
            keep));
      },
      {"'fc.weight'", "[384, 1152]", "expected [384, 768]"});
  expect_error(
      [&] {
        Eagle3Provider::open(edited_head(
            "arch", [](json& c) { c["architectures"] = {"LlamaForCausalLM"}; }, keep));
      },
      {"architectures", "LlamaForCausalLMEagle3"});
  expect_error(
      [&] {
        Eagle3Provider::open(edited_head(
            "layers", [](json& c) { c["num_hidden_layers"] = 2; }, keep));
      },
      {"num_hidden_layers"});
}

TEST(Eagle3Layout, TargetMismatchesAreRefusedWhenRowsOpen) {
  testing::ScratchDir dir("eagle3-mismatch");
  Eagle3RandomShape s = demo_shape();
  s.vocab_size = 5000;
  spec::write_random_eagle3_head(s, dir.file("vocab"), DType::BF16, 1);
  expect_error([&] { Eagle3Provider::open(dir.file("vocab"))->open_rows(*demo().target); },
               {"vocabulary size 5000", "4096"});
  s = demo_shape();
  s.target_hidden_size = 256;
  spec::write_random_eagle3_head(s, dir.file("ht"), DType::BF16, 1);
  expect_error([&] { Eagle3Provider::open(dir.file("ht"))->open_rows(*demo().target); },
               {"target_hidden_size 256", "384"});
  s = demo_shape();
  s.hidden_size = 256;
  s.num_attention_heads = 4;
  s.num_key_value_heads = 2;
  s.target_hidden_size = 384;
  spec::write_random_eagle3_head(s, dir.file("h"), DType::BF16, 1);
  expect_error([&] { Eagle3Provider::open(dir.file("h"))->open_rows(*demo().target); },
               {"hidden size 256", "no embed_tokens"});
  // With its own embedding a narrower head serves the target.
  s.own_embedding = true;
  spec::write_random_eagle3_head(s, dir.file("h_embed"), DType::BF16, 1);
  auto rows = Eagle3Provider::open(dir.file("h_embed"))->open_rows(*demo().target);
  const std::vector<int32_t> ids = random_ids(6, 3);
  const std::vector<float> taps = random_taps(6, 3 * 384, 4);
  rows->append(std::vector<spec::CheckpointPtr>{nullptr});
  rows->prefill(std::vector<spec::RowPrefill>{{0, ids, taps.data(), 0}});
  std::vector<spec::DraftProposal> out;
  rows->draft(std::vector<spec::RowDraft>{{ids.back(), 3, {}, 0, false}}, &out);
  EXPECT_EQ(out.at(0).tokens.size(), 3u);
}

// --- Layer taps ----------------------------------------------------------------------------------

// The demo model cut to its first `layers` layers (same weights file): its pre-norm hidden is the
// residual stream entering layer `layers` of the whole model.
std::unique_ptr<Qwen35Model> truncated_demo(int layers) {
  const std::string dir = scratch().file("demo_first_" + std::to_string(layers));
  if (!fs::exists(dir)) {
    fs::create_directories(dir);
    json config = read_json_file(test::kDemoDir + "/config.json");
    json& t = config["text_config"];
    t["num_hidden_layers"] = layers;
    t["layer_types"] =
        json(std::vector<json>(t["layer_types"].begin(), t["layer_types"].begin() + layers));
    std::ofstream(dir + "/config.json") << config.dump(2);
    fs::create_symlink(fs::absolute(test::kDemoDir + "/model.safetensors"),
                       dir + "/model.safetensors");
  }
  return Qwen35Model::load(dir);
}

TEST(Eagle3Taps, LayerTapsAreTheResidualStreamEnteringEachLayer) {
  Qwen35Model& model = *demo().model;
  const std::vector<int32_t> ids = demo().tok->encode(test::kDemoPrompts[1]);
  const int64_t T = static_cast<int64_t>(ids.size()), H = 384;
  const std::vector<int> layers = {7, 0, 3, 1, 5, 2, 6, 4};  // any order, as listed
  Qwen35State st(model.config());
  const int slot = st.open_row();
  const std::vector<RowInput> rows = {{slot, T, false}};
  ForwardRequest req{ids, rows};
  req.prompt = true;
  req.tap_layers = layers;
  ForwardOutput out;
  model.forward(st, req, &out);
  const int64_t n = static_cast<int64_t>(layers.size());
  ASSERT_EQ(out.layer_taps.size(), static_cast<size_t>(T * n * H));
  auto tap = [&](int64_t t, int64_t j) { return out.layer_taps.data() + (t * n + j) * H; };
  std::vector<float> embed(static_cast<size_t>(T * H));
  model.embed(ids, embed.data());
  for (int64_t j = 0; j < n; ++j) {
    const int layer = layers[static_cast<size_t>(j)];
    std::vector<float> want = embed;
    if (layer > 0) {
      auto cut = truncated_demo(layer);
      Qwen35State cs(cut->config());
      const int s = cs.open_row();
      const std::vector<RowInput> r = {{s, T, false}};
      ForwardRequest q{ids, r};
      q.prompt = true;
      q.want_prenorm_hidden = true;
      ForwardOutput o;
      cut->forward(cs, q, &o);
      want = o.prenorm_hidden;
    }
    for (int64_t t = 0; t < T; ++t)
      ASSERT_EQ(0, std::memcmp(tap(t, j), want.data() + t * H, sizeof(float) * H))
          << "layer " << layer << " token " << t;
  }
  // Decoding the same tokens one at a time in a second row, next to a verify window of the
  // first, taps them bitwise as the prompt forward did.
  Qwen35State st2(model.config());
  const int a = st2.open_row(), b = st2.open_row();
  const std::vector<int> one = {3, 6};
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int32_t> toks = {ids[static_cast<size_t>(t)]};
    std::vector<RowInput> r = {{a, 1, false}};
    if (t + 3 <= T && t % 5 == 0) {
      toks.insert(toks.end(), ids.begin() + t, ids.begin() + t + 3);
      r.push_back({b, 3, true});
    }
    ForwardRequest q{toks, r};
    q.tap_layers = one;
    ForwardOutput o;
    model.forward(st2, q, &o);
    ASSERT_EQ(o.layer_taps.size(), toks.size() * 2 * H);
    for (int64_t j = 0; j < 2; ++j)
      ASSERT_EQ(0,
                std::memcmp(o.layer_taps.data() + j * H, tap(t, j == 0 ? 2 : 6), sizeof(float) * H))
          << "token " << t << " tap " << one[static_cast<size_t>(j)];
    if (r.size() > 1) model.commit_windows(st2, std::vector<RowKeep>{{b, 3}});
  }
  // Out of range: refused before anything changes.
  const std::vector<int> bad = {8};
  ForwardRequest q{ids, rows};
  q.tap_layers = bad;
  const int64_t before = st.length(slot);
  expect_error([&] { model.forward(st, q, &out); }, {"tap layer 8", "[0, 8)"});
  EXPECT_EQ(st.length(slot), before);
}

// --- The block against a direct computation ------------------------------------------------------

// The head's arithmetic written out plainly from the contract (double sums), one row at a time
// over a single sequence: context rows, then chain rows fed their predecessor's `out`.
struct DirectHead {
  int64_t H, I, nh, nkv, hd, Vd, W;
  double eps, theta;
  std::vector<float> fc, in_norm, hid_norm, q, k, v, o, post, gate, up, down, norm, lm;
  std::vector<std::vector<float>> keys, values;  // per row [nkv * hd]

  explicit DirectHead(const std::string& dir) {
    const spec::Eagle3Weights w = spec::load_eagle3_head(dir);
    const spec::Eagle3Config& c = w.cfg;
    H = c.hidden_size, I = c.intermediate_size, nh = c.num_attention_heads;
    nkv = c.num_key_value_heads, hd = c.head_dim, Vd = c.draft_vocab_size;
    W = c.tap_count() * c.target_hidden_size;
    eps = c.rms_norm_eps, theta = c.rope_theta;
    const WeightStore& s = w.store;
    auto f = [&](const char* n) { return to_f32(s.get(n)); };
    fc = f("fc.weight"), in_norm = f("midlayer.input_layernorm.weight");
    hid_norm = f("midlayer.hidden_norm.weight"), q = f("midlayer.self_attn.q_proj.weight");
    k = f("midlayer.self_attn.k_proj.weight"), v = f("midlayer.self_attn.v_proj.weight");
    o = f("midlayer.self_attn.o_proj.weight");
    post = f("midlayer.post_attention_layernorm.weight");
    gate = f("midlayer.mlp.gate_proj.weight"), up = f("midlayer.mlp.up_proj.weight");
    down = f("midlayer.mlp.down_proj.weight"), norm = f("norm.weight"), lm = f("lm_head.weight");
  }
  static std::vector<float> matvec(const std::vector<float>& m, const std::vector<float>& x,
                                   int64_t rows) {
    const int64_t cols = static_cast<int64_t>(x.size());
    std::vector<float> y(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) {
      double s = 0;
      for (int64_t c = 0; c < cols; ++c) s += double(m[r * cols + c]) * x[c];
      y[r] = static_cast<float>(s);
    }
    return y;
  }
  std::vector<float> rms(const std::vector<float>& x, const std::vector<float>& w) const {
    double s = 0;
    for (float a : x) s += double(a) * a;
    const double r = 1.0 / std::sqrt(s / static_cast<double>(x.size()) + eps);
    std::vector<float> y(x.size());
    for (size_t i = 0; i < x.size(); ++i) y[i] = static_cast<float>(x[i] * r * w[i]);
    return y;
  }
  void rope(std::vector<float>& x, int64_t heads, int64_t p) const {
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < hd / 2; ++i) {
        const double a = p * std::pow(theta, -2.0 * i / hd);
        float& x1 = x[h * hd + i];
        float& x2 = x[h * hd + i + hd / 2];
        const double y1 = x1 * std::cos(a) - x2 * std::sin(a);
        const double y2 = x2 * std::cos(a) + x1 * std::sin(a);
        x1 = static_cast<float>(y1), x2 = static_cast<float>(y2);
      }
  }
  std::vector<float> project(const float* taps) const {
    return matvec(fc, std::vector<float>(taps, taps + W), H);
  }
  // One row at position keys.size(): returns out [H]; *logits receives [Vd].
  std::vector<float> row(const std::vector<float>& e, const std::vector<float>& g,
                         std::vector<float>* logits) {
    const int64_t p = static_cast<int64_t>(keys.size());
    std::vector<float> a = rms(e, in_norm);
    const std::vector<float> hn = rms(g, hid_norm);
    a.insert(a.end(), hn.begin(), hn.end());
    std::vector<float> qq = matvec(q, a, nh * hd), kk = matvec(k, a, nkv * hd);
    rope(qq, nh, p);
    rope(kk, nkv, p);
    keys.push_back(kk);
    values.push_back(matvec(v, a, nkv * hd));
    std::vector<float> attn(static_cast<size_t>(nh * hd));
    for (int64_t h = 0; h < nh; ++h) {
      const int64_t kh = h / (nh / nkv);
      std::vector<double> s(static_cast<size_t>(p + 1));
      double mx = -1e300;
      for (int64_t j = 0; j <= p; ++j) {
        double d = 0;
        for (int64_t i = 0; i < hd; ++i) d += double(qq[h * hd + i]) * keys[j][kh * hd + i];
        s[j] = d / std::sqrt(static_cast<double>(hd));
        mx = std::max(mx, s[j]);
      }
      double z = 0;
      for (double& x : s) z += (x = std::exp(x - mx));
      for (int64_t i = 0; i < hd; ++i) {
        double acc = 0;
        for (int64_t j = 0; j <= p; ++j) acc += s[j] / z * values[j][kh * hd + i];
        attn[h * hd + i] = static_cast<float>(acc);
      }
    }
    std::vector<float> r = matvec(o, attn, H);
    for (int64_t i = 0; i < H; ++i) r[i] += g[i];
    const std::vector<float> n = rms(r, post);
    std::vector<float> gg = matvec(gate, n, I), uu = matvec(up, n, I);
    for (int64_t i = 0; i < I; ++i) gg[i] = gg[i] / (1.0f + std::exp(-gg[i])) * uu[i];
    const std::vector<float> d = matvec(down, gg, H);
    for (int64_t i = 0; i < H; ++i) r[i] += d[i];
    *logits = matvec(lm, rms(r, norm), Vd);
    return r;
  }
};

double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, std::fabs(double(x)));
  return m;
}

TEST(Eagle3Block, PrefillAndChainMatchADirectComputation) {
  const Eagle3Provider& p = head();
  DirectHead ref(scratch().file("head"));
  const int64_t n = 23, H = 384, W = 3 * 384;
  const std::vector<int32_t> ids = random_ids(n + 1, 21);
  const std::vector<float> taps = random_taps(n, W, 22);
  auto rows = open_rows(p);
  rows->append(std::vector<spec::CheckpointPtr>{nullptr});
  rows->prefill(std::vector<spec::RowPrefill>{{0, std::span(ids).first(n), taps.data(), 0}});
  EXPECT_EQ(rows->context_rows(0), n - 1);
  std::vector<spec::DraftProposal> out;
  const int depth = 4;
  rows->draft(std::vector<spec::RowDraft>{{ids[n], depth, {}, 0, false}}, &out);
  // Direct: rows p = 0..n-2 from (x_{p+1}, fc(taps_p)), then the chain from (pending, taps_{n-1}).
  std::vector<float> logits, e(static_cast<size_t>(H));
  for (int64_t q = 0; q + 1 < n; ++q) {
    demo().model->embed(std::span(ids).subspan(q + 1, 1), e.data());
    ref.row(e, ref.project(taps.data() + q * W), &logits);
  }
  std::vector<float> g = ref.project(taps.data() + (n - 1) * W);
  int32_t token = ids[n];
  const std::vector<int32_t>& d2t = p.block().weights().draft_to_target;
  for (int j = 0; j < depth; ++j) {
    demo().model->embed(std::span(&token, 1), e.data());
    g = ref.row(e, g, &logits);
    const std::vector<float> got = rows->last_draft_logits(0, j);
    const std::vector<float> hid = rows->last_draft_hidden(0, j);
    const double scale = max_abs(logits);
    for (size_t i = 0; i < got.size(); ++i)
      ASSERT_NEAR(got[i], logits[i], 1e-4 * scale) << "step " << j << " draft id " << i;
    for (size_t i = 0; i < hid.size(); ++i)
      ASSERT_NEAR(hid[i], g[i], 1e-4 * max_abs(g)) << "step " << j << " hidden " << i;
    const int32_t want =
        d2t[static_cast<size_t>(std::max_element(logits.begin(), logits.end()) - logits.begin())];
    EXPECT_EQ(out[0].tokens.at(static_cast<size_t>(j)), want) << "step " << j;
    token = out[0].tokens[static_cast<size_t>(j)];
  }
}

// --- Rows: commit, batches, checkpoints ----------------------------------------------------------

// Drafts `depth` greedy proposals for every row; returns their proposals and step-0 logits.
struct Drafted {
  std::vector<std::vector<int32_t>> tokens;
  std::vector<std::vector<float>> logits;
};
Drafted draft_all(Eagle3Rows& rows, const std::vector<int32_t>& pending, int depth,
                  float temperature = 0.0f) {
  std::vector<spec::RowDraft> in;
  for (int32_t t : pending) {
    spec::RowDraft d{t, depth, {}, 100, false};
    d.sampling.temperature = temperature;
    d.sampling.seed = 9;
    in.push_back(d);
  }
  std::vector<spec::DraftProposal> out;
  rows.draft(in, &out);
  Drafted r;
  for (size_t b = 0; b < pending.size(); ++b) {
    r.tokens.push_back(out[b].tokens);
    for (int j = 0; j < depth; ++j) {
      const auto l = rows.last_draft_logits(static_cast<int>(b), j);
      r.logits.push_back(l);
    }
  }
  return r;
}

// A commit that accepted a proposals leaves the state a prefill of the same tokens and taps
// reaches: its context grows only by rows rebuilt from the verified taps.
TEST(Eagle3Commit, CommitEqualsPrefillingTheVerifiedTokens) {
  const int64_t W = 3 * 384, n = 17;
  for (int depth : {0, 1, 3}) {
    for (int a = 0; a <= depth; ++a) {
      const std::vector<int32_t> ids = random_ids(n + 1, 31 + static_cast<uint64_t>(a));
      const std::vector<float> taps = random_taps(n, W, 32);
      auto rows = open_rows(head());
      rows->append(std::vector<spec::CheckpointPtr>{nullptr});
      rows->prefill(std::vector<spec::RowPrefill>{{0, std::span(ids).first(n), taps.data(), 0}});
      const Drafted d = draft_all(*rows, {ids[n]}, depth);
      std::vector<int32_t> window = {ids[n]};
      window.insert(window.end(), d.tokens[0].begin(), d.tokens[0].end());
      const std::vector<float> vtaps = random_taps(static_cast<int64_t>(window.size()), W, 33);
      const int32_t next = 77;
      rows->commit(std::vector<spec::VerifyRow>{{window, vtaps.data(), a, next}});
      EXPECT_EQ(rows->context_rows(0), n + a);
      // The same tokens and taps prefilled: prompt + window[0..a].
      std::vector<int32_t> all(ids.begin(), ids.begin() + n);
      all.insert(all.end(), window.begin(), window.begin() + a + 1);
      std::vector<float> all_taps = taps;
      all_taps.insert(all_taps.end(), vtaps.begin(), vtaps.begin() + (a + 1) * W);
      auto fresh = open_rows(head());
      fresh->append(std::vector<spec::CheckpointPtr>{nullptr});
      fresh->prefill(std::vector<spec::RowPrefill>{{0, all, all_taps.data(), 0}});
      const Drafted x = draft_all(*rows, {next}, 3), y = draft_all(*fresh, {next}, 3);
      EXPECT_EQ(x.tokens, y.tokens) << "depth " << depth << " accepted " << a;
      EXPECT_EQ(x.logits, y.logits) << "depth " << depth << " accepted " << a;
    }
  }
}

TEST(Eagle3Rows, BatchedRowsOfDifferentLengthsEqualRowsAlone) {
  const int64_t W = 3 * 384;
  const std::vector<int64_t> lengths = {5, 31, 12};
  std::vector<std::vector<int32_t>> ids;
  std::vector<std::vector<float>> taps;
  for (size_t i = 0; i < lengths.size(); ++i) {
    ids.push_back(random_ids(lengths[i] + 1, 40 + i));
    taps.push_back(random_taps(lengths[i], W, 50 + i));
  }
  auto batch = open_rows(head());
  batch->append(std::vector<spec::CheckpointPtr>(lengths.size(), nullptr));
  std::vector<spec::RowPrefill> pre;
  std::vector<int32_t> pending;
  for (size_t i = 0; i < lengths.size(); ++i) {
    pre.push_back({static_cast<int>(i), std::span(ids[i]).first(lengths[i]), taps[i].data(), 0});
    pending.push_back(ids[i].back());
  }
  batch->prefill(pre);
  // Different depths per row: the chain steps see shrinking sets of rows.
  std::vector<spec::RowDraft> in;
  const std::vector<int> depths = {3, 1, 2};
  for (size_t i = 0; i < lengths.size(); ++i) in.push_back({pending[i], depths[i], {}, 0, false});
  std::vector<spec::DraftProposal> out;
  batch->draft(in, &out);
  for (size_t i = 0; i < lengths.size(); ++i) {
    auto alone = open_rows(head());
    alone->append(std::vector<spec::CheckpointPtr>{nullptr});
    alone->prefill(std::vector<spec::RowPrefill>{{0, pre[i].tokens, taps[i].data(), 0}});
    std::vector<spec::DraftProposal> o;
    alone->draft(std::vector<spec::RowDraft>{in[i]}, &o);
    EXPECT_EQ(o[0].tokens, out[i].tokens) << "row " << i;
    for (int j = 0; j < depths[i]; ++j)
      EXPECT_EQ(alone->last_draft_logits(0, j), batch->last_draft_logits(static_cast<int>(i), j))
          << "row " << i << " step " << j;
  }
  // Commit everything, keep the last two rows: they draft as before the filter.
  std::vector<std::vector<int32_t>> windows;
  std::vector<std::vector<float>> vtaps;
  std::vector<spec::VerifyRow> verify;
  for (size_t i = 0; i < lengths.size(); ++i) {
    windows.push_back({pending[i]});
    windows[i].insert(windows[i].end(), out[i].tokens.begin(), out[i].tokens.end());
    vtaps.push_back(random_taps(static_cast<int64_t>(windows[i].size()), W, 60 + i));
  }
  for (size_t i = 0; i < lengths.size(); ++i)
    verify.push_back({windows[i], vtaps[i].data(), static_cast<int>(i % 2), 5});
  batch->commit(verify);
  auto copy = open_rows(head());
  copy->append(std::vector<spec::CheckpointPtr>{batch->capture(1), batch->capture(2)});
  batch->filter_rows(std::vector<int>{1, 2});
  ASSERT_EQ(batch->row_count(), 2);
  EXPECT_EQ(draft_all(*batch, {5, 5}, 2).logits, draft_all(*copy, {5, 5}, 2).logits);
}

TEST(Eagle3Checkpoint, RoundTripAndRefusals) {
  const int64_t W = 3 * 384, n = 20;
  const std::vector<int32_t> ids = random_ids(n + 1, 70);
  const std::vector<float> taps = random_taps(n, W, 71);
  auto rows = open_rows(head());
  rows->append(std::vector<spec::CheckpointPtr>{nullptr});
  rows->prefill(std::vector<spec::RowPrefill>{{0, std::span(ids).first(n), taps.data(), 0}});
  int32_t pending = ids[n];
  for (int round = 0; round < 3; ++round) {
    const Drafted d = draft_all(*rows, {pending}, 2);
    std::vector<int32_t> window = {pending};
    window.insert(window.end(), d.tokens[0].begin(), d.tokens[0].end());
    const std::vector<float> vt = random_taps(3, W, 72 + round);
    rows->commit(std::vector<spec::VerifyRow>{{window, vt.data(), round % 3, 100 + round}});
    pending = 100 + round;
  }
  const spec::CheckpointPtr c = rows->capture(0);
  EXPECT_EQ(c->schema, "eagle3-v1");
  EXPECT_EQ(c->ns, head().checkpoint_namespace());
  EXPECT_EQ(c->processed_tokens, n + 1 + 2 + 3);  // accepted 0, 1, 2 of 2
  auto restored = open_rows(head());
  restored->append(std::vector<spec::CheckpointPtr>{c});
  EXPECT_EQ(restored->context_rows(0), rows->context_rows(0));
  const Drafted x = draft_all(*rows, {pending}, 3, 0.8f),
                y = draft_all(*restored, {pending}, 3, 0.8f);
  EXPECT_EQ(x.tokens, y.tokens);
  EXPECT_EQ(x.logits, y.logits);
  // A checkpoint of another drafter, of another head, or cut short is refused.
  auto mtp = demo().mtp->open_rows(*demo().target);
  mtp->append(std::vector<spec::CheckpointPtr>{nullptr});
  std::vector<float> hidden(static_cast<size_t>(n * 384), 0.5f);
  mtp->prefill(std::vector<spec::RowPrefill>{{0, std::span(ids).first(n), hidden.data(), 0}});
  expect_error([&] { restored->append(std::vector<spec::CheckpointPtr>{mtp->capture(0)}); },
               {"qwen-mtp-v1"});
  auto lucky = lucky_head().open_rows(*demo().target);
  expect_error([&] { lucky->append(std::vector<spec::CheckpointPtr>{c}); }, {"eagle3"});
  auto broken = std::make_shared<spec::Checkpoint>(*c);
  broken->tensors.erase("g_true");
  expect_error([&] { restored->append(std::vector<spec::CheckpointPtr>{broken}); }, {"'g_true'"});
  EXPECT_EQ(restored->row_count(), 1);
}

TEST(Eagle3Rows, AdoptedPrefixStartsTheHistoryAtTheBoundary) {
  const int64_t W = 3 * 384;
  const std::vector<int32_t> ids = random_ids(41, 80);
  const std::vector<float> taps = random_taps(40, W, 81);
  auto rows = open_rows(head());
  EXPECT_FALSE(rows->adopts_exactly());
  rows->append(std::vector<spec::CheckpointPtr>{nullptr});
  rows->adopt_prefix(0, std::span(ids).first(32));
  rows->prefill(
      std::vector<spec::RowPrefill>{{0, std::span(ids).subspan(32, 8), taps.data() + 32 * W, 32}});
  EXPECT_EQ(rows->context_rows(0), 7);
  EXPECT_EQ(rows->capture(0)->processed_tokens, 40);
  EXPECT_EQ(rows->capture(0)->history_from, 32);
  EXPECT_EQ(draft_all(*rows, {ids[40]}, 2).tokens[0].size(), 2u);
}

TEST(Eagle3Rows, SampledDraftsAreKeyedAndGiveDistributionsOverTargetIds) {
  const int64_t W = 3 * 384;
  const std::vector<int32_t> ids = random_ids(13, 90);
  const std::vector<float> taps = random_taps(12, W, 91);
  auto rows = open_rows(head());
  rows->append(std::vector<spec::CheckpointPtr>{nullptr, nullptr});
  rows->prefill(std::vector<spec::RowPrefill>{{0, std::span(ids).first(12), taps.data(), 0},
                                              {1, std::span(ids).first(12), taps.data(), 0}});
  std::vector<spec::RowDraft> in(2);
  for (auto& d : in) {
    d = {ids[12], 3, {}, 40, true};
    d.sampling.temperature = 1.0f;
    d.sampling.seed = 3;
  }
  std::vector<spec::DraftProposal> out;
  rows->draft(in, &out);
  EXPECT_EQ(out[0].tokens, out[1].tokens) << "same state, same keys: same draws";
  const std::vector<int32_t>& d2t = head().block().weights().draft_to_target;
  ASSERT_EQ(out[0].q.size(), 3u);
  for (const auto& q : out[0].q) {
    double sum = 0;
    for (const TokenProb& tp : q) {
      sum += tp.prob;
      EXPECT_NE(std::find(d2t.begin(), d2t.end(), tp.id), d2t.end()) << tp.id;
    }
    EXPECT_NEAR(sum, 1.0, 1e-9);
  }
  for (int32_t t : out[0].tokens) EXPECT_NE(std::find(d2t.begin(), d2t.end(), t), d2t.end());
}

// A sampled row that wants no distribution draws on the device (the map keeps id order, as the
// fixture's sorted draft vocabulary does): the same proposals as the host's draw over the draft
// logits spread on the target vocabulary.
TEST(Eagle3Rows, DeviceDrawsEqualHostDraws) {
  const std::vector<int32_t>& d2t = head().block().weights().draft_to_target;
  ASSERT_TRUE(std::is_sorted(d2t.begin(), d2t.end()) &&
              std::adjacent_find(d2t.begin(), d2t.end()) == d2t.end());
  const int64_t W = 3 * 384;
  const std::vector<int32_t> ids = random_ids(13, 92);
  const std::vector<float> taps = random_taps(12, W, 93);
  auto draw = [&](bool want_distribution) {
    auto rows = open_rows(head());
    rows->append(std::vector<spec::CheckpointPtr>{nullptr, nullptr, nullptr});
    std::vector<spec::RowPrefill> pre;
    for (int r = 0; r < 3; ++r) pre.push_back({r, std::span(ids).first(12), taps.data(), 0});
    rows->prefill(pre);
    std::vector<int32_t> all;
    for (uint64_t round = 0; round < 4; ++round) {
      std::vector<spec::RowDraft> in(3);
      for (int r = 0; r < 3; ++r) {
        in[r] = {ids[12], 3 - r, {}, 40 + 8 * round, want_distribution};
        in[r].sampling.temperature = 1.5f;
        in[r].sampling.top_p = 0.95f;
        in[r].sampling.seed = 11 + static_cast<uint64_t>(r);
      }
      std::vector<spec::DraftProposal> out;
      rows->draft(in, &out);
      std::vector<spec::VerifyRow> verified(3);
      std::vector<std::vector<int32_t>> windows(3);
      for (int r = 0; r < 3; ++r) {
        all.insert(all.end(), out[r].tokens.begin(), out[r].tokens.end());
        windows[r] = {ids[12]};
        windows[r].insert(windows[r].end(), out[r].tokens.begin(), out[r].tokens.end());
        verified[r] = {windows[r], taps.data(), 0, ids[12]};
      }
      rows->commit(verified);
    }
    return all;
  };
  const std::vector<int32_t> device = draw(false), host = draw(true);
  ASSERT_EQ(device.size(), 24u);
  EXPECT_EQ(device, host);
}

// --- Lossless speculation on the demo ------------------------------------------------------------

struct Case {
  int depth;
  float temperature;
};
class Eagle3Lossless : public ::testing::TestWithParam<Case> {};

TEST_P(Eagle3Lossless, SpeculativeEqualsPlainAloneAndBatched) {
  const Case c = GetParam();
  // The probe stays off: a random head's greedy proposals are rarely accepted, and the test is
  // about the rounds it drafts.
  SpecOptions opts{c.depth, spec::VerifyMode::Match};
  opts.health_probe = false;
  SpeculativeGenerator spec_gen(*demo().model, &lucky_head(), "demo-target", opts);
  std::vector<GenerateRequest> reqs;
  for (size_t p = 0; p < test::kDemoPrompts.size(); ++p)
    for (uint64_t seed : {1u, 2u})
      reqs.push_back(test::demo_request(demo(), test::kDemoPrompts[p], c.temperature, seed * 7 + p,
                                        12 + 5 * (p + seed)));
  const auto want = test::plain_tokens(*demo().model, reqs);
  for (size_t i = 0; i < reqs.size(); ++i)
    ASSERT_EQ(spec_gen.run({reqs[i]}).at(0).tokens, want[i]) << "alone, request " << i;
  std::vector<SpecStats> st;
  const auto got = spec_gen.run(reqs, {}, nullptr, &st);
  int64_t accepted = 0;
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(got[i].tokens, want[i]) << "batched request " << i;
    accepted += st[i].accepted;
  }
  // Sampled drafts from a head over the tokens the demo emits are accepted now and then, so the
  // rounds that keep accepted rows run (greedy ones may always miss; the commit tests cover them).
  if (c.temperature > 0) {
    EXPECT_GT(accepted, 0) << "no proposal was ever accepted: rollback of accepted rows not run";
  }
}

INSTANTIATE_TEST_SUITE_P(Depths, Eagle3Lossless,
                         ::testing::Values(Case{1, 0.0f}, Case{1, 0.7f}, Case{1, 1.0f},
                                           Case{3, 0.0f}, Case{3, 0.7f}, Case{3, 1.0f}),
                         [](const auto& i) {
                           return "depth" + std::to_string(i.param.depth) + "_T" +
                                  std::to_string(static_cast<int>(i.param.temperature * 10));
                         });

// Rejection mode: greedy equals plain decoding; sampled rows run with the head's distribution.
TEST(Eagle3Rejection, GreedyEqualsPlainAndSampledRuns) {
  SpecOptions opts{3, spec::VerifyMode::Rejection};
  opts.health_probe = false;
  SpeculativeGenerator spec_gen(*demo().model, &lucky_head(), "demo-target", opts);
  Generator gen(*demo().model);
  std::vector<GenerateRequest> reqs;
  for (size_t p = 0; p < test::kDemoPrompts.size(); ++p)
    reqs.push_back(test::demo_request(demo(), test::kDemoPrompts[p], 0.0f, p, 20));
  const auto got = spec_gen.run(reqs);
  for (size_t i = 0; i < reqs.size(); ++i)
    EXPECT_EQ(got[i].tokens, gen.run({reqs[i]}).at(0).tokens) << i;
  for (auto& r : reqs) {
    r.sampling.temperature = 0.8f;
    r.ignore_eos = true;
  }
  std::vector<SpecStats> st;
  const auto sampled = spec_gen.run(reqs, {}, nullptr, &st);
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(static_cast<int64_t>(sampled[i].tokens.size()), reqs[i].max_tokens);
    EXPECT_GT(st[i].rounds, 0);
  }
}

// The prefix cache: a later turn reusing a saved boundary gets exactly a cold engine's tokens.
TEST(Eagle3PrefixCache, HitEqualsColdEngine) {
  auto options = [](size_t cache) {
    EngineOptions o;
    o.spec.depth = 3;
    o.spec.prefill_chunk = 16;
    o.prefill_budget = 64;
    o.max_rows = 4;
    o.kv_blocks = 200;
    o.prefix_cache_bytes = cache;
    return o;
  };

  for (float temperature : {0.0f, 0.9f}) {
    BatchEngine cached(*demo().model, &lucky_head(), "demo-target", options(size_t{1} << 30));
    GenerateRequest first = test::demo_request(demo(), test::kDemoPrompts[1], temperature, 5, 12);
    std::vector<int32_t> answer;
    test::serve_alone(cached, first, &answer);
    GenerateRequest next = first;
    next.prompt.insert(next.prompt.end(), answer.begin(), answer.end());
    const std::vector<int32_t> more = demo().tok->encode("\n    def put(self, key, value):\n");
    next.prompt.insert(next.prompt.end(), more.begin(), more.end());
    next.sampling.seed = 6;
    std::vector<int32_t> hot, cold;
    const RequestOutcome oh = test::serve_alone(cached, next, &hot);
    BatchEngine fresh(*demo().model, &lucky_head(), "demo-target", options(0));
    test::serve_alone(fresh, next, &cold);
    EXPECT_GT(oh.cached_tokens, 0);
    EXPECT_EQ(hot, cold) << "T " << temperature;
  }
}

// GLM-5 targets tap layers too: the taps are the residual stream entering each layer (the GLM-5
// demo cut to its first layers), and an EAGLE-3 head drafts losslessly on it.
TEST(Eagle3Glm5, TapsAndLosslessOnTheGlm5Demo) {
  const std::string dir = std::string(TANDEM_SOURCE_DIR) + "/models/glm5-demo";
  const auto model = Glm5Model::load(dir);
  const int64_t H = model->config().hidden_size;
  const std::vector<int32_t> ids = random_ids(21, 100);
  const int64_t T = static_cast<int64_t>(ids.size());
  auto forward = [&](const Glm5Model& m, const std::vector<int>& taps, ForwardOutput* out) {
    Glm5State st(m.config(), 0);
    const std::vector<RowInput> rows = {{st.open_row(), T, false}};
    ForwardRequest req{ids, rows};
    req.prompt = true;
    req.want_prenorm_hidden = true;
    req.tap_layers = taps;
    m.forward(st, req, out);
  };
  const std::vector<int> layers = {3, 0, 1, 2};
  ForwardOutput out;
  forward(*model, layers, &out);
  ASSERT_EQ(out.layer_taps.size(), static_cast<size_t>(T * 4 * H));
  for (size_t j = 0; j < layers.size(); ++j) {
    std::vector<float> want(static_cast<size_t>(T * H));
    if (layers[j] == 0) {
      model->embed(ids, want.data());
    } else {
      const std::string cut = scratch().file("glm5_first_" + std::to_string(layers[j]));
      fs::create_directories(cut);
      json config = read_json_file(dir + "/config.json");
      for (const char* key : {"mlp_layer_types", "indexer_types"})
        config[key] = json(std::vector<json>(config[key].begin(), config[key].begin() + layers[j]));
      config["num_hidden_layers"] = layers[j];
      config["num_nextn_predict_layers"] = 0;
      std::ofstream(cut + "/config.json") << config.dump(2);
      fs::create_symlink(fs::absolute(dir + "/model.safetensors"), cut + "/model.safetensors");
      ForwardOutput o;
      forward(*Glm5Model::load(cut), {}, &o);
      want = o.prenorm_hidden;
    }
    for (int64_t t = 0; t < T; ++t)
      ASSERT_EQ(0, std::memcmp(out.layer_taps.data() + (t * 4 + static_cast<int64_t>(j)) * H,
                               want.data() + t * H, sizeof(float) * H))
          << "layer " << layers[j] << " token " << t;
  }

  Eagle3RandomShape s;
  s.hidden_size = H;
  s.intermediate_size = 128;
  s.num_attention_heads = 4;
  s.num_key_value_heads = 2;
  s.vocab_size = model->config().vocab_size;
  s.draft_vocab_size = 256;
  s.tap_layers = {1, 2, 3};
  spec::write_random_eagle3_head(s, scratch().file("glm5_head"), DType::BF16, 8);
  const auto head = Eagle3Provider::open(scratch().file("glm5_head"));
  SpecOptions opts;
  opts.depth = 3;
  opts.health_probe = false;
  auto target = [&] { return std::make_unique<Glm5EngineTarget>(*model, "glm5-demo"); };
  SpeculativeGenerator spec_gen(target, model->config().vocab_size, head.get(), opts);
  SpeculativeGenerator plain(target, model->config().vocab_size, nullptr, opts);
  std::vector<GenerateRequest> reqs;
  for (float temperature : {0.0f, 0.8f}) {
    GenerateRequest r;
    r.prompt = std::vector<int32_t>(ids.begin(), ids.begin() + 12 + (temperature > 0 ? 5 : 0));
    r.max_tokens = 12;
    r.ignore_eos = true;
    r.sampling.temperature = temperature;
    r.sampling.seed = 3;
    reqs.push_back(r);
  }
  const auto want = plain.run(reqs), got = spec_gen.run(reqs);
  for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(got[i].tokens, want[i].tokens) << i;
}

// --- The command line ---------------------------------------------------------------------------

std::string run_cli(const std::string& args, int* code) {
  const std::string cmd = std::string(TANDEM_BINARY) + " " + args + " 2>&1";
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int status = pclose(p);
  *code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return out;
}

TEST(Eagle3Cli, GenerateAndBenchSpecDraftWithAHead) {
  lucky_head();  // written
  const std::string head_dir = scratch().file("lucky");
  const std::string gen = "generate --model " + test::kDemoDir +
                          " --prompt 'def f(x):' --max-tokens 16 --json --threads 1";
  int code = 0;
  const json plain = json::parse(run_cli(gen, &code));
  ASSERT_EQ(code, 0);
  const std::string out =
      run_cli(gen + " --draft eagle3 --depth 2 --draft-model " + head_dir, &code);
  ASSERT_EQ(code, 0) << out;
  const json spec = json::parse(out);
  EXPECT_EQ(spec["tokens"], plain["tokens"]);
  EXPECT_EQ(spec["stats"]["draft"], "eagle3");
  EXPECT_GT(spec["stats"]["drafted"].get<int64_t>(), 0);

  const std::string missing = run_cli(gen + " --draft eagle3", &code);
  EXPECT_EQ(code, 1);
  EXPECT_NE(missing.find("--draft eagle3 needs --draft-model"), std::string::npos) << missing;

  const std::string prompts = scratch().file("prompts.jsonl");
  std::ofstream(prompts) << "{\"prompt\": \"def f(x):\"}\n";
  const std::string bench =
      run_cli("bench-spec --model " + test::kDemoDir + " --prompts-file " + prompts +
                  " --drafts eagle3 --draft-model " + head_dir +
                  " --depths 1,2 --max-tokens 8 --repeats 1 --json --threads 1",
              &code);
  ASSERT_EQ(code, 0) << bench;
  const json rows = json::parse(bench.substr(bench.find('[')));
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[1]["draft"], "eagle3");
  EXPECT_EQ(rows[2]["acceptance_by_position"].size(), 2u);
}

// --- The PyTorch oracle (tests/fixtures/eagle3_demo, tools/make_eagle3_fixture.py) ---------------

TEST(Eagle3Oracle, MatchesPyTorchOnTheDemoFixture) {
  const std::string dir = std::string(TANDEM_FIXTURES_DIR) + "/eagle3_demo";
  if (!fs::exists(dir + "/reference.safetensors") || !fs::exists(dir + "/head/config.json"))
    FAIL() << "missing fixture " << dir
           << " (reference.safetensors and head/): run python3 tools/make_eagle3_fixture.py on "
              "the GPU machine and commit its output";
  const testing::FixtureReference ref{SafetensorsFile::open(dir + "/reference.safetensors")};
  auto p = Eagle3Provider::open(dir + "/head");
  const std::vector<int> layers = p->tap_layers(*demo().target);
  ASSERT_EQ(layers, (std::vector<int>{1, 3, 6}));
  const std::vector<int32_t> ids = ref.ids("prompt_ids");
  const int64_t n = static_cast<int64_t>(ids.size()), H = 384, W = 3 * H, Vd = 512;
  const std::vector<float> taps = ref.floats("taps");
  ASSERT_EQ(taps.size(), static_cast<size_t>(n * W));

  // The target's taps (fp32 forward of the bf16 checkpoint, like the reference).
  Qwen35State st(demo().model->config(), RecurrentRollback::PerPositionStates, DType::F32);
  const int slot = st.open_row();
  const std::vector<RowInput> rows = {{slot, n, false}};
  ForwardRequest req{ids, rows};
  req.prompt = true;
  req.tap_layers = layers;
  ForwardOutput out;
  demo().model->forward(st, req, &out);
  const double tap_scale = max_abs(taps);
  for (size_t i = 0; i < taps.size(); ++i)
    ASSERT_NEAR(out.layer_taps[i], taps[i], 1e-4 * tap_scale) << "tap value " << i;

  // Context rows 0..n-2 in one causal pass of the block (from the reference taps).
  const spec::Eagle3Block& block = p->block();
  spec::DraftKvPool kv(2, 64);
  std::vector<int32_t> table;
  kv.reserve(table, n);
  const std::vector<const std::vector<int32_t>*> tables = {&table};
  const std::vector<int64_t> zero = {0}, count = {n - 1};
  const auto segs = kv.segments(tables, zero, count);
  spec::Eagle3Block::Workspace ws;
  std::vector<float> g(static_cast<size_t>(n * H)), emb(static_cast<size_t>((n - 1) * H));
  std::vector<float> hid(static_cast<size_t>((n - 1) * H));
  std::vector<float> logits(static_cast<size_t>((n - 1) * Vd));
  block.project(taps.data(), n, g.data());
  demo().model->embed(std::span(ids).subspan(1), emb.data());
  block.forward(emb.data(), g.data(), segs, kv.view(), ws, hid.data());
  block.logits(hid.data(), n - 1, ws, logits.data());
  const std::vector<float> want_ctx = ref.floats("context_logits");
  const double ctx_scale = max_abs(want_ctx);
  ASSERT_EQ(want_ctx.size(), logits.size());
  for (size_t i = 0; i < logits.size(); ++i)
    ASSERT_NEAR(logits[i], want_ctx[i], 1e-4 * ctx_scale) << "context logit " << i;

  // The greedy chain of depth 4 from (pending, taps_{n-1}) through the rows.
  auto r = p->open_rows(*demo().target);
  auto& e3 = static_cast<Eagle3Rows&>(*r);
  e3.append(std::vector<spec::CheckpointPtr>{nullptr});
  e3.prefill(std::vector<spec::RowPrefill>{{0, ids, taps.data(), 0}});
  const int32_t pending = ref.ids("pending").at(0);
  std::vector<spec::DraftProposal> prop;
  e3.draft(std::vector<spec::RowDraft>{{pending, 4, {}, 0, false}}, &prop);
  const std::vector<float> chain = ref.floats("chain_logits"), chain_h = ref.floats("chain_hidden");
  const std::vector<int32_t> chain_tokens = ref.ids("chain_tokens");
  const double chain_scale = max_abs(chain);
  for (int j = 0; j < 4; ++j) {
    const std::vector<float> l = e3.last_draft_logits(0, j), h = e3.last_draft_hidden(0, j);
    for (int64_t i = 0; i < Vd; ++i)
      ASSERT_NEAR(l[i], chain[j * Vd + i], 1e-4 * chain_scale) << "step " << j << " id " << i;
    for (int64_t i = 0; i < H; ++i)
      ASSERT_NEAR(h[i], chain_h[j * H + i], 1e-4 * max_abs(chain_h)) << "step " << j;
    // Tie-free positions: the top two draft logits apart by more than the tolerance.
    std::vector<float> s(chain.begin() + j * Vd, chain.begin() + (j + 1) * Vd);
    std::partial_sort(s.begin(), s.begin() + 2, s.end(), std::greater<float>());
    if (s[0] - s[1] > 1e-3 * chain_scale)
      EXPECT_EQ(prop[0].tokens.at(static_cast<size_t>(j)), chain_tokens.at(static_cast<size_t>(j)))
          << "step " << j;
    else
      break;  // a near tie: later steps follow a different token
  }
}

}  // namespace
}  // namespace tandem
