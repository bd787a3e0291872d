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

// start_together: each upload's staged bytes land in its destination and each moves on to its
// other buffer; a part that asks for more than was staged, or an upload given twice, is refused
// before anything is copied.
TEST(StagedUpload, StartsSeveralUploadsTogether) {
  StagedUpload a, b;
  std::vector<uint8_t> da(32, 0), db(48, 0);
  uint8_t* a1 = a.host(32);
  std::memset(a1, 3, 32);
  uint8_t* b1 = b.host(48);
  std::memset(b1, 4, 48);
  const StagedUpload::Part too_big[] = {{&a, da.data(), 32}, {&b, db.data(), 49}};
  EXPECT_THROW(StagedUpload::start_together(too_big), Error);
  const StagedUpload::Part twice[] = {{&a, da.data(), 16}, {&a, da.data() + 16, 16}};
  EXPECT_THROW(StagedUpload::start_together(twice), Error);
  EXPECT_EQ(da[0], 0);  // nothing copied by the refused calls
  EXPECT_EQ(db[0], 0);
  const StagedUpload::Part both[] = {{&a, da.data(), 32}, {&b, db.data(), 48}};
  StagedUpload::start_together(both);
  EXPECT_EQ(da, std::vector<uint8_t>(32, 3));
  EXPECT_EQ(db, std::vector<uint8_t>(48, 4));
  EXPECT_NE(a.host(8), a1);  // each went on to its other buffer
  EXPECT_NE(b.host(8), b1);
}

}  // namespace
}  // namespace tandem
