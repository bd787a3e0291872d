// y[m, N] = x[m, K] · Wᵀ for fp8 e4m3 weights W [N, K] with block scales (the published GLM-5 /
// DeepSeek fp8 layout: one fp32 or bf16 scale per block_rows × block_cols tile,
// `weight_scale_inv`). Weight streaming for decode and verify (a few rows): each weight element is
// decoded exactly and multiplied by its block's scale, as the CPU's dequantisation does, and x
// stays fp32.
//
// One warp per output column n. Lane l reads four consecutive weights at k = 128·j + 4·l (one
// 128-byte line per warp and step), keeps one fp32 partial sum per input row in registers, and the
// warp adds its 32 partials with a fixed butterfly. Each output's reduction order depends on K
// alone, never on m or on the other rows, so rows are batch-invariant (DESIGN.md principle 2).
// Rows go through in tiles of kRowTile; a tile re-reads the weight row from L2. With `accumulate`
// the sum is added to y (linear_add), after the reduction, as the CPU adds it.
#include <cuda_fp8.h>

#include "tandem/backend/cuda/check.cuh"

namespace tandem::cuda {

namespace {

constexpr int kRowTile = 8;
constexpr int kWarps = 8;  // columns per block

__device__ __forceinline__ float fp8_value(uint8_t bits) {
  __nv_fp8_e4m3 v;
  v.__x = bits;
  return static_cast<float>(v);
}

__device__ __forceinline__ float scale_value(const void* scales, bool bf16, int64_t i) {
  if (!bf16) return static_cast<const float*>(scales)[i];
  const uint16_t b = static_cast<const uint16_t*>(scales)[i];
  return __uint_as_float(static_cast<uint32_t>(b) << 16);
}

// grid (ceil(N / kWarps), ceil(m / kRowTile)), block 32 × kWarps.
__global__ void linear_fp8_kernel(const float* __restrict__ x, int64_t m, int64_t K,
                                  const uint8_t* __restrict__ w, int64_t N, const void* scales,
                                  bool scales_bf16, int64_t block_rows, int64_t block_cols,
                                  bool accumulate, float* __restrict__ y) {
  pdl_wait();
  pdl_release();
  const int lane = threadIdx.x & 31;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kRowTile;
  if (n >= N) return;
  const int rows = static_cast<int>(m - row0 < kRowTile ? m - row0 : kRowTile);
  const uint8_t* wr = w + n * K;
  const int64_t scale_cols = (K + block_cols - 1) / block_cols;
  const int64_t scale_row = (n / block_rows) * scale_cols;
  float acc[kRowTile];
#pragma unroll
  for (int r = 0; r < kRowTile; ++r) acc[r] = 0.0f;
  for (int64_t k0 = 4 * lane; k0 < K; k0 += 128) {
    float wv[4];
    if (k0 + 4 <= K && (reinterpret_cast<uintptr_t>(wr + k0) & 3) == 0) {
      const uint32_t q = __ldg(reinterpret_cast<const uint32_t*>(wr + k0));
#pragma unroll
      for (int e = 0; e < 4; ++e) wv[e] = fp8_value(static_cast<uint8_t>(q >> (8 * e)));
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) wv[e] = k0 + e < K ? fp8_value(wr[k0 + e]) : 0.0f;
    }
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (k0 + e < K) wv[e] *= scale_value(scales, scales_bf16, scale_row + (k0 + e) / block_cols);
#pragma unroll
    for (int r = 0; r < kRowTile; ++r) {
      if (r >= rows) break;
      const float* xr = x + (row0 + r) * K + k0;
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (k0 + e < K) acc[r] += xr[e] * wv[e];
    }
  }
#pragma unroll
  for (int r = 0; r < kRowTile; ++r) {
    float s = acc[r];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    if (lane == 0 && r < rows) {
      float* out = y + (row0 + r) * N + n;
      *out = accumulate ? *out + s : s;
    }
  }
}

}  // namespace

void linear_fp8(const float* x, int64_t m, const ops::WeightRef& w, float* y, bool accumulate) {
  if (w.dtype != DType::F8_E4M3) fail("linear_fp8: weight dtype ", dtype_name(w.dtype));
  const ops::BlockScales& s = w.scales;
  if (!s.data || s.block_rows < 1 || s.block_cols < 1)
    fail("linear_fp8: an fp8 weight of [", w.rows, " x ", w.cols, "] has no block scales");
  if (s.dtype != DType::F32 && s.dtype != DType::BF16)
    fail("linear_fp8: scales of dtype ", dtype_name(s.dtype), " (expected F32 or BF16)");
  if (m == 0 || w.rows == 0) return;
  const dim3 grid(grid_blocks(ceil_div(w.rows, kWarps), "linear_fp8"),
                  grid_blocks(ceil_div(m, kRowTile), "linear_fp8"));
  launch("linear_fp8", linear_fp8_kernel, grid, dim3(32 * kWarps), 0, x, m, w.cols,
         static_cast<const uint8_t*>(w.data), w.rows, s.data, s.dtype == DType::BF16, s.block_rows,
         s.block_cols, accumulate, y);
}

}  // namespace tandem::cuda
