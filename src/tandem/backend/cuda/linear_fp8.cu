// y[m, N] = x[m, K] · Wᵀ for fp8 e4m3 weights W [N, K] with block scales (the published GLM-5 /
// DeepSeek fp8 layout: one fp32 or bf16 scale per block_rows × block_cols tile,
// `weight_scale_inv`).
//
// Decode and verify (a few rows): weight streaming. Each weight element is decoded exactly and
// multiplied by its block's scale, as the CPU's dequantisation does, and x stays fp32. One warp
// per output column n: lane l reads four consecutive weights at k = 128·j + 4·l (one 128-byte
// line per warp and step), keeps one fp32 partial sum per input row in registers, and the warp
// adds its 32 partials with a fixed butterfly (fp8_dots). Each output's reduction order depends on
// K alone, never on m or on the other rows, so rows are batch-invariant (DESIGN.md principle 2).
// Rows go through in tiles of kRowTile; a tile re-reads the weight row from L2. With `accumulate`
// the sum is added to y (linear_add), after the reduction, as the CPU adds it. The grouped form
// (a mixture's experts) runs the same arithmetic per expert, so a pair row's value is the one
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
#include <cuda_fp8.h>

#include <cstdlib>
#include <map>
#include <string_view>
#include <tuple>

#include "tandem/backend/cuda/activation.cuh"
#include "tandem/backend/cuda/check.cuh"
#include "tandem/backend/cuda/cuda_ops.h"
#include "tandem/backend/cuda/lt.cuh"

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
// of them. The order of every sum depends on K alone.
__device__ __forceinline__ void fp8_dots(const Fp8Weight& w, int64_t n, const float* const* xr,
                                         int rows, int lane, float (&out)[kRowTile]) {
  const int64_t K = w.K;
  const uint8_t* wr = w.codes + n * K;
  const int64_t scale_row = (n / w.block_rows) * ((K + w.block_cols - 1) / w.block_cols);
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
#pragma unroll
  for (int r = 0; r < kRowTile; ++r) {
    float s = acc[r];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    out[r] = s;
  }
}

// grid (ceil(N / kWarps), ceil(m / kRowTile)), block 32 × kWarps.
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
  fp8_dots(w, n, xr, rows, lane, s);
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
    fp8_dots(w, base + n, xr, rows, lane, a);
    if (swiglu) fp8_dots(w, base + width + n, xr, rows, lane, b);
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

// Grow-only device scratch; a reallocation bumps the scratch generation (graph keys).
struct Scratch {
  void* p = nullptr;
  size_t size = 0;
  template <class T>
  T* get(size_t n) {
    if (sizeof(T) * n > size) {
      cuda::free(p);
      p = cuda::alloc(sizeof(T) * n);
      size = sizeof(T) * n;
      bump_scratch_generation();
    }
    return static_cast<T*>(p);
  }
};

Scratch& weight_bf16_scratch() {  // a weight (or an expert stack) dequantised for prefill
  static Scratch s;
  return s;
}

ops::WeightRef dequantised_bf16(const ops::WeightRef& w) {
  const Fp8Weight fw = fp8_weight(w, "linear_fp8");
  auto* out = weight_bf16_scratch().get<__nv_bfloat16>(static_cast<size_t>(w.rows * w.cols));
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
  static const bool on = [] {
    const char* v = std::getenv("TANDEM_CUDA_FP8_PREFILL");
    return !(v && std::string_view(v) == "bf16");
  }();
  return on;
}

cublasLtMatmulDesc_t fp8_matmul_desc() {
  static cublasLtMatmulDesc_t d = [] {
    cublasLtMatmulDesc_t desc;
    if (cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS)
      fail("cuBLASLt: cublasLtMatmulDescCreate failed");
    const cublasOperation_t t = CUBLAS_OP_T;
    const cublasLtMatmulMatrixScale_t a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    const cublasLtMatmulMatrixScale_t b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    const bool ok = cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &t,
                                                   sizeof t) == CUBLAS_STATUS_SUCCESS &&
                    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a_mode,
                                                   sizeof a_mode) == CUBLAS_STATUS_SUCCESS &&
                    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &b_mode,
                                                   sizeof b_mode) == CUBLAS_STATUS_SUCCESS;
    if (!ok) fail("cuBLASLt: the block-scaled fp8 matmul description");
    return desc;
  }();
  return d;
}

struct Fp8Layouts {
  cublasLtMatrixLayout_t w = nullptr, x = nullptr, y = nullptr;
  bool ok = false;
  Fp8Layouts(int64_t N, int64_t K, int64_t m) {
    ok = cublasLtMatrixLayoutCreate(&w, CUDA_R_8F_E4M3, K, N, K) == CUBLAS_STATUS_SUCCESS &&
         cublasLtMatrixLayoutCreate(&x, CUDA_R_8F_E4M3, K, m, K) == CUBLAS_STATUS_SUCCESS &&
         cublasLtMatrixLayoutCreate(&y, CUDA_R_32F, N, m, N) == CUBLAS_STATUS_SUCCESS;
  }
  ~Fp8Layouts() {
    cublasLtMatrixLayoutDestroy(w);
    cublasLtMatrixLayoutDestroy(x);
    cublasLtMatrixLayoutDestroy(y);
  }
  Fp8Layouts(const Fp8Layouts&) = delete;
  Fp8Layouts& operator=(const Fp8Layouts&) = delete;
};

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

// The algorithm of (N, K, tile) among those without a split of K, or none (the bf16 route).
const cublasLtMatmulAlgo_t* fp8_prefill_algo(int64_t N, int64_t K, int64_t tile) {
  static std::map<std::tuple<int64_t, int64_t, int64_t>, std::pair<bool, cublasLtMatmulAlgo_t>>
      chosen;
  const auto key = std::make_tuple(N, K, tile);
  auto it = chosen.find(key);
  if (it == chosen.end()) {
    std::pair<bool, cublasLtMatmulAlgo_t> pick{false, {}};
    cublasLtMatmulPreference_t pref;
    if (cublasLtMatmulPreferenceCreate(&pref) != CUBLAS_STATUS_SUCCESS)
      fail("cuBLASLt: cublasLtMatmulPreferenceCreate failed");
    const uint64_t ws = kLtWorkspaceBytes;
    const uint32_t no_reduction = CUBLASLT_REDUCTION_SCHEME_NONE, align = 16;
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                         sizeof ws);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                         &no_reduction, sizeof no_reduction);
    for (auto attr :
         {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
      cublasLtMatmulPreferenceSetAttribute(pref, attr, &align, sizeof align);
    const Fp8Layouts l(N, K, pad4(tile));
    constexpr int kCandidates = 8;
    cublasLtMatmulHeuristicResult_t found[kCandidates];
    int n = 0;
    if (l.ok &&
        cublasLtMatmulAlgoGetHeuristic(cublas_lt(), fp8_matmul_desc(), l.w, l.x, l.y, l.y, pref,
                                       kCandidates, found, &n) != CUBLAS_STATUS_SUCCESS)
      n = 0;
    cublasLtMatmulPreferenceDestroy(pref);
    for (int i = 0; i < n && !pick.first; ++i) {
      int32_t splits = 0;
      size_t written = 0;
      cublasLtMatmulAlgoConfigGetAttribute(&found[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splits,
                                           sizeof splits, &written);
      if (found[i].state == CUBLAS_STATUS_SUCCESS && splits <= 1) pick = {true, found[i].algo};
    }
    it = chosen.emplace(key, pick).first;
  }
  return it->second.first ? &it->second.second : nullptr;
}

struct QuantScratch {
  Scratch codes, scales, out;
};

QuantScratch& quant_scratch() {
  static QuantScratch s;
  return s;
}

// The FP8 tensor-core product; false (nothing queued) when cuBLASLt has no algorithm for it.
bool linear_fp8_tensor_cores(const float* x, int64_t m, const ops::WeightRef& w, float* y,
                             bool accumulate) {
  const int64_t N = w.rows, K = w.cols;
  const cublasLtMatmulAlgo_t* algo = fp8_prefill_algo(N, K, prefill_rows());
  if (!algo) return false;
  const int64_t mp = pad4(m), blocks = (K + kQuantBlock - 1) / kQuantBlock;
  QuantScratch& s = quant_scratch();
  auto* codes = s.codes.get<uint8_t>(static_cast<size_t>(mp * K));
  auto* scales = s.scales.get<float>(static_cast<size_t>(mp * blocks));
  constexpr int kQuantWarps = 8;
  launch("linear_fp8 (quantise rows)", quantise_rows_kernel,
         grid_blocks(ceil_div(mp * blocks, kQuantWarps), "linear_fp8"), 32 * kQuantWarps, 0, x, m,
         mp, K, codes, scales);
  // Straight into y when it has the padded rows' shape and alignment, else through scratch.
  const bool direct = mp == m && reinterpret_cast<uintptr_t>(y) % 16 == 0;
  float* d = direct ? y : s.out.get<float>(static_cast<size_t>(mp * N));
  cublasLtMatmulDesc_t desc = fp8_matmul_desc();
  const void* a_scale = w.scales.data;
  const void* b_scale = scales;
  if (cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale,
                                     sizeof a_scale) != CUBLAS_STATUS_SUCCESS ||
      cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale,
                                     sizeof b_scale) != CUBLAS_STATUS_SUCCESS)
    fail("cuBLASLt: setting the fp8 block scales");
  const Fp8Layouts l(N, K, mp);
  if (!l.ok) fail("cuBLASLt: fp8 matrix layouts for [", N, " x ", K, "] and ", mp, " rows");
  const float alpha = 1.0f, beta = accumulate && direct ? 1.0f : 0.0f;
  const cublasStatus_t st =
      cublasLtMatmul(cublas_lt(), desc, &alpha, w.data, l.w, codes, l.x, &beta, d, l.y, d, l.y,
                     algo, lt_workspace(), kLtWorkspaceBytes, static_cast<cudaStream_t>(stream()));
  if (st != CUBLAS_STATUS_SUCCESS)
    fail("cuBLASLt: the fp8 prefill product of a [", N, " x ", K, "] weight and ", m,
         " rows failed (status ", int(st), ")");
  if (direct) return true;
  if (accumulate)
    cuda::add_inplace(y, d, m * N);
  else
    cuda::copy_on_device(y, d, sizeof(float) * static_cast<size_t>(m * N));
  return true;
}

}  // namespace

bool fp8_prefill_on_tensor_cores(const ops::WeightRef& w) {
  return fp8_prefill_wanted() && fp8_prefill_shape(w) &&
         fp8_prefill_algo(w.rows, w.cols, prefill_mode() ? prefill_rows() : 16) != nullptr;
}

void linear_fp8(const float* x, int64_t m, const ops::WeightRef& w, float* y, bool accumulate) {
  const Fp8Weight fw = fp8_weight(w, "linear_fp8");
  if (m == 0 || w.rows == 0) return;
  if (prefill_mode()) {
    if (fp8_prefill_wanted() && fp8_prefill_shape(w) &&
        linear_fp8_tensor_cores(x, m, w, y, accumulate))
      return;
    if (w.cols % 16 == 0) return linear_prefill_bf16(x, m, dequantised_bf16(w), y, accumulate);
  }
  const dim3 grid(grid_blocks(ceil_div(w.rows, kWarps), "linear_fp8"),
                  grid_blocks(ceil_div(m, kRowTile), "linear_fp8"));
  launch("linear_fp8", linear_fp8_kernel, grid, dim3(32 * kWarps), 0, x, m, fw, w.rows, accumulate,
         y);
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
  if (groups < 1 || groups > experts)
    fail("linear_grouped: ", groups, " groups of ", experts, " experts");
  if (rows == 0) return;
  if (prefill_mode() && stacked.cols % 16 == 0)
    return linear_grouped(x, rows, max_rows, dequantised_bf16(stacked), experts, groups, expert,
                          start, y, opt);
  const int64_t width = opt.swiglu ? N / 2 : N;
  const dim3 grid(grid_blocks(ceil_div(width, kWarps), "linear_grouped"),
                  static_cast<unsigned>(groups));
  launch("linear_grouped (fp8)", linear_fp8_grouped_kernel, grid, dim3(32 * kWarps), 0, x, fw, N,
         expert, start, opt.gather, opt.swiglu, y);
}

}  // namespace tandem::cuda
