// Speculative decoding of a GLM-5 target through the batch engine (Glm5EngineTarget) is lossless:
// with the NextN drafter (its history prefilled or starting empty) and with n-gram lookup, at
// several depths and temperatures, rows of different prompt lengths batched together emit
// exactly the tokens of a plain decoding loop written here against the model alone.
#include <gtest/gtest.h>

#include <filesystem>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "glm5_requests.h"
#include "recording_sink.h"
#include "tandem/core/sampler.h"
#include "tandem/engine/batch_engine.h"
#include "tandem/engine/glm5_engine_target.h"
#include "tandem/engine/speculative.h"
#include "tandem/io/tokenizer.h"
#include "tandem/model/glm5.h"
#include "tandem/model/glm5_random.h"
#include "tandem/spec/glm_mtp.h"
#include "tandem/spec/ngram.h"
#include "test_util.h"

namespace tandem {
namespace {

using testing::ScratchDir;

// Small enough to decode fast, with the DSA indexer choosing (index_topk below the lengths).
const char* kConfig = R"({
  "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
  "vocab_size": 40, "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
  "num_hidden_layers": 2, "num_attention_heads": 2, "q_lora_rank": 16, "kv_lora_rank": 16,
  "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "n_routed_experts": 4,
  "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 2, "topk_group": 1,
  "routed_scaling_factor": 2.0, "first_k_dense_replace": 1, "index_topk": 6,
  "index_head_dim": 16, "index_n_heads": 2, "num_nextn_predict_layers": 1, "eos_token_id": 1
})";

struct Glm5Fixture {
  ScratchDir dir{"glm5-spec"};
  std::unique_ptr<Glm5Model> model;
  std::unique_ptr<spec::Glm5TargetView> view;
  Glm5Fixture() {
    testing::write_text(dir.file("config.json"), kConfig);
    write_random_glm5(dir.file("config.json"), dir.file("model"), DType::BF16, 11);
    model = Glm5Model::load(dir.file("model"));
    view = std::make_unique<spec::Glm5TargetView>(*model, "glm5-spec-target");
  }
};

// A function-local static (not a leaked heap object), so the scratch directory is removed when
// the test process exits.
const Glm5Fixture& fixture() {
  static const Glm5Fixture f;
  return f;
}

// Plain decoding, one request at a time: the prompt in one forward, then one token per forward;
// token i drawn with the key (seed, i).
std::vector<int32_t> plain_decode(const Glm5Model& m, const GenerateRequest& r) {
  Glm5State state(m.config(), 1);
  const int slot = state.open_row();
  std::vector<int32_t> out;
  std::vector<int32_t> in = r.prompt;
  bool prompt = true;
  while (static_cast<int64_t>(out.size()) < r.max_tokens) {
    const RowInput row{slot, static_cast<int64_t>(in.size()), false};
    ForwardRequest req;
    req.tokens = in;
    req.rows = {&row, 1};
    req.prompt = prompt;
    ForwardOutput o;
    m.forward(state, req, &o);
    const int32_t t = sample_token(o.logits, r.sampling, out.size());
    out.push_back(t);
    in = {t};
    prompt = false;
  }
  return out;
}

// (drafter, depth, temperature)
using Case = std::tuple<std::string, int, float>;

class Glm5Lossless : public ::testing::TestWithParam<Case> {};

TEST_P(Glm5Lossless, SpeculativeEqualsPlainDecodingBatched) {
  const auto& [name, depth, temperature] = GetParam();
  const Glm5Fixture& f = fixture();
  std::unique_ptr<spec::DraftProvider> drafter;
  if (name == "mtp")
    drafter = spec::GlmMtpProvider::from_target(*f.view);
  else if (name == "mtp-empty")
    drafter = spec::GlmMtpProvider::from_target(*f.view, spec::GlmMtpHistory::Empty);
  else
    drafter = std::make_unique<spec::NgramProvider>(spec::NgramOptions{1, 3});
  SpecOptions opts;
  opts.depth = depth;
  opts.health_probe = false;  // keep drafting whatever the random drafter accepts
  opts.prefill_chunk = 8;     // the longer prompts take several chunks
  const Glm5Model& model = *f.model;
  SpeculativeGenerator gen(
      [&] { return std::make_unique<Glm5EngineTarget>(model, "glm5-spec-target"); },
      model.config().vocab_size, drafter.get(), opts);
  const std::vector<GenerateRequest> reqs = test::glm5_lossless_requests(temperature);
  std::vector<SpecStats> stats;
  const std::vector<GenerateResult> got = gen.run(reqs, {}, nullptr, &stats);
  ASSERT_EQ(got.size(), reqs.size());
  int64_t drafted = 0, accepted = 0;
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(got[i].tokens, plain_decode(model, reqs[i])) << "request " << i;
    drafted += stats[i].drafted;
    accepted += stats[i].accepted;
  }
  EXPECT_GT(drafted, 0);  // the rounds did carry proposals
  // Greedy rows of this random model repeat themselves: n-gram windows are accepted in part and
  // whole, so commits cut the caches back at every offset.
  if (name == "ngram" && temperature == 0.0f) {
    EXPECT_GT(accepted, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Drafters, Glm5Lossless,
                         ::testing::Combine(::testing::Values("mtp", "mtp-empty", "ngram"),
                                            ::testing::Values(1, 3),
                                            ::testing::Values(0.0f, 0.7f, 1.0f)),
                         [](const ::testing::TestParamInfo<Case>& i) {
                           return std::get<0>(i.param) == "mtp-empty"
                                      ? "mtp_empty_depth" + std::to_string(std::get<1>(i.param)) +
                                            "_T" + std::to_string(int(std::get<2>(i.param) * 10))
                                      : std::get<0>(i.param) + "_depth" +
                                            std::to_string(std::get<1>(i.param)) + "_T" +
                                            std::to_string(int(std::get<2>(i.param) * 10));
                         });

// The bundled GLM-5 demo model (models/glm5-demo, trained with its NextN layer): on held-out
// code prompts its drafter is accepted as its training measured (teacher-forced agreement 0.67;
// a wrong hidden or a broken commit drops it near 0), and the output is plain decoding's.
TEST(Glm5Demo, TheTrainedNextNDraftsLosslesslyAndIsAccepted) {
  const std::string dir = std::string(TANDEM_SOURCE_DIR) + "/models/glm5-demo";
  const auto model = Glm5Model::load(dir);
  const spec::Glm5TargetView view(*model, "glm5-demo");
  const auto drafter = spec::GlmMtpProvider::from_target(view);
  const Tokenizer tok = Tokenizer::load(dir + "/tokenizer.json");
  std::vector<GenerateRequest> reqs;
  for (const char* text :
       {"def read_config(path):\n    \"\"\"Read a JSON configuration file.\"\"\"\n",
        "import os\nimport sys\n\n\nclass Cache:\n    def __init__(self, size):\n"}) {
    GenerateRequest r;
    r.prompt = tok.encode(text);
    r.max_tokens = 40;
    r.ignore_eos = true;
    reqs.push_back(r);
  }
  reqs[1].sampling.temperature = 0.7f;
  reqs[1].sampling.seed = 5;
  SpecOptions opts;
  opts.depth = 3;
  SpeculativeGenerator gen([&] { return std::make_unique<Glm5EngineTarget>(*model, "glm5-demo"); },
                           model->config().vocab_size, drafter.get(), opts);
  std::vector<SpecStats> stats;
  const std::vector<GenerateResult> got = gen.run(reqs, {}, nullptr, &stats);
  int64_t drafted = 0, accepted = 0;
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(got[i].tokens, plain_decode(*model, reqs[i])) << "request " << i;
    drafted += stats[i].drafted_by_position.at(0);
    accepted += stats[i].accepted_by_position.at(0);
  }
  ASSERT_GT(drafted, 10);
  EXPECT_GT(static_cast<double>(accepted) / static_cast<double>(drafted), 0.5)
      << accepted << " of " << drafted << " first proposals accepted";
}

// Prompts sharing a prefix: a later request restores the earlier one's state at the prefill
// grid's boundary (target caches and the NextN drafter's checkpoint) and still emits exactly
// what plain decoding of its own prompt emits.
TEST(Glm5Engine, APrefixCacheHitContinuesLikeAColdPrefill) {
  const Glm5Fixture& f = fixture();
  const auto drafter = spec::GlmMtpProvider::from_target(*f.view);
  for (const bool with_drafter : {false, true}) {
    SCOPED_TRACE(with_drafter ? "glm-mtp" : "no drafter");
    EngineOptions eo;
    eo.spec.depth = 2;
    eo.spec.prefill_chunk = 8;
    eo.spec.health_probe = false;
    eo.prefix_cache_bytes = size_t{64} << 20;
    BatchEngine engine(std::make_unique<Glm5EngineTarget>(*f.model, "glm5-spec-target"),
                       with_drafter ? drafter.get() : nullptr, eo);
    const std::vector<int32_t> shared = {3, 17, 22, 8, 8, 31, 29, 5, 37, 12, 30, 14, 2, 9, 9, 6};
    std::vector<GenerateRequest> reqs(3);
    for (size_t i = 0; i < reqs.size(); ++i) {
      reqs[i].prompt = shared;
      reqs[i].prompt.push_back(static_cast<int32_t>(20 + i));
      reqs[i].prompt.push_back(static_cast<int32_t>(30 - i));
      reqs[i].max_tokens = 12;
      reqs[i].ignore_eos = true;
      reqs[i].sampling.temperature = i == 2 ? 0.7f : 0.0f;
      reqs[i].sampling.seed = i;
    }
    for (size_t i = 0; i < reqs.size(); ++i) {  // one after the other: each finds the last's
      auto sink = std::make_shared<test::RecordingSink>();
      EngineRequest er;
      er.gen = reqs[i];
      engine.submit(er, sink);
      engine.run_to_completion();
      EXPECT_EQ(sink->tokens, plain_decode(*f.model, reqs[i])) << "request " << i;
    }
    const EngineCounters c = engine.counters();
    EXPECT_EQ(c.prefix_hits, 2);
    EXPECT_EQ(c.prefix_tokens_reused, 2 * 16);  // the grid boundary below each prompt's end
  }
}

TEST(Glm5Engine, OptionsTheTargetCannotServeAreRefused) {
  const Glm5Fixture& f = fixture();
  EngineOptions eo;
  eo.max_rows = 4;
  eo.kv_blocks = 64;
  try {
    BatchEngine e(std::make_unique<Glm5EngineTarget>(*f.model, "x"), nullptr, eo);
    ADD_FAILURE() << "a fixed pool was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("fixed KV pool"), std::string::npos) << e.what();
  }
}

// The prefix cache's disk tier: a clean shutdown writes every boundary, a restarted engine reads
// the longest one back (target caches and the NextN drafter's checkpoint) and emits exactly what
// plain decoding emits; files of another target identity, or damaged ones, are misses and are
// removed; entries evicted under a small budget spill to the disk and come back from it.
TEST(Glm5Engine, ARestartedEngineResumesFromTheDiskTier) {
  const Glm5Fixture& f = fixture();
  const auto drafter = spec::GlmMtpProvider::from_target(*f.view);
  const ScratchDir scratch("glm5-disk");
  const std::string dir = scratch.file("cache");
  auto options = [&](bool persist) {
    EngineOptions eo;
    eo.spec.depth = 2;
    eo.spec.prefill_chunk = 8;
    eo.spec.health_probe = false;
    eo.prefix_cache_bytes = size_t{64} << 20;
    eo.prefix_cache_dir = dir;
    eo.prefix_cache_persist = persist;
    return eo;
  };
  auto serve = [&](BatchEngine& engine, const GenerateRequest& r) {
    auto sink = std::make_shared<test::RecordingSink>();
    EngineRequest er;
    er.gen = r;
    engine.submit(er, sink);
    engine.run_to_completion();
    return sink->tokens;
  };
  const std::vector<int32_t> shared = {3, 17, 22, 8, 8, 31, 29, 5, 37, 12, 30, 14, 2, 9, 9, 6};
  GenerateRequest first, second;
  first.prompt = shared;
  first.prompt.insert(first.prompt.end(), {20, 30});
  second.prompt = shared;
  second.prompt.insert(second.prompt.end(), {21, 29, 4});
  for (GenerateRequest* r : {&first, &second}) {
    r->max_tokens = 12;
    r->ignore_eos = true;
  }
  second.sampling.temperature = 0.7f;
  second.sampling.seed = 3;
  {
    BatchEngine a(std::make_unique<Glm5EngineTarget>(*f.model, "glm5-spec-target"), drafter.get(),
                  options(/*persist=*/true));
    EXPECT_EQ(serve(a, first), plain_decode(*f.model, first));
  }  // the shutdown writes the boundaries at 8 and 16
  {
    BatchEngine b(std::make_unique<Glm5EngineTarget>(*f.model, "glm5-spec-target"), drafter.get(),
                  options(false));
    EXPECT_EQ(serve(b, second), plain_decode(*f.model, second));
    const EngineCounters c = b.counters();
    EXPECT_EQ(c.prefix_disk_hits, 1);
    EXPECT_EQ(c.prefix_tokens_reused, 16);
  }
  {
    // Other weights (another artifact identity): nothing is used, the files are removed.
    BatchEngine other(std::make_unique<Glm5EngineTarget>(*f.model, "glm5-other-weights"),
                      drafter.get(), options(false));
    EXPECT_EQ(serve(other, second), plain_decode(*f.model, second));
    EXPECT_EQ(other.counters().prefix_tokens_reused, 0);
    EXPECT_GT(other.counters().prefix_disk_removed, 0);
  }
  {
    // A damaged file (cut short) is a miss and is removed.
    {
      BatchEngine a(std::make_unique<Glm5EngineTarget>(*f.model, "glm5-spec-target"), drafter.get(),
                    options(true));
      serve(a, first);
    }
    int64_t cut = 0;
    for (const auto& e : std::filesystem::directory_iterator(dir)) {
      std::filesystem::resize_file(e.path(), std::filesystem::file_size(e.path()) / 2);
      ++cut;
    }
    ASSERT_GT(cut, 0);
    BatchEngine b(std::make_unique<Glm5EngineTarget>(*f.model, "glm5-spec-target"), drafter.get(),
                  options(false));
    EXPECT_EQ(serve(b, second), plain_decode(*f.model, second));
    EXPECT_EQ(b.counters().prefix_tokens_reused, 0);
    EXPECT_EQ(b.counters().prefix_disk_removed, cut);
  }
  {
    // A budget that holds the longer boundary only: the shorter is evicted to the disk while the
    // engine runs, and a later request sharing only it reads it back.
    EngineOptions small = options(false);
    BatchEngine probe(std::make_unique<Glm5EngineTarget>(*f.model, "glm5-spec-target"), nullptr,
                      small);
    serve(probe, first);
    // The boundaries at 8 and 16 tokens hold 1 and 2 parts of the total: room for the longer.
    const auto total = static_cast<size_t>(probe.counters().prefix_bytes);
    small.prefix_cache_bytes = total - total / 3 + 8;
    BatchEngine c(std::make_unique<Glm5EngineTarget>(*f.model, "glm5-spec-target"), nullptr, small);
    serve(c, first);
    EXPECT_GT(c.counters().prefix_disk_writes, 0);
    GenerateRequest third;
    third.prompt = {shared.begin(), shared.begin() + 8};
    third.prompt.insert(third.prompt.end(), {1, 2, 3});
    third.max_tokens = 6;
    third.ignore_eos = true;
    EXPECT_EQ(serve(c, third), plain_decode(*f.model, third));
    EXPECT_EQ(c.counters().prefix_tokens_reused, 8);
  }
}

}  // namespace
}  // namespace tandem
