// The benchmark's continuation drafter: it proposes the recorded continuation, corrupting each
// proposal with probability 1 - p, keyed by position only; speculation with it stays lossless and
// accepts exactly the uncorrupted prefix of each window.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "demo_model.h"
#include "fixture_model.h"
#include "recording_sink.h"
#include "tandem/core/error.h"
#include "tandem/engine/batch_engine.h"
#include "tandem/engine/speculative.h"
#include "tandem/spec/continuation.h"

namespace tandem::spec {
namespace {

// The drafter reads only the target's vocabulary size; any loaded model serves.
const Qwen35Model& any_model() {
  return test::tied_fixture_model();
}
const TargetView& any_target() {
  static QwenTargetView v(any_model(), "test-target");
  return v;
}

std::vector<int32_t> sequence(int32_t first, int n) {
  std::vector<int32_t> s;
  for (int i = 0; i < n; ++i) s.push_back((first + 7 * i) % 200);
  return s;
}

// A single cold row prefilled with `prompt`.
std::unique_ptr<DraftRows> open_row(const ContinuationProvider& p,
                                    const std::vector<int32_t>& prompt) {
  auto rows = p.open_rows(any_target());
  std::vector<CheckpointPtr> none(1);
  rows->prepare_append(none)->commit();
  const RowPrefill pf{0, prompt, nullptr, 0};
  rows->prefill({&pf, 1});
  return rows;
}

std::vector<int32_t> draft(DraftRows& rows, int32_t pending, int depth) {
  RowDraft d;
  d.pending = pending;
  d.depth = depth;
  std::vector<DraftProposal> out;
  rows.draft({&d, 1}, &out);
  return out.at(0).tokens;
}

void commit(DraftRows& rows, const std::vector<int32_t>& window, int accepted, int32_t next) {
  const VerifyRow v{window, nullptr, accepted, next};
  rows.commit({&v, 1});
}

TEST(Continuation, ProposesTheReferenceAtPOne) {
  const std::vector<int32_t> ref = sequence(3, 20);
  const ContinuationProvider p({ref}, 1.0, 5);
  auto rows = open_row(p, {ref.begin(), ref.begin() + 4});
  // Pending ref[4]: proposals are ref[5..8).
  const std::vector<int32_t> first = draft(*rows, ref[4], 3);
  EXPECT_EQ(first, std::vector<int32_t>(ref.begin() + 5, ref.begin() + 8));
  // Two accepted, the target's ref[7] pending: next proposals start at ref[8].
  commit(*rows, {ref[4], first[0], first[1], first[2]}, 2, ref[7]);
  EXPECT_EQ(draft(*rows, ref[7], 4), std::vector<int32_t>(ref.begin() + 8, ref.begin() + 12));
  commit(*rows, {ref[7], ref[8], ref[9], ref[10], ref[11]}, 4, ref[12]);
  // Near the reference's end the proposals stop with it.
  EXPECT_EQ(draft(*rows, ref[12], 16), std::vector<int32_t>(ref.begin() + 13, ref.end()));
}

TEST(Continuation, CorruptsEveryProposalAtPZero) {
  const std::vector<int32_t> ref = sequence(11, 40);
  const ContinuationProvider p({ref}, 0.0, 5);
  auto rows = open_row(p, {ref.begin(), ref.begin() + 2});
  const std::vector<int32_t> got = draft(*rows, ref[2], 30);
  ASSERT_EQ(got.size(), 30u);
  const int64_t V = any_target().vocab_size();
  for (size_t j = 0; j < got.size(); ++j) {
    EXPECT_NE(got[j], ref[3 + j]) << j;
    EXPECT_GE(got[j], 0);
    EXPECT_LT(got[j], V);
  }
}

// Proposals are keyed by (seed, reference, position): the share kept is p, and a position's
// proposal does not depend on the depth or the round that drafts it.
TEST(Continuation, KeepsASharePOfProposalsWhateverTheDepth) {
  const int n = 6000;
  const std::vector<int32_t> ref = sequence(1, n);
  for (double p : {0.2, 0.5, 0.8}) {
    const ContinuationProvider provider({ref}, p, 9);
    auto rows = open_row(provider, {ref[0]});
    const std::vector<int32_t> all = draft(*rows, ref[1], n);
    ASSERT_EQ(all.size(), static_cast<size_t>(n - 2));
    int kept = 0;
    for (size_t j = 0; j < all.size(); ++j) kept += all[j] == ref[2 + j];
    EXPECT_NEAR(static_cast<double>(kept) / static_cast<double>(all.size()), p, 0.025) << p;
    // The same positions one or three at a time, the window accepted whole each round.
    auto again = open_row(provider, {ref[0]});
    size_t at = 1;  // index of the pending token
    int depth = 1;
    while (at + 1 < 200) {
      const std::vector<int32_t> got = draft(*again, ref[at], depth);
      ASSERT_EQ(got, std::vector<int32_t>(all.begin() + static_cast<int64_t>(at) - 1,
                                          all.begin() + static_cast<int64_t>(at) - 1 + depth));
      std::vector<int32_t> window{ref[at]};
      window.insert(window.end(), ref.begin() + static_cast<int64_t>(at) + 1,
                    ref.begin() + static_cast<int64_t>(at) + 1 + depth);
      commit(*again, window, depth, ref[at + 1 + static_cast<size_t>(depth)]);
      at += 1 + static_cast<size_t>(depth);
      depth = depth == 1 ? 3 : 1;
    }
  }
}

// A row follows the reference its history is a prefix of, switches when the history leaves it
// for another, and proposes nothing once it has left them all.
TEST(Continuation, FollowsTheReferenceTheHistoryIsOn) {
  std::vector<int32_t> a = sequence(5, 12), b = a;
  b[6] = 199;
  b[7] = 198;
  const ContinuationProvider p({a, b}, 1.0, 1);
  auto rows = open_row(p, {a.begin(), a.begin() + 4});
  EXPECT_EQ(draft(*rows, a[4], 2), std::vector<int32_t>(a.begin() + 5, a.begin() + 7));
  // The target took b's token at 6 instead: from then on the row is on b.
  commit(*rows, {a[4], a[5], a[6]}, 1, b[6]);
  EXPECT_EQ(draft(*rows, b[6], 3), std::vector<int32_t>(b.begin() + 7, b.begin() + 10));
  // Then off both.
  commit(*rows, {b[6], b[7], b[8], b[9]}, 0, 150);
  EXPECT_TRUE(draft(*rows, 150, 3).empty());
  commit(*rows, {150}, 0, b[9]);
  EXPECT_TRUE(draft(*rows, b[9], 3).empty());
  // A prompt on no reference proposes nothing.
  auto other = open_row(p, {1, 2, 3});
  EXPECT_TRUE(draft(*other, 4, 3).empty());
}

// After a commit the row holds its pending token; a prefill then continues it with the tokens
// the target processed in plain rounds, the first of them that pending token.
TEST(Continuation, ContinuesAfterPlainRounds) {
  const std::vector<int32_t> ref = sequence(2, 30);
  const ContinuationProvider p({ref}, 1.0, 4);
  auto rows = open_row(p, {ref.begin(), ref.begin() + 4});
  EXPECT_EQ(draft(*rows, ref[4], 2), std::vector<int32_t>(ref.begin() + 5, ref.begin() + 7));
  commit(*rows, {ref[4], ref[5], ref[6]}, 2, ref[7]);
  // Plain rounds processed ref[7..10); ref[10] is pending.
  const RowPrefill more{0, std::span(ref).subspan(7, 3), nullptr, 7};
  rows->prefill({&more, 1});
  EXPECT_EQ(draft(*rows, ref[10], 3), std::vector<int32_t>(ref.begin() + 11, ref.begin() + 14));
  // A continuation that does not start with the pending token is refused, naming both.
  commit(*rows, {ref[10], ref[11], ref[12], ref[13]}, 3, ref[14]);
  const std::vector<int32_t> wrong = {ref[15], ref[16]};
  const RowPrefill bad{0, wrong, nullptr, 14};
  try {
    rows->prefill({&bad, 1});
    FAIL() << "a continuation without the pending token was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("pending token is " + std::to_string(ref[14])),
              std::string::npos)
        << e.what();
  }
}

// With --depth auto a round the policy runs at depth 0 is a pipelined plain step when the drafter
// needs only tokens; the drafter takes in what it missed before it drafts again. Either way the
// output is plain decoding's.
TEST(Continuation, AutoDepthZeroRoundsArePipelinedAndLossless) {
  static auto demo = test::load_demo_model();
  std::vector<GenerateRequest> reqs;
  for (size_t i = 0; i < test::kDemoPrompts.size(); ++i)
    reqs.push_back(test::demo_request(*demo, test::kDemoPrompts[i], 0.0f, i, 80));
  const auto plain = test::plain_tokens(*demo->model, reqs);
  std::vector<std::vector<int32_t>> refs;
  for (size_t i = 0; i < reqs.size(); ++i) {
    refs.push_back(reqs[i].prompt);
    refs.back().insert(refs.back().end(), plain[i].begin(), plain[i].end());
  }
  for (double p : {0.0, 0.5}) {
    const ContinuationProvider drafter(refs, p, 8);
    // A policy taught that drafting costs far more than any round measured here (1 s against
    // microseconds), for every row count the run passes through: it stays at depth 0 and
    // explores depth 1 at rounds 16, 32 and 64 whatever this machine's timing, so plain steps
    // and drafted rounds alternate.
    auto policy = std::make_shared<DepthPolicy>(DepthPolicyOptions{.max_depth = 4});
    for (int64_t rows = 1; rows <= static_cast<int64_t>(reqs.size()); ++rows) {
      policy->record(rows, 0, 1e-6, {}, {});
      for (int k = 1; k <= 4; ++k) {
        const std::vector<int64_t> drafted(static_cast<size_t>(k), rows),
            accepted(static_cast<size_t>(k));
        policy->record(rows, k, 1.0, drafted, accepted);
      }
    }
    EngineOptions o;
    o.spec.depth = 4;
    o.spec.auto_depth = true;
    o.spec.health_probe = false;
    o.depth_policy = policy;
    BatchEngine engine(*demo->model, &drafter, "demo-target", o);
    std::vector<std::shared_ptr<test::RecordingSink>> sinks;
    for (const GenerateRequest& r : reqs) {
      EngineRequest er;
      er.gen = r;
      sinks.push_back(std::make_shared<test::RecordingSink>());
      ASSERT_EQ(engine.submit(er, sinks.back()), BatchEngine::Submit::Queued);
    }
    engine.run_to_completion();
    for (size_t i = 0; i < reqs.size(); ++i) {
      EXPECT_EQ(sinks[i]->tokens, plain[i]) << "p " << p << " request " << i;
      ASSERT_TRUE(sinks[i]->outcome.has_value());
      EXPECT_EQ(sinks[i]->outcome->end, RequestEnd::Finished) << sinks[i]->outcome->error;
    }
    const EngineCounters c = engine.counters();
    // Plain steps and drafted rounds alternate (at p = 0 the policy still explores a depth now
    // and then), so the drafter catches up after plain steps.
    EXPECT_GT(c.pipelined_rounds, p == 0.0 ? c.rounds / 2 : 0) << c.rounds;
    EXPECT_LT(c.pipelined_rounds, c.rounds) << "every round pipelined: nothing was drafted";
    // Every round is counted at the depth it ran: plain steps at 0, the explorations at 1.
    ASSERT_EQ(c.rounds_by_depth.size(), 5u);
    int64_t counted = 0;
    for (int64_t n : c.rounds_by_depth) counted += n;
    EXPECT_EQ(counted, c.rounds);
    EXPECT_GE(c.rounds_by_depth[0], c.pipelined_rounds);
    EXPECT_GT(c.rounds_by_depth[1], 0);
    EXPECT_EQ(c.rounds_by_depth[2] + c.rounds_by_depth[3] + c.rounds_by_depth[4], 0);
  }
}

// Engines that share a depth policy (SpeculativeGenerator's runs) start from what it learnt: a
// policy that has seen depth 0 far cheaper than any drafted depth, and nothing accepted, does not
// draft in a new engine, where a fresh policy drafts from its first round. (The costs taught are
// beyond any measured round, so the outcome does not depend on this machine's timing.)
TEST(Continuation, AutoDepthCarriesOverBetweenEnginesThatShareAPolicy) {
  static auto demo = test::load_demo_model();
  const GenerateRequest req = test::demo_request(*demo, test::kDemoPrompts[0], 0.0f, 1, 40);
  const auto plain = test::plain_tokens(*demo->model, {req});
  std::vector<int32_t> ref = req.prompt;
  ref.insert(ref.end(), plain[0].begin(), plain[0].end());
  const ContinuationProvider drafter({ref}, 0.0, 8);
  auto drafted_in_a_run = [&](std::shared_ptr<DepthPolicy> policy) {
    EngineOptions o;
    o.spec.depth = 4;
    o.spec.auto_depth = true;
    o.spec.health_probe = false;
    o.depth_policy = std::move(policy);
    BatchEngine engine(*demo->model, &drafter, "demo-target", o);
    auto sink = std::make_shared<test::RecordingSink>();
    EngineRequest er;
    er.gen = req;
    EXPECT_EQ(engine.submit(er, sink), BatchEngine::Submit::Queued);
    engine.run_to_completion();
    EXPECT_EQ(sink->tokens, plain[0]);
    return sink->outcome.value_or(RequestOutcome{}).speculation.drafted;
  };
  auto taught = std::make_shared<DepthPolicy>(DepthPolicyOptions{.max_depth = 4});
  taught->record(1, 0, 1e-6, {}, {});
  for (int r = 0; r < 100; ++r) {
    const int k = taught->choose(1);
    const std::vector<int64_t> drafted(static_cast<size_t>(k), 1), accepted(static_cast<size_t>(k));
    taught->record(1, k, k == 0 ? 1e-6 : 1.0, drafted, accepted);
  }
  ASSERT_EQ(taught->best(1), 0);
  // Its explorations have thinned out to one in 128 rounds: at most one falls in this run.
  EXPECT_LE(drafted_in_a_run(taught), 1);
  EXPECT_GE(drafted_in_a_run(nullptr), 2);  // a fresh policy starts at depth 2
  // A shared policy must propose up to the engine's depth.
  EngineOptions o;
  o.spec.depth = 3;
  o.spec.auto_depth = true;
  o.depth_policy = taught;
  try {
    BatchEngine engine(*demo->model, &drafter, "demo-target", o);
    FAIL() << "a policy of another max depth was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("up to 4 tokens"), std::string::npos) << e.what();
  }
}

TEST(Continuation, BadInputIsRefused) {
  const std::vector<int32_t> ref = sequence(0, 8);
  for (double bad : {-0.1, 1.5, std::numeric_limits<double>::quiet_NaN()}) {
    try {
      ContinuationProvider p({ref}, bad, 1);
      FAIL() << "p = " << bad << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("[0, 1]"), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(ContinuationProvider({ref, {}}, 0.5, 1), Error);
  const int64_t V = any_target().vocab_size();
  const ContinuationProvider outside({{1, 2, static_cast<int32_t>(V)}}, 0.5, 1);
  try {
    outside.open_rows(any_target());
    FAIL() << "a token past the vocabulary was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("outside the target's vocabulary"), std::string::npos)
        << e.what();
  }
}

// On the demo model: the output is plain decoding's at any p and depth, every proposal is
// accepted at p = 1 and none at p = 0, and with p in between a window is accepted up to its
// first corrupted proposal.
TEST(Continuation, SpeculationIsLosslessAndAcceptsTheUncorruptedPrefix) {
  static auto demo = test::load_demo_model();
  std::vector<GenerateRequest> reqs;
  for (size_t i = 0; i < test::kDemoPrompts.size(); ++i)
    reqs.push_back(test::demo_request(*demo, test::kDemoPrompts[i], 0.0f, i, 24 + 4 * i));
  const auto plain = test::plain_tokens(*demo->model, reqs);
  std::vector<std::vector<int32_t>> refs;
  for (size_t i = 0; i < reqs.size(); ++i) {
    refs.push_back(reqs[i].prompt);
    refs.back().insert(refs.back().end(), plain[i].begin(), plain[i].end());
  }
  for (double p : {1.0, 0.0, 0.7}) {
    const ContinuationProvider drafter(refs, p, 3);
    for (int depth : {1, 3}) {
      SpecOptions opts{depth, VerifyMode::Match};
      opts.health_probe = false;
      SpeculativeGenerator gen(*demo->model, &drafter, "demo-target", opts);
      std::vector<SpecStats> st;
      const auto got = gen.run(reqs, {}, nullptr, &st);
      int64_t drafted = 0, accepted = 0;
      for (size_t i = 0; i < reqs.size(); ++i) {
        EXPECT_EQ(got[i].tokens, plain[i]) << "p " << p << " depth " << depth << " request " << i;
        drafted += st[i].drafted;
        accepted += st[i].accepted;
      }
      ASSERT_GT(drafted, 0);
      if (p == 1.0) {
        EXPECT_EQ(accepted, drafted) << depth;
      } else if (p == 0.0) {
        EXPECT_EQ(accepted, 0) << depth;
      } else {
        EXPECT_GT(accepted, 0);
        EXPECT_LT(accepted, drafted);
      }
    }
  }
}

}  // namespace
}  // namespace tandem::spec
