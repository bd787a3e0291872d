// ops::linear_quantized (MLX affine layout) against dequantize-then-dense, for every supported
// bit width; batch invariance; refusals.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "tandem/backend/ops.h"
#include "tandem/core/error.h"

namespace tandem::ops {
namespace {

struct Case {
  int bits;
  int64_t group;
};

// Random codes packed as a little-endian bit stream per row, bf16 scales and biases, and the
// dequantized fp32 matrix (scale * q + bias).
struct QuantMatrix {
  std::vector<uint32_t> packed;
  std::vector<uint16_t> scales, biases;
  std::vector<float> dense;
};

QuantMatrix make(int64_t rows, int64_t cols, int bits, int64_t gs, std::mt19937& rng) {
  QuantMatrix m;
  const int64_t words = cols * bits / 32, groups = cols / gs;
  m.packed.assign(static_cast<size_t>(rows * words), 0);
  m.dense.resize(static_cast<size_t>(rows * cols));
  std::uniform_real_distribution<float> u(-0.05f, 0.05f);
  std::uniform_int_distribution<uint32_t> code(0, (1u << bits) - 1u);
  for (int64_t i = 0; i < rows * groups; ++i) {
    m.scales.push_back(f32_to_bf16(std::fabs(u(rng)) + 1e-3f));
    m.biases.push_back(f32_to_bf16(u(rng)));
  }
  for (int64_t r = 0; r < rows; ++r) {
    auto* row = reinterpret_cast<uint8_t*>(m.packed.data() + r * words);
    for (int64_t c = 0; c < cols; ++c) {
      const uint32_t q = code(rng);
      for (int b = 0; b < bits; ++b) {
        const int64_t bit = c * bits + b;
        if (q >> b & 1u) row[bit / 8] |= static_cast<uint8_t>(1u << (bit % 8));
      }
      const int64_t g = r * groups + c / gs;
      m.dense[r * cols + c] =
          bf16_to_f32(m.scales[g]) * static_cast<float>(q) + bf16_to_f32(m.biases[g]);
    }
  }
  return m;
}

QuantWeightRef ref(const QuantMatrix& m, int64_t rows, int64_t cols, int bits, int64_t gs) {
  QuantWeightRef w;
  w.packed = m.packed.data();
  w.scales = {DType::BF16, m.scales.data(), rows, cols / gs, {}};
  w.biases = {DType::BF16, m.biases.data(), rows, cols / gs, {}};
  w.rows = rows;
  w.cols = cols;
  w.group_size = gs;
  w.bits = bits;
  return w;
}

TEST(QuantizedLinear, MatchesDequantizedDense) {
  std::mt19937 rng(7);
  const int64_t rows = 37, cols = 256, m = 5;
  std::vector<float> x(static_cast<size_t>(m * cols));
  std::normal_distribution<float> n(0, 1);
  for (float& v : x) v = n(rng);
  for (const Case c : {Case{2, 32}, Case{3, 64}, Case{4, 64}, Case{5, 32}, Case{6, 128},
                       Case{8, 64}, Case{4, 256}}) {
    const QuantMatrix q = make(rows, cols, c.bits, c.group, rng);
    const QuantWeightRef w = ref(q, rows, cols, c.bits, c.group);
    std::vector<float> got(static_cast<size_t>(m * rows)), want(got.size());
    linear_quantized(x.data(), m, w, got.data());
    linear(x.data(), m, WeightRef{DType::F32, q.dense.data(), rows, cols, {}}, want.data());
    for (size_t i = 0; i < got.size(); ++i)
      ASSERT_NEAR(got[i], want[i], 1e-4 * (1 + std::fabs(want[i])))
          << c.bits << "-bit, group " << c.group << ", element " << i;
    // Batch invariance: each row alone gives the same bits.
    for (int64_t i = 0; i < m; ++i) {
      std::vector<float> one(static_cast<size_t>(rows));
      linear_quantized(x.data() + i * cols, 1, w, one.data());
      EXPECT_EQ(std::memcmp(one.data(), got.data() + i * rows, sizeof(float) * rows), 0);
    }
  }
}

TEST(QuantizedLinear, RefusesUnsupportedLayouts) {
  std::mt19937 rng(1);
  const QuantMatrix q = make(4, 64, 4, 32, rng);
  QuantWeightRef w = ref(q, 4, 64, 4, 32);
  std::vector<float> x(64), y(4);
  w.bits = 7;
  EXPECT_THROW(linear_quantized(x.data(), 1, w, y.data()), Error);
  w.bits = 4;
  w.group_size = 48;
  EXPECT_THROW(linear_quantized(x.data(), 1, w, y.data()), Error);
  EXPECT_FALSE(quant_bits_supported(1));
  EXPECT_TRUE(quant_bits_supported(3));
}

}  // namespace
}  // namespace tandem::ops
