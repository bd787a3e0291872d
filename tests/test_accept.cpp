// The acceptance walk: match mode emits exactly the target's own samples; rejection mode emits
// exactly the target's distribution (chi-square on a tiny vocabulary with exact probabilities).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "tandem/core/error.h"
#include "tandem/spec/accept.h"

namespace tandem::spec {
namespace {

std::vector<float> rows_of(const std::vector<float>& one, int n) {
  std::vector<float> all;
  for (int i = 0; i < n; ++i) all.insert(all.end(), one.begin(), one.end());
  return all;
}

TEST(AcceptWalk, MatchEmitsTheTargetsSamplesWhateverWasProposed) {
  const std::vector<float> logits = {0.1f, 2.0f, -1.0f, 0.7f, 1.5f};
  const int64_t V = 5;
  SamplingParams sp;
  sp.temperature = 0.9f;
  sp.seed = 11;
  for (uint64_t first = 0; first < 200; ++first) {
    // What plain decoding would emit at indices first, first+1, first+2.
    std::vector<int32_t> plain;
    for (uint64_t j = 0; j < 3; ++j) plain.push_back(sample_token(logits, sp, first + j));
    const auto all = rows_of(logits, 3);
    // Proposing exactly those: everything accepted plus the bonus.
    auto o = accept_walk(all, V, std::vector<int32_t>{plain[0], plain[1]}, {}, sp, first,
                         VerifyMode::Match);
    EXPECT_EQ(o.accepted, 2);
    EXPECT_EQ(o.emitted, plain);
    // A wrong second proposal: the first is kept, the correction is plain[1].
    const int32_t wrong = (plain[1] + 1) % V;
    o = accept_walk(all, V, std::vector<int32_t>{plain[0], wrong}, {}, sp, first,
                    VerifyMode::Match);
    EXPECT_EQ(o.accepted, 1);
    EXPECT_EQ(o.emitted, (std::vector<int32_t>{plain[0], plain[1]}));
  }
  // No proposals: a plain decode step.
  const auto o = accept_walk(logits, V, {}, {}, sp, 7, VerifyMode::Match);
  EXPECT_EQ(o.accepted, 0);
  EXPECT_EQ(o.emitted, std::vector<int32_t>{sample_token(logits, sp, 7)});
}

TEST(AcceptWalk, GreedyRejectionEqualsMatch) {
  const std::vector<float> logits = {0.1f, 2.0f, -1.0f, 2.0f, 1.5f};  // tie: lowest id wins
  SamplingParams sp;                                                  // greedy
  const auto all = rows_of(logits, 2);
  const std::vector<std::vector<TokenProb>> q = {{{1, 1.0}}};
  auto m = accept_walk(all, 5, std::vector<int32_t>{1}, q, sp, 0, VerifyMode::Match);
  auto r = accept_walk(all, 5, std::vector<int32_t>{1}, q, sp, 0, VerifyMode::Rejection);
  EXPECT_EQ(m.emitted, r.emitted);
  EXPECT_EQ(r.accepted, 1);
  const std::vector<std::vector<TokenProb>> q3 = {{{3, 1.0}}};
  r = accept_walk(all, 5, std::vector<int32_t>{3}, q3, sp, 0, VerifyMode::Rejection);
  EXPECT_EQ(r.accepted, 0);
  EXPECT_EQ(r.emitted, std::vector<int32_t>{1});
}

// Exact target probabilities of the filtered distribution, by id.
std::vector<double> exact(const std::vector<float>& logits, const SamplingParams& sp) {
  std::vector<TokenProb> d;
  filtered_distribution(logits, sp, &d);
  std::vector<double> p(logits.size(), 0.0);
  for (const auto& t : d) p[t.id] = t.prob;
  return p;
}

// Pearson statistic over the categories with positive expected count, and its degrees of freedom.
std::pair<double, int> chi_square(const std::vector<int64_t>& counts, const std::vector<double>& p,
                                  int64_t n) {
  double x2 = 0;
  int df = -1;
  for (size_t i = 0; i < p.size(); ++i) {
    if (p[i] <= 0) {
      EXPECT_EQ(counts[i], 0) << "token " << i << " has probability 0 but was emitted";
      continue;
    }
    const double e = p[i] * static_cast<double>(n);
    x2 += (counts[i] - e) * (counts[i] - e) / e;
    ++df;
  }
  return {x2, df};
}

// Critical values of chi-square at p = 1e-4 for df = 1..6 (the test is deterministic for fixed
// seeds; the threshold only has to be one a correct sampler passes).
double critical_1e4(int df) {
  static const double kTable[] = {0, 15.14, 18.42, 21.11, 23.51, 25.74, 27.86};
  return kTable[df];
}

TEST(AcceptWalk, RejectionModeEmitsTheTargetDistribution) {
  const std::vector<float> target = {1.2f, 0.3f, -0.5f, 2.0f, 0.0f, -2.0f};
  // A drafter that is confidently wrong in places (it favours token 0 and 5).
  const std::vector<std::vector<TokenProb>> drafter_q = {
      {{0, 0.45}, {5, 0.25}, {3, 0.15}, {1, 0.10}, {2, 0.05}}};
  struct Case {
    float temperature;
    int top_k;
  };
  for (const Case c : {Case{1.0f, 0}, Case{0.7f, 0}, Case{1.0f, 4}}) {
    SamplingParams sp;
    sp.temperature = c.temperature;
    sp.top_k = c.top_k;
    sp.seed = 1234;
    const auto p = exact(target, sp);
    const int64_t N = 200000;
    // first: the token emitted at window position 0; second: the token at position 1 in walks
    // that accepted proposal 0 (the target distribution there is the same p).
    std::vector<int64_t> first(6, 0), second(6, 0);
    int64_t accepted = 0, n_second = 0;
    const auto logits3 = rows_of(target, 3);
    const std::vector<std::vector<TokenProb>> q2 = {drafter_q[0], drafter_q[0]};
    for (int64_t i = 0; i < N; ++i) {
      const uint64_t index = static_cast<uint64_t>(i) * 3;
      // Proposals drawn from q with the token stream (coupled keys), as a drafter would.
      const int32_t x0 = draw_from(drafter_q[0], sp.seed, index);
      const int32_t x1 = draw_from(drafter_q[0], sp.seed, index + 1);
      const auto o = accept_walk(logits3, 6, std::vector<int32_t>{x0, x1}, q2, sp, index,
                                 VerifyMode::Rejection);
      ++first[o.emitted[0]];
      if (o.accepted >= 1) {
        ++second[o.emitted[1]];
        ++n_second;
      }
      accepted += o.accepted;
    }
    const auto [x2, df] = chi_square(first, p, N);
    EXPECT_LT(x2, critical_1e4(df)) << "T=" << c.temperature << " top_k=" << c.top_k;
    const auto [y2, df2] = chi_square(second, p, n_second);
    EXPECT_LT(y2, critical_1e4(df2)) << "second position, T=" << c.temperature;
    EXPECT_GT(accepted, 0);
  }
}

TEST(AcceptWalk, RejectionNeedsDistributions) {
  const std::vector<float> logits = {0.0f, 1.0f, 0.0f, 1.0f};
  SamplingParams sp;
  sp.temperature = 1.0f;
  EXPECT_THROW(accept_walk(logits, 2, std::vector<int32_t>{1}, {}, sp, 0, VerifyMode::Rejection),
               Error);
  EXPECT_EQ(parse_verify_mode("match"), VerifyMode::Match);
  EXPECT_EQ(parse_verify_mode("rejection"), VerifyMode::Rejection);
  EXPECT_THROW(parse_verify_mode("greedy"), Error);
}

}  // namespace
}  // namespace tandem::spec
