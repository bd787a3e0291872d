// The drafter health probe: a collapsed drafter (random MTP weights for the demo model, standing
// in for a wrong hidden tap or a damaged quantization; a random EAGLE-3 head, standing in for a
// head trained for another checkpoint) is reported once within a few rounds and stops drafting;
// the right drafter (the demo's MTP layer, its trained EAGLE-3 head) never is; the output is plain
// decoding's either way.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "demo_model.h"
#include "recording_sink.h"
#include "tandem/engine/batch_engine.h"
#include "tandem/spec/drafter_health.h"
#include "tandem/spec/eagle3.h"
#include "tandem/spec/qwen_mtp.h"
#include "test_util.h"

namespace tandem {
namespace {

using spec::DrafterHealth;
using spec::DrafterHealthOptions;

TEST(DrafterHealth, JudgesOnlyAFullWindowAndReportsACollapseOnce) {
  DrafterHealth h(DrafterHealthOptions{10, 0.2});
  EXPECT_FALSE(h.record(4, 0));  // 4 proposals: too few to judge
  EXPECT_FALSE(h.record(0, 0));  // rounds without proposals change nothing
  EXPECT_FALSE(h.record(4, 0));
  EXPECT_EQ(h.window_proposals(), 8);
  EXPECT_TRUE(h.record(4, 1));  // 12 proposals, 1 accepted: 8% < 20%
  EXPECT_TRUE(h.collapsed());
  EXPECT_NEAR(h.acceptance(), 1.0 / 12.0, 1e-12);
  EXPECT_FALSE(h.record(4, 0));  // reported once
  EXPECT_TRUE(h.collapsed());
}

TEST(DrafterHealth, TheWindowSlidesSoALaterCollapseIsSeenToo) {
  DrafterHealth h(DrafterHealthOptions{10, 0.3});
  for (int i = 0; i < 5; ++i) EXPECT_FALSE(h.record(5, 4));  // healthy: 80%
  EXPECT_LE(h.window_proposals(), 15);                       // old rounds leave the window
  EXPECT_FALSE(h.record(5, 0));                              // 10 proposals, 4 accepted: 40%
  EXPECT_TRUE(h.record(5, 0));                               // the window is now all misses
  EXPECT_EQ(h.acceptance(), 0.0);
}

TEST(DrafterHealth, BadOptionsAndCountsAreRefused) {
  EXPECT_THROW(DrafterHealth(DrafterHealthOptions{0, 0.1}), Error);
  EXPECT_THROW(DrafterHealth(DrafterHealthOptions{10, 1.5}), Error);
  DrafterHealth h;
  EXPECT_THROW(h.record(2, 3), Error);
}

TEST(DrafterHealth, TheMessageNamesTheDrafterTheShareAndTheLikelyCauses) {
  DrafterHealth h(DrafterHealthOptions{4, 0.5});
  ASSERT_TRUE(h.record(8, 1));
  const std::string mtp = spec::drafter_collapse_message("qwen-mtp", h);
  EXPECT_NE(mtp.find("'qwen-mtp'"), std::string::npos) << mtp;
  EXPECT_NE(mtp.find("12.5%"), std::string::npos) << mtp;
  EXPECT_NE(mtp.find("--mtp-hidden"), std::string::npos) << mtp;
  EXPECT_NE(mtp.find("depth 0"), std::string::npos) << mtp;
  EXPECT_EQ(spec::drafter_collapse_message("ngram", h).find("--mtp-hidden"), std::string::npos);
  const std::string eagle = spec::drafter_collapse_message("eagle3", h);
  EXPECT_NE(eagle.find("eagle_aux_hidden_state_layer_ids"), std::string::npos) << eagle;
  EXPECT_NE(eagle.find("another checkpoint"), std::string::npos) << eagle;
  EXPECT_EQ(eagle.find("repeat"), std::string::npos) << eagle;
  EXPECT_EQ(spec::drafter_collapse_message("glm-mtp", h).find("repeat"), std::string::npos);
}

// --- In the engine ----------------------------------------------------------------------------

test::DemoModel& demo() {
  static test::DemoModel* d = test::load_demo_model().release();
  return *d;
}

using Recorder = test::RecordingSink;

struct Served {
  std::vector<std::vector<int32_t>> tokens;
  std::vector<SpecStats> stats;
  EngineCounters counters;
  std::vector<std::string> warnings;
};

// The demo prompts, `rows` of them at once, each decoding `tokens` tokens at temperature `t`.
Served serve(const spec::DraftProvider* drafter, int rows, float t, bool probe, int64_t tokens = 96,
             bool settled = false) {
  auto& d = demo();
  EngineOptions o;
  o.spec.depth = 3;
  o.spec.health_probe = probe;
  o.spec.settled_rounds = settled;
  o.max_rows = rows;
  Served s;
  o.on_warning = [&](const std::string& w) { s.warnings.push_back(w); };
  BatchEngine engine(*d.model, drafter, "demo-target", o);
  std::vector<std::shared_ptr<Recorder>> sinks;
  for (int r = 0; r < rows; ++r) {
    EngineRequest er;
    er.gen.prompt =
        d.tok->encode(test::kDemoPrompts[static_cast<size_t>(r) % test::kDemoPrompts.size()]);
    er.gen.max_tokens = tokens;
    er.gen.ignore_eos = true;
    er.gen.sampling.temperature = t;
    er.gen.sampling.seed = 11 + static_cast<uint64_t>(r);
    sinks.push_back(std::make_shared<Recorder>());
    EXPECT_EQ(engine.submit(er, sinks.back()), BatchEngine::Submit::Queued);
  }
  engine.run_to_completion();
  for (const auto& k : sinks) {
    s.tokens.push_back(k->tokens);
    s.stats.push_back(k->outcome.value_or(RequestOutcome{}).speculation);
  }
  s.counters = engine.counters();
  return s;
}

TEST(DrafterHealthEngine, ACollapsedDrafterIsReportedOnceAndStopsDraftingLosslessly) {
  auto& d = demo();
  const auto broken = spec::QwenMtpProvider::random(*d.target, 5);
  for (const float t : {0.0f, 0.8f}) {
    for (const int rows : {1, 4}) {
      SCOPED_TRACE("T " + std::to_string(t) + ", rows " + std::to_string(rows));
      const Served plain = serve(nullptr, rows, t, true, 160);
      const Served probed = serve(broken.get(), rows, t, true, 160);
      EXPECT_EQ(probed.tokens, plain.tokens);
      ASSERT_EQ(probed.warnings.size(), 1u);
      EXPECT_NE(probed.warnings[0].find("qwen-mtp"), std::string::npos);
      EXPECT_NE(probed.warnings[0].find("--mtp-hidden"), std::string::npos);
      EXPECT_EQ(probed.counters.drafter_disabled, 1);
      EXPECT_LT(probed.counters.drafter_first_acceptance, 0.10);
      // Within a few rounds: the 48-proposal window fills after 48 / rows rounds of depth 3, and
      // nothing is drafted after it; without the probe every round drafts to the end.
      int64_t drafted = 0;
      for (const SpecStats& st : probed.stats) drafted += st.drafted_by_position[0];
      EXPECT_LE(drafted, 48 + rows);
      const Served unprobed = serve(broken.get(), rows, t, false, 160);
      EXPECT_EQ(unprobed.tokens, plain.tokens);
      EXPECT_TRUE(unprobed.warnings.empty());
      int64_t drafted_always = 0;
      for (const SpecStats& st : unprobed.stats) drafted_always += st.drafted_by_position[0];
      EXPECT_GT(drafted_always, 2 * drafted);
      // Released, the drafter costs nothing: rows then decode in the pipelined plain rounds of
      // an engine without one, at any temperature (their tokens are drawn where the logits are).
      EXPECT_GT(probed.counters.pipelined_rounds, 100 - 48 / rows);
      EXPECT_GT(plain.counters.pipelined_rounds, 0);
      EXPECT_EQ(unprobed.counters.pipelined_rounds, 0);
    }
  }
}

// Rounds settled on the device are read a round late: the probe still sees every round, and on
// a collapse the rounds in flight are read before the drafter is released.
TEST(DrafterHealthEngine, ACollapseIsCaughtInSettledRoundsToo) {
  auto& d = demo();
  const auto broken = [&] {
    const ops::ContextScope scope(d.model->context());
    return spec::QwenMtpProvider::random(*d.target, 5);
  }();
  for (const float t : {0.0f, 0.8f}) {
    SCOPED_TRACE("T " + std::to_string(t));
    const Served plain = serve(nullptr, 4, t, true, 160);
    const Served probed = serve(broken.get(), 4, t, true, 160, /*settled=*/true);
    EXPECT_EQ(probed.tokens, plain.tokens);
    ASSERT_EQ(probed.warnings.size(), 1u);
    EXPECT_EQ(probed.counters.drafter_disabled, 1);
    EXPECT_GT(probed.counters.settled_rounds, 0);
    int64_t drafted = 0;
    for (const SpecStats& st : probed.stats) drafted += st.drafted_by_position[0];
    EXPECT_LE(drafted, 48 + 2 * 4);  // at most one more round was in flight
    EXPECT_GT(probed.counters.pipelined_rounds, 100 - 48 / 4);
  }
}

TEST(DrafterHealthEngine, TheRightDrafterIsNeverReported) {
  auto& d = demo();
  for (const float t : {0.0f, 0.8f}) {
    const Served s = serve(d.mtp.get(), 4, t, true);
    EXPECT_TRUE(s.warnings.empty()) << (s.warnings.empty() ? "" : s.warnings[0]);
    EXPECT_EQ(s.counters.drafter_disabled, 0);
    EXPECT_GT(s.counters.drafter_first_acceptance, 0.3);
  }
}

// EAGLE-3: a random head of the demo's shape (a head trained for another checkpoint, as the
// target sees it) is reported and retired within a few rounds, naming the head's likely causes;
// the bundled head trained for the demo never is.
TEST(DrafterHealthEngine, AnEagle3HeadForAnotherCheckpointIsCaughtAndTheTrainedOneIsNot) {
  testing::ScratchDir dir("health-eagle3");
  spec::Eagle3RandomShape shape = test::demo_eagle3_shape();
  shape.tap_layers = {3, 5, 7};  // the trained head's
  spec::write_random_eagle3_head(shape, dir.file("other"), DType::BF16, 3);
  const auto other = spec::Eagle3Provider::open(dir.file("other"));
  const Served plain = serve(nullptr, 2, 0.0f, true, 120);
  const Served caught = serve(other.get(), 2, 0.0f, true, 120);
  EXPECT_EQ(caught.tokens, plain.tokens);
  ASSERT_EQ(caught.warnings.size(), 1u);
  EXPECT_NE(caught.warnings[0].find("'eagle3'"), std::string::npos) << caught.warnings[0];
  EXPECT_NE(caught.warnings[0].find("eagle_aux_hidden_state_layer_ids"), std::string::npos);
  EXPECT_EQ(caught.counters.drafter_disabled, 1);
  int64_t drafted = 0;
  for (const SpecStats& st : caught.stats) drafted += st.drafted_by_position[0];
  EXPECT_LE(drafted, 48 + 2);

  const auto trained =
      spec::Eagle3Provider::open(std::string(TANDEM_SOURCE_DIR) + "/models/qwen35-demo-eagle3");
  for (const float t : {0.0f, 0.8f}) {
    const Served s = serve(trained.get(), 4, t, true);
    EXPECT_TRUE(s.warnings.empty()) << (s.warnings.empty() ? "" : s.warnings[0]);
    EXPECT_EQ(s.counters.drafter_disabled, 0);
    EXPECT_GT(s.counters.drafter_first_acceptance, 0.5);
    const Served plain_t = serve(nullptr, 4, t, true);
    EXPECT_EQ(s.tokens, plain_t.tokens);
  }
}

}  // namespace
}  // namespace tandem
