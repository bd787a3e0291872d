// Counter-based keys (core/rng.h) and the sampler chain (core/sampler.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "sampling_params.h"
#include "tandem/core/error.h"
#include "tandem/core/rng.h"
#include "tandem/core/sample_weights.h"
#include "tandem/core/sampler.h"

namespace tandem {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// Upper regularized incomplete gamma Q(a, x) (Numerical Recipes gammq): the chi-square survival
// function is Q(dof / 2, chi2 / 2).
double gamma_q(double a, double x) {
  if (x <= 0.0) return 1.0;
  const double log_prefix = -x + a * std::log(x) - std::lgamma(a);
  if (x < a + 1.0) {  // series for P, then Q = 1 - P
    double term = 1.0 / a, sum = term;
    for (int n = 1; n < 10000; ++n) {
      term *= x / (a + n);
      sum += term;
      if (std::fabs(term) < std::fabs(sum) * 1e-16) break;
    }
    return 1.0 - sum * std::exp(log_prefix);
  }
  // Continued fraction for Q (modified Lentz).
  double b = x + 1.0 - a, c = 1.0 / 1e-300, d = 1.0 / b, h = d;
  for (int i = 1; i < 10000; ++i) {
    const double an = -i * (i - a);
    b += 2.0;
    d = an * d + b;
    if (std::fabs(d) < 1e-300) d = 1e-300;
    c = b + an / c;
    if (std::fabs(c) < 1e-300) c = 1e-300;
    d = 1.0 / d;
    const double delta = d * c;
    h *= delta;
    if (std::fabs(delta - 1.0) < 1e-16) break;
  }
  return std::exp(log_prefix) * h;
}

double chi2_sf(double chi2, int dof) {
  return gamma_q(dof / 2.0, chi2 / 2.0);
}

std::vector<int32_t> ids_of(const std::vector<TokenProb>& d) {
  std::vector<int32_t> ids;
  for (const TokenProb& e : d) ids.push_back(e.id);
  return ids;
}

std::vector<int32_t> filtered_ids(const std::vector<float>& logits, const SamplingParams& p) {
  std::vector<TokenProb> d;
  filtered_distribution(logits, p, &d);
  return ids_of(d);
}

using tandem::testing::sampling;

// Platform-independent pseudo-random logits (std distributions differ across libraries).
std::vector<float> random_logits(size_t n, uint64_t seed) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    v[i] = static_cast<float>(8.0 * uniform_open01(seed, i, 7) - 4.0);
  }
  return v;
}

using Block = std::array<uint32_t, 4>;

TEST(Rng, PhiloxKnownAnswers) {
  // Random123 kat_vectors, "philox4x32 10" rows: counter, key -> output.
  EXPECT_EQ(philox4x32_10({0, 0, 0, 0}, {0, 0}),
            (Block{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
  EXPECT_EQ(
      philox4x32_10({0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff}),
      (Block{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}));
  EXPECT_EQ(
      philox4x32_10({0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0}),
      (Block{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}));
  // The same zero vector through the documented (seed, index, stream) mapping.
  EXPECT_EQ(philox_bits(0, 0, 0), (Block{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
}

TEST(Rng, MappingOntoKeyAndCounter) {
  const uint64_t seed = 0x0123456789abcdefull;
  const uint64_t index = 0xfedcba9876543210ull;
  EXPECT_EQ(philox_bits(seed, index, 5),
            philox4x32_10({0x76543210, 0xfedcba98, 5, 0}, {0x89abcdef, 0x01234567}));
  EXPECT_EQ(philox_bits(seed, index), philox_bits(seed, index, kRngStreamToken));
}

TEST(Rng, DeterministicAndIndependentPerKey) {
  const double a = uniform_open01(42, 1000);
  EXPECT_EQ(a, uniform_open01(42, 1000));
  EXPECT_NE(a, uniform_open01(42, 1001));
  EXPECT_NE(a, uniform_open01(43, 1000));
  EXPECT_NE(a, uniform_open01(42, 1000, kRngStreamAccept));
  EXPECT_NE(a, uniform_open01(42, 1000 + (uint64_t{1} << 32)));  // high index word matters
  EXPECT_NE(a, uniform_open01(42 + (uint64_t{1} << 32), 1000));  // high seed word matters
}

TEST(Rng, UniformOpenIntervalAndDistribution) {
  constexpr int kN = 100000;
  constexpr int kBuckets = 100;
  for (const uint32_t stream : {kRngStreamToken, kRngStreamAccept}) {
    std::vector<double> u(kN);
    std::vector<int> bucket(kBuckets, 0);
    double sum = 0.0;
    for (int i = 0; i < kN; ++i) {
      u[i] = uniform_open01(12345, i, stream);
      ASSERT_GT(u[i], 0.0);
      ASSERT_LT(u[i], 1.0);
      sum += u[i];
      ++bucket[static_cast<int>(u[i] * kBuckets)];
    }
    // Mean: standard error sqrt(1/12/N) ~ 0.00091; 5 sigma.
    EXPECT_NEAR(sum / kN, 0.5, 5 * std::sqrt(1.0 / 12.0 / kN));
    double chi2 = 0.0;
    const double expected = static_cast<double>(kN) / kBuckets;
    for (const int c : bucket) chi2 += (c - expected) * (c - expected) / expected;
    EXPECT_GT(chi2_sf(chi2, kBuckets - 1), 1e-4) << "chi2 " << chi2 << " stream " << stream;
    // Kolmogorov-Smirnov: D * sqrt(N) beyond 2.23 has p < 1e-4.
    std::sort(u.begin(), u.end());
    double d = 0.0;
    for (int i = 0; i < kN; ++i) {
      d = std::max({d, (i + 1.0) / kN - u[i], u[i] - static_cast<double>(i) / kN});
    }
    EXPECT_LT(d * std::sqrt(static_cast<double>(kN)), 2.23) << "stream " << stream;
  }
}

TEST(ChiSquare, SurvivalFunctionMatchesTables) {
  EXPECT_NEAR(chi2_sf(25.745, 5), 1e-4, 2e-6);
  EXPECT_NEAR(chi2_sf(3.841, 1), 0.05, 1e-4);
  EXPECT_NEAR(chi2_sf(123.225, 99), 0.05, 1e-4);
}

TEST(Sampler, ArgmaxLowestIdWinsTies) {
  EXPECT_EQ(argmax(std::vector<float>{1, 3, 3, 2}), 1);
  EXPECT_EQ(argmax(std::vector<float>{-kInf, -kInf, -5}), 2);
  EXPECT_EQ(argmax(std::vector<float>{7}), 0);
  EXPECT_THROW(argmax(std::vector<float>{1, kNaN, 2}), Error);
  EXPECT_THROW(argmax(std::vector<float>{-kInf, -kInf}), Error);
  EXPECT_THROW(argmax(std::vector<float>{}), Error);
}

TEST(Sampler, GreedyIgnoresKey) {
  const std::vector<float> logits = {0.5f, 2.0f, 2.0f, -1.0f};
  const SamplingParams p = sampling(0.0f, 1, 0.5f, 0.5f, 99);  // filters are irrelevant when greedy
  EXPECT_EQ(filtered_ids(logits, p), (std::vector<int32_t>{1}));
  for (uint64_t i = 0; i < 100; ++i) EXPECT_EQ(sample_token(logits, p, i), 1);
}

TEST(Sampler, TopKExactSets) {
  const std::vector<float> logits = {1, 3, 3, 3, 2};
  EXPECT_EQ(filtered_ids(logits, sampling(1, 1)), (std::vector<int32_t>{1}));
  EXPECT_EQ(filtered_ids(logits, sampling(1, 2)), (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(filtered_ids(logits, sampling(1, 3)), (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(filtered_ids(logits, sampling(1, 4)), (std::vector<int32_t>{1, 2, 3, 4}));
  EXPECT_EQ(filtered_ids(logits, sampling(1, 5)), (std::vector<int32_t>{1, 2, 3, 4, 0}));
  EXPECT_EQ(filtered_ids(logits, sampling(1, 50)), (std::vector<int32_t>{1, 2, 3, 4, 0}));
  // -inf tokens are never candidates, even when k exceeds the live count.
  EXPECT_EQ(filtered_ids({-kInf, 0, -kInf, 1}, sampling(1, 3)), (std::vector<int32_t>{3, 1}));
  // Tied tokens share probability equally after renormalization.
  std::vector<TokenProb> d;
  filtered_distribution(logits, sampling(1, 2), &d);
  ASSERT_EQ(d.size(), 2u);
  EXPECT_EQ(d[0].prob, 0.5);
  EXPECT_EQ(d[1].prob, 0.5);
}

TEST(Sampler, TopPExactSets) {
  // Equal logits: weights are exactly 1, so the boundary arithmetic is exact.
  const std::vector<float> flat = {0, 0, 0, 0};
  EXPECT_EQ(filtered_ids(flat, sampling(1, 0, 0.5f)), (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(filtered_ids(flat, sampling(1, 0, 0.5000001f)), (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(filtered_ids(flat, sampling(1, 0, 0.75f)), (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(filtered_ids(flat, sampling(1, 0, 0.25f)), (std::vector<int32_t>{0}));
  EXPECT_EQ(filtered_ids(flat, sampling(1, 0, 1e-6f)), (std::vector<int32_t>{0}));
  EXPECT_EQ(filtered_ids(flat, sampling(1, 0, 1.0f)), (std::vector<int32_t>{0, 1, 2, 3}));
  // Probabilities 0.05, 0.5, 0.15, 0.3 (ids out of order on purpose).
  const std::vector<float> l = {std::log(0.05f), std::log(0.5f), std::log(0.15f), std::log(0.3f)};
  EXPECT_EQ(filtered_ids(l, sampling(1, 0, 0.4f)), (std::vector<int32_t>{1}));
  EXPECT_EQ(filtered_ids(l, sampling(1, 0, 0.7f)), (std::vector<int32_t>{1, 3}));
  EXPECT_EQ(filtered_ids(l, sampling(1, 0, 0.9f)), (std::vector<int32_t>{1, 3, 2}));
  EXPECT_EQ(filtered_ids(l, sampling(1, 0, 0.96f)), (std::vector<int32_t>{1, 3, 2, 0}));
  std::vector<TokenProb> d;
  filtered_distribution(l, sampling(1, 0, 0.7f), &d);
  ASSERT_EQ(d.size(), 2u);
  EXPECT_NEAR(d[0].prob, 0.5 / 0.8, 1e-6);
  EXPECT_NEAR(d[1].prob, 0.3 / 0.8, 1e-6);
}

TEST(Sampler, MinPExactSets) {
  // Ratios to the max at T=1: 1, e^-1 = 0.3679, e^-2 = 0.1353.
  const std::vector<float> l = {-2, 0, -1};
  EXPECT_EQ(filtered_ids(l, sampling(1, 0, 1, 0.1f)), (std::vector<int32_t>{1, 2, 0}));
  EXPECT_EQ(filtered_ids(l, sampling(1, 0, 1, 0.2f)), (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(filtered_ids(l, sampling(1, 0, 1, 0.36f)), (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(filtered_ids(l, sampling(1, 0, 1, 0.37f)), (std::vector<int32_t>{1}));
  // On the temperature-scaled distribution: at T=2 the ratios are e^-0.5 and e^-1.
  EXPECT_EQ(filtered_ids(l, sampling(2, 0, 1, 0.37f)), (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(filtered_ids(l, sampling(2, 0, 1, 0.36f)), (std::vector<int32_t>{1, 2, 0}));
  // min_p = 1 keeps exactly the tokens tied with the max.
  EXPECT_EQ(filtered_ids({0, -1, 0}, sampling(1, 0, 1, 1.0f)), (std::vector<int32_t>{0, 2}));
}

TEST(Sampler, ChainOrderTemperatureTopKTopPMinP) {
  // Probabilities 0.4, 0.3, 0.2, 0.1 at T=1.
  const std::vector<float> l = {std::log(0.4f), std::log(0.3f), std::log(0.2f), std::log(0.1f)};
  // top-p alone: cumulative 0.4, 0.7, 0.9 -> three tokens reach 0.75.
  EXPECT_EQ(filtered_ids(l, sampling(1, 0, 0.75f)), (std::vector<int32_t>{0, 1, 2}));
  // top-k first renormalizes over {0,1,2}: cumulative 0.444, 0.778 -> two tokens reach 0.75.
  EXPECT_EQ(filtered_ids(l, sampling(1, 3, 0.75f)), (std::vector<int32_t>{0, 1}));
  std::vector<TokenProb> d;
  filtered_distribution(l, sampling(1, 3, 0.75f), &d);
  ASSERT_EQ(d.size(), 2u);
  EXPECT_NEAR(d[0].prob, 4.0 / 7.0, 1e-6);
  EXPECT_NEAR(d[1].prob, 3.0 / 7.0, 1e-6);
  // min-p last: 0.3 / 0.4 = 0.75 < 0.8 drops token 1.
  EXPECT_EQ(filtered_ids(l, sampling(1, 3, 0.75f, 0.8f)), (std::vector<int32_t>{0}));
  // Temperature first: at T=0.25 probabilities are 256:81:16:1 / 354 (0.723 for token 0), so
  // top-p 0.7 keeps one token where T=1 needs two.
  EXPECT_EQ(filtered_ids(l, sampling(0.25f, 0, 0.7f)), (std::vector<int32_t>{0}));
  EXPECT_EQ(filtered_ids(l, sampling(1, 0, 0.6f)), (std::vector<int32_t>{0, 1}));
}

TEST(Sampler, UnderflowedTokensAreNotCandidates) {
  EXPECT_EQ(filtered_ids({0, -100, -1e-3f}, sampling(0.01f)), (std::vector<int32_t>{0, 2}));
}

TEST(Sampler, DistributionCanonicalOrderAndNormalized) {
  const std::vector<float> logits = random_logits(1000, 3);
  for (const SamplingParams& p :
       {sampling(0.8f), sampling(1.3f, 50), sampling(0.7f, 0, 0.9f), sampling(1, 0, 1, 0.05f)}) {
    std::vector<TokenProb> d;
    filtered_distribution(logits, p, &d);
    ASSERT_FALSE(d.empty());
    double sum = 0.0;
    for (size_t i = 0; i < d.size(); ++i) {
      sum += d[i].prob;
      if (i > 0) {
        EXPECT_TRUE(d[i - 1].prob > d[i].prob ||
                    (d[i - 1].prob == d[i].prob && d[i - 1].id < d[i].id));
      }
    }
    EXPECT_NEAR(sum, 1.0, 1e-12);
  }
}

TEST(Sampler, LargeVocabularyTopKMatchesTopLogits) {
  const std::vector<float> logits = random_logits(250000, 11);
  std::vector<TokenProb> d;
  filtered_distribution(logits, sampling(0.9f, 40), &d);
  std::vector<int32_t> expected;
  for (const auto& [id, l] : top_logits(logits, 40)) expected.push_back(id);
  EXPECT_EQ(ids_of(d), expected);
}

TEST(Sampler, LargeVocabularyTopPIsPrefixOfFullSort) {
  // The chunked lazy sort must agree with a full sort on the prefix it keeps, and the kept
  // prefix must be the smallest reaching top_p.
  const std::vector<float> logits = random_logits(250000, 5);
  std::vector<TokenProb> full, cut;
  filtered_distribution(logits, sampling(0.3f), &full);
  filtered_distribution(logits, sampling(0.3f, 0, 0.6f), &cut);
  ASSERT_GT(cut.size(), 64u);  // exercises more than one chunk
  ASSERT_LT(cut.size(), full.size());
  double cum = 0.0;
  for (size_t i = 0; i < cut.size(); ++i) {
    ASSERT_EQ(cut[i].id, full[i].id) << i;
    cum += full[i].prob;
    if (i + 1 < cut.size()) {
      EXPECT_LT(cum, 0.6 + 1e-9);
    }
  }
  EXPECT_GE(cum, 0.6 - 1e-9);
}

TEST(Sampler, FilteredDistributionIsBitwiseDeterministic) {
  const std::vector<float> logits = random_logits(50000, 9);
  const SamplingParams p = sampling(0.8f, 0, 0.95f, 0.01f);
  std::vector<TokenProb> a, b;
  filtered_distribution(logits, p, &a);
  filtered_distribution(logits, sampling(1.7f, 5), &b);  // dirty the reused vector first
  filtered_distribution(logits, p, &b);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {  // field by field: TokenProb has padding bytes
    ASSERT_EQ(a[i].id, b[i].id);
    ASSERT_EQ(std::bit_cast<uint64_t>(a[i].prob), std::bit_cast<uint64_t>(b[i].prob));
  }
}

// Chi-square of `draws` tokens sampled at indices 0..draws-1 against `expected` (by id).
void expect_matches_distribution(const std::vector<float>& logits, const SamplingParams& p,
                                 const std::vector<double>& expected, int draws) {
  std::vector<int> counts(logits.size(), 0);
  std::vector<TokenWeight> scratch;
  for (int i = 0; i < draws; ++i) ++counts[sample_token(logits, p, i, &scratch)];
  double chi2 = 0.0;
  int dof = -1;
  for (size_t id = 0; id < logits.size(); ++id) {
    if (expected[id] == 0.0) {
      EXPECT_EQ(counts[id], 0) << "filtered token " << id << " was drawn";
      continue;
    }
    const double e = expected[id] * draws;
    chi2 += (counts[id] - e) * (counts[id] - e) / e;
    ++dof;
  }
  ASSERT_GT(dof, 0);
  EXPECT_GT(chi2_sf(chi2, dof), 1e-4) << "chi2 " << chi2 << " dof " << dof;
}

TEST(Sampler, DrawsFollowTheSoftmax) {
  const std::vector<float> logits = {1.0f, 0.5f, 0.2f, -0.3f, -1.0f, 0.0f};
  for (const float t : {0.7f, 1.0f}) {
    // Independent reference: softmax(logits / T) in double.
    std::vector<double> expected(logits.size());
    double z = 0.0;
    for (size_t i = 0; i < logits.size(); ++i) z += expected[i] = std::exp(logits[i] / double(t));
    for (double& e : expected) e /= z;
    SCOPED_TRACE(t);
    expect_matches_distribution(logits, sampling(t, 0, 1, 0, 20240601), expected, 200000);
  }
}

TEST(Sampler, DrawsFollowTheFilteredDistribution) {
  // T=1 probabilities .344 .209 .155 .115 .051 .127 (ids 0..5); top-k 5 drops id 4, then top-p
  // 0.8 keeps ids 0, 1, 2, 5 (cumulative .363 .583 .746 .879 of the top-5 mass).
  const std::vector<float> logits = {1.0f, 0.5f, 0.2f, -0.1f, -0.9f, 0.0f};
  const SamplingParams p = sampling(1.0f, 5, 0.8f, 0.0f, 7);
  std::vector<TokenProb> d;
  filtered_distribution(logits, p, &d);
  ASSERT_EQ(ids_of(d), (std::vector<int32_t>{0, 1, 2, 5}));
  std::vector<double> expected(logits.size(), 0.0);
  for (const TokenProb& e : d) expected[e.id] = e.prob;
  expect_matches_distribution(logits, p, expected, 200000);
}

TEST(Sampler, DrawDependsOnlyOnSeedAndIndex) {
  const std::vector<float> logits = random_logits(3000, 21);
  const std::vector<float> other = random_logits(3000, 22);
  const SamplingParams p = sampling(1.1f, 0, 0.95f, 0.0f, 1234);
  constexpr int kN = 500;
  std::vector<int32_t> forward(kN), backward(kN);
  for (int i = 0; i < kN; ++i) forward[i] = sample_token(logits, p, i);
  std::vector<TokenWeight> scratch;
  for (int i = kN - 1; i >= 0; --i) {
    // Unrelated calls in between (other logits, other params, other indices) change nothing.
    sample_token(other, sampling(0.5f, 3, 1, 0, 99), 7 * i + 3, &scratch);
    backward[i] = sample_token(logits, p, i, &scratch);
  }
  EXPECT_EQ(forward, backward);
  // And the draw is exactly the inverse CDF over the filtered weights with key (seed, i).
  std::vector<TokenWeight> d;
  const uint64_t total = filtered_weights(logits, p, &d);
  for (int i = 0; i < kN; ++i) EXPECT_EQ(forward[i], draw_weighted(d, total, p.seed, i));
  // A different seed gives a different token sequence.
  SamplingParams q = p;
  q.seed = 1235;
  int differ = 0;
  for (int i = 0; i < kN; ++i) differ += sample_token(logits, q, i) != forward[i];
  EXPECT_GT(differ, kN / 2);
}

TEST(Sampler, LazyWalkEqualsDrawFromFilteredWeights) {
  // sample_token sorts only the prefix its walk reaches; on a flat distribution the walks go
  // deep into the list and across many chunks, and must still pick the draw_weighted token.
  const std::vector<float> logits = random_logits(20000, 31);
  for (const SamplingParams& p : {sampling(2.0f), sampling(1.5f, 500), sampling(2.0f, 0, 1, 0.2f),
                                  sampling(2.0f, 0, 0.99f), sampling(3.0f, 5000, 0.9f, 0.05f)}) {
    std::vector<TokenWeight> d;
    const uint64_t total = filtered_weights(logits, p, &d);
    std::vector<TokenWeight> scratch;
    size_t deepest = 0;
    for (uint64_t i = 0; i < 300; ++i) {
      const int32_t token = sample_token(logits, p, i, &scratch);
      ASSERT_EQ(token, draw_weighted(d, total, p.seed, i)) << i;
      const auto at =
          std::find_if(d.begin(), d.end(), [&](const TokenWeight& e) { return e.id == token; });
      deepest = std::max(deepest, static_cast<size_t>(at - d.begin()));
    }
    EXPECT_GT(deepest, 64u) << "walks should cross the first chunk";
  }
}

TEST(SampleWeights, ExpIsAccurateAndExactAtZero) {
  EXPECT_EQ(sample_exp(0.0), 1.0);
  EXPECT_EQ(sample_exp(-32.5), 0.0);
  EXPECT_EQ(sample_exp(-std::numeric_limits<double>::infinity()), 0.0);
  for (int i = 0; i <= 64000; ++i) {
    const double x = -32.0 * i / 64000.0;
    const long double want = std::exp(static_cast<long double>(x));
    const long double got = sample_exp(x);
    ASSERT_LE(std::fabs(static_cast<double>((got - want) / want)), 1e-15) << x;
  }
}

TEST(SampleWeights, WeightsRoundTheScaledProbability) {
  // W = round(exp((l - max) / T) * 2^40): against exp of the same argument in long double, except
  // where that lies within 1e-3 of a rounding boundary (the double exp is good to ~4e-16
  // relative, 4e-4 of a unit at the top weight).
  EXPECT_EQ(sample_weight(1.5f, 1.5f, 1.0), kSampleWeightOne);
  EXPECT_EQ(sample_weight(-40.0f, 0.0f, 1.0), 0u);
  int checked = 0;
  for (int i = 0; i < 20000; ++i) {
    const float l = static_cast<float>(-30.0 * uniform_open01(5, i, 9));
    for (const double inv_t : {1.0, 1.0 / 0.7, 1.0 / 1.3}) {
      const double x = static_cast<double>(l) * inv_t;
      const long double exact =
          std::exp(static_cast<long double>(x)) * static_cast<long double>(kSampleWeightOne);
      const long double frac = exact - std::floor(exact);
      if (std::fabs(frac - 0.5L) < 1e-3L) continue;
      ASSERT_EQ(sample_weight(l, 0.0f, inv_t), static_cast<uint64_t>(std::llround(exact)))
          << l << " " << inv_t;
      ++checked;
    }
  }
  EXPECT_GT(checked, 59000);  // of 60000
  // Order keys sort floats numerically.
  const std::vector<float> ordered = {-kInf, -3.5f, -0.0f, 0.0f, 1e-30f, 2.0f, kInf};
  for (size_t i = 1; i < ordered.size(); ++i)
    EXPECT_LE(logit_order_key(ordered[i - 1]), logit_order_key(ordered[i])) << i;
  EXPECT_LT(logit_order_key(-3.5f), logit_order_key(1e-30f));
}

TEST(SampleWeights, ThresholdsAreCeilings) {
  EXPECT_EQ(min_p_weight(0.0f), 0u);
  EXPECT_EQ(min_p_weight(1.0f), kSampleWeightOne);
  EXPECT_EQ(min_p_weight(0.5f), kSampleWeightOne / 2);
  EXPECT_EQ(top_p_weight(0.5f, 10), 5u);
  EXPECT_EQ(top_p_weight(0.51f, 10), 6u);
  EXPECT_EQ(top_p_weight(1e-9f, 10), 1u);
  // The draw target covers [1, total]: u near 0 picks the first unit, near 1 the last.
  EXPECT_EQ(draw_weight(0x1p-53, 1000), 1u);
  EXPECT_EQ(draw_weight(1.0 - 0x1p-53, 1000), 1000u);
  EXPECT_EQ(draw_weight(0.5, 1000), 501u);
}

TEST(Sampler, HugeVocabularyIsRefusedByName) {
  std::vector<float> logits(static_cast<size_t>(kMaxSampleVocab) + 1, 0.0f);
  try {
    sample_token(logits, sampling(1.0f), 0);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("vocabulary"), std::string::npos) << e.what();
  }
}

TEST(Sampler, InverseCdfWalk) {
  const std::vector<TokenProb> d = {{4, 0.5}, {2, 0.25}, {9, 0.25}};
  for (uint64_t i = 0; i < 200; ++i) {
    const double u = uniform_open01(77, i);
    const int32_t want = u < 0.5 ? 4 : (u < 0.75 ? 2 : 9);
    EXPECT_EQ(draw_from(d, 77, i), want);
  }
}

TEST(Sampler, BadParamsThrow) {
  const std::vector<float> logits = {0, 1};
  for (const SamplingParams& p :
       {sampling(-0.1f), sampling(kNaN), sampling(kInf), sampling(1, -1), sampling(1, 0, 0.0f),
        sampling(1, 0, -0.5f), sampling(1, 0, 1.1f), sampling(1, 0, kNaN), sampling(1, 0, 1, -0.1f),
        sampling(1, 0, 1, 1.5f), sampling(1, 0, 1, kNaN)}) {
    EXPECT_THROW(p.validate(), Error);
    EXPECT_THROW(sample_token(logits, p, 0), Error);
  }
  EXPECT_NO_THROW(sampling(0.0f, 0, 1.0f, 1.0f).validate());
  EXPECT_NO_THROW(sampling(2.0f, 10, 1e-3f, 0.0f).validate());
}

TEST(Sampler, BadLogitsThrow) {
  for (const SamplingParams& p : {sampling(0.0f), sampling(1.0f), sampling(1.0f, 2, 0.9f)}) {
    EXPECT_THROW(sample_token(std::vector<float>{0, kNaN, 1}, p, 0), Error);
    EXPECT_THROW(sample_token(std::vector<float>{-kInf, -kInf, -kInf}, p, 0), Error);
    EXPECT_THROW(sample_token(std::vector<float>{0, kInf}, p, 0), Error);
    EXPECT_THROW(sample_token(std::vector<float>{}, p, 0), Error);
  }
}

TEST(Sampler, LogSoftmax) {
  const std::vector<float> l = {1, 2, 3};
  const double lse = std::log(std::exp(1.0) + std::exp(2.0) + std::exp(3.0));
  EXPECT_NEAR(log_softmax_at(l, 1), 2.0 - lse, 1e-12);
  EXPECT_NEAR(log_softmax_at(std::vector<float>{1000, 1000}, 0), -std::log(2.0), 1e-12);
  EXPECT_NEAR(log_softmax_at(std::vector<float>{-kInf, 5}, 1), 0.0, 1e-12);
  EXPECT_EQ(log_softmax_at(std::vector<float>{-kInf, 5}, 0),
            -std::numeric_limits<double>::infinity());
  EXPECT_THROW(log_softmax_at(l, 3), Error);
  EXPECT_THROW(log_softmax_at(l, -1), Error);
  EXPECT_THROW(log_softmax_at(std::vector<float>{0, kNaN}, 0), Error);
  EXPECT_THROW(log_softmax_at(std::vector<float>{-kInf, -kInf}, 0), Error);
}

TEST(Sampler, TopLogits) {
  const std::vector<float> l = {1, 3, 3, 2, -kInf};
  using V = std::vector<std::pair<int32_t, float>>;
  EXPECT_EQ(top_logits(l, 3), (V{{1, 3.0f}, {2, 3.0f}, {3, 2.0f}}));
  EXPECT_EQ(top_logits(l, 10), (V{{1, 3.0f}, {2, 3.0f}, {3, 2.0f}, {0, 1.0f}, {4, -kInf}}));
  EXPECT_TRUE(top_logits(l, 0).empty());
  EXPECT_THROW(top_logits(l, -1), Error);
  EXPECT_THROW(top_logits(std::vector<float>{0, kNaN}, 1), Error);
}

}  // namespace
}  // namespace tandem
