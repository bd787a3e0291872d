// Prompt prefill attention (attention_prompt.h): causal GQA attention of one row's n prompt tokens
// from its contiguous q/k/v, as two tensor-core GEMMs through cuBLAS around a softmax kernel.
//
// Shape of the work. Query rows are taken in chunks of R rows (chunk_rows); chunk [r0, r0 + rc)
// attends to keys [0, L) with L = r0 + rc, so the key range follows the causal triangle at chunk
// granularity (the part above the diagonal inside a chunk is computed, then masked to zero).
// Per chunk, on the one stream:
//  1. split_queries: the chunk's queries → q3 [n_heads][rc][3·head_dim] bf16, head-major, so
//     that the G = n_heads / n_kv_heads query heads of one kv head are G·rc consecutive rows;
//  2. one strided-batched GEMM over the kv heads (batch g): scores of heads gG..gG+G-1,
//     S [n_heads][rc][ld] fp32 = scale · q3 · k3ᵀ (k3 prepared once per call, below);
//  3. causal_softmax: row (h, t) becomes P over keys 0..r0+t, zeros up to L;
//  4. one strided-batched GEMM: O [n_heads][rc][head_dim] = P · V, batch g again;
//  5. scatter_heads: O → out rows r0.. in the token-major [n, n_heads, head_dim] layout.
// The head-major q3/S/O layouts are what make steps 2 and 4 one GEMM each for all heads: in
// out's token-major layout the G heads of one group are not evenly strided rows.
//
// Precision. The scores decide the softmax exponent, and an error ε there changes a weight by a
// factor e^ε however sharp the attention is, so they are computed close to fp32: each value x of
// q and k is split into bf16 hi = bf16(x) and lo = bf16(x - hi) (x = hi + lo to 2^-18), and
// q3 = [hi | hi | lo], k3 = [hi | lo | hi] along head_dim make ONE bf16 GEMM with K = 3·head_dim
// sum hi·hi + hi·lo + lo·hi (the dropped lo·lo is ≤ 2^-18 of the product), accumulated in fp32.
// The output is a convex combination of values, where a relative error stays relative: P and V
// are rounded to nearest TF32 here (so cuBLAS's own TF32 conversion, truncating or not, is exact)
// and multiplied with CUBLAS_COMPUTE_32F_FAST_TF32. Emulated on random data (n up to 2048, score
// spreads up to 100x the unit one) the worst (token, head) vector was 1.2e-3 of its max |out|
// off exact attention; TF32 scores instead gave up to 2.7e-3 (4.7e-3 with truncating
// conversion), growing with sharpness.
//
// Determinism. R depends on (n, n_heads) only; every GEMM's shape follows from (n, shape), cuBLAS
// is deterministic for a fixed shape on one GPU (atomics are off by default), and the softmax
// reduces in a fixed order. A row's output thus depends on its q/k/v and shape only; the scratch
// is fully rewritten before it is read.
//
// Scratch (grown on demand, never shrunk): S is H·R·round_up(n, 32)·4 bytes and R is cut so that
// S stays ≤ kScoreBytes (512 MiB); O is H·R·D·4 and q3 H·R·3D·2 bytes; k3 + V are n·KV·D·10
// bytes. For n = 4096, 16/4 heads, D = 256: R = 512, S 128 MiB, k3 + V 40 MiB, ~190 MiB in all.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>

#include "tandem/backend/cuda/attention_prompt.h"
#include "tandem/backend/cuda/check.cuh"
#include "tandem/backend/cuda/scratch.cuh"
#include "tandem/core/error.h"

namespace tandem::cuda {

namespace {

constexpr int64_t kChunkRows = 512;  // query rows per chunk when S fits (~12% causal waste at 4k)
constexpr int64_t kScoreBytes = int64_t(512) << 20;  // cap on the S scratch
constexpr int64_t kRowAlign = 32;  // S row stride in floats: 128-byte rows for loads and GEMMs
constexpr int kCopyThreads = 256;
constexpr int kSoftmaxThreads = 256;
constexpr int kSoftmaxWarps = kSoftmaxThreads / 32;

int64_t round_up(int64_t a, int64_t b) {
  return ceil_div(a, b) * b;
}

// Nearest TF32 (10 explicit mantissa bits), ties to even; Inf and NaN pass through.
__device__ __forceinline__ float round_tf32(float x) {
  uint32_t b = __float_as_uint(x);
  if ((b & 0x7f800000u) != 0x7f800000u) b += 0xfffu + ((b >> 13) & 1u);
  return __uint_as_float(b & 0xffffe000u);
}

// k, v: [rows, D] (rows = n · n_kv_heads). k3: [rows, 3D] = [hi | lo | hi] of k (paired with
// q3's [hi | hi | lo]); vr: [rows, D] = v rounded to TF32.
__global__ void split_keys_kernel(const float* __restrict__ k, const float* __restrict__ v,
                                  int64_t rows, int64_t D, __nv_bfloat16* __restrict__ k3,
                                  float* __restrict__ vr) {
  pdl_wait();
  pdl_release();
  const int64_t total = rows * D;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = e / D, i = e - r * D;
    const float x = k[e];
    const __nv_bfloat16 hi = __float2bfloat16_rn(x);
    const __nv_bfloat16 lo = __float2bfloat16_rn(x - __bfloat162float(hi));
    __nv_bfloat16* dst = k3 + r * 3 * D + i;
    dst[0] = hi;
    dst[D] = lo;
    dst[2 * D] = hi;
    vr[e] = round_tf32(v[e]);
  }
}

// q: the chunk's queries [rc, H, D] (token-major). q3: [H, rc, 3D] (head-major) = [hi | hi | lo].
__global__ void split_queries_kernel(const float* __restrict__ q, int64_t rc, int64_t H, int64_t D,
                                     __nv_bfloat16* __restrict__ q3) {
  pdl_wait();
  pdl_release();
  const int64_t total = rc * H * D;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t th = e / D, i = e - th * D;  // th = t · H + h
    const int64_t t = th / H, h = th - t * H;
    const float x = q[e];
    const __nv_bfloat16 hi = __float2bfloat16_rn(x);
    const __nv_bfloat16 lo = __float2bfloat16_rn(x - __bfloat162float(hi));
    __nv_bfloat16* dst = q3 + (h * rc + t) * 3 * D + i;
    dst[0] = hi;
    dst[D] = hi;
    dst[2 * D] = lo;
  }
}

// o: [H, rc, D] (head-major). out: the chunk's rows [rc, H, D] of the token-major output.
__global__ void scatter_heads_kernel(const float* __restrict__ o, int64_t rc, int64_t H, int64_t D,
                                     float* __restrict__ out) {
  pdl_wait();
  pdl_release();
  const int64_t total = rc * H * D;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t th = e / D, i = e - th * D;
    const int64_t t = th / H, h = th - t * H;
    out[e] = o[(h * rc + t) * D + i];
  }
}

// Block-wide max / sum that every thread returns: a butterfly within each warp (all lanes end
// with the same bits), then the warp totals in warp order. The order depends on nothing but the
// thread values, so the result is a fixed function of them. Each shared array is used once per
// block (no reuse, so no second barrier).
__device__ float block_max(float x, float* shared) {
  for (int off = 16; off > 0; off /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  if (threadIdx.x % 32 == 0) shared[threadIdx.x / 32] = x;
  __syncthreads();
  float r = shared[0];
  for (int w = 1; w < kSoftmaxWarps; ++w) r = fmaxf(r, shared[w]);
  return r;
}
__device__ float block_sum(float x, float* shared) {
  for (int off = 16; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
  if (threadIdx.x % 32 == 0) shared[threadIdx.x / 32] = x;
  __syncthreads();
  float r = shared[0];
  for (int w = 1; w < kSoftmaxWarps; ++w) r += shared[w];
  return r;
}

// s: [H, rc, ld] scores of queries first..first+rc-1 over keys [0, width); grid (rc, H).
// Row (h, t) becomes P: p_j = tf32(exp(s_j - max) / Σ) for j <= first + t, exactly 0 for
// first + t < j < width (the GEMM multiplies all `width` entries, so the zeros must be real).
// Thread i handles float4s i, i + 256, ... in all three passes, so each element is only ever
// touched by one thread and the passes need no barrier besides the reductions'. Its partial sums
// run in ascending j; ld % 4 == 0 keeps the float4 accesses aligned. The last float4 of a row may
// reach past len (those lanes are read but not used) and past width into the row's padding (< ld,
// written but never read by the GEMM).
__global__ void __launch_bounds__(kSoftmaxThreads)
    causal_softmax_kernel(float* __restrict__ s, int64_t rc, int64_t ld, int64_t first,
                          int64_t width) {
  pdl_wait();
  pdl_release();
  __shared__ float shared_max[kSoftmaxWarps];
  __shared__ float shared_sum[kSoftmaxWarps];
  const int64_t t = blockIdx.x, h = blockIdx.y;
  float4* row = reinterpret_cast<float4*>(s + (h * rc + t) * ld);
  const int64_t len = first + t + 1;  // keys 0..first+t
  const int64_t len4 = (len + 3) / 4, width4 = (width + 3) / 4;

  float mx = -INFINITY;
  for (int64_t u = threadIdx.x; u < len4; u += kSoftmaxThreads) {
    const float4 x = row[u];
    const int64_t j = 4 * u;  // j < len since u < len4
    mx = fmaxf(mx, x.x);
    if (j + 1 < len) mx = fmaxf(mx, x.y);
    if (j + 2 < len) mx = fmaxf(mx, x.z);
    if (j + 3 < len) mx = fmaxf(mx, x.w);
  }
  mx = block_max(mx, shared_max);

  float sum = 0.0f;
  for (int64_t u = threadIdx.x; u < len4; u += kSoftmaxThreads) {
    const float4 x = row[u];
    const int64_t j = 4 * u;
    sum += expf(x.x - mx);
    if (j + 1 < len) sum += expf(x.y - mx);
    if (j + 2 < len) sum += expf(x.z - mx);
    if (j + 3 < len) sum += expf(x.w - mx);
  }
  sum = block_sum(sum, shared_sum);  // >= 1: the max contributes exp(0)
  const float inv = 1.0f / sum;

  for (int64_t u = threadIdx.x; u < width4; u += kSoftmaxThreads) {
    float4 p = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (u < len4) {
      const float4 x = row[u];
      const int64_t j = 4 * u;
      p.x = round_tf32(expf(x.x - mx) * inv);
      if (j + 1 < len) p.y = round_tf32(expf(x.y - mx) * inv);
      if (j + 2 < len) p.z = round_tf32(expf(x.z - mx) * inv);
      if (j + 3 < len) p.w = round_tf32(expf(x.w - mx) * inv);
    }
    row[u] = p;
  }
}

void check_cublas(cublasStatus_t st, const char* what) {
  if (st != CUBLAS_STATUS_SUCCESS)
    fail("attention_prompt: cuBLAS ", what, " failed: ", cublasGetStatusString(st), " (status ",
         static_cast<int>(st), ")");
}

// The context's device scratch, grown to the largest shape seen (scratch.cuh).
struct PromptAttentionScratch {
  DeviceScratch k3;  // bf16 [n, KV, 3D]
  DeviceScratch vr;  // [n, KV, D]
  DeviceScratch q3;  // bf16 [H, R, 3D]
  DeviceScratch s;   // [H, R, ld]
  DeviceScratch o;   // [H, R, D]
};

// Query rows per chunk: kChunkRows, fewer when S [H, R, round_up(n, 32)] would pass kScoreBytes
// (a multiple of 64 while that is possible, for GEMM tiles; at least 1).
int64_t chunk_rows(int64_t n, int64_t n_heads) {
  const int64_t row_bytes = n_heads * round_up(n, kRowAlign) * static_cast<int64_t>(sizeof(float));
  const int64_t fit = std::max<int64_t>(1, kScoreBytes / row_bytes);
  int64_t r = std::min(n, kChunkRows);
  if (r > fit) r = fit >= 64 ? fit / 64 * 64 : fit;
  return r;
}

}  // namespace

void attention_prompt(const float* q, const float* k, const float* v, int64_t n, int64_t n_heads,
                      int64_t n_kv_heads, int64_t head_dim, float scale, float* out) {
  if (n < 0 || n_heads <= 0 || n_kv_heads <= 0 || head_dim <= 0)
    fail("attention_prompt: bad shape n ", n, ", heads ", n_heads, "/", n_kv_heads, ", head_dim ",
         head_dim);
  if (n_heads % n_kv_heads != 0)
    fail("attention_prompt: ", n_heads, " query heads are not a multiple of ", n_kv_heads,
         " kv heads");
  if (n == 0) return;
  const int64_t H = n_heads, KV = n_kv_heads, G = H / KV, D = head_dim, D3 = 3 * head_dim;
  const int64_t R = chunk_rows(n, H);
  const int64_t ld_max = round_up(n, kRowAlign);
  // cuBLAS takes int sizes and leading dimensions; the softmax grid puts heads on gridDim.y.
  if (ld_max > INT_MAX || KV * D3 > INT_MAX || G * R > INT_MAX || H > 65535)
    fail("attention_prompt: shape n ", n, ", heads ", H, "/", KV, ", head_dim ", D,
         " exceeds cuBLAS's 32-bit sizes or 65535 heads");

  Context& context = current();
  PromptAttentionScratch& sc = context.unit<PromptAttentionScratch>();
  auto* k3 = sc.k3.get<__nv_bfloat16>(n * KV * D3);
  float* vr = sc.vr.get<float>(n * KV * D);
  auto* q3 = sc.q3.get<__nv_bfloat16>(H * R * D3);
  // The softmax's float4 reads may reach a row's padding (read, never used): zeroing a new buffer
  // once keeps every read initialized (compute-sanitizer initcheck) without a per-call cost.
  float* s = sc.s.get_zeroed<float>(H * R * ld_max);
  float* o = sc.o.get<float>(H * R * D);

  cublasHandle_t handle = context.blas();
  launch("attention_prompt (split keys)", split_keys_kernel,
         grid_stride_blocks(n * KV * D, kCopyThreads), kCopyThreads, 0, k, v, n * KV, D, k3, vr);

  const float alpha_qk = scale, one = 1.0f, zero = 0.0f;
  for (int64_t r0 = 0; r0 < n; r0 += R) {
    const int64_t rc = std::min(R, n - r0);
    const int64_t L = r0 + rc;  // keys this chunk can see
    const int64_t ld = round_up(L, kRowAlign);
    const int64_t cols = G * rc;  // GEMM columns per kv head: (i, t) = head gG+i, query r0+t

    launch("attention_prompt (split queries)", split_queries_kernel,
           grid_stride_blocks(rc * H * D, kCopyThreads), kCopyThreads, 0, q + r0 * H * D, rc, H, D,
           q3);

    // Column-major view, batch g: S_gᵀ [L, cols] (ld) = k3_g [L, 3D] · q3_gᵀ [3D, cols].
    // k3_g: key j at k3 + (j·KV + g)·3D, i.e. a 3D x L column-major matrix with lda KV·3D, used
    // transposed. q3_g: rows (gG + i)·rc + t of q3, consecutive with stride 3D. S_g likewise
    // holds rows (gG + i)·rc + t of S.
    check_cublas(cublasGemmStridedBatchedEx(
                     handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(L), static_cast<int>(cols),
                     static_cast<int>(D3), &alpha_qk, k3, CUDA_R_16BF, static_cast<int>(KV * D3),
                     D3, q3, CUDA_R_16BF, static_cast<int>(D3), cols * D3, &zero, s, CUDA_R_32F,
                     static_cast<int>(ld), cols * ld, static_cast<int>(KV), CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT),
                 "scores GEMM");

    launch("attention_prompt (softmax)", causal_softmax_kernel,
           dim3(grid_blocks(rc, "attention_prompt"), static_cast<unsigned>(H)), kSoftmaxThreads, 0,
           s, rc, ld, r0, L);

    // Batch g: O_gᵀ [D, cols] (ldc D) = V_gᵀ [D, L] (value j at vr + (j·KV + g)·D, lda KV·D)
    // · P_gᵀ [L, cols] (S_g's rows as columns, ldb ld). O_g holds rows (gG + i)·rc + t of O.
    check_cublas(cublasGemmStridedBatchedEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(D),
                                            static_cast<int>(cols), static_cast<int>(L), &one, vr,
                                            CUDA_R_32F, static_cast<int>(KV * D), D, s, CUDA_R_32F,
                                            static_cast<int>(ld), cols * ld, &zero, o, CUDA_R_32F,
                                            static_cast<int>(D), cols * D, static_cast<int>(KV),
                                            CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_GEMM_DEFAULT),
                 "output GEMM");

    launch("attention_prompt (scatter)", scatter_heads_kernel,
           grid_stride_blocks(rc * H * D, kCopyThreads), kCopyThreads, 0, o, rc, H, D,
           out + r0 * H * D);
  }
}

TANDEM_CUDA_TRACE_UNIT(attention_prompt)

}  // namespace tandem::cuda
