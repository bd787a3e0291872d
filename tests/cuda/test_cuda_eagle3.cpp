// The EAGLE-3 drafter (issue 22) on the CUDA backend, with the trained head for the demo model
// (models/qwen35-demo-eagle3): the target's layer taps against the CPU backend within bf16
// tolerance and bitwise independent of window and batch, the head's arithmetic (fc, the decoder
// layer over its paged KV, the draft head, batched chains) against the CPU on the same inputs,
// and lossless speculation (greedy and sampled, depths 1 and 3, alone and batched) with the head
// accepted about as often as it was trained to be. Run on a GPU machine: `ctest -L cuda`.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "cuda/cuda_test_util.h"
#include "demo_model.h"
#include "tandem/backend/buffer.h"
#include "tandem/backend/ops.h"
#include "tandem/engine/generator.h"
#include "tandem/engine/speculative.h"
#include "tandem/model/qwen3_5.h"
#include "tandem/model/qwen3_5_state.h"
#include "tandem/spec/draft_kv_pool.h"
#include "tandem/spec/eagle3.h"
#include "tandem/spec/eagle3_block.h"

namespace tandem {
namespace {

using spec::Eagle3Provider;
using spec::Eagle3Rows;
using testing::near_blocks;
using testing::ScopedBackend;

const std::string kHead = std::string(TANDEM_SOURCE_DIR) + "/models/qwen35-demo-eagle3";
const std::vector<std::string>& kPrompts = test::kDemoPrompts;

// The tolerance of the other CPU-vs-CUDA model tests (DemoModelMatchesTheCpuBackend: logits
// within 2e-2 of their scale). Here it applies per row (a token's tap of one layer, a draft
// row's logits or hidden), which is stricter than one scale over a whole prompt.
constexpr double kRel = 2e-2;
// Taps seven layers deep carry the activation rounding of every product below them (the CUDA
// linears multiply bf16-rounded activations, the CPU fp32 ones) and are compared per token, not
// against the largest value of the prompt: a little more room. A tap of the wrong layer or the
// wrong token is off by the row's own scale.
constexpr double kTapRel = 3e-2;

class CudaEagle3 : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!ops::cuda_available())
      GTEST_FAIL() << "no usable CUDA device: the `cuda` tests run on a GPU machine only";
  }
};

// The demo model (with its tokenizer and target view "demo-target") and the trained head, loaded
// once per backend under that backend; both live for the whole test run.
struct Demo {
  std::unique_ptr<test::DemoModel> demo;
  std::unique_ptr<Eagle3Provider> head;
  const Qwen35Model& model() const { return *demo->model; }
};
Demo& on(ops::Backend b) {
  static Demo* loaded[2] = {nullptr, nullptr};
  Demo*& d = loaded[b == ops::Backend::Cuda ? 1 : 0];
  if (!d) {
    ScopedBackend scope(b);
    d = new Demo{test::load_demo_model(), nullptr};
    d->head = Eagle3Provider::open(kHead);
  }
  return *d;
}

std::vector<int32_t> encode(const std::string& text) {
  return on(ops::Backend::Cpu).demo->tok->encode(text);
}

double max_abs(const float* v, size_t n) {
  double m = 0;
  for (size_t i = 0; i < n; ++i) m = std::max(m, std::fabs(static_cast<double>(v[i])));
  return m;
}

// max over rows of |got - want| / max |want| of the row (`block` values per row).
double worst_rel(const std::vector<float>& got, const std::vector<float>& want, size_t block) {
  double worst = 0;
  for (size_t b0 = 0; b0 + block <= want.size() && got.size() == want.size(); b0 += block) {
    const double scale = max_abs(want.data() + b0, block);
    for (size_t i = b0; i < b0 + block; ++i)
      worst = std::max(worst, std::fabs(static_cast<double>(got[i]) - want[i]) / scale);
  }
  return worst;
}

// The values of layer tap j (of n per token) of every token: [tokens, H].
std::vector<float> tap_column(const std::vector<float>& taps, size_t n, size_t j, size_t H) {
  std::vector<float> v;
  for (size_t t = 0; t * n * H < taps.size(); ++t)
    v.insert(v.end(), taps.begin() + static_cast<std::ptrdiff_t>((t * n + j) * H),
             taps.begin() + static_cast<std::ptrdiff_t>((t * n + j + 1) * H));
  return v;
}

// Opens a row of st and prefills `prompt` as a prompt forward (the prefill GEMM path on CUDA)
// with `layers` tapped; returns the slot, out has the last token's logits and every token's taps.
int prefill(const Qwen35Model& m, Qwen35State& st, std::span<const int32_t> prompt,
            std::span<const int> layers, ForwardOutput* out) {
  const int slot = st.open_row();
  const RowInput row{slot, static_cast<int64_t>(prompt.size())};
  ForwardRequest req{prompt, {&row, 1}};
  req.prompt = true;
  req.tap_layers = layers;
  m.forward(st, req, out);
  return slot;
}

// A prompt, and the taps (and greedy next token) of its prompt forward on the CPU.
struct Tapped {
  std::vector<int32_t> ids;
  std::vector<float> taps;  // [ids, taps · H]
  int32_t next = 0;
};
Tapped cpu_tapped(const std::string& prompt, const std::vector<int>& layers) {
  ScopedBackend cpu(ops::Backend::Cpu);
  const Qwen35Model& m = on(ops::Backend::Cpu).model();
  Tapped t;
  t.ids = encode(prompt);
  Qwen35State st(m.config());
  ForwardOutput out;
  prefill(m, st, t.ids, layers, &out);
  t.taps = out.layer_taps;
  t.next = static_cast<int32_t>(
      std::max_element(out.logits.end() - m.config().vocab_size, out.logits.end()) -
      (out.logits.end() - m.config().vocab_size));
  return t;
}

// --- Layer taps ------------------------------------------------------------------------------

// The taps a prompt forward and a verify window after it capture on the active backend.
struct Taps {
  std::vector<float> prompt, window;
};
Taps taps_of(const Qwen35Model& m, std::span<const int32_t> prompt, std::span<const int32_t> window,
             std::span<const int> layers) {
  Qwen35State st(m.config());
  ForwardOutput out;
  const int slot = prefill(m, st, prompt, layers, &out);
  Taps t;
  t.prompt = out.layer_taps;
  const RowInput w{slot, static_cast<int64_t>(window.size()), true};
  ForwardRequest req{window, {&w, 1}};
  req.tap_layers = layers;
  ForwardOutput wout;
  m.forward(st, req, &wout);
  t.window = wout.layer_taps;
  return t;
}

// The taps the head reads (and the embedding output, layer 0, in a shuffled list: taps come in
// the listed order) of a prompt forward and of a verify window: on CUDA within bf16 tolerance of
// the CPU's, per token and layer; layer 0 is the embedding row on both, bit for bit. On CUDA, the
// window's taps are bitwise those of decoding its tokens one at a time and of the same window
// next to another row (what the drafter's commit reads is what its prefill would have read).
TEST_F(CudaEagle3, LayerTapsMatchTheCpuAndAreBitwiseIndependentOfWindowAndBatch) {
  const std::vector<int> layers = {7, 0, 3, 5};
  ASSERT_EQ(on(ops::Backend::Cpu).head->tap_layers(*on(ops::Backend::Cpu).demo->target),
            (std::vector<int>{3, 5, 7}));
  const std::vector<int32_t> prompt = encode(kPrompts[1]);
  const std::vector<int32_t> window = encode("        return self.items.get(key)\n");
  ASSERT_GE(window.size(), 4u);
  const size_t n = layers.size(), H = 384, T = prompt.size(), K = window.size();
  Taps cpu, cuda;
  {
    ScopedBackend scope(ops::Backend::Cpu);
    cpu = taps_of(on(ops::Backend::Cpu).model(), prompt, window, layers);
  }
  ScopedBackend scope(ops::Backend::Cuda);
  const Qwen35Model& m = on(ops::Backend::Cuda).model();
  cuda = taps_of(m, prompt, window, layers);
  ASSERT_EQ(cpu.prompt.size(), T * n * H);
  ASSERT_EQ(cuda.prompt.size(), T * n * H);
  ASSERT_EQ(cpu.window.size(), K * n * H);
  ASSERT_EQ(cuda.window.size(), K * n * H);
  for (size_t j = 0; j < n; ++j) {
    SCOPED_TRACE("layer " + std::to_string(layers[j]));
    for (const auto& [what, got, want] : {std::tuple{"prompt", &cuda.prompt, &cpu.prompt},
                                          std::tuple{"window", &cuda.window, &cpu.window}}) {
      const std::vector<float> g = tap_column(*got, n, j, H), w = tap_column(*want, n, j, H);
      if (layers[j] == 0) {
        EXPECT_TRUE(testing::bitwise_equal(g, w)) << what << ": the embedding rows differ";
        continue;
      }
      EXPECT_TRUE(near_blocks(g, w, H, kTapRel)) << what;
      RecordProperty(std::string("max_rel_tap_diff_") + what + "_layer" + std::to_string(layers[j]),
                     std::to_string(worst_rel(g, w, H)));
    }
  }

  // The window's tokens decoded one at a time after the same prompt.
  {
    Qwen35State st(m.config());
    ForwardOutput out;
    const int slot = prefill(m, st, prompt, layers, &out);
    for (size_t k = 0; k < K; ++k) {
      const RowInput r{slot, 1};
      ForwardRequest req{std::span(window).subspan(k, 1), {&r, 1}};
      req.tap_layers = layers;
      ForwardOutput step;
      m.forward(st, req, &step);
      ASSERT_EQ(step.layer_taps.size(), n * H);
      EXPECT_TRUE(
          testing::bitwise_equal(step.layer_taps.data(), cuda.window.data() + k * n * H, n * H))
          << "window token " << k << ": decoded alone differs from the verify window";
    }
  }
  // The window next to a row decoding one token (that row first in the batch).
  {
    Qwen35State st(m.config());
    ForwardOutput out;
    const std::vector<int32_t> other = encode(kPrompts[2]);
    const int a = prefill(m, st, other, layers, &out);
    const int b = prefill(m, st, prompt, layers, &out);
    std::vector<int32_t> toks = {other.back()};
    toks.insert(toks.end(), window.begin(), window.end());
    const std::vector<RowInput> rows = {{a, 1}, {b, static_cast<int64_t>(K), true}};
    ForwardRequest req{toks, rows};
    req.tap_layers = layers;
    ForwardOutput both;
    m.forward(st, req, &both);
    ASSERT_EQ(both.layer_taps.size(), (K + 1) * n * H);
    EXPECT_TRUE(
        testing::bitwise_equal(both.layer_taps.data() + n * H, cuda.window.data(), K * n * H))
        << "the window next to another row differs from the window alone";
  }
}

// --- The head's arithmetic ----------------------------------------------------------------------

// Context rows 0..n-2 of one sequence in one causal pass of the head's block on the active
// backend (row p from token ids[p + 1] and fc(taps[p]), the drafter's row convention): every
// row's output hidden [n - 1, H] and draft logits [n - 1, Vd].
struct BlockOut {
  std::vector<float> hidden, logits;
};
BlockOut block_context(const Demo& d, const std::vector<int32_t>& ids,
                       const std::vector<float>& taps) {
  const spec::Eagle3Block& block = d.head->block();
  const spec::Eagle3Config& c = block.config();
  const int64_t n = static_cast<int64_t>(ids.size()), H = c.hidden_size;
  const int64_t Vd = c.draft_vocab_size, W = c.tap_count() * c.target_hidden_size;
  EXPECT_EQ(static_cast<int64_t>(taps.size()), n * W);
  spec::DraftKvPool kv(c.num_key_value_heads, c.head_dim);
  std::vector<int32_t> table;
  kv.reserve(table, n);
  const std::vector<const std::vector<int32_t>*> tables = {&table};
  const std::vector<int64_t> zero = {0}, count = {n - 1};
  const std::vector<AttentionSegment> segs = kv.segments(tables, zero, count);
  spec::Eagle3Block::Workspace ws;
  Buffer<float> t(n * W), g(n * H), emb((n - 1) * H), hid((n - 1) * H), logits((n - 1) * Vd);
  ops::copy_from_host(t.data(), taps.data(), sizeof(float) * taps.size());
  block.project(t.data(), n, g.data());
  d.model().embed(std::span(ids).subspan(1), emb.data());
  block.forward(emb.data(), g.data(), segs, kv.view(), ws, hid.data());
  block.logits(hid.data(), n - 1, ws, logits.data());
  BlockOut o;
  o.hidden.resize(static_cast<size_t>((n - 1) * H));
  o.logits.resize(static_cast<size_t>((n - 1) * Vd));
  ops::copy_to_host(o.hidden.data(), hid.data(), sizeof(float) * o.hidden.size());
  ops::copy_to_host(o.logits.data(), logits.data(), sizeof(float) * o.logits.size());
  return o;
}

// The block on the same inputs (a prompt's CPU taps): every context row's output hidden and
// draft logits on CUDA within bf16 tolerance of the CPU's (rows attend to 1..n-1 positions, so
// the paged attention is checked at every length up to the prompt's).
TEST_F(CudaEagle3, BlockContextRowsMatchTheCpu) {
  const std::vector<int> layers = {3, 5, 7};
  const Tapped in = cpu_tapped(kPrompts[1], layers);
  BlockOut cpu, cuda;
  {
    ScopedBackend scope(ops::Backend::Cpu);
    cpu = block_context(on(ops::Backend::Cpu), in.ids, in.taps);
  }
  {
    ScopedBackend scope(ops::Backend::Cuda);
    cuda = block_context(on(ops::Backend::Cuda), in.ids, in.taps);
  }
  const spec::Eagle3Config& c = on(ops::Backend::Cpu).head->block().config();
  const size_t H = static_cast<size_t>(c.hidden_size), Vd = static_cast<size_t>(c.draft_vocab_size);
  ASSERT_EQ(cpu.logits.size(), (in.ids.size() - 1) * Vd);
  EXPECT_TRUE(near_blocks(cuda.hidden, cpu.hidden, H, kRel)) << "context rows' output hidden";
  EXPECT_TRUE(near_blocks(cuda.logits, cpu.logits, Vd, kRel)) << "context rows' draft logits";
  RecordProperty("max_rel_hidden_diff", std::to_string(worst_rel(cuda.hidden, cpu.hidden, H)));
  RecordProperty("max_rel_logit_diff", std::to_string(worst_rel(cuda.logits, cpu.logits, Vd)));
}

// One greedy draft of a batch of rows through Eagle3Rows on the active backend: the proposals,
// and per row and step the draft logits and output hidden.
struct Chains {
  std::vector<std::vector<int32_t>> tokens;
  std::vector<std::vector<std::vector<float>>> logits, hidden;  // [row][step]
};
Chains draft_chains(const Demo& d, const std::vector<Tapped>& in, const std::vector<int>& depths) {
  std::unique_ptr<spec::DraftRows> base = d.head->open_rows(*d.demo->target);
  auto& rows = static_cast<Eagle3Rows&>(*base);
  rows.append(std::vector<spec::CheckpointPtr>(in.size(), nullptr));
  std::vector<spec::RowPrefill> pre;
  std::vector<spec::RowDraft> draft;
  for (size_t i = 0; i < in.size(); ++i) {
    pre.push_back({static_cast<int>(i), in[i].ids, in[i].taps.data(), 0});
    draft.push_back({in[i].next, depths[i], {}, 0, false});
  }
  rows.prefill(pre);
  for (size_t i = 0; i < in.size(); ++i)
    EXPECT_EQ(rows.context_rows(static_cast<int>(i)), static_cast<int64_t>(in[i].ids.size()) - 1);
  std::vector<spec::DraftProposal> out;
  rows.draft(draft, &out);
  Chains c;
  for (size_t i = 0; i < in.size(); ++i) {
    c.tokens.push_back(out.at(i).tokens);
    c.logits.emplace_back();
    c.hidden.emplace_back();
    for (int j = 0; j < depths[i]; ++j) {
      c.logits.back().push_back(rows.last_draft_logits(static_cast<int>(i), j));
      c.hidden.back().push_back(rows.last_draft_hidden(static_cast<int>(i), j));
    }
  }
  return c;
}

// The drafter's own path (prefill of context rows, chained steps fed the previous step's hidden,
// the draft head and argmax mapped through d2t) for three rows of different prompt lengths and
// depths in one batch, on the same inputs (CPU taps, the CPU's greedy next token pending): every
// step's draft logits and hidden on CUDA within bf16 tolerance of the CPU's, and the same
// proposals wherever the CPU's top two draft logits are clearly apart (after a proposal that
// differs, the chains read different tokens and are not compared).
TEST_F(CudaEagle3, BatchedDraftChainsMatchTheCpu) {
  const std::vector<int> layers = {3, 5, 7}, depths = {4, 1, 3};
  std::vector<Tapped> in;
  for (const std::string& p : kPrompts) in.push_back(cpu_tapped(p, layers));
  ASSERT_NE(in[0].ids.size(), in[1].ids.size());
  Chains cpu, cuda;
  {
    ScopedBackend scope(ops::Backend::Cpu);
    cpu = draft_chains(on(ops::Backend::Cpu), in, depths);
  }
  {
    ScopedBackend scope(ops::Backend::Cuda);
    cuda = draft_chains(on(ops::Backend::Cuda), in, depths);
  }
  const size_t H = 384;
  int compared = 0;
  double worst_logits = 0, worst_hidden = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    ASSERT_EQ(cuda.tokens[i].size(), static_cast<size_t>(depths[i])) << "row " << i;
    for (size_t j = 0; j < static_cast<size_t>(depths[i]); ++j) {
      SCOPED_TRACE("row " + std::to_string(i) + " step " + std::to_string(j));
      const std::vector<float>& want = cpu.logits[i][j];
      EXPECT_TRUE(near_blocks(cuda.logits[i][j], want, want.size(), kRel)) << "draft logits";
      EXPECT_TRUE(near_blocks(cuda.hidden[i][j], cpu.hidden[i][j], H, kRel)) << "output hidden";
      worst_logits = std::max(worst_logits, worst_rel(cuda.logits[i][j], want, want.size()));
      worst_hidden = std::max(worst_hidden, worst_rel(cuda.hidden[i][j], cpu.hidden[i][j], H));
      ++compared;
      std::vector<float> top = want;
      std::partial_sort(top.begin(), top.begin() + 2, top.end(), std::greater<float>());
      if (top[0] - top[1] > 4e-2 * max_abs(want.data(), want.size())) {
        EXPECT_EQ(cuda.tokens[i][j], cpu.tokens[i][j]) << "greedy proposal";
      }
      if (cuda.tokens[i][j] != cpu.tokens[i][j]) break;
    }
  }
  RecordProperty("steps_compared", std::to_string(compared) + " of 8");
  RecordProperty("max_rel_draft_logit_diff", std::to_string(worst_logits));
  RecordProperty("max_rel_draft_hidden_diff", std::to_string(worst_hidden));
}

// --- Lossless speculative decoding on the GPU ---------------------------------------------------

struct SpecCase {
  int depth;
  float temperature;
};

class CudaEagle3Lossless : public CudaEagle3, public ::testing::WithParamInterface<SpecCase> {};

// Two requests per demo prompt (three prompt lengths, different seeds and lengths).
std::vector<GenerateRequest> lossless_requests(float temperature) {
  std::vector<GenerateRequest> reqs;
  for (size_t p = 0; p < kPrompts.size(); ++p)
    for (uint64_t seed : {1u, 2u}) {
      GenerateRequest r;
      r.prompt = encode(kPrompts[p]);
      r.sampling.temperature = temperature;
      r.sampling.top_p = temperature > 0 ? 0.95f : 1.0f;
      r.sampling.seed = seed * 7 + p;
      r.max_tokens = static_cast<int64_t>(16 + 6 * (p + seed));
      reqs.push_back(r);
    }
  return reqs;
}

// Plain decoding of each request alone on CUDA, once per temperature (both depths compare with
// it).
const std::vector<std::vector<int32_t>>& plain_tokens(float temperature,
                                                      const std::vector<GenerateRequest>& reqs) {
  static std::map<float, std::vector<std::vector<int32_t>>> cache;
  auto [it, fresh] = cache.try_emplace(temperature);
  if (fresh) {
    Generator gen(on(ops::Backend::Cuda).model());
    for (const auto& r : reqs) it->second.push_back(gen.run({r}).at(0).tokens);
  }
  return it->second;
}

// The trained head on the GPU gives plain decoding's tokens exactly, each request alone and all
// six in one batch (rows of three prompt lengths), greedy and sampled; its proposals are accepted
// (so rounds keep accepted rows and the commit rebuilds context rows from verified taps). The
// head and the target were loaded apart, so each holds its own backend context (stream and
// scratch): every round switches between the two and back.
TEST_P(CudaEagle3Lossless, SpeculativeEqualsPlainAloneAndBatched) {
  ScopedBackend cuda(ops::Backend::Cuda);
  const SpecCase c = GetParam();
  const Demo& d = on(ops::Backend::Cuda);
  ASSERT_NE(d.head->block().context().id(), d.model().context().id());
  SpecOptions o{c.depth, spec::VerifyMode::Match};
  o.health_probe = false;  // every round drafts, whatever the head's acceptance on the GPU
  SpeculativeGenerator spec_gen(d.model(), d.head.get(), "demo-target", o);
  const std::vector<GenerateRequest> reqs = lossless_requests(c.temperature);
  const std::vector<std::vector<int32_t>>& want = plain_tokens(c.temperature, reqs);
  for (size_t i = 0; i < reqs.size(); ++i)
    ASSERT_EQ(spec_gen.run({reqs[i]}).at(0).tokens, want[i])
        << "eagle3 depth " << c.depth << " T " << c.temperature << " request " << i << " alone";
  std::vector<SpecStats> st;
  const auto got = spec_gen.run(reqs, {}, nullptr, &st);
  ASSERT_EQ(got.size(), reqs.size());
  int64_t drafted = 0, accepted = 0;
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(got[i].tokens, want[i]) << "batched request " << i;
    drafted += st[i].drafted;
    accepted += st[i].accepted;
  }
  EXPECT_GT(drafted, 0) << "the head drafted nothing";
  EXPECT_GT(accepted, 0) << "no proposal of the trained head was ever accepted on the GPU";
}

INSTANTIATE_TEST_SUITE_P(Depths, CudaEagle3Lossless,
                         ::testing::Values(SpecCase{1, 0.0f}, SpecCase{1, 0.7f}, SpecCase{1, 1.0f},
                                           SpecCase{3, 0.0f}, SpecCase{3, 0.7f}, SpecCase{3, 1.0f}),
                         [](const auto& info) {
                           return "depth" + std::to_string(info.param.depth) + "_T" +
                                  std::to_string(static_cast<int>(info.param.temperature * 10));
                         });

// The head is accepted on the GPU as trained: greedy at depth 3, the demo prompts batched, more
// than 2 tokens per round (bonus included). On the CPU backend the same requests give 3.08 (and
// PyTorch's held-out evaluation 3.49); a drafter that proposes wrong tokens gives about 1.0.
// The health probe stays on, as in serving: a broken GPU drafter it released fails here too.
TEST_F(CudaEagle3, TrainedHeadIsAcceptedAtDepth3) {
  ScopedBackend cuda(ops::Backend::Cuda);
  const Demo& d = on(ops::Backend::Cuda);
  SpeculativeGenerator spec_gen(d.model(), d.head.get(), "demo-target",
                                {3, spec::VerifyMode::Match});
  std::vector<GenerateRequest> reqs;
  for (const std::string& p : kPrompts) {
    GenerateRequest r;
    r.prompt = encode(p);
    r.max_tokens = 40;
    reqs.push_back(r);
  }
  std::vector<SpecStats> st;
  const auto got = spec_gen.run(reqs, {}, nullptr, &st);
  Generator plain(d.model());
  SpecStats all;
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(got[i].tokens, plain.run({reqs[i]}).at(0).tokens) << "request " << i;
    all.rounds += st[i].rounds;
    all.drafted += st[i].drafted;
    all.accepted += st[i].accepted;
  }
  ASSERT_GT(all.rounds, 0);
  EXPECT_GT(all.drafted, 0) << "the head drafted nothing";
  RecordProperty("mean_accepted_length", std::to_string(all.mean_accepted_length()));
  EXPECT_GT(all.mean_accepted_length(), 2.0)
      << "the trained head is accepted " << all.mean_accepted_length()
      << " tokens per round at depth 3 on the GPU (CPU 3.08): " << all.accepted << " of "
      << all.drafted << " proposals in " << all.rounds << " rounds";
}

}  // namespace
}  // namespace tandem
