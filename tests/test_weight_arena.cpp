// WeightArena's merged layouts: the stacked and pair-interleaved matrices the CUDA model runs its
// projections on. Checked on the CPU backend, where the arena's blocks are host memory.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "tandem/backend/weight_arena.h"
#include "tandem/core/error.h"

namespace tandem {
namespace {

std::vector<uint16_t> rows_of(const ops::WeightRef& w) {
  std::vector<uint16_t> v(static_cast<size_t>(w.rows * w.cols));
  std::memcpy(v.data(), w.data, v.size() * sizeof(uint16_t));
  return v;
}

TEST(WeightArena, InterleaveRowsAlternatesBlocksAndReleasesTheParts) {
  WeightArena arena;
  const int64_t rows = 24, cols = 6, group = 8;
  ops::WeightRef a = arena.random_matrix(rows, cols, 1, 1.0f);
  ops::WeightRef b = arena.random_matrix(rows, cols, 2, 1.0f);
  const std::vector<uint16_t> ha = rows_of(a), hb = rows_of(b);
  const uint64_t before = arena.bytes();
  const ops::WeightRef w = arena.interleave_rows(&a, &b, group);
  ASSERT_EQ(w.rows, 2 * rows);
  ASSERT_EQ(w.cols, cols);
  const std::vector<uint16_t> hw = rows_of(w);
  for (int64_t r = 0; r < w.rows; ++r) {
    const int64_t blk = r / (2 * group), in = r % (2 * group);
    const std::vector<uint16_t>& src = in < group ? ha : hb;
    const int64_t src_row = blk * group + in % group;
    for (int64_t c = 0; c < cols; ++c)
      ASSERT_EQ(hw[static_cast<size_t>(r * cols + c)], src[static_cast<size_t>(src_row * cols + c)])
          << "row " << r << " col " << c;
  }
  EXPECT_EQ(a.data, nullptr);
  EXPECT_EQ(b.data, nullptr);
  EXPECT_EQ(a.rows, rows) << "the parts keep their shapes (weight byte counts use them)";
  EXPECT_EQ(arena.bytes(), before) << "the parts' copies are released";
}

TEST(WeightArena, InterleaveRowsRefusesPartsThatDoNotPair) {
  WeightArena arena;
  ops::WeightRef a = arena.random_matrix(24, 6, 1, 1.0f);
  ops::WeightRef b = arena.random_matrix(16, 6, 2, 1.0f);
  EXPECT_THROW(arena.interleave_rows(&a, &b, 8), Error);
  ops::WeightRef c = arena.random_matrix(20, 6, 3, 1.0f);
  ops::WeightRef d = arena.random_matrix(20, 6, 4, 1.0f);
  try {
    arena.interleave_rows(&c, &d, 8);
    ADD_FAILURE() << "20 rows interleaved in blocks of 8";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("20 rows"), std::string::npos) << e.what();
  }
  EXPECT_NE(c.data, nullptr) << "a refused call left its parts alone";
}

TEST(WeightArena, StackRowsConcatenatesAndMakesPartsViews) {
  WeightArena arena;
  ops::WeightRef a = arena.random_matrix(3, 4, 1, 1.0f);
  ops::WeightRef b = arena.random_matrix(5, 4, 2, 1.0f);
  const std::vector<uint16_t> ha = rows_of(a), hb = rows_of(b);
  const ops::WeightRef w = arena.stack_rows({&a, &b});
  ASSERT_EQ(w.rows, 8);
  std::vector<uint16_t> want = ha;
  want.insert(want.end(), hb.begin(), hb.end());
  EXPECT_EQ(rows_of(w), want);
  EXPECT_EQ(rows_of(a), ha);
  EXPECT_EQ(rows_of(b), hb);
  EXPECT_EQ(static_cast<const uint16_t*>(b.data), static_cast<const uint16_t*>(w.data) + 12);
}

}  // namespace
}  // namespace tandem
