// The device sampler (cuda::sample_rows) against the host sampler (core/sampler.h): the same
// token for every row, parameter set and key, bit for bit. Both compute the integer weights of
// core/sample_weights.h, so any difference is a bug, never rounding.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "cuda_test_util.h"
#include "sampling_params.h"
#include "tandem/backend/cuda/cuda_ops.h"
#include "tandem/backend/ops.h"
#include "tandem/core/sampler.h"

namespace tandem {
namespace {

using tandem::testing::CudaTest;
using tandem::testing::DeviceBuffer;

constexpr float kInf = std::numeric_limits<float>::infinity();

using tandem::testing::sampling;

// Logits of the kinds a model gives: spread like a trained head's (a few high tokens), rounded to
// bf16-like precision so ties occur, some -inf (a masked vocabulary tail).
std::vector<float> model_like_logits(int64_t V, std::mt19937& rng, float scale) {
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(V));
  for (auto& x : v) {
    x = nd(rng);
    x = std::ldexp(std::nearbyint(std::ldexp(x, 6)), -6);  // ties among near values
  }
  for (int i = 0; i < 5 && i < V; ++i) v[static_cast<size_t>(rng() % V)] += 12.0f;
  for (int64_t i = V - V / 50; i < V; ++i) v[static_cast<size_t>(i)] = -kInf;
  return v;
}

// Every row sampled on the device and on the host with rows[r]'s parameters.
void expect_same_tokens(const std::vector<float>& logits, int64_t V,
                        const std::vector<ops::SampleRow>& rows) {
  const int64_t R = static_cast<int64_t>(rows.size());
  ASSERT_EQ(logits.size(), static_cast<size_t>(R * V));
  DeviceBuffer<float> d_logits(logits);
  DeviceBuffer<ops::SampleRow> d_rows(rows);
  DeviceBuffer<int32_t> d_out(std::vector<int32_t>(static_cast<size_t>(R), -7));
  cuda::sample_rows(d_logits.get(), R, V, d_rows.get(), d_out.get());
  const std::vector<int32_t> got = d_out.download();
  for (int64_t r = 0; r < R; ++r) {
    const ops::SampleRow& p = rows[static_cast<size_t>(r)];
    const int32_t want =
        sample_token({logits.data() + r * V, static_cast<size_t>(V)}, ops::sampling_of(p), p.index);
    ASSERT_EQ(got[static_cast<size_t>(r)], want)
        << "row " << r << " V " << V << " T " << p.temperature << " top_k " << p.top_k << " top_p "
        << p.top_p << " min_p " << p.min_p << " index " << p.index;
  }
}

TEST_F(CudaTest, SampleRowsEqualsTheHostSamplerOnEveryFilter) {
  std::mt19937 rng(42);
  const std::vector<SamplingParams> sets = {sampling(0.0f),
                                            sampling(1.0f),
                                            sampling(0.7f),
                                            sampling(2.5f),
                                            sampling(0.05f),
                                            sampling(1.0f, 1),
                                            sampling(0.8f, 40),
                                            sampling(1.0f, 0, 0.9f),
                                            sampling(0.7f, 0, 0.5f),
                                            sampling(1.2f, 50, 0.95f, 0.02f),
                                            sampling(1.0f, 0, 1.0f, 0.1f),
                                            sampling(1.5f, 0, 0.999f),
                                            sampling(1.0f, 0, 1e-6f),
                                            sampling(1.0f, 0, 1.0f, 1.0f)};
  for (const int64_t V : {int64_t{1}, int64_t{7}, int64_t{1000}, int64_t{4099}, int64_t{248320}}) {
    for (const float scale : {0.3f, 3.0f}) {
      std::vector<float> logits;
      std::vector<ops::SampleRow> rows;
      for (size_t s = 0; s < sets.size(); ++s) {
        for (uint64_t index : {uint64_t{0}, uint64_t{1}, uint64_t{977}, (uint64_t{1} << 33) + 5}) {
          const std::vector<float> l = V < 50 ? std::vector<float>(static_cast<size_t>(V), 0.5f)
                                              : model_like_logits(V, rng, scale);
          logits.insert(logits.end(), l.begin(), l.end());
          SamplingParams p = sets[s];
          p.seed = 1000 + s;
          rows.push_back(ops::sample_row(p, index));
        }
      }
      SCOPED_TRACE(V);
      expect_same_tokens(logits, V, rows);
    }
  }
}

TEST_F(CudaTest, SampleRowsFollowsTheHostOverManyKeys) {
  // One row, many keys: the draws spread over the head and the tail of the canonical order, so
  // the descent meets every level and tie case the host's walk does.
  std::mt19937 rng(7);
  const int64_t V = 32000;
  const std::vector<float> one = model_like_logits(V, rng, 1.0f);
  for (const SamplingParams& p :
       {sampling(1.0f), sampling(1.0f, 100, 0.9f), sampling(3.0f, 0, 1, 0.01f)}) {
    std::vector<float> logits;
    std::vector<ops::SampleRow> rows;
    for (uint64_t i = 0; i < 512; ++i) {
      logits.insert(logits.end(), one.begin(), one.end());
      rows.push_back(ops::sample_row(p, i));
    }
    expect_same_tokens(logits, V, rows);
  }
}

TEST_F(CudaTest, SampleRowsSpreadsOneRowOverManyBlocks) {
  // One row per launch: a 248k vocabulary is split over the most blocks, which meet at every
  // phase's barrier. Boundaries come from sorted lists of one bin's tokens, except where a bin
  // holds more than a list takes (scale 0: every token alike), which takes every descent level.
  std::mt19937 rng(11);
  const int64_t V = 248320;
  for (const float scale : {0.3f, 3.0f, 0.0f}) {
    const std::vector<float> logits = scale > 0 ? model_like_logits(V, rng, scale)
                                                : std::vector<float>(static_cast<size_t>(V), 0.75f);
    for (const SamplingParams& p : {sampling(1.0f), sampling(0.7f, 0, 0.9f), sampling(1.0f, 5000),
                                    sampling(1.3f, 20000, 0.95f, 0.001f)}) {
      for (uint64_t i = 0; i < 6; ++i) expect_same_tokens(logits, V, {ops::sample_row(p, i * 7)});
    }
  }
}

TEST_F(CudaTest, SampleRowsTakesMoreRowsThanOneLaunch) {
  // More rows than the GPU holds blocks at once (and than one launch takes): they go in turns.
  std::mt19937 rng(5);
  const int64_t V = 3000, R = 1500;
  std::vector<float> logits;
  std::vector<ops::SampleRow> rows;
  for (int64_t r = 0; r < R; ++r) {
    const std::vector<float> l = model_like_logits(V, rng, 1.0f);
    logits.insert(logits.end(), l.begin(), l.end());
    rows.push_back(ops::sample_row(sampling(r % 3 == 0 ? 0.0f : 0.9f, r % 5 == 0 ? 50 : 0), r));
  }
  expect_same_tokens(logits, V, rows);
}

TEST_F(CudaTest, SampleRowsTiesGoToTheLowestIds) {
  // A flat row: every token weighs 2^40, so the draw and top-k and top-p boundaries all land in
  // ties that only the id order separates.
  const int64_t V = 5000;
  std::vector<float> logits;
  std::vector<ops::SampleRow> rows;
  for (const SamplingParams& p :
       {sampling(1.0f), sampling(1.0f, 777), sampling(1.0f, 0, 0.3f), sampling(1.0f, 3000, 0.5f)}) {
    for (uint64_t i = 0; i < 64; ++i) {
      logits.insert(logits.end(), static_cast<size_t>(V), -1.25f);
      rows.push_back(ops::sample_row(p, i * 31));
    }
  }
  expect_same_tokens(logits, V, rows);
}

TEST_F(CudaTest, SampleRowsMarksBadRowsAndBadParams) {
  const int64_t V = 300;
  std::vector<float> logits(static_cast<size_t>(4 * V), 0.25f);
  logits[17] = std::numeric_limits<float>::quiet_NaN();                            // row 0
  logits[static_cast<size_t>(V) + 3] = kInf;                                       // row 1
  for (int64_t i = 0; i < V; ++i) logits[static_cast<size_t>(2 * V + i)] = -kInf;  // row 2
  std::vector<ops::SampleRow> rows(4, ops::sample_row(sampling(1.0f), 0));
  rows.push_back(ops::sample_row(sampling(1.0f, 0, 0.0f), 0));  // row 4: top_p outside (0, 1]
  logits.insert(logits.end(), static_cast<size_t>(V), 0.0f);
  DeviceBuffer<float> d_logits(logits);
  DeviceBuffer<ops::SampleRow> d_rows(rows);
  DeviceBuffer<int32_t> d_out(std::vector<int32_t>(5, 99));
  cuda::sample_rows(d_logits.get(), 5, V, d_rows.get(), d_out.get());
  const std::vector<int32_t> got = d_out.download();
  EXPECT_EQ(got[0], -1);
  EXPECT_EQ(got[1], -1);
  EXPECT_EQ(got[2], -1);
  EXPECT_GE(got[3], 0);
  EXPECT_EQ(got[4], -1);
}

}  // namespace
}  // namespace tandem
