// PositionCache: a row's per-position entries in backend memory (GLM-5's latent caches and index
// keys). Appends keep every earlier entry through capacity growth, strided sources are packed,
// truncation keeps exactly a prefix, and the host copies round-trip.
#include <gtest/gtest.h>

#include <vector>

#include "tandem/core/error.h"
#include "tandem/model/position_cache.h"

namespace tandem {
namespace {

std::vector<float> entries(int64_t n, int64_t width, float base) {
  std::vector<float> v;
  for (int64_t i = 0; i < n * width; ++i) v.push_back(base + static_cast<float>(i));
  return v;
}

TEST(PositionCache, AppendsKeepEveryEntryThroughGrowthAndTruncateKeepsAPrefix) {
  const int64_t W = 5;
  PositionCache c(W);
  std::vector<float> want;
  for (int step = 0; step < 40; ++step) {  // one or three positions at a time, well past 16
    const int64_t n = step % 2 ? 3 : 1;
    const std::vector<float> e = entries(n, W, 1000.0f * step);
    c.append(e.data(), n);
    want.insert(want.end(), e.begin(), e.end());
    ASSERT_EQ(c.length() * W, static_cast<int64_t>(want.size()));
  }
  EXPECT_EQ(c.to_host(), want);
  EXPECT_EQ(c.bytes(), want.size() * sizeof(float));
  c.truncate(7);
  EXPECT_EQ(c.to_host(), std::vector<float>(want.begin(), want.begin() + 7 * W));
  // Appending after a truncation overwrites the dropped positions.
  const std::vector<float> e = entries(2, W, -50.0f);
  c.append(e.data(), 2);
  std::vector<float> again(want.begin(), want.begin() + 7 * W);
  again.insert(again.end(), e.begin(), e.end());
  EXPECT_EQ(c.to_host(), again);
  EXPECT_EQ(c.to_host(3), std::vector<float>(want.begin(), want.begin() + 3 * W));
}

TEST(PositionCache, StridedSourcesArePackedAndHostCopiesRoundTrip) {
  const int64_t W = 4, stride = 9;
  const std::vector<float> rows = entries(3, stride, 0.0f);  // entries are the first 4 of each 9
  PositionCache c(W);
  c.append(rows.data(), 3, stride);
  std::vector<float> want;
  for (int64_t r = 0; r < 3; ++r)
    want.insert(want.end(), rows.begin() + r * stride, rows.begin() + r * stride + W);
  EXPECT_EQ(c.to_host(), want);

  PositionCache d(W);
  d.assign_host(want);
  EXPECT_EQ(d.length(), 3);
  EXPECT_EQ(d.to_host(), want);
  d.release();
  EXPECT_EQ(d.length(), 0);
  EXPECT_TRUE(d.to_host().empty());
}

TEST(PositionCache, MisuseIsRefused) {
  PositionCache c(4);
  const std::vector<float> e = entries(2, 4, 0.0f);
  c.append(e.data(), 2);
  EXPECT_THROW(c.truncate(3), Error);
  EXPECT_THROW(c.to_host(5), Error);
  EXPECT_THROW(c.append(e.data(), 1, 3), Error);  // a stride shorter than an entry
  EXPECT_THROW(c.assign_host(std::vector<float>(6, 1.0f)), Error);  // not whole entries
  EXPECT_EQ(c.to_host(), e);                                        // nothing changed
}

}  // namespace
}  // namespace tandem
