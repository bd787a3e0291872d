// The batch engine on the GPU: requests joining a running speculative batch at different steps,
// one prompt spanning three prefill chunks interleaved with decode rounds, every request's tokens
// bitwise those of plain decoding alone. On CUDA a prompt's numbers depend on where its chunks
// start (the first chunk runs the prompt attention kernel), so this holds because the engine and
// the plain generator cut prompts at the same fixed boundaries.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "demo_model.h"
#include "recording_sink.h"
#include "tandem/backend/ops.h"
#include "tandem/engine/batch_engine.h"
#include "tandem/engine/generator.h"
#include "tandem/spec/qwen_mtp.h"

namespace tandem {
namespace {

class OnCuda {
 public:
  OnCuda() : saved_(ops::backend()) { ops::set_backend(ops::Backend::Cuda); }
  ~OnCuda() { ops::set_backend(saved_); }

 private:
  ops::Backend saved_;
};

test::DemoModel& demo() {
  static test::DemoModel* d = [] {
    OnCuda cuda;
    return test::load_demo_model().release();
  }();
  return *d;
}

using Sink = test::RecordingSink;

struct Case {
  const char* drafter;
  int64_t budget;
  int64_t chunk = kPrefillChunkTokens;
  int layers = 0;  // layer-sliced prefill: layers per step (0 = whole forwards)
};

class CudaStaggeredJoins : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    if (!ops::cuda_available())
      GTEST_FAIL() << "no usable CUDA device: the `cuda` tests run on a GPU machine only";
  }
};

TEST_P(CudaStaggeredJoins, EveryRequestEqualsPlainDecodingAlone) {
  OnCuda cuda;
  const Case c = GetParam();
  auto& d = demo();
  std::ifstream in(test::kDemoDir + "/heldout_sample.py");
  std::stringstream ss;
  ss << in.rdbuf();
  auto long_prompt = d.tok->encode(ss.str());
  long_prompt.resize(600);
  std::vector<GenerateRequest> reqs;
  for (size_t i = 0; i < 6; ++i) {
    GenerateRequest r;
    r.prompt =
        i == 2 ? long_prompt : d.tok->encode(test::kDemoPrompts[i % test::kDemoPrompts.size()]);
    r.sampling.temperature = i % 3 == 0 ? 0.0f : 0.8f;
    r.sampling.top_p = 0.9f;
    r.sampling.seed = 17 + i;
    r.max_tokens = 10 + 5 * static_cast<int64_t>(i);
    reqs.push_back(r);
  }
  const spec::DraftProvider* drafter = std::string(c.drafter) == "mtp"     ? d.mtp.get()
                                       : std::string(c.drafter) == "ngram" ? d.ngram.get()
                                                                           : nullptr;
  EngineOptions o;
  o.spec.depth = 3;
  o.prefill_budget = c.budget;
  o.spec.prefill_chunk = c.chunk;
  o.prefill_layers = c.layers;
  o.prefill_slice_ratio = 0;  // slice whenever a row decodes
  o.max_rows = 4;
  o.kv_blocks = 400;
  BatchEngine engine(*d.model, drafter, "demo-target", o);
  std::vector<std::shared_ptr<Sink>> sinks;
  size_t next = 0;
  for (int step = 0;; ++step) {
    if (next < reqs.size() && step % 2 == 0) {
      sinks.push_back(std::make_shared<Sink>());
      engine.submit({reqs[next++], -1}, sinks.back());
    }
    if (!engine.step() && next == reqs.size()) break;
    ASSERT_LT(step, 3000);
  }
  Generator plain(*d.model, c.chunk);
  for (size_t i = 0; i < reqs.size(); ++i) {
    ASSERT_TRUE(sinks[i]->outcome.has_value());
    EXPECT_EQ(sinks[i]->outcome->end, RequestEnd::Finished) << sinks[i]->outcome->error;
    EXPECT_EQ(sinks[i]->tokens, plain.run({reqs[i]}).at(0).tokens) << c.drafter << " " << i;
  }
  EXPECT_EQ(engine.counters().kv_blocks_used, 0);
}

INSTANTIATE_TEST_SUITE_P(Engine, CudaStaggeredJoins,
                         ::testing::Values(Case{"none", 256}, Case{"mtp", 256}, Case{"ngram", 512},
                                           Case{"mtp", 0}, Case{"mtp", 128, 64},
                                           Case{"none", 256, 64, 1}, Case{"mtp", 256, 256, 3},
                                           Case{"ngram", 0, 64, 2}),
                         [](const auto& info) {
                           return std::string(info.param.drafter) + "_budget" +
                                  std::to_string(info.param.budget) + "_chunk" +
                                  std::to_string(info.param.chunk) +
                                  (info.param.layers > 0
                                       ? "_layers" + std::to_string(info.param.layers)
                                       : std::string());
                         });

// The prefix cache on the GPU: only the chunk grid's boundaries are saved (a prompt's end is not:
// CUDA's prompt forwards differ from decoding), and a request resumed from one gets the tokens of
// plain decoding alone, with every drafter.
class CudaCachedPrefixes : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    if (!ops::cuda_available())
      GTEST_FAIL() << "no usable CUDA device: the `cuda` tests run on a GPU machine only";
  }
};

TEST_P(CudaCachedPrefixes, GridBoundaryHitEqualsPlainDecodingAlone) {
  OnCuda cuda;
  auto& d = demo();
  std::ifstream in(test::kDemoDir + "/heldout_sample.py");
  std::stringstream ss;
  ss << in.rdbuf();
  auto text = d.tok->encode(ss.str());
  text.resize(450);
  const spec::DraftProvider* drafter = std::string(GetParam()) == "mtp"     ? d.mtp.get()
                                       : std::string(GetParam()) == "ngram" ? d.ngram.get()
                                                                            : nullptr;
  EngineOptions o;
  o.spec.depth = 3;
  o.spec.prefill_chunk = 64;
  o.prefill_budget = 128;
  o.max_rows = 4;
  o.kv_blocks = 200;
  o.prefix_cache_bytes = size_t{1} << 30;
  BatchEngine engine(*d.model, drafter, "demo-target", o);
  Generator plain(*d.model, 64);
  auto run = [&](std::vector<int32_t> prompt, float temperature, uint64_t seed) {
    GenerateRequest r;
    r.prompt = std::move(prompt);
    r.sampling.temperature = temperature;
    r.sampling.top_p = 0.9f;
    r.sampling.seed = seed;
    r.max_tokens = 16;
    auto sink = std::make_shared<Sink>();
    engine.submit({r, -1}, sink);
    engine.run_to_completion();
    EXPECT_TRUE(sink->outcome.has_value());
    EXPECT_EQ(sink->tokens, plain.run({r}).at(0).tokens) << GetParam();
    return sink->outcome->cached_tokens;
  };
  EXPECT_EQ(run({text.begin(), text.begin() + 300}, 0.0f, 1), 0);
  EXPECT_EQ(engine.counters().prefix_entries, 4);  // 64, 128, 192, 256: not the prompt's end
  EXPECT_EQ(run(text, 0.8f, 2), 256);
  EXPECT_EQ(run({text.begin(), text.begin() + 200}, 0.0f, 3), 192);
}

INSTANTIATE_TEST_SUITE_P(Engine, CudaCachedPrefixes, ::testing::Values("none", "mtp", "ngram"));

// The drafter health probe on the GPU: random MTP weights (a drafter that no longer fits its
// target, as a wrong hidden tap or a damaged quantization leaves it) are reported once and stop
// drafting, with plain decoding's output; the demo's own MTP layer is never reported.
TEST(CudaDrafterHealth, TheProbeCatchesABrokenDrafterOnly) {
  if (!ops::cuda_available())
    GTEST_FAIL() << "no usable CUDA device: the `cuda` tests run on a GPU machine only";
  OnCuda cuda;
  auto& d = demo();
  const auto broken = spec::QwenMtpProvider::random(*d.target, 5);
  Generator plain(*d.model, 64);
  const std::vector<const spec::DraftProvider*> drafters = {broken.get(), d.mtp.get()};
  for (const spec::DraftProvider* drafter : drafters) {
    EngineOptions o;
    o.max_rows = 4;
    std::vector<std::string> warnings;
    o.on_warning = [&](const std::string& w) { warnings.push_back(w); };
    BatchEngine engine(*d.model, drafter, "demo-target", o);
    std::vector<GenerateRequest> reqs;
    std::vector<std::shared_ptr<Sink>> sinks;
    for (int r = 0; r < 4; ++r) {
      GenerateRequest g;
      g.prompt =
          d.tok->encode(test::kDemoPrompts[static_cast<size_t>(r) % test::kDemoPrompts.size()]);
      g.sampling.temperature = r % 2 ? 0.8f : 0.0f;
      g.sampling.seed = 7 + static_cast<uint64_t>(r);
      g.max_tokens = 96;
      g.ignore_eos = true;
      reqs.push_back(g);
      sinks.push_back(std::make_shared<Sink>());
      engine.submit({g, -1}, sinks.back());
    }
    engine.run_to_completion();
    for (int r = 0; r < 4; ++r)
      EXPECT_EQ(sinks[static_cast<size_t>(r)]->tokens,
                plain.run({reqs[static_cast<size_t>(r)]}).at(0).tokens)
          << "request " << r;
    const bool is_broken = drafter == broken.get();
    EXPECT_EQ(warnings.size(), is_broken ? 1u : 0u);
    EXPECT_EQ(engine.counters().drafter_disabled, is_broken ? 1 : 0);
  }
}

}  // namespace
}  // namespace tandem
