// Norms, activations, gates and small helpers: memory-bound loops over rows.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "tandem/backend/cpu/cpu_ops.h"
#include "tandem/backend/cpu/thread_pool.h"
#include "tandem/backend/cpu/weight_element.h"
#include "tandem/core/error.h"

namespace tandem::cpu {

using namespace tandem::ops;

namespace {
inline float silu(float x) {
  return x / (1.0f + std::exp(-x));
}

// Reciprocal RMS of one row, accumulated in double in index order (row-count independent).
inline float inv_rms(const float* x, int64_t d, float eps) {
  double ss = 0.0;
  for (int64_t i = 0; i < d; ++i) ss += static_cast<double>(x[i]) * x[i];
  return static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(d) + eps));
}

void check_float_weight(const WeightRef& w, const char* op) {
  if (w.dtype != DType::F32 && w.dtype != DType::BF16 && w.dtype != DType::F16)
    fail(op, ": unsupported weight dtype ", dtype_name(w.dtype));
}
}  // namespace

void embed_rows(const WeightRef& table, const int32_t* ids, int64_t n, float* out) {
  check_float_weight(table, "embed_rows");
  const int64_t d = table.cols;
  const size_t row_bytes = static_cast<size_t>(d) * dtype_size(table.dtype);
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= table.rows) {
      std::fill(out + i * d, out + (i + 1) * d, std::numeric_limits<float>::quiet_NaN());
      continue;
    }
    WeightRef row = table;
    row.data = static_cast<const uint8_t*>(table.data) + static_cast<size_t>(ids[i]) * row_bytes;
    for (int64_t c = 0; c < d; ++c) out[i * d + c] = weight_element(row, c);
  }
}

void embed_rows_selected(const WeightRef& table, const int32_t* ids, const int32_t* source,
                         const int32_t* from, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    const int32_t id = from[i] >= 0 ? source[from[i]] : ids[i];
    cpu::embed_rows(table, &id, 1, out + i * table.cols);
  }
}

namespace {
// One row: y[i] = (x[i] · s) · scale, scale = 1 + w (zero-centred) or w.
void norm_row(const float* x, int64_t d, const WeightRef& w, bool zero_centred, float eps,
              float* y) {
  const float s = inv_rms(x, d, eps);
  for (int64_t i = 0; i < d; ++i) {
    const float wi = weight_element(w, i);
    y[i] = (x[i] * s) * (zero_centred ? 1.0f + wi : wi);
  }
}

void check_norm_weight(const WeightRef& w, int64_t d, const char* op) {
  check_float_weight(w, op);
  if (w.rows * w.cols != d) fail(op, ": weight has ", w.rows * w.cols, " elements for rows of ", d);
}
}  // namespace

void rms_norm(const float* x, int64_t m, int64_t d, const WeightRef& w, bool zero_centred,
              float eps, float* y) {
  check_norm_weight(w, d, "rms_norm");
  parallel_for(
      m,
      [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) norm_row(x + r * d, d, w, zero_centred, eps, y + r * d);
      },
      m > 8);
}

void rms_norm_pair(const float* a, const float* b, int64_t m, int64_t d, const WeightRef& wa,
                   const WeightRef& wb, bool zero_centred, float eps, float* y) {
  check_norm_weight(wa, d, "rms_norm_pair");
  check_norm_weight(wb, d, "rms_norm_pair");
  parallel_for(
      m,
      [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          norm_row(a + r * d, d, wa, zero_centred, eps, y + r * 2 * d);
          norm_row(b + r * d, d, wb, zero_centred, eps, y + r * 2 * d + d);
        }
      },
      m > 8);
}

void rms_norm_pair_embedded(const WeightRef& table, const int32_t* ids, const float* b, int64_t m,
                            const WeightRef& wa, const WeightRef& wb, bool zero_centred, float eps,
                            float* y) {
  // The rows gathered first: embed_rows' values through rms_norm_pair's passes, the same bits.
  std::vector<float> a(static_cast<size_t>(std::max<int64_t>(0, m) * table.cols));
  cpu::embed_rows(table, ids, m, a.data());
  cpu::rms_norm_pair(a.data(), b, m, table.cols, wa, wb, zero_centred, eps, y);
}

void gated_rms_norm(const float* x, const float* z, int64_t m, int64_t d, const WeightRef& w,
                    float eps, float* y) {
  check_float_weight(w, "gated_rms_norm");
  TANDEM_CHECK(w.rows * w.cols == d, "gated_rms_norm weight size");
  parallel_for(
      m,
      [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const float s = inv_rms(x + r * d, d, eps);
          for (int64_t i = 0; i < d; ++i)
            y[r * d + i] = weight_element(w, i) * (x[r * d + i] * s) * silu(z[r * d + i]);
        }
      },
      m > 8);
}

void swiglu(const float* gate, const float* up, int64_t n, float* out) {
  parallel_for(
      n,
      [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) out[i] = silu(gate[i]) * up[i];
      },
      n > 65536);
}

void sigmoid_gate(float* x, const float* gate, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] *= 1.0f / (1.0f + std::exp(-gate[i]));
}

void add_inplace(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

void scale(float* x, int64_t n, float s) {
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

void rope_slice(float* x, int64_t n_tokens, int64_t n_heads, int64_t head_stride, int64_t offset,
                int64_t dim, const int64_t* positions, const float* inv_freq, bool interleaved) {
  TANDEM_CHECK(dim % 2 == 0 && offset >= 0 && offset + dim <= head_stride, "rope_slice: ", dim,
               " values at ", offset, " of heads of ", head_stride);
  const int64_t half = dim / 2;
  for (int64_t t = 0; t < n_tokens; ++t) {
    const float pos = static_cast<float>(positions[t]);
    for (int64_t i = 0; i < half; ++i) {
      // Angles in fp32 as the reference computes them (inv_freq · position, then cos/sin).
      const float angle = pos * inv_freq[i];
      const float c = std::cos(angle);
      const float s = std::sin(angle);
      // The pair frequency i rotates: adjacent values, or one from each half.
      const int64_t ia = interleaved ? 2 * i : i;
      const int64_t ib = interleaved ? 2 * i + 1 : i + half;
      for (int64_t h = 0; h < n_heads; ++h) {
        float* v = x + (t * n_heads + h) * head_stride + offset;
        const float a = v[ia];
        const float b = v[ib];
        v[ia] = a * c - b * s;
        v[ib] = b * c + a * s;
      }
    }
  }
}

void rope(float* x, int64_t n_tokens, int64_t n_heads, int64_t head_dim, int64_t rotary_dim,
          const int64_t* positions, const float* inv_freq) {
  rope_slice(x, n_tokens, n_heads, head_dim, 0, rotary_dim, positions, inv_freq, false);
}

void layer_norm(const float* x, int64_t m, int64_t d, const WeightRef& w, const WeightRef& b,
                float eps, float* y) {
  check_float_weight(w, "layer_norm");
  check_float_weight(b, "layer_norm");
  TANDEM_CHECK(w.rows * w.cols == d && b.rows * b.cols == d, "layer_norm: weight and bias of ",
               w.rows * w.cols, " and ", b.rows * b.cols, " values for rows of ", d);
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = x + r * d;
    float* yr = y + r * d;
    float mean = 0.0f;
    for (int64_t i = 0; i < d; ++i) mean += xr[i];
    mean /= static_cast<float>(d);
    float var = 0.0f;
    for (int64_t i = 0; i < d; ++i) var += (xr[i] - mean) * (xr[i] - mean);
    const float inv = 1.0f / std::sqrt(var / static_cast<float>(d) + eps);
    for (int64_t i = 0; i < d; ++i)
      yr[i] = (xr[i] - mean) * inv * weight_element(w, i) + weight_element(b, i);
  }
}

void causal_conv_silu(const float* x, int64_t n, int64_t channels, int64_t kernel,
                      const WeightRef& w, float* state, float* out, float* state_after) {
  check_float_weight(w, "causal_conv_silu");
  TANDEM_CHECK(w.rows == channels && w.cols == kernel, "conv weight shape");
  // wc below holds one channel's taps (the loader accepts kernels of 1..16).
  TANDEM_CHECK(kernel >= 1 && kernel <= 16, "conv kernel ", kernel, " outside 1..16");
  const int64_t hist = kernel - 1;
  parallel_for(
      channels,
      [&](int64_t c0, int64_t c1) {
        for (int64_t c = c0; c < c1; ++c) {
          float* st = state + c * hist;
          float wc[16] = {};  // zeroed only so GCC sees every read initialised
          for (int64_t j = 0; j < kernel; ++j) wc[j] = weight_element(w, c * kernel + j);
          for (int64_t t = 0; t < n; ++t) {
            const float xt = x[t * channels + c];
            float acc = 0.0f;
            for (int64_t j = 0; j < hist; ++j) acc += wc[j] * st[j];
            acc += wc[hist] * xt;
            for (int64_t j = 0; j + 1 < hist; ++j) st[j] = st[j + 1];
            if (hist > 0) st[hist - 1] = xt;
            out[t * channels + c] = silu(acc);
            if (state_after)
              for (int64_t j = 0; j < hist; ++j) state_after[(t * channels + c) * hist + j] = st[j];
          }
        }
      },
      channels >= 256);
}

}  // namespace tandem::cpu
