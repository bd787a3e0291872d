// y[m, N] = x[m, K] · Wᵀ for fp8 e4m3 weights W [N, K] with block scales (the published GLM-5 /
// DeepSeek fp8 layout: one fp32 or bf16 scale per block_rows × block_cols tile,
// `weight_scale_inv`).
//
// Decode and verify (a few rows): weight streaming. Each weight element is decoded exactly and
// multiplied by its block's scale, as the CPU's dequantisation does, and x stays fp32. One warp
// per output column: its lanes stream the weight row in 16-byte chunks (fp8_dots gives the
// order), keep one fp32 partial sum per input row in registers, and the warp adds its 32 partials
// with a fixed butterfly. Each output's reduction order depends on the weight's shape alone,
// never on m or on the other rows, so rows are batch-invariant (DESIGN.md principle 2). Rows go
// through in tiles of kRowTile; a tile re-reads the weight row from L2. With `accumulate` the sum
// is added to y (linear_add), after the reduction, as the CPU adds it. The grouped form (a
// mixture's experts) runs the same arithmetic per expert, so a pair row's value is the one
// linear_fp8 of its expert gives it alone.
//
// Prompt prefill: the FP8 tensor cores through cuBLASLt's block-scaled product (A: the weight
// with its 128 x 128 scales; B: the input rows quantised to e4m3 with one scale per row and 128
// columns, the dynamic activation scheme the fp8 checkpoints declare). The algorithm is fixed per
// (N, K, prefill tile) among those that do not split K, as for the bf16 prefill product, so a
// prompt row's numbers do not depend on how many rows share the call. Shapes cuBLASLt refuses
// (block sizes other than 128, a scale row stride not a multiple of 4, bf16 scales) dequantise
// the weight to bf16 and take the bf16 prefill product.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdlib>
#include <map>
#include <string>
#include <string_view>
#include <tuple>

#include "tandem/backend/cuda/activation.cuh"
#include "tandem/backend/cuda/check.cuh"
#include "tandem/backend/cuda/cuda_ops.h"
#include "tandem/backend/cuda/lt.cuh"
#include "tandem/backend/cuda/scratch.cuh"
#include "tandem/core/env_switch.h"

namespace tandem::cuda {

namespace {

constexpr int kRowTile = 8;
constexpr int kWarps = 8;  // columns per block
constexpr float kE4M3Max = 448.0f;
constexpr int kQuantBlock = 128;  // activation columns per scale (the weight's block_cols)

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

// Where a weight's codes and scales are, as kernels read them.
struct Fp8Weight {
  const uint8_t* codes;  // [rows, K]
  const void* scales;    // [ceil(rows / block_rows), ceil(K / block_cols)]
  bool scales_bf16;
  int64_t K, block_rows, block_cols;
};

// The warp's sums of weight row n against `rows` input rows xr[0..rows): every lane returns all
// of them, after a fixed butterfly. Two orders, chosen by the weight's shape alone:
//  - Chunked (K and block_cols multiples of 16, the published layouts): lane l takes the 16
//    weights at k = 16·l + 512·j for j = 0, 1, .. (one 16-byte load, one scale), adding
//    x[k + e] · w[k + e] for e = 0..15 into its running sum; the next chunk's codes are loaded
//    before this one's products.
//  - Otherwise: lane l takes the 4 weights at k = 4·l + 128·j, each with its own scale.
// Either way a row's sum depends on K and the row's values only, never on the other rows. XVec
// (input rows 16-byte aligned) only changes how the chunked order loads x.
template <bool Chunked, bool XVec>
__device__ __forceinline__ void fp8_dots(const Fp8Weight& w, int64_t n, const float* const* xr,
                                         int rows, int lane, float (&out)[kRowTile]) {
  const int64_t K = w.K;
  const uint8_t* wr = w.codes + n * K;
  const int64_t scale_row = (n / w.block_rows) * ((K + w.block_cols - 1) / w.block_cols);
  float acc[kRowTile];
#pragma unroll
  for (int r = 0; r < kRowTile; ++r) acc[r] = 0.0f;
  if constexpr (Chunked) {
    const int chunks = static_cast<int>(K / 16);
    const int chunks_per_block = static_cast<int>(w.block_cols / 16);
    uint4 next = make_uint4(0, 0, 0, 0);
    if (lane < chunks) next = __ldg(reinterpret_cast<const uint4*>(wr) + lane);
    for (int c = lane; c < chunks; c += 32) {
      const uint4 q = next;
      if (c + 32 < chunks) next = __ldg(reinterpret_cast<const uint4*>(wr) + c + 32);
      const float s = scale_value(w.scales, w.scales_bf16, scale_row + c / chunks_per_block);
      float wv[16];
      const uint32_t words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const __half2_raw pair = __nv_cvt_fp8x2_to_halfraw2(
              static_cast<__nv_fp8x2_storage_t>(words[i] >> (16 * h)), __NV_E4M3);
          const float2 f = __half22float2(__half2(pair));
          wv[4 * i + 2 * h] = f.x * s;
          wv[4 * i + 2 * h + 1] = f.y * s;
        }
#pragma unroll
      for (int r = 0; r < kRowTile; ++r) {
        if (r >= rows) break;
        const float* x = xr[r] + 16 * static_cast<int64_t>(c);
        float xv[16];
        if constexpr (XVec) {  // the same values in four 16-byte loads: a load per 4 products
#pragma unroll
          for (int v = 0; v < 4; ++v) {
            const float4 f = *reinterpret_cast<const float4*>(x + 4 * v);
            xv[4 * v] = f.x;
            xv[4 * v + 1] = f.y;
            xv[4 * v + 2] = f.z;
            xv[4 * v + 3] = f.w;
          }
        } else {
#pragma unroll
          for (int e = 0; e < 16; ++e) xv[e] = x[e];
        }
#pragma unroll
        for (int e = 0; e < 16; ++e) acc[r] += xv[e] * wv[e];
      }
    }
  } else {
    for (int64_t k0 = 4 * lane; k0 < K; k0 += 128) {
      float wv[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) wv[e] = k0 + e < K ? fp8_value(wr[k0 + e]) : 0.0f;
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (k0 + e < K)
          wv[e] *= scale_value(w.scales, w.scales_bf16, scale_row + (k0 + e) / w.block_cols);
#pragma unroll
      for (int r = 0; r < kRowTile; ++r) {
        if (r >= rows) break;
        const float* x = xr[r] + k0;
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (k0 + e < K) acc[r] += x[e] * wv[e];
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRowTile; ++r) {
    float s = acc[r];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    out[r] = s;
  }
}

// grid (ceil(N / kWarps), ceil(m / kRowTile)), block 32 × kWarps.
template <bool Chunked, bool XVec>
__global__ void linear_fp8_kernel(const float* __restrict__ x, int64_t m, Fp8Weight w, int64_t N,
                                  bool accumulate, float* __restrict__ y) {
  pdl_wait();
  pdl_release();
  const int lane = threadIdx.x & 31;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kRowTile;
  if (n >= N) return;
  const int rows = static_cast<int>(m - row0 < kRowTile ? m - row0 : kRowTile);
  const float* xr[kRowTile];
#pragma unroll
  for (int r = 0; r < kRowTile; ++r) xr[r] = x + (row0 + (r < rows ? r : 0)) * w.K;
  float s[kRowTile];
  fp8_dots<Chunked, XVec>(w, n, xr, rows, lane, s);
  if (lane != 0) return;
#pragma unroll
  for (int r = 0; r < kRowTile; ++r)
    if (r < rows) {
      float* out = y + (row0 + r) * N + n;
      *out = accumulate ? *out + s[r] : s[r];
    }
}

// The grouped product: grid (ceil(width / kWarps), groups), block 32 × kWarps. Block row g
// multiplies pair rows start[g] .. start[g + 1] (input row gather[r], or r) by expert expert[g]'s
// N rows of the stack; with swiglu, output column n < N / 2 is silu(gate row n) · (up row
// N / 2 + n), the swiglu op's expression.
template <bool Chunked, bool XVec>
__global__ void linear_fp8_grouped_kernel(const float* __restrict__ x, Fp8Weight w, int64_t N,
                                          const int32_t* __restrict__ expert,
                                          const int32_t* __restrict__ start,
                                          const int32_t* __restrict__ gather, bool swiglu,
                                          float* __restrict__ y) {
  pdl_wait();
  pdl_release();
  const int lane = threadIdx.x & 31;
  const int64_t width = swiglu ? N / 2 : N;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (n >= width) return;
  const int g = blockIdx.y;
  const int r0 = start[g], r1 = start[g + 1];
  if (r0 == r1) return;  // a group without rows (its expert id is not set)
  const int64_t base = static_cast<int64_t>(expert[g]) * N;
  for (int t0 = r0; t0 < r1; t0 += kRowTile) {
    const int rows = r1 - t0 < kRowTile ? r1 - t0 : kRowTile;
    const float* xr[kRowTile];
#pragma unroll
    for (int r = 0; r < kRowTile; ++r) {
      const int row = t0 + (r < rows ? r : 0);
      xr[r] = x + static_cast<int64_t>(gather ? gather[row] : row) * w.K;
    }
    float a[kRowTile], b[kRowTile];
    fp8_dots<Chunked, XVec>(w, base + n, xr, rows, lane, a);
    if (swiglu) fp8_dots<Chunked, XVec>(w, base + width + n, xr, rows, lane, b);
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < kRowTile; ++r)
        if (r < rows)
          y[static_cast<int64_t>(t0 + r) * width + n] = swiglu ? silu(a[r]) * b[r] : a[r];
    }
  }
}

// out[i] = bf16(decoded code · its block's scale): the value the CPU dequantises, rounded once.
__global__ void fp8_to_bf16_kernel(Fp8Weight w, int64_t rows, __nv_bfloat16* __restrict__ out) {
  pdl_wait();
  pdl_release();
  const int64_t K = w.K, scale_cols = (K + w.block_cols - 1) / w.block_cols;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * K;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / K, c = i % K;
    const float s =
        scale_value(w.scales, w.scales_bf16, (r / w.block_rows) * scale_cols + c / w.block_cols);
    out[i] = __float2bfloat16_rn(fp8_value(w.codes[i]) * s);
  }
}

// Input rows [m, K] to e4m3 codes [m_pad, K] and scales [ceil(K / 128), m_pad] (the row index
// fastest, as cuBLASLt's VEC128 mode reads them). One warp per (row, 128 columns): the block's
// largest magnitude maps to 448 (scale = amax / 448), each value is x / scale rounded to the
// nearest code; an all-zero block gets scale 1. Rows m .. m_pad are zeros.
__global__ void quantise_rows_kernel(const float* __restrict__ x, int64_t m, int64_t m_pad,
                                     int64_t K, uint8_t* __restrict__ codes,
                                     float* __restrict__ scales) {
  pdl_wait();
  pdl_release();
  const int lane = threadIdx.x & 31;
  const int64_t blocks = (K + kQuantBlock - 1) / kQuantBlock;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + (threadIdx.x >> 5);
  if (item >= m_pad * blocks) return;
  const int64_t row = item / blocks, b = item % blocks;
  const int64_t c0 = b * kQuantBlock + 4 * lane;
  float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (row < m) {
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (c0 + e < K) v[e] = x[row * K + c0 + e];
  }
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
  for (int off = 16; off > 0; off >>= 1)
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  const float s = amax > 0.0f ? amax / kE4M3Max : 1.0f;
#pragma unroll
  for (int e = 0; e < 4; ++e)
    if (c0 + e < K) codes[row * K + c0 + e] = __nv_fp8_e4m3(v[e] / s).__x;
  if (lane == 0) scales[b * m_pad + row] = s;
}

Fp8Weight fp8_weight(const ops::WeightRef& w, const char* op) {
  if (w.dtype != DType::F8_E4M3) fail(op, ": weight dtype ", dtype_name(w.dtype));
  const ops::BlockScales& s = w.scales;
  if (!s.data || s.block_rows < 1 || s.block_cols < 1)
    fail(op, ": an fp8 weight of [", w.rows, " x ", w.cols, "] has no block scales");
  if (s.dtype != DType::F32 && s.dtype != DType::BF16)
    fail(op, ": scales of dtype ", dtype_name(s.dtype), " (expected F32 or BF16)");
  return {static_cast<const uint8_t*>(w.data),
          s.data,
          s.dtype == DType::BF16,
          w.cols,
          s.block_rows,
          s.block_cols};
}

// The chunked order (fp8_dots): a property of the weight's shape (and of its codes' 16-byte
// alignment, which the arena's copies always have).
bool chunked(const Fp8Weight& w) {
  return w.K % 16 == 0 && w.block_cols % 16 == 0 && reinterpret_cast<uintptr_t>(w.codes) % 16 == 0;
}

// Whether the input rows can be read 16 bytes at a time (the chunked order's K is a multiple of
// 16, so every row is aligned when the first is).
bool x_vectors(const float* x, const Fp8Weight& w) {
  return w.K % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
}

// How (N, K, tile) runs: cuBLASLt's first heuristic choice without a split of K, with fp32
// outputs where it offers one, else bf16 outputs (widened after); or none, with the reason.
struct Fp8Plan {
  bool ok = false;
  bool bf16_out = false;
  cublasLtMatmulAlgo_t algo{};
  std::string why;
};

// This file's state in a context: scratch, the plans chosen per (N, K, tile), and the fp8
// matmul description (its scale pointers are set before each product).
struct Fp8Unit {
  DeviceScratch weight_bf16;  // a weight (or an expert stack) dequantised for prefill
  DeviceScratch codes, scales, out, out_bf16;  // the quantised rows and the product's outputs
  std::map<std::tuple<int64_t, int64_t, int64_t>, Fp8Plan> plans;
  cublasLtMatmulDesc_t desc = nullptr;
  Fp8Unit() = default;
  ~Fp8Unit() {
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
  Fp8Unit(const Fp8Unit&) = delete;
  Fp8Unit& operator=(const Fp8Unit&) = delete;
};

Fp8Unit& fp8_unit() {
  return current().unit<Fp8Unit>();
}

ops::WeightRef dequantised_bf16(const ops::WeightRef& w) {
  const Fp8Weight fw = fp8_weight(w, "linear_fp8");
  auto* out = fp8_unit().weight_bf16.get<__nv_bfloat16>(w.rows * w.cols);
  launch("linear_fp8 (dequantise)", fp8_to_bf16_kernel, grid_stride_blocks(w.rows * w.cols, 256),
         256, 0, fw, w.rows, out);
  ops::WeightRef b = w;
  b.dtype = DType::BF16;
  b.data = out;
  b.scales = {};
  return b;
}

// --- Prompt prefill on the FP8 tensor cores ----------------------------------------------------

bool fp8_prefill_wanted() {
  static const bool on = env_switch_on("TANDEM_CUDA_FP8_PREFILL", "bf16");
  return on;
}

cublasLtMatmulDesc_t fp8_matmul_desc() {
  cublasLtMatmulDesc_t& d = fp8_unit().desc;
  if (d == nullptr) {
    cublasLtMatmulDesc_t desc = transposed_weight_desc();
    const cublasLtMatmulMatrixScale_t a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    const cublasLtMatmulMatrixScale_t b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    if (cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a_mode,
                                       sizeof a_mode) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &b_mode,
                                       sizeof b_mode) != CUBLAS_STATUS_SUCCESS) {
      cublasLtMatmulDescDestroy(desc);
      fail("cuBLASLt: the block-scaled fp8 matmul description");
    }
    d = desc;
  }
  return d;
}

int64_t pad4(int64_t m) {
  return (m + 3) / 4 * 4;
}

// Whether the block-scaled product can take this weight at all (cuBLASLt's documented layout):
// 128 x 128 fp32 scales whose rows (one per 128 weight rows, K-major) are a multiple of 4
// apart and 16-byte aligned, N a multiple of 4, K a multiple of 16.
bool fp8_prefill_shape(const ops::WeightRef& w) {
  const ops::BlockScales& s = w.scales;
  return s.dtype == DType::F32 && s.block_rows == kQuantBlock && s.block_cols == kQuantBlock &&
         ((w.cols + kQuantBlock - 1) / kQuantBlock) % 4 == 0 && w.rows % 4 == 0 &&
         w.cols % 16 == 0 && reinterpret_cast<uintptr_t>(s.data) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(w.data) % 16 == 0;
}

void set_scale_pointers(const void* a, const void* b) {
  cublasLtMatmulDesc_t desc = fp8_matmul_desc();
  if (cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a, sizeof a) !=
          CUBLAS_STATUS_SUCCESS ||
      cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b, sizeof b) !=
          CUBLAS_STATUS_SUCCESS)
    fail("cuBLASLt: setting the fp8 block scales");
}

const Fp8Plan& fp8_prefill_plan(const ops::WeightRef& w, int64_t tile) {
  std::map<std::tuple<int64_t, int64_t, int64_t>, Fp8Plan>& plans = fp8_unit().plans;
  const int64_t N = w.rows, K = w.cols, mp = pad4(tile);
  const auto key = std::make_tuple(N, K, tile);
  if (auto it = plans.find(key); it != plans.end()) return it->second;
  Fp8Plan plan;
  // The heuristic sees the scale pointers it will be given: the weight's, and the rows' scratch.
  auto* row_scales = fp8_unit().scales.get<float>(mp * ((K + kQuantBlock - 1) / kQuantBlock));
  set_scale_pointers(w.scales.data, row_scales);
  for (const bool bf16_out : {false, true})
    for (const bool only_single_pass : {true, false}) {
      if (plan.ok) break;
      cublasLtMatmulPreference_t pref;
      if (cublasLtMatmulPreferenceCreate(&pref) != CUBLAS_STATUS_SUCCESS)
        fail("cuBLASLt: cublasLtMatmulPreferenceCreate failed");
      const uint64_t ws = kLtWorkspaceBytes;
      const uint32_t no_reduction = CUBLASLT_REDUCTION_SCHEME_NONE;
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                           sizeof ws);
      if (only_single_pass)
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                             &no_reduction, sizeof no_reduction);
      const LtLayouts l(N, K, mp, CUDA_R_8F_E4M3, bf16_out ? CUDA_R_16BF : CUDA_R_32F);
      constexpr int kCandidates = 8;
      cublasLtMatmulHeuristicResult_t found[kCandidates];
      int n = 0;
      cublasStatus_t st = CUBLAS_STATUS_NOT_SUPPORTED;
      if (l.ok)
        st = cublasLtMatmulAlgoGetHeuristic(cublas_lt(), fp8_matmul_desc(), l.w, l.x, l.y, l.y,
                                            pref, kCandidates, found, &n);
      cublasLtMatmulPreferenceDestroy(pref);
      if (st != CUBLAS_STATUS_SUCCESS) n = 0;
      for (int i = 0; i < n && !plan.ok; ++i) {
        int32_t splits = 0;
        size_t written = 0;
        cublasLtMatmulAlgoConfigGetAttribute(&found[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
                                             &splits, sizeof splits, &written);
        if (found[i].state == CUBLAS_STATUS_SUCCESS && splits <= 1) {
          plan.ok = true;
          plan.bf16_out = bf16_out;
          plan.algo = found[i].algo;
        }
      }
      plan.why += std::string(plan.why.empty() ? "" : "; ") + (bf16_out ? "bf16" : "fp32") +
                  " outputs" + (only_single_pass ? ", single-pass" : "") + ": status " +
                  std::to_string(int(st)) + ", " + std::to_string(n) + " candidates";
    }
  return plans.emplace(key, plan).first->second;
}

// y[i] = d[i] (+ y[i] with accumulate), bf16 outputs widened.
__global__ void widen_outputs_kernel(const __nv_bfloat16* __restrict__ d, int64_t n,
                                     bool accumulate, float* __restrict__ y) {
  pdl_wait();
  pdl_release();
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = __bfloat162float(d[i]);
    y[i] = accumulate ? y[i] + v : v;
  }
}

// The plan of this weight at this tile, or null where prompt prefill takes the bf16 route.
const Fp8Plan* tensor_core_plan(const ops::WeightRef& w, int64_t tile) {
  if (!fp8_prefill_wanted() || !fp8_prefill_shape(w)) return nullptr;
  const Fp8Plan& plan = fp8_prefill_plan(w, tile);
  return plan.ok ? &plan : nullptr;
}

// The FP8 tensor-core product with `plan`.
void linear_fp8_tensor_cores(const float* x, int64_t m, const ops::WeightRef& w, float* y,
                             bool accumulate, const Fp8Plan& plan) {
  const int64_t N = w.rows, K = w.cols;
  const int64_t mp = pad4(m), blocks = (K + kQuantBlock - 1) / kQuantBlock;
  Fp8Unit& s = fp8_unit();
  auto* codes = s.codes.get<uint8_t>(mp * K);
  auto* scales = s.scales.get<float>(mp * blocks);
  constexpr int kQuantWarps = 8;
  launch("linear_fp8 (quantise rows)", quantise_rows_kernel,
         grid_blocks(ceil_div(mp * blocks, kQuantWarps), "linear_fp8"), 32 * kQuantWarps, 0, x, m,
         mp, K, codes, scales);
  // Straight into y when it has the padded rows' shape and alignment, else through scratch.
  const bool direct = !plan.bf16_out && mp == m && reinterpret_cast<uintptr_t>(y) % 16 == 0;
  void* d = direct          ? static_cast<void*>(y)
            : plan.bf16_out ? static_cast<void*>(s.out_bf16.get<__nv_bfloat16>(mp * N))
                            : static_cast<void*>(s.out.get<float>(mp * N));
  set_scale_pointers(w.scales.data, scales);
  const LtLayouts l(N, K, mp, CUDA_R_8F_E4M3, plan.bf16_out ? CUDA_R_16BF : CUDA_R_32F);
  if (!l.ok) fail("cuBLASLt: fp8 matrix layouts for [", N, " x ", K, "] and ", mp, " rows");
  const float alpha = 1.0f, beta = accumulate && direct ? 1.0f : 0.0f;
  const cublasStatus_t st = cublasLtMatmul(
      cublas_lt(), fp8_matmul_desc(), &alpha, w.data, l.w, codes, l.x, &beta, d, l.y, d, l.y,
      &plan.algo, lt_workspace(), kLtWorkspaceBytes, static_cast<cudaStream_t>(stream()));
  if (st != CUBLAS_STATUS_SUCCESS)
    fail("cuBLASLt: the fp8 prefill product of a [", N, " x ", K, "] weight and ", m,
         " rows failed (status ", int(st), ")");
  if (direct) return;
  if (plan.bf16_out)
    launch("linear_fp8 (widen)", widen_outputs_kernel, grid_stride_blocks(m * N, 256), 256, 0,
           static_cast<const __nv_bfloat16*>(d), m * N, accumulate, y);
  else if (accumulate)
    cuda::add_inplace(y, static_cast<const float*>(d), m * N);
  else
    cuda::copy_on_device(y, d, sizeof(float) * static_cast<size_t>(m * N));
}

}  // namespace

std::string fp8_prefill_route(const ops::WeightRef& w) {
  const int64_t tile = prefill_mode() ? prefill_rows() : 16;
  if (const Fp8Plan* plan = tensor_core_plan(w, tile))
    return plan->bf16_out ? "fp8 tensor cores, bf16 outputs" : "fp8 tensor cores";
  if (!fp8_prefill_wanted()) return "bf16 (TANDEM_CUDA_FP8_PREFILL=bf16)";
  if (!fp8_prefill_shape(w))
    return "bf16 (not a block-scaled shape: 128 x 128 fp32 scales, their rows a multiple of 4 "
           "apart, N a multiple of 4, K of 16)";
  return "bf16 (cuBLASLt has no block-scaled fp8 algorithm: " + fp8_prefill_plan(w, tile).why + ")";
}

void linear_fp8(const float* x, int64_t m, const ops::WeightRef& w, float* y, bool accumulate) {
  const Fp8Weight fw = fp8_weight(w, "linear_fp8");
  if (m == 0 || w.rows == 0) return;
  if (prefill_mode()) {
    if (const Fp8Plan* plan = tensor_core_plan(w, prefill_rows()))
      return linear_fp8_tensor_cores(x, m, w, y, accumulate, *plan);
    if (w.cols % 16 == 0) return linear_prefill_bf16(x, m, dequantised_bf16(w), y, accumulate);
  }
  const dim3 grid(grid_blocks(ceil_div(w.rows, kWarps), "linear_fp8"),
                  grid_blocks(ceil_div(m, kRowTile), "linear_fp8"));
  const auto kernel = !chunked(fw)       ? linear_fp8_kernel<false, false>
                      : x_vectors(x, fw) ? linear_fp8_kernel<true, true>
                                         : linear_fp8_kernel<true, false>;
  launch("linear_fp8", kernel, grid, dim3(32 * kWarps), 0, x, m, fw, w.rows, accumulate, y);
}

void linear_grouped_fp8(const float* x, int64_t rows, int64_t max_rows,
                        const ops::WeightRef& stacked, int64_t experts, int64_t groups,
                        const int32_t* expert, const int32_t* start, float* y,
                        const GroupedOptions& opt) {
  const Fp8Weight fw = fp8_weight(stacked, "linear_grouped");
  if (experts < 1 || stacked.rows % experts != 0)
    fail("linear_grouped: ", stacked.rows, " stacked rows do not split into ", experts, " experts");
  const int64_t N = stacked.rows / experts;
  if (N % fw.block_rows != 0)
    fail("linear_grouped: fp8 experts of ", N, " rows straddle scale blocks of ", fw.block_rows);
  if (opt.swiglu && N % 2 != 0) fail("linear_grouped: SwiGLU over ", N, " rows per expert");
  if (opt.extra_expert) fail("linear_grouped: an extra expert beside fp8 experts");
  if (groups < 1 || groups > experts)
    fail("linear_grouped: ", groups, " groups of ", experts, " experts");
  if (rows == 0) return;
  if (prefill_mode() && stacked.cols % 16 == 0)
    return linear_grouped(x, rows, max_rows, dequantised_bf16(stacked), experts, groups, expert,
                          start, y, opt);
  const int64_t width = opt.swiglu ? N / 2 : N;
  const dim3 grid(grid_blocks(ceil_div(width, kWarps), "linear_grouped"),
                  static_cast<unsigned>(groups));
  const auto kernel = !chunked(fw)       ? linear_fp8_grouped_kernel<false, false>
                      : x_vectors(x, fw) ? linear_fp8_grouped_kernel<true, true>
                                         : linear_fp8_grouped_kernel<true, false>;
  launch("linear_grouped (fp8)", kernel, grid, dim3(32 * kWarps), 0, x, fw, N, expert, start,
         opt.gather, opt.swiglu, y);
}

TANDEM_CUDA_TRACE_UNIT(linear_fp8)

}  // namespace tandem::cuda
