// fp8 e4m3 weights (GLM-5's published release): the exact decode of every code, block-scaled
// dequantization with partial edge blocks, and the CPU product on them (ops::linear with F8_E4M3
// weights), which must equal the product on the dequantized weights and be batch invariant.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "tandem/backend/cpu/cpu_ops.h"
#include "tandem/backend/cpu/weight_element.h"
#include "tandem/backend/ops.h"
#include "tandem/core/dtype.h"
#include "tandem/core/error.h"

namespace tandem {
namespace {

// e4m3 by its bit fields, built as a float's bit pattern (normal codes) or scaled (subnormal).
float reference_e4m3(uint8_t v) {
  const uint32_t sign = (v >> 7) & 1, exp = (v >> 3) & 0xf, mant = v & 7;
  if (exp == 0xf && mant == 7) return NAN;
  if (exp == 0) return (sign ? -1.0f : 1.0f) * static_cast<float>(mant) / 512.0f;
  const uint32_t bits = (sign << 31) | ((exp - 7 + 127) << 23) | (mant << 20);
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

TEST(Fp8E4M3, EveryCodeDecodesExactly) {
  for (int c = 0; c < 256; ++c) {
    const auto v = static_cast<uint8_t>(c);
    const float got = fp8_e4m3_to_f32(v), want = reference_e4m3(v);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << "code " << c;
    } else {
      EXPECT_EQ(got, want) << "code " << c;
    }
  }
  EXPECT_EQ(fp8_e4m3_to_f32(0x38), 1.0f);
  EXPECT_EQ(fp8_e4m3_to_f32(0x7e), 448.0f);  // the largest finite value
  EXPECT_EQ(fp8_e4m3_to_f32(0xfe), -448.0f);
  EXPECT_EQ(fp8_e4m3_to_f32(0x01), std::ldexp(1.0f, -9));  // the smallest subnormal
  EXPECT_EQ(fp8_e4m3_to_f32(0x08), std::ldexp(1.0f, -6));  // the smallest normal
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_f32(0x7f)));
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_f32(0xff)));
  EXPECT_EQ(dtype_size(DType::F8_E4M3), 1u);
  DType t{};
  ASSERT_TRUE(dtype_from_safetensors("F8_E4M3", &t));
  EXPECT_EQ(t, DType::F8_E4M3);
}

// Encoding: every finite code round-trips; values between two codes go to the nearer (ties to the
// even code); magnitudes past 448 saturate.
TEST(Fp8E4M3, EncodesToTheNearestCode) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;  // NaN
    const auto v = static_cast<uint8_t>(c);
    EXPECT_EQ(f32_to_fp8_e4m3(fp8_e4m3_to_f32(v)), v) << "code " << c;
  }
  EXPECT_EQ(f32_to_fp8_e4m3(1.0625f), 0x38);  // halfway between 1 (even) and 1.125
  EXPECT_EQ(f32_to_fp8_e4m3(1.1875f), 0x3a);  // halfway between 1.125 and 1.25 (even)
  EXPECT_EQ(f32_to_fp8_e4m3(1.07f), 0x39);    // nearer 1.125
  EXPECT_EQ(f32_to_fp8_e4m3(1000.0f), 0x7e);  // saturates at 448
  EXPECT_EQ(f32_to_fp8_e4m3(-1000.0f), 0xfe);
  EXPECT_EQ(f32_to_fp8_e4m3(std::ldexp(1.0f, -12)), 0x00);  // below half the smallest subnormal
}

// The encoder against a search for the nearest code over every 613th float in [0, 2^9) and every
// midpoint between neighbouring codes, both signs.
TEST(Fp8E4M3, EncodingEqualsTheNearestCodeBySearch) {
  std::vector<float> values;
  for (int c = 0; c < 0x7e; ++c) {
    const float lo = fp8_e4m3_to_f32(static_cast<uint8_t>(c));
    const float hi = fp8_e4m3_to_f32(static_cast<uint8_t>(c + 1));
    values.push_back((lo + hi) / 2);  // exact: the codes have 4 significant bits
  }
  uint32_t limit;
  const float top = 512.0f;
  std::memcpy(&limit, &top, 4);
  for (uint32_t u = 0; u < limit; u += 613) {
    float f;
    std::memcpy(&f, &u, 4);
    values.push_back(f);
  }
  std::vector<float> codes;  // the non-negative finite values, increasing with the code
  for (int c = 0; c <= 0x7e; ++c) codes.push_back(fp8_e4m3_to_f32(static_cast<uint8_t>(c)));
  auto nearest = [&](float a) {
    if (a >= codes.back()) return uint8_t{0x7e};
    const auto hi =
        static_cast<int>(std::upper_bound(codes.begin(), codes.end(), a) - codes.begin());
    const int lo = hi - 1;
    const float dl = a - codes[static_cast<size_t>(lo)], dh = codes[static_cast<size_t>(hi)] - a;
    return static_cast<uint8_t>(dl < dh ? lo : dh < dl ? hi : (lo % 2 == 0 ? lo : hi));
  };
  int checked = 0;
  for (const float a : values) {
    const uint8_t want = nearest(a);
    ASSERT_EQ(f32_to_fp8_e4m3(a), want) << "value " << a;
    ASSERT_EQ(f32_to_fp8_e4m3(-a), want | 0x80) << "value " << -a;
    ++checked;
  }
  EXPECT_GT(checked, 1000000);
}

struct Fp8Matrix {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  ops::WeightRef ref;
  Fp8Matrix(int64_t rows, int64_t cols, int64_t br, int64_t bc, std::mt19937& rng) {
    std::uniform_int_distribution<int> code(0, 255);
    std::uniform_real_distribution<float> scale(0.001f, 0.01f);
    for (int64_t i = 0; i < rows * cols; ++i) {
      int c = code(rng);
      if ((c & 0x7f) == 0x7f) c &= 0xfe;  // no NaN codes in a weight
      codes.push_back(static_cast<uint8_t>(c));
    }
    const int64_t nbr = (rows + br - 1) / br, nbc = (cols + bc - 1) / bc;
    for (int64_t i = 0; i < nbr * nbc; ++i) scales.push_back(scale(rng));
    ref.dtype = DType::F8_E4M3;
    ref.data = codes.data();
    ref.rows = rows;
    ref.cols = cols;
    ref.scales.data = scales.data();
    ref.scales.dtype = DType::F32;
    ref.scales.block_rows = br;
    ref.scales.block_cols = bc;
  }
};

// Partial last blocks in both directions: every weight is its code's value times its block's
// scale.
TEST(Fp8Weights, DequantizeScalesEachBlockIncludingPartialOnes) {
  std::mt19937 rng(3);
  const int64_t rows = 200, cols = 136, br = 128, bc = 128;
  const Fp8Matrix w(rows, cols, br, bc, rng);
  std::vector<float> out(static_cast<size_t>(rows * cols));
  cpu::dequantize_fp8_rows(w.ref, 0, rows, out.data());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      ASSERT_EQ(out[static_cast<size_t>(r * cols + c)],
                reference_e4m3(w.codes[static_cast<size_t>(r * cols + c)]) *
                    w.scales[static_cast<size_t>((r / br) * 2 + c / bc)])
          << r << ", " << c;
  // A row range starts where it says.
  std::vector<float> tail(static_cast<size_t>(3 * cols));
  cpu::dequantize_fp8_rows(w.ref, 130, 3, tail.data());
  EXPECT_EQ(0, std::memcmp(tail.data(), out.data() + 130 * cols, tail.size() * sizeof(float)));
}

// The product equals an fp32 product on the dequantized weights (within summation rounding), and
// each input row's outputs are bitwise the same alone and in a batch.
TEST(Fp8Weights, ProductMatchesTheDequantizedWeightsAndIsBatchInvariant) {
  std::mt19937 rng(4);
  const int64_t rows = 96, cols = 160, m = 5;
  const Fp8Matrix w(rows, cols, 32, 64, rng);
  std::vector<float> dense(static_cast<size_t>(rows * cols));
  cpu::dequantize_fp8_rows(w.ref, 0, rows, dense.data());
  std::normal_distribution<float> d;
  std::vector<float> x(static_cast<size_t>(m * cols));
  for (float& v : x) v = d(rng);
  std::vector<float> y(static_cast<size_t>(m * rows));
  ops::linear(x.data(), m, w.ref, y.data());
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t r = 0; r < rows; ++r) {
      double want = 0, mag = 0;
      for (int64_t c = 0; c < cols; ++c) {
        want +=
            double(x[static_cast<size_t>(i * cols + c)]) * dense[static_cast<size_t>(r * cols + c)];
        mag += std::fabs(double(x[static_cast<size_t>(i * cols + c)]) *
                         dense[static_cast<size_t>(r * cols + c)]);
      }
      EXPECT_NEAR(y[static_cast<size_t>(i * rows + r)], want, 1e-5 * mag + 1e-12);
    }
    std::vector<float> alone(static_cast<size_t>(rows));
    ops::linear(x.data() + i * cols, 1, w.ref, alone.data());
    EXPECT_EQ(0, std::memcmp(alone.data(), y.data() + i * rows, alone.size() * sizeof(float)))
        << "row " << i;
  }
}

// Every element the scalar reader gives (mla_attention reads kv_b_proj through it) is the
// dequantized value.
TEST(Fp8Weights, ElementsReadAsTheirDequantizedValues) {
  std::mt19937 rng(6);
  const int64_t rows = 40, cols = 72;
  const Fp8Matrix w(rows, cols, 16, 32, rng);
  std::vector<float> dense(static_cast<size_t>(rows * cols));
  cpu::dequantize_fp8_rows(w.ref, 0, rows, dense.data());
  for (int64_t i = 0; i < rows * cols; ++i)
    ASSERT_EQ(ops::weight_element(w.ref, i), dense[static_cast<size_t>(i)]) << i;
}

TEST(Fp8Weights, MissingScalesAreNamed) {
  std::mt19937 rng(5);
  Fp8Matrix w(64, 64, 32, 32, rng);
  std::vector<float> y(64), x(64, 1.0f);
  w.ref.scales.block_rows = 0;
  try {
    ops::linear(x.data(), 1, w.ref, y.data());
    ADD_FAILURE() << "accepted fp8 weights without block scales";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("without block scales"), std::string::npos) << e.what();
  }
  w.ref.scales.block_rows = 32;
  w.ref.scales.dtype = DType::I32;
  EXPECT_THROW(ops::linear(x.data(), 1, w.ref, y.data()), Error);
}

}  // namespace
}  // namespace tandem
