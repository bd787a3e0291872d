// The continuously batched engine: requests that join a running speculative batch at any step,
// prompts prefilled in chunks under a token budget, neighbours that are cancelled, fail or stop
// early — every request's tokens still equal plain decoding of it alone (DESIGN.md §7). Plus the
// fixed pool: admission waits for room, a request that can never fit is refused at once, a join
// that fails leaves the running rows untouched.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <fstream>
#include <sstream>

#include "demo_model.h"
#include "tandem/core/error.h"
#include "tandem/engine/batch_engine.h"
#include "tandem/engine/generator.h"
#include "tandem/spec/qwen_mtp.h"
#include "test_util.h"

namespace tandem {
namespace {

test::DemoModel& demo() {
  static test::DemoModel* f = test::load_demo_model().release();
  return *f;
}

// A prompt longer than two prefill chunks: the held-out sample file of the demo model.
std::vector<int32_t> long_prompt(size_t n) {
  std::ifstream in(test::kDemoDir + "/heldout_sample.py");
  std::stringstream ss;
  ss << in.rdbuf();
  auto ids = demo().tok->encode(ss.str());
  if (ids.size() > n) ids.resize(n);
  return ids;
}

GenerateRequest request(std::vector<int32_t> prompt, float temperature, uint64_t seed,
                        int64_t max_tokens) {
  GenerateRequest r;
  r.prompt = std::move(prompt);
  r.sampling.temperature = temperature;
  r.sampling.top_p = temperature > 0 ? 0.9f : 1.0f;
  r.sampling.seed = seed;
  r.max_tokens = max_tokens;
  return r;
}

std::vector<int32_t> alone(const GenerateRequest& r) {
  Generator gen(*demo().model);
  return gen.run({r}).at(0).tokens;
}

class Recorder : public RequestSink {
 public:
  std::vector<int32_t> tokens;
  std::optional<RequestOutcome> outcome;
  int cancel_after = -1;  // cancel once this many tokens arrived
  int throw_at = -1;      // on_token throws at this token
  int stop_at = -1;       // on_token returns false at this token
  bool on_token(const TokenOutput& t) override {
    EXPECT_EQ(t.index, tokens.size());
    tokens.push_back(t.id);
    const int n = static_cast<int>(tokens.size());
    if (n == throw_at) throw Error("detokenization failed (test)");
    if (n == cancel_after) cancel = true;
    return n != stop_at;
  }
  void on_finish(const RequestOutcome& o) override {
    EXPECT_FALSE(outcome.has_value()) << "on_finish called twice";
    outcome = o;
  }
  bool cancelled() const override { return cancel; }
  std::atomic<bool> cancel{false};
};

std::vector<GenerateRequest> mixed_requests() {
  std::vector<GenerateRequest> reqs;
  const auto& prompts = test::kDemoPrompts;
  for (size_t i = 0; i < 6; ++i) {
    const float t = i % 3 == 0 ? 0.0f : (i % 3 == 1 ? 0.7f : 1.0f);
    std::vector<int32_t> p =
        i == 2 ? long_prompt(600) : demo().tok->encode(prompts[i % prompts.size()]);
    reqs.push_back(request(p, t, 11 + i, 9 + 4 * static_cast<int64_t>(i)));
  }
  return reqs;
}

struct DraftCase {
  const char* drafter;
  int64_t budget;
  int64_t chunk = kPrefillChunkTokens;  // CPU prefill is chunk-invariant: any size agrees
  int layers = 0;                       // layer-sliced prefill: layers per step (0 = whole)
};

class StaggeredJoins : public ::testing::TestWithParam<DraftCase> {};

// Requests join a running batch at different steps, one prompt spans three prefill chunks that
// interleave with decode rounds, and every request's tokens equal plain decoding alone.
TEST_P(StaggeredJoins, EveryRequestEqualsPlainDecodingAlone) {
  const DraftCase c = GetParam();
  auto& d = demo();
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
  const auto reqs = mixed_requests();
  std::vector<std::shared_ptr<Recorder>> sinks;
  size_t next = 0;
  int steps = 0;
  for (;;) {
    // One new request every other step, while earlier ones are mid-prefill or mid-decode.
    if (next < reqs.size() && steps % 2 == 0) {
      sinks.push_back(std::make_shared<Recorder>());
      EngineRequest er;
      er.gen = reqs[next++];
      ASSERT_EQ(engine.submit(er, sinks.back()), BatchEngine::Submit::Queued);
    }
    const bool more = engine.step();
    ++steps;
    if (!more && next == reqs.size()) break;
    ASSERT_LT(steps, 2000);
  }
  for (size_t i = 0; i < reqs.size(); ++i) {
    ASSERT_TRUE(sinks[i]->outcome.has_value()) << i;
    EXPECT_EQ(sinks[i]->outcome->end, RequestEnd::Finished) << sinks[i]->outcome->error;
    EXPECT_EQ(sinks[i]->tokens, alone(reqs[i])) << c.drafter << " request " << i;
    EXPECT_EQ(sinks[i]->outcome->generated_tokens, static_cast<int64_t>(sinks[i]->tokens.size()));
  }
  const EngineCounters k = engine.counters();
  EXPECT_EQ(k.kv_blocks_used, 0);
  EXPECT_EQ(k.finished, static_cast<int64_t>(reqs.size()));
  EXPECT_EQ(k.decoding + k.prefilling + k.queued, 0);
}

INSTANTIATE_TEST_SUITE_P(
    Engine, StaggeredJoins,
    ::testing::Values(DraftCase{"none", 256}, DraftCase{"mtp", 256}, DraftCase{"ngram", 256},
                      DraftCase{"mtp", 512}, DraftCase{"mtp", 0}, DraftCase{"ngram", 128, 64},
                      // A chunk's layers spread over several steps.
                      DraftCase{"none", 256, 64, 1}, DraftCase{"mtp", 128, 64, 3},
                      DraftCase{"ngram", 0, 256, 2}),
    [](const auto& info) {
      return std::string(info.param.drafter) + "_budget" + std::to_string(info.param.budget) +
             "_chunk" + std::to_string(info.param.chunk) +
             (info.param.layers > 0 ? "_layers" + std::to_string(info.param.layers)
                                    : std::string());
    });

// CPU kernels are chunk-invariant outright: a prompt's logits are bitwise the same whether it
// runs in one forward or in chunks (the fixed chunk boundaries are what the GPU relies on).
// A drafter that shares the demo target's context (its MTP chain runs as one CUDA graph there).
std::unique_ptr<spec::DraftProvider> shared_mtp() {
  auto& d = demo();
  const ops::ContextScope scope(d.model->context());
  return spec::QwenMtpProvider::from_target(*d.target);
}

// n demo prompts, greedy and sampled (T = 0.8) in turn; request i has seed seed0 + i and
// max_tokens tokens0 + i * step.
std::vector<GenerateRequest> staggered_requests(size_t n, uint64_t seed0, int64_t tokens0,
                                                int64_t step) {
  auto& d = demo();
  std::vector<GenerateRequest> reqs;
  for (size_t i = 0; i < n; ++i)
    reqs.push_back(request(d.tok->encode(test::kDemoPrompts[i % test::kDemoPrompts.size()]),
                           i % 2 == 0 ? 0.0f : 0.8f, seed0 + i,
                           tokens0 + step * static_cast<int64_t>(i)));
  return reqs;
}

// Submits reqs[i] at step i * every (request `cancelled`, if any, cancels itself after
// cancel_after tokens) and steps the engine until every request has ended. The sinks, in order.
std::vector<std::shared_ptr<Recorder>> run_staggered(BatchEngine& engine,
                                                     const std::vector<GenerateRequest>& reqs,
                                                     int every, size_t cancelled = SIZE_MAX,
                                                     int cancel_after = -1) {
  std::vector<std::shared_ptr<Recorder>> sinks;
  size_t next = 0;
  for (int step = 0;; ++step) {
    if (next < reqs.size() && step % every == 0) {
      sinks.push_back(std::make_shared<Recorder>());
      if (next == cancelled) sinks.back()->cancel_after = cancel_after;
      engine.submit({reqs[next], -1}, sinks.back());
      ++next;
    }
    if (!engine.step() && next == reqs.size()) break;
    if (step >= 3000) {
      ADD_FAILURE() << "the engine did not finish in 3000 steps";
      break;
    }
  }
  return sinks;
}

TEST(BatchEngine, PromptChunkingDoesNotChangeCpuLogits) {
  auto& d = demo();
  const auto prompt = long_prompt(600);
  ASSERT_EQ(prompt.size(), 600u);
  ForwardOutput whole, part;
  {
    Qwen35State st(d.model->config());
    const int slot = st.open_row();
    const RowInput row{slot, static_cast<int64_t>(prompt.size()), false};
    ForwardRequest f{prompt, std::span(&row, 1), false, false};
    f.prompt = true;
    d.model->forward(st, f, &whole);
  }
  {
    Qwen35State st(d.model->config());
    const int slot = st.open_row();
    for (size_t at = 0; at < prompt.size(); at += 100) {
      const size_t n = std::min<size_t>(100, prompt.size() - at);
      const RowInput row{slot, static_cast<int64_t>(n), false};
      ForwardRequest f{std::span(prompt).subspan(at, n), std::span(&row, 1), false, false};
      f.prompt = true;
      d.model->forward(st, f, &part);
    }
  }
  ASSERT_EQ(whole.logits.size(), part.logits.size());
  EXPECT_EQ(
      0, std::memcmp(whole.logits.data(), part.logits.data(), whole.logits.size() * sizeof(float)));
}

// Neighbours that are cancelled, whose consumer throws, or that stop early (a stop string) end
// alone; the other rows' tokens do not change.
TEST(BatchEngine, CancelledFailedAndStoppedNeighboursDoNotDisturbOthers) {
  auto& d = demo();
  // Host rounds, and rounds settled on the device (read a round late: the early ends land while
  // the next round is in flight).
  const auto shared = [&] {
    const ops::ContextScope scope(d.model->context());
    return spec::QwenMtpProvider::from_target(*d.target);
  }();
  for (bool settled : {false, true}) {
    SCOPED_TRACE(settled ? "settled rounds" : "host rounds");
    EngineOptions o;
    o.spec.depth = 2;
    o.spec.settled_rounds = settled;
    o.prefill_budget = 256;
    o.max_rows = 8;
    o.kv_blocks = 300;
    BatchEngine engine(*d.model, settled ? shared.get() : d.mtp.get(), "demo-target", o);
    const auto reqs = mixed_requests();
    std::vector<std::shared_ptr<Recorder>> sinks;
    for (size_t i = 0; i < reqs.size(); ++i) {
      sinks.push_back(std::make_shared<Recorder>());
      EngineRequest er;
      er.gen = reqs[i];
      er.gen.max_tokens = 30;
      engine.submit(er, sinks.back());
    }
    sinks[1]->cancel_after = 4;
    sinks[3]->throw_at = 3;
    sinks[4]->stop_at = 5;
    engine.run_to_completion();
    EXPECT_EQ(sinks[1]->outcome->end, RequestEnd::Cancelled);
    EXPECT_EQ(sinks[3]->outcome->end, RequestEnd::Failed);
    EXPECT_NE(sinks[3]->outcome->error.find("detokenization failed"), std::string::npos);
    EXPECT_EQ(sinks[4]->outcome->end, RequestEnd::Finished);
    EXPECT_EQ(sinks[4]->outcome->finish, FinishReason::Stop);
    EXPECT_EQ(sinks[4]->tokens.size(), 5u);
    for (size_t i : {0u, 2u, 5u}) {
      auto r = reqs[i];
      r.max_tokens = 30;
      EXPECT_EQ(sinks[i]->tokens, alone(r)) << "request " << i;
    }
    // The early ends' prefixes are the plain tokens too.
    for (size_t i : {1u, 3u, 4u}) {
      auto r = reqs[i];
      r.max_tokens = 30;
      const auto want = alone(r);
      ASSERT_LE(sinks[i]->tokens.size(), want.size());
      EXPECT_TRUE(std::equal(sinks[i]->tokens.begin(), sinks[i]->tokens.end(), want.begin()));
    }
    const EngineCounters k = engine.counters();
    EXPECT_EQ(k.cancelled, 1);
    EXPECT_EQ(k.failed, 1);
    EXPECT_EQ(k.finished, 4);
    EXPECT_EQ(k.kv_blocks_used, 0);
    if (settled) {
      EXPECT_GT(k.settled_rounds, 0);
    }
  }
}

// Layer-sliced prefill: a row cancelled while its chunk's forward is halfway through the layers
// waits for that forward to finish before its slot is freed (the forward still writes it), the
// rows sharing the forward and the decoding rows keep their exact tokens, and the pool is whole
// at the end. A prefill layer count the engine cannot use is refused up front.
TEST(BatchEngine, CancellingARowMidSliceFinishesItsForwardFirst) {
  auto& d = demo();
  EngineOptions o;
  o.spec.depth = 2;
  o.spec.prefill_chunk = 64;
  o.prefill_budget = 0;  // every prefilling row in one forward
  o.prefill_layers = 1;
  o.prefill_slice_ratio = 0;
  o.max_rows = 8;
  o.kv_blocks = 400;
  BatchEngine engine(*d.model, d.mtp.get(), "demo-target", o);
  auto first = request(demo().tok->encode(test::kDemoPrompts[0]), 0.0f, 3, 40);
  auto longer = request(long_prompt(500), 0.7f, 4, 12);
  auto victim = request(long_prompt(400), 0.0f, 5, 12);
  std::vector<std::shared_ptr<Recorder>> sinks;
  auto submit = [&](const GenerateRequest& g) {
    sinks.push_back(std::make_shared<Recorder>());
    EngineRequest er;
    er.gen = g;
    ASSERT_EQ(engine.submit(er, sinks.back()), BatchEngine::Submit::Queued);
  };
  submit(first);
  while (sinks[0]->tokens.empty()) ASSERT_TRUE(engine.step());
  submit(longer);
  submit(victim);
  // Slices of one layer: a 64-token chunk's forward spans one step per layer, so after a few
  // steps the two long prompts are mid-forward.
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(engine.step());
  EXPECT_TRUE(sinks[2]->tokens.empty());
  sinks[2]->cancel = true;
  engine.run_to_completion();
  ASSERT_TRUE(sinks[2]->outcome.has_value());
  EXPECT_EQ(sinks[2]->outcome->end, RequestEnd::Cancelled);
  EXPECT_TRUE(sinks[2]->tokens.empty());
  EXPECT_EQ(sinks[0]->tokens, alone(first));
  EXPECT_EQ(sinks[1]->tokens, alone(longer));
  const EngineCounters k = engine.counters();
  EXPECT_EQ(k.cancelled, 1);
  EXPECT_EQ(k.finished, 2);
  EXPECT_EQ(k.kv_blocks_used, 0);

  EngineOptions bad = o;
  bad.prefill_layers = -1;
  EXPECT_THROW(BatchEngine(*d.model, nullptr, "demo-target", bad), Error);
}

// The slicing policy, seen from the steps a prompt waits for its first token next to one decoding
// row (demo model: 8 layers, one layer per step): a prompt longer than a chunk is sliced whatever
// the ratio (8 chunks x 8 layers), a prompt that fits one chunk is not while too few rows decode
// (one step), and is once the ratio allows it (8 steps). Tokens are plain decoding's throughout.
TEST(BatchEngine, LongPromptsAreAlwaysSlicedShortOnesByRatio) {
  auto& d = demo();
  const int layers = d.model->layer_count();
  auto steps_to_first_token = [&](const GenerateRequest& g, int ratio) {
    EngineOptions o;
    o.spec.prefill_chunk = 64;
    o.prefill_budget = 64;
    o.prefill_layers = 1;
    o.prefill_slice_ratio = ratio;
    o.max_rows = 4;
    o.kv_blocks = 200;
    BatchEngine engine(*d.model, nullptr, "demo-target", o);
    auto busy = std::make_shared<Recorder>();
    EngineRequest first;
    first.gen = request(demo().tok->encode(test::kDemoPrompts[0]), 0.0f, 1, 200);
    engine.submit(first, busy);
    while (busy->tokens.empty()) engine.step();
    auto sink = std::make_shared<Recorder>();
    EngineRequest er;
    er.gen = g;
    engine.submit(er, sink);
    int steps = 0;
    while (sink->tokens.empty()) {
      engine.step();
      ++steps;
    }
    busy->cancel = true;
    engine.run_to_completion();
    EXPECT_EQ(sink->tokens, alone(g)) << "ratio " << ratio;
    return steps;
  };
  const auto long_req = request(long_prompt(500), 0.0f, 2, 4);  // 8 chunks of <= 64
  const auto short_req = request(demo().tok->encode(test::kDemoPrompts[2]), 0.0f, 3, 4);
  ASSERT_LE(short_req.prompt.size(), 64u);
  EXPECT_EQ(steps_to_first_token(long_req, 3), 8 * layers);
  EXPECT_EQ(steps_to_first_token(short_req, 3), 1);
  EXPECT_EQ(steps_to_first_token(short_req, 1), layers);
}

// The pool: a request that could never fit is refused at submit; a full queue says so; requests
// wait for blocks and run once earlier ones free theirs.
TEST(BatchEngine, FixedPoolAdmissionWaitsAndRefuses) {
  auto& d = demo();
  EngineOptions o;
  o.spec.depth = 3;
  o.max_rows = 4;
  o.max_queue = 3;
  const auto prompt = d.tok->encode(test::kDemoPrompts[0]);
  // Room for one request of 40 tokens at a time, not two.
  const int64_t per_request = Qwen35State::blocks_for(static_cast<int64_t>(prompt.size()) + 40 + 4);
  o.kv_blocks = per_request + per_request / 2;
  BatchEngine engine(*d.model, d.ngram.get(), "demo-target", o);

  EngineRequest too_big;
  too_big.gen = request(prompt, 0, 1, 100000);
  EXPECT_THROW(engine.submit(too_big, std::make_shared<Recorder>()), Error);
  EngineRequest bad_ids;
  bad_ids.gen = request({1, 2, 999999}, 0, 1, 4);
  EXPECT_THROW(engine.submit(bad_ids, std::make_shared<Recorder>()), Error);

  std::vector<std::shared_ptr<Recorder>> sinks;
  std::vector<GenerateRequest> reqs;
  for (int i = 0; i < 4; ++i) {
    reqs.push_back(request(prompt, 0.8f, 100 + i, 40));
    sinks.push_back(std::make_shared<Recorder>());
    EngineRequest er;
    er.gen = reqs.back();
    const auto s = engine.submit(er, sinks.back());
    EXPECT_EQ(s, i < 3 ? BatchEngine::Submit::Queued : BatchEngine::Submit::QueueFull) << i;
  }
  engine.step();
  EXPECT_EQ(engine.counters().prefilling + engine.counters().decoding, 1);
  EXPECT_EQ(engine.counters().queued, 2);
  engine.run_to_completion();
  for (int i = 0; i < 3; ++i) EXPECT_EQ(sinks[i]->tokens, alone(reqs[i])) << i;
  EXPECT_FALSE(sinks[3]->outcome.has_value());
  EXPECT_EQ(engine.counters().kv_blocks_used, 0);
}

// A drafter whose join fails: the request ends with the error, the running rows keep going and
// their tokens do not change; the failed join left no target slot behind.
class FailingJoins : public spec::DraftProvider {
 public:
  explicit FailingJoins(const spec::DraftProvider& inner) : inner_(inner) {}
  const std::string& id() const override { return inner_.id(); }
  uint64_t weights_bytes() const override { return 0; }
  const std::string& checkpoint_namespace() const override { return inner_.checkpoint_namespace(); }
  std::unique_ptr<spec::DraftRows> open_rows(const spec::TargetView& t) const override;
  mutable std::atomic<int> fail_next{0};

 private:
  const spec::DraftProvider& inner_;
};

class FailingRows : public spec::DraftRows {
 public:
  FailingRows(std::unique_ptr<spec::DraftRows> inner, const FailingJoins& owner)
      : inner_(std::move(inner)), owner_(owner) {}
  const std::string& ns() const override { return inner_->ns(); }
  spec::PrefillMode prefill_mode() const override { return inner_->prefill_mode(); }
  spec::HiddenTaps taps() const override { return inner_->taps(); }
  int row_count() const override { return inner_->row_count(); }
  std::unique_ptr<spec::PreparedChange> prepare_append(
      std::span<const spec::CheckpointPtr> from) override {
    if (owner_.fail_next > 0) {
      --owner_.fail_next;
      fail("drafter refused the join (test)");
    }
    return inner_->prepare_append(from);
  }
  void filter_rows(std::span<const int> keep) override { inner_->filter_rows(keep); }
  void adopt_prefix(int row, std::span<const int32_t> tokens) override {
    inner_->adopt_prefix(row, tokens);
  }
  bool adopts_exactly() const override { return inner_->adopts_exactly(); }
  void prefill(std::span<const spec::RowPrefill> rows) override { inner_->prefill(rows); }
  void draft(std::span<const spec::RowDraft> rows, std::vector<spec::DraftProposal>* out) override {
    inner_->draft(rows, out);
  }
  void commit(std::span<const spec::VerifyRow> rows) override { inner_->commit(rows); }
  spec::CheckpointPtr capture(int row) const override { return inner_->capture(row); }

 private:
  std::unique_ptr<spec::DraftRows> inner_;
  const FailingJoins& owner_;
};

std::unique_ptr<spec::DraftRows> FailingJoins::open_rows(const spec::TargetView& t) const {
  return std::make_unique<FailingRows>(inner_.open_rows(t), *this);
}

TEST(BatchEngine, FailedJoinLeavesRunningRowsUntouched) {
  auto& d = demo();
  FailingJoins drafter(*d.mtp);
  EngineOptions o;
  o.spec.depth = 3;
  o.max_rows = 4;
  o.kv_blocks = 200;
  BatchEngine engine(*d.model, &drafter, "demo-target", o);
  const auto a = request(d.tok->encode(test::kDemoPrompts[0]), 0.7f, 5, 30);
  const auto b = request(d.tok->encode(test::kDemoPrompts[1]), 0.0f, 6, 30);
  auto sa = std::make_shared<Recorder>(), sb = std::make_shared<Recorder>();
  engine.submit({a, -1}, sa);
  for (int i = 0; i < 3; ++i) engine.step();
  const int64_t used = engine.counters().kv_blocks_used;
  drafter.fail_next = 1;
  engine.submit({b, -1}, sb);
  engine.step();
  ASSERT_TRUE(sb->outcome.has_value());
  EXPECT_EQ(sb->outcome->end, RequestEnd::Failed);
  EXPECT_NE(sb->outcome->error.find("drafter refused the join"), std::string::npos);
  EXPECT_EQ(engine.counters().kv_blocks_used, used);  // b's blocks went back
  engine.run_to_completion();
  EXPECT_EQ(sa->tokens, alone(a));
  EXPECT_EQ(engine.counters().kv_blocks_used, 0);
}

// Plain rounds are pipelined (the next step is queued before the host reads the last one's
// tokens), greedy and sampled rows alike (a sampled row's tokens are drawn by ops::sample_rows,
// the step after next with the next output index): joins, a cancellation, a consumer's stop and
// length limits interrupt the chain at different points, and every request still gets the
// tokens a Generator draws on the host. The model is left with no pending copy (a Generator runs
// cleanly afterwards).
TEST(BatchEngine, PipelinedRoundsKeepTokensThroughMembershipChanges) {
  auto& d = demo();
  EngineOptions o;
  o.max_rows = 3;
  o.kv_blocks = 300;
  o.prefill_budget = 128;
  BatchEngine engine(*d.model, nullptr, "demo-target", o);
  std::vector<GenerateRequest> reqs;
  for (size_t i = 0; i < 7; ++i) {
    auto p = i == 3 ? long_prompt(300)
                    : d.tok->encode(test::kDemoPrompts[i % test::kDemoPrompts.size()]);
    reqs.push_back(request(p, i % 2 == 0 ? 0.0f : 0.6f + 0.2f * static_cast<float>(i % 3), 1 + i,
                           5 + 6 * static_cast<int64_t>(i)));
  }
  reqs[5].sampling.top_k = 20;
  reqs[5].sampling.min_p = 0.02f;
  std::vector<std::shared_ptr<Recorder>> sinks;
  for (size_t i = 0; i < reqs.size(); ++i) sinks.push_back(std::make_shared<Recorder>());
  sinks[1]->cancel_after = 6;
  sinks[4]->stop_at = 9;
  size_t next = 0;
  for (int step = 0;; ++step) {
    if (next < reqs.size() && step % 3 == 0) engine.submit({reqs[next], -1}, sinks[next]), ++next;
    if (!engine.step() && next == reqs.size()) break;
    ASSERT_LT(step, 5000);
  }
  for (size_t i = 0; i < reqs.size(); ++i) {
    const auto want = alone(reqs[i]);
    ASSERT_TRUE(sinks[i]->outcome.has_value()) << i;
    if (i == 1 || i == 4) {
      ASSERT_LE(sinks[i]->tokens.size(), want.size());
      EXPECT_TRUE(std::equal(sinks[i]->tokens.begin(), sinks[i]->tokens.end(), want.begin())) << i;
    } else {
      EXPECT_EQ(sinks[i]->tokens, want) << i;
    }
  }
  EXPECT_EQ(sinks[1]->outcome->end, RequestEnd::Cancelled);
  EXPECT_EQ(sinks[4]->tokens.size(), 9u);
  EXPECT_EQ(engine.counters().kv_blocks_used, 0);
  EXPECT_GT(engine.counters().pipelined_rounds, engine.counters().rounds / 2);
  EXPECT_EQ(alone(reqs[0]), sinks[0]->tokens);
}

// An MTP drafter in the target's backend context leaves its proposals where its chain drew them:
// every drafted round's verify reads them in place (one host wait per round), for greedy and
// sampled rows joining and leaving, and every request still gets its plain tokens.
TEST(BatchEngine, VerifyReadsQueuedDraftsInPlace) {
  auto& d = demo();
  const auto shared = [&] {
    const ops::ContextScope scope(d.model->context());
    return spec::QwenMtpProvider::from_target(*d.target);
  }();
  EngineOptions o;
  o.spec.depth = 3;
  o.max_rows = 3;
  o.kv_blocks = 300;
  BatchEngine engine(*d.model, shared.get(), "demo-target", o);
  std::vector<GenerateRequest> reqs;
  for (size_t i = 0; i < 5; ++i)
    reqs.push_back(request(d.tok->encode(test::kDemoPrompts[i % test::kDemoPrompts.size()]),
                           i % 2 == 0 ? 0.0f : 0.8f, 3 + i, 8 + 5 * static_cast<int64_t>(i)));
  std::vector<std::shared_ptr<Recorder>> sinks;
  size_t next = 0;
  for (int step = 0;; ++step) {
    if (next < reqs.size() && step % 2 == 0) {
      sinks.push_back(std::make_shared<Recorder>());
      engine.submit({reqs[next], -1}, sinks.back());
      ++next;
    }
    if (!engine.step() && next == reqs.size()) break;
    ASSERT_LT(step, 3000);
  }
  for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(sinks[i]->tokens, alone(reqs[i])) << i;
  const EngineCounters c = engine.counters();
  EXPECT_GT(c.queued_draft_rounds, 0);
  EXPECT_EQ(c.queued_draft_rounds, c.rounds - c.pipelined_rounds);
  int64_t accepted = 0;
  for (int64_t a : c.accepted_by_position) accepted += a;
  EXPECT_GT(accepted, 0);
}

// A host round queues the next round's draft right after its commit where the rows cannot change
// before it (SpecOptions::draft_ahead). With rows joining, leaving by length, a cancellation and
// an auto depth, every request gets its plain tokens and the same proposals and acceptance as
// without drafting ahead, most rounds of a steady batch are drafted ahead, and none is while a
// request waits for its turn.
TEST(BatchEngine, DraftsQueuedAheadChangeNoTokenOrProposal) {
  auto& d = demo();
  const auto shared = shared_mtp();
  const std::vector<GenerateRequest> reqs = staggered_requests(5, 11, 10, 6);
  for (bool automatic : {false, true}) {
    std::vector<std::shared_ptr<Recorder>> sinks[2];
    EngineCounters counters[2];
    for (bool ahead : {false, true}) {
      EngineOptions o;
      o.spec.depth = 3;
      o.spec.auto_depth = automatic;
      o.spec.draft_ahead = ahead;
      o.max_rows = 3;
      BatchEngine engine(*d.model, shared.get(), "demo-target", o);
      sinks[ahead] = run_staggered(engine, reqs, 6, 2, 9);
      counters[ahead] = engine.counters();
    }
    for (size_t i = 0; i < reqs.size(); ++i) {
      const std::string what =
          std::string(automatic ? "auto" : "fixed") + " depth, request " + std::to_string(i);
      ASSERT_TRUE(sinks[0][i]->outcome && sinks[1][i]->outcome) << what;
      const std::vector<int32_t> want = alone(reqs[i]);
      if (i == 2) {  // cancelled: a prefix of its plain tokens, at least the 9 it asked for
        EXPECT_EQ(sinks[1][i]->outcome->end, RequestEnd::Cancelled) << what;
        ASSERT_GE(sinks[1][i]->tokens.size(), 9u) << what;
        ASSERT_LE(sinks[1][i]->tokens.size(), want.size()) << what;
        EXPECT_TRUE(
            std::equal(sinks[1][i]->tokens.begin(), sinks[1][i]->tokens.end(), want.begin()))
            << what;
        continue;
      }
      EXPECT_EQ(sinks[1][i]->tokens, want) << what;
      EXPECT_EQ(sinks[0][i]->tokens, want) << what;
      if (automatic) continue;  // the policy's explorations follow the batch's timing
      const SpecStats& plain = sinks[0][i]->outcome->speculation;
      const SpecStats& ahead = sinks[1][i]->outcome->speculation;
      EXPECT_EQ(ahead.rounds, plain.rounds) << what;
      EXPECT_EQ(ahead.drafted_by_position, plain.drafted_by_position) << what;
      EXPECT_EQ(ahead.accepted_by_position, plain.accepted_by_position) << what;
    }
    EXPECT_EQ(counters[0].drafted_ahead_rounds, 0);
    const EngineCounters& c = counters[1];
    EXPECT_GT(c.drafted_ahead_rounds, (c.rounds - c.pipelined_rounds) / 3)
        << (automatic ? "auto" : "fixed") << " depth";
    EXPECT_LE(c.drafted_ahead_rounds, c.queued_draft_rounds);
    EXPECT_EQ(c.kv_blocks_used, 0);
  }
}

// Rounds settled on the device (SpecOptions::settled_rounds): each round's accept walk and
// commits stay where the tokens are and the next round is queued before the host reads it, for
// greedy and sampled rows joining, leaving and running into their max_tokens. Every request
// still gets its plain tokens, most rounds are settled, and each request's speculation is what
// host rounds give it (the drafter's proposals are the same, bit for bit).
TEST(BatchEngine, SettledRoundsEmitThePlainTokens) {
  auto& d = demo();
  const auto shared = shared_mtp();
  const std::vector<GenerateRequest> reqs = staggered_requests(6, 7, 12, 7);
  // The n-gram drafter's rounds settle too (its lookup and history where the tokens are), with
  // windows that pad what it did not find.
  const std::vector<const spec::DraftProvider*> drafters = {shared.get(), d.ngram.get()};
  for (int depth : {1, 3})
    for (const spec::DraftProvider* drafter : drafters) {
      std::vector<std::shared_ptr<Recorder>> sinks[2];
      EngineCounters counters[2];
      for (bool settled : {false, true}) {
        EngineOptions o;
        o.spec.depth = depth;
        o.spec.settled_rounds = settled;
        o.max_rows = 3;
        BatchEngine engine(*d.model, drafter, "demo-target", o);
        sinks[settled] = run_staggered(engine, reqs, 5);
        counters[settled] = engine.counters();
      }
      for (size_t i = 0; i < reqs.size(); ++i) {
        const std::string what =
            drafter->id() + " depth " + std::to_string(depth) + ", request " + std::to_string(i);
        EXPECT_EQ(sinks[1][i]->tokens, alone(reqs[i])) << what;
        ASSERT_TRUE(sinks[0][i]->outcome && sinks[1][i]->outcome) << what;
        const SpecStats& host = sinks[0][i]->outcome->speculation;
        const SpecStats& settled = sinks[1][i]->outcome->speculation;
        EXPECT_EQ(settled.accepted_by_position, host.accepted_by_position) << what;
        EXPECT_EQ(settled.rounds, host.rounds) << what;
      }
      const EngineCounters& c = counters[1];
      EXPECT_EQ(counters[0].settled_rounds, 0);
      EXPECT_GT(c.settled_rounds, (c.rounds - c.pipelined_rounds) / 2)
          << drafter->id() << " depth " << depth;
      int64_t accepted = 0;
      for (int64_t a : c.accepted_by_position) accepted += a;
      EXPECT_GT(accepted, 0);
    }
}

// A host round's commit run on the device behind the verify's reads (SpecOptions::device_commit):
// the device walks the windows where their tokens are and commits them while the host walks the
// same tokens, then the host only resolves the lengths. For greedy and sampled rows joining,
// leaving, cancelled and ending mid-window at their max_tokens, every request gets its plain
// tokens and the same speculation as with the host's commit; an engine with a prefix cache keeps
// the host's commit (a cached turn's state must hold exactly its tokens).
TEST(BatchEngine, DeviceCommitEmitsThePlainTokens) {
  auto& d = demo();
  const auto shared = shared_mtp();
  const std::vector<GenerateRequest> reqs = staggered_requests(6, 5, 9, 7);
  const std::vector<const spec::DraftProvider*> drafters = {shared.get(), d.ngram.get()};
  for (const spec::DraftProvider* drafter : drafters) {
    std::vector<std::shared_ptr<Recorder>> sinks[2];
    EngineCounters counters[2];
    for (bool on_device : {false, true}) {
      EngineOptions o;
      o.spec.depth = 3;
      o.spec.device_commit = on_device;
      o.max_rows = 3;
      BatchEngine engine(*d.model, drafter, "demo-target", o);
      sinks[on_device] = run_staggered(engine, reqs, 4, 3, 5);
      counters[on_device] = engine.counters();
    }
    for (size_t i = 0; i < reqs.size(); ++i) {
      const std::string what = drafter->id() + ", request " + std::to_string(i);
      ASSERT_TRUE(sinks[0][i]->outcome && sinks[1][i]->outcome) << what;
      if (i == 3) {  // cancelled: a prefix of its plain tokens, at least the 5 it asked for
        const std::vector<int32_t> want = alone(reqs[i]);
        const std::vector<int32_t>& got = sinks[1][i]->tokens;
        EXPECT_EQ(sinks[1][i]->outcome->end, RequestEnd::Cancelled) << what;
        ASSERT_GE(got.size(), 5u) << what;
        ASSERT_LE(got.size(), want.size()) << what;
        EXPECT_TRUE(std::equal(got.begin(), got.end(), want.begin())) << what;
        continue;
      }
      EXPECT_EQ(sinks[1][i]->tokens, alone(reqs[i])) << what;
      EXPECT_EQ(sinks[0][i]->tokens, sinks[1][i]->tokens) << what;
      const SpecStats& host = sinks[0][i]->outcome->speculation;
      const SpecStats& device = sinks[1][i]->outcome->speculation;
      EXPECT_EQ(device.drafted_by_position, host.drafted_by_position) << what;
      EXPECT_EQ(device.accepted_by_position, host.accepted_by_position) << what;
    }
    EXPECT_EQ(counters[0].device_commit_rounds, 0) << drafter->id();
    const EngineCounters& c = counters[1];
    EXPECT_GT(c.device_commit_rounds, (c.rounds - c.pipelined_rounds) / 2) << drafter->id();
    EXPECT_LE(c.device_commit_rounds, c.rounds - c.pipelined_rounds) << drafter->id();
    EXPECT_EQ(c.kv_blocks_used, 0) << drafter->id();
  }
  // With a prefix cache the host commits: a turn ending mid-window keeps exactly its tokens.
  EngineOptions o;
  o.spec.depth = 3;
  o.prefix_cache_bytes = size_t{64} << 20;
  BatchEngine cached(*d.model, shared.get(), "demo-target", o);
  auto sink = std::make_shared<Recorder>();
  cached.submit({reqs[0], -1}, sink);
  cached.run_to_completion();
  EXPECT_EQ(sink->tokens, alone(reqs[0]));
  EXPECT_GT(cached.counters().rounds, 0);
  EXPECT_EQ(cached.counters().device_commit_rounds, 0);
}

// Log-probabilities ride along without changing tokens: the chosen token's logprob is the
// largest of the top list for greedy rows.
TEST(BatchEngine, LogprobsDoNotChangeTokens) {
  auto& d = demo();
  EngineOptions o;
  o.spec.depth = 3;
  BatchEngine engine(*d.model, d.mtp.get(), "demo-target", o);
  const auto r = request(d.tok->encode(test::kDemoPrompts[0]), 0.0f, 1, 20);
  class LogprobSink : public Recorder {
   public:
    std::vector<TokenOutput> outs;
    bool on_token(const TokenOutput& t) override {
      outs.push_back(t);
      return Recorder::on_token(t);
    }
  };
  auto s = std::make_shared<LogprobSink>();
  engine.submit({r, 5}, s);
  engine.run_to_completion();
  EXPECT_EQ(s->tokens, alone(r));
  for (const auto& t : s->outs) {
    ASSERT_TRUE(t.has_logprob);
    ASSERT_EQ(t.top_logprobs.size(), 5u);
    EXPECT_EQ(t.top_logprobs[0].first, t.id);
    EXPECT_FLOAT_EQ(t.top_logprobs[0].second, t.logprob);
    EXPECT_LE(t.logprob, 0.0f);
  }
}

}  // namespace
}  // namespace tandem
