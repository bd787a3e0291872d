// The host side of the pipelined decode loop's copies on the CPU backend, where both complete at
// once: what a Readback returns and refuses, and StagedUpload's alternating buffers.
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <vector>

#include "tandem/backend/readback.h"
#include "tandem/backend/staged_upload.h"
#include "tandem/core/error.h"

namespace tandem {
namespace {

TEST(Readback, ReturnsTheBytesOfStartAndRefusesMisuse) {
  Readback rb;
  EXPECT_FALSE(rb.pending());
  EXPECT_THROW(rb.wait(), Error);
  std::vector<int32_t> src(100);
  std::iota(src.begin(), src.end(), 7);
  rb.start(src.data(), src.size() * sizeof(int32_t));
  EXPECT_TRUE(rb.pending());
  EXPECT_THROW(rb.start(src.data(), 4), Error);  // still pending
  src[0] = -1;                                   // after the copy: not seen
  const auto* got = static_cast<const int32_t*>(rb.wait());
  EXPECT_EQ(got[0], 7);
  EXPECT_EQ(got[99], 106);
  EXPECT_FALSE(rb.pending());
}

TEST(StagedUpload, AlternatesBuffersAndCopiesWhatWasStaged) {
  StagedUpload up;
  std::vector<uint8_t> dst(64, 0);
  uint8_t* first = up.host(64);
  std::memset(first, 1, 64);
  up.start(dst.data(), 64);
  EXPECT_EQ(dst[63], 1);
  uint8_t* second = up.host(32);
  EXPECT_NE(second, first);  // the other buffer: the first may still be in flight on a GPU
  std::memset(second, 2, 32);
  EXPECT_THROW(up.start(dst.data(), 65), Error);  // more than was staged
  up.start(dst.data(), 32);
  EXPECT_EQ(dst[0], 2);
  EXPECT_EQ(dst[40], 1);
  EXPECT_EQ(up.host(16), first);
}

}  // namespace
}  // namespace tandem
