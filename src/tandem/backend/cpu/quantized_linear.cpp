// y = x · dequant(w)ᵀ for quantized weights: MLX affine groups (companion drafters ship them)
// and fp8 e4m3 blocks with one scale each (GLM-5's published release).
//
// Each thread dequantizes one weight row at a time into an fp32 buffer (a few KB: it stays in L1)
// and dots it with every input row. A dot product walks k in 16 independent lanes and reduces
// them with a fixed tree, so y[i, j] does not depend on m (batch invariance, DESIGN.md §1.2).
#include <algorithm>
#include <cstring>
#include <vector>

#include "tandem/backend/cpu/cpu_ops.h"
#include "tandem/backend/cpu/thread_pool.h"
#include "tandem/core/error.h"

namespace tandem::cpu {

using namespace tandem::ops;

namespace {

inline float load_scalar(const WeightRef& w, int64_t i) {
  switch (w.dtype) {
    case DType::F32: {
      float f;
      std::memcpy(&f, static_cast<const char*>(w.data) + i * 4, 4);
      return f;
    }
    case DType::BF16: {
      uint16_t h;
      std::memcpy(&h, static_cast<const char*>(w.data) + i * 2, 2);
      return bf16_to_f32(h);
    }
    default: {  // F16 (checked on entry)
      uint16_t h;
      std::memcpy(&h, static_cast<const char*>(w.data) + i * 2, 2);
      return f16_to_f32(h);
    }
  }
}

// Element c of a row's little-endian bit stream of `bits`-wide unsigned values.
template <int Bits>
inline uint32_t extract(const uint8_t* row, int64_t c) {
  if constexpr (Bits == 8) {
    return row[c];
  } else if constexpr (Bits == 4) {
    return (row[c >> 1] >> ((c & 1) * 4)) & 0xfu;
  } else if constexpr (Bits == 2) {
    return (row[c >> 2] >> ((c & 3) * 2)) & 0x3u;
  } else {
    const int64_t bit = c * Bits;
    const int64_t byte = bit >> 3;
    const int sh = static_cast<int>(bit & 7);
    uint32_t v = static_cast<uint32_t>(row[byte]) >> sh;
    // Read the next byte only when the value straddles it (never past the row's last byte).
    if (sh + Bits > 8) v |= static_cast<uint32_t>(row[byte + 1]) << (8 - sh);
    return v & ((1u << Bits) - 1u);
  }
}

template <int Bits>
void dequant_row(const QuantWeightRef& w, int64_t r, float* out) {
  const int64_t row_bytes = w.cols * Bits / 8;
  const auto* row = static_cast<const uint8_t*>(w.packed) + r * row_bytes;
  const int64_t groups = w.cols / w.group_size;
  for (int64_t g = 0; g < groups; ++g) {
    const float s = load_scalar(w.scales, r * groups + g);
    const float b = load_scalar(w.biases, r * groups + g);
    const int64_t c0 = g * w.group_size;
    for (int64_t c = c0; c < c0 + w.group_size; ++c)
      out[c] = s * static_cast<float>(extract<Bits>(row, c)) + b;
  }
}

inline float dot16(const float* a, const float* b, int64_t k) {
  float acc[16] = {};
  int64_t c = 0;
  for (; c + 16 <= k; c += 16)
    for (int l = 0; l < 16; ++l) acc[l] += a[c + l] * b[c + l];
  for (int l = 0; c < k; ++c, ++l) acc[l] += a[c] * b[c];
  for (int width = 8; width >= 1; width /= 2)
    for (int l = 0; l < width; ++l) acc[l] += acc[l + width];
  return acc[0];
}

// y[m, n] = x[m, k] · Wᵀ with weight row r produced by dequant(r, buf) into buf [k]. Rows are
// independent; buf holds one dequantized row at a time (rewritten before use).
template <class Dequant>
void linear_rows(const float* x, int64_t m, int64_t n, int64_t k, float* y,
                 const Dequant& dequant) {
  parallel_for(n, [&](int64_t r0, int64_t r1) {
    thread_local std::vector<float> scratch;
    if (scratch.size() < static_cast<size_t>(k)) scratch.resize(k);
    float* const buf = scratch.data();
    for (int64_t r = r0; r < r1; ++r) {
      dequant(r, buf);
      for (int64_t i = 0; i < m; ++i) y[i * n + r] = dot16(x + i * k, buf, k);
    }
  });
}

template <int Bits>
void linear_bits(const float* x, int64_t m, const QuantWeightRef& w, float* y) {
  linear_rows(x, m, w.rows, w.cols, y,
              [&](int64_t r, float* buf) { dequant_row<Bits>(w, r, buf); });
}

float fp8_scale(const BlockScales& s, int64_t i) {
  WeightRef v;
  v.dtype = s.dtype;
  v.data = s.data;
  return load_scalar(v, i);
}

// fp8 row r: each block's scale times the exact e4m3 values.
void fp8_row(const WeightRef& w, int64_t r, float* out) {
  const int64_t blocks = (w.cols + w.scales.block_cols - 1) / w.scales.block_cols;
  const auto* row = static_cast<const uint8_t*>(w.data) + r * w.cols;
  for (int64_t b = 0; b < blocks; ++b) {
    const float s = fp8_scale(w.scales, (r / w.scales.block_rows) * blocks + b);
    const int64_t c1 = std::min(w.cols, (b + 1) * w.scales.block_cols);
    for (int64_t c = b * w.scales.block_cols; c < c1; ++c) out[c] = fp8_e4m3_to_f32(row[c]) * s;
  }
}

void check_fp8(const WeightRef& w, const char* op) {
  if (w.dtype != DType::F8_E4M3) fail(op, ": weight dtype ", dtype_name(w.dtype), " is not fp8");
  if (!w.scales.data || w.scales.block_rows < 1 || w.scales.block_cols < 1)
    fail(op, ": fp8 weight [", w.rows, " x ", w.cols, "] without block scales (blocks of ",
         w.scales.block_rows, " x ", w.scales.block_cols, ")");
  if (w.scales.dtype != DType::F32 && w.scales.dtype != DType::BF16)
    fail(op, ": scale_inv dtype ", dtype_name(w.scales.dtype), " is not supported (F32 or BF16)");
}

bool is_float(DType t) {
  return t == DType::F32 || t == DType::BF16 || t == DType::F16;
}

}  // namespace

void linear_quantized(const float* x, int64_t m, const QuantWeightRef& w, float* y) {
  if (!ops::quant_bits_supported(w.bits))
    fail("linear_quantized: ", w.bits, "-bit weights are not supported (2, 3, 4, 5, 6 or 8)");
  if (w.group_size <= 0 || w.group_size % 32 != 0 || w.cols % w.group_size != 0)
    fail("linear_quantized: group_size ", w.group_size, " must be a positive multiple of 32 ",
         "dividing the input width ", w.cols);
  const int64_t groups = w.cols / w.group_size;
  for (const WeightRef* s : {&w.scales, &w.biases}) {
    if (!is_float(s->dtype))
      fail("linear_quantized: scales/biases dtype ", dtype_name(s->dtype),
           " is not supported (F32, BF16 or F16)");
    if (s->rows * s->cols != w.rows * groups)
      fail("linear_quantized: scales/biases hold ", s->rows * s->cols, " values, expected ",
           w.rows * groups, " (", w.rows, " rows x ", groups, " groups)");
  }
  if (m <= 0 || w.rows == 0) return;
  switch (w.bits) {
    case 2:
      return linear_bits<2>(x, m, w, y);
    case 3:
      return linear_bits<3>(x, m, w, y);
    case 4:
      return linear_bits<4>(x, m, w, y);
    case 5:
      return linear_bits<5>(x, m, w, y);
    case 6:
      return linear_bits<6>(x, m, w, y);
    default:
      return linear_bits<8>(x, m, w, y);
  }
}

}  // namespace tandem::cpu

namespace tandem::cpu {

void linear_fp8(const float* x, int64_t m, const ops::WeightRef& w, float* y) {
  check_fp8(w, "linear");
  if (m <= 0 || w.rows == 0) return;
  linear_rows(x, m, w.rows, w.cols, y, [&](int64_t r, float* buf) { fp8_row(w, r, buf); });
}

void dequantize_fp8_rows(const ops::WeightRef& w, int64_t r0, int64_t n, float* out) {
  check_fp8(w, "dequantize_fp8_rows");
  for (int64_t r = r0; r < r0 + n; ++r) fp8_row(w, r, out + (r - r0) * w.cols);
}

float fp8_element(const ops::WeightRef& w, int64_t i) {
  const int64_t r = i / w.cols, c = i % w.cols;
  const int64_t blocks = (w.cols + w.scales.block_cols - 1) / w.scales.block_cols;
  const float s = fp8_scale(w.scales, (r / w.scales.block_rows) * blocks + c / w.scales.block_cols);
  return fp8_e4m3_to_f32(static_cast<const uint8_t*>(w.data)[i]) * s;
}

void dequantize_rows(const ops::QuantWeightRef& w, int64_t r0, int64_t n, float* out) {
  if (!ops::quant_bits_supported(w.bits))
    fail("dequantize_rows: ", w.bits, "-bit weights are not supported (2, 3, 4, 5, 6 or 8)");
  for (int64_t r = r0; r < r0 + n; ++r) {
    float* dst = out + (r - r0) * w.cols;
    switch (w.bits) {
      case 2:
        dequant_row<2>(w, r, dst);
        break;
      case 3:
        dequant_row<3>(w, r, dst);
        break;
      case 4:
        dequant_row<4>(w, r, dst);
        break;
      case 5:
        dequant_row<5>(w, r, dst);
        break;
      case 6:
        dequant_row<6>(w, r, dst);
        break;
      default:
        dequant_row<8>(w, r, dst);
        break;
    }
  }
}

}  // namespace tandem::cpu
