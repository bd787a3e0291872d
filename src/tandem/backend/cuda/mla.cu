// GLM-5's multi-head latent attention on CUDA (ops::mla_attention; the CPU's is cpu/mla.cpp,
// whose header comment describes the cache layout). Both evaluation orders run here in the
// absorbed one — the key projection folded into the query (q_lat = W_ukᵀ q_nope), the value
// projection applied once to the weighted sum of latents — which reads each cached latent once
// and equals the expanded order within fp32 rounding.
//
// One block per (query, head). The attended positions are walked in ascending order in chunks
// of kChunk with a running max and sum (online softmax); a warp scores a position (lanes over the
// latent, a fixed butterfly), one thread folds a chunk's maximum and sum in position order, and
// thread c accumulates latent column c. Every sum's order depends on the shapes and the
// positions attended alone, so a query's result never depends on the other queries or rows of
// the call (batch invariance, DESIGN.md principle 2).
#include <cfloat>
#include <climits>

#include "tandem/backend/cuda/check.cuh"

namespace tandem::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kChunk = 256;

__device__ __forceinline__ float weight_at(const void* w, bool bf16, int64_t i) {
  if (!bf16) return static_cast<const float*>(w)[i];
  return __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t*>(w)[i]) << 16);
}

// Shared memory: qlat [R], acc [R], qp [dr], score [kChunk], then (with a DSA choice) the sorted
// positions [sort_n] as ints.
__global__ void mla_absorbed_kernel(const float* __restrict__ q_nope,
                                    const float* __restrict__ q_pe, int64_t H, int64_t dn,
                                    int64_t dr, int64_t dv, const float* __restrict__ latent,
                                    int64_t R, const void* kv_b, bool kv_bf16,
                                    const int64_t* __restrict__ pos,
                                    const int32_t* __restrict__ allowed, int64_t topk, int sort_n,
                                    float scale, float* __restrict__ out) {
  extern __shared__ float smem[];
  float* qlat = smem;
  float* acc = qlat + R;
  float* qp = acc + R;
  float* score = qp + dr;
  int* cols = reinterpret_cast<int*>(score + kChunk);
  __shared__ float s_max, s_alpha, s_sum;
  __shared__ int s_count;

  pdl_wait();
  pdl_release();
  const int64_t job = blockIdx.x;
  const int64_t i = job / H, h = job % H;
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const float* qn = q_nope + (i * H + h) * dn;
  const int64_t wk = h * (dn + dv) * R;  // W_uk [dn][R], then W_uv [dv][R]
  const int64_t wv = wk + dn * R;
  const int64_t L = R + dr;
  const int64_t p_max = pos[i];

  for (int64_t c = t; c < R; c += kThreads) {
    float s = 0.0f;
    for (int64_t d = 0; d < dn; ++d) s += qn[d] * weight_at(kv_b, kv_bf16, wk + d * R + c);
    qlat[c] = s;
    acc[c] = 0.0f;
  }
  for (int64_t c = t; c < dr; c += kThreads) qp[c] = q_pe[(i * H + h) * dr + c];

  // The attended positions: the DSA choice, ascending (invalid ones sort last), or 0..p_max.
  int64_t count = p_max + 1;
  if (allowed) {
    for (int j = t; j < sort_n; j += kThreads) {
      const int p = j < topk ? allowed[i * topk + j] : INT_MAX;
      cols[j] = p >= 0 && p <= p_max ? p : INT_MAX;
    }
    __syncthreads();
    for (int size = 2; size <= sort_n; size <<= 1)
      for (int stride = size >> 1; stride > 0; stride >>= 1) {
        for (int j = t; j < sort_n; j += kThreads) {
          const int other = j ^ stride;
          if (other > j) {
            const bool up = (j & size) == 0;
            const int a = cols[j], b = cols[other];
            if ((a > b) == up) {
              cols[j] = b;
              cols[other] = a;
            }
          }
        }
        __syncthreads();
      }
    if (t == 0) {
      int n = 0;
      while (n < sort_n && cols[n] != INT_MAX) ++n;
      s_count = n;
    }
    __syncthreads();
    count = s_count;
  }
  if (t == 0) {
    s_max = -FLT_MAX;
    s_sum = 0.0f;
  }
  __syncthreads();

  for (int64_t start = 0; start < count; start += kChunk) {
    const int n = static_cast<int>(count - start < kChunk ? count - start : kChunk);
    for (int j = warp; j < n; j += kWarps) {
      const int64_t p = allowed ? cols[start + j] : start + j;
      const float* lat = latent + p * L;
      float s = 0.0f;
      for (int64_t c = lane; c < R; c += 32) s += qlat[c] * lat[c];
      for (int64_t c = lane; c < dr; c += 32) s += qp[c] * lat[R + c];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
      if (lane == 0) score[j] = s * scale;
    }
    __syncthreads();
    if (t == 0) {
      float m = s_max;
      for (int j = 0; j < n; ++j) m = fmaxf(m, score[j]);
      const float alpha = __expf(s_max - m);
      float sum = s_sum * alpha;
      for (int j = 0; j < n; ++j) {
        score[j] = __expf(score[j] - m);
        sum += score[j];
      }
      s_alpha = alpha;
      s_max = m;
      s_sum = sum;
    }
    __syncthreads();
    const float alpha = s_alpha;
    for (int64_t c = t; c < R; c += kThreads) {
      float a = acc[c] * alpha;
      for (int j = 0; j < n; ++j) {
        const int64_t p = allowed ? cols[start + j] : start + j;
        a += score[j] * latent[p * L + c];
      }
      acc[c] = a;
    }
    __syncthreads();
  }

  float* o = out + (i * H + h) * dv;
  const float inv = count > 0 ? 1.0f / s_sum : 0.0f;
  for (int64_t d = warp; d < dv; d += kWarps) {
    float s = 0.0f;
    for (int64_t c = lane; c < R; c += 32) s += weight_at(kv_b, kv_bf16, wv + d * R + c) * acc[c];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    if (lane == 0) o[d] = s * inv;
  }
}

}  // namespace

void mla_attention(const float* q_nope, const float* q_pe, int64_t n, int64_t H, int64_t dn,
                   int64_t dr, int64_t dv, const float* latent, int64_t ctx, int64_t R,
                   const ops::WeightRef& kv_b, const int64_t* pos, const int32_t* allowed,
                   int64_t topk, float scale, bool /*absorbed*/, float* out) {
  if (kv_b.rows != H * (dn + dv) || kv_b.cols != R)
    fail("mla_attention: kv_b is [", kv_b.rows, " x ", kv_b.cols, "], expected [", H * (dn + dv),
         " x ", R, "] for ", H, " heads of ", dn, " + ", dv);
  if (kv_b.dtype != DType::F32 && kv_b.dtype != DType::BF16)
    fail("mla_attention (CUDA): kv_b dtype ", dtype_name(kv_b.dtype), " (expected F32 or BF16)");
  if (reinterpret_cast<uintptr_t>(kv_b.data) % (kv_b.dtype == DType::F32 ? 4 : 2) != 0)
    fail("mla_attention (CUDA): kv_b is not aligned to its element size");
  (void)ctx;  // positions are bounded by pos[], which the model keeps below the cache's length
  if (n == 0 || H == 0) return;
  int sort_n = 0;
  if (allowed) {
    if (topk < 1 || topk > 4096) fail("mla_attention (CUDA): topk ", topk, " outside 1..4096");
    sort_n = 1;
    while (sort_n < topk) sort_n <<= 1;
  }
  const size_t smem = sizeof(float) * static_cast<size_t>(2 * R + dr + kChunk) +
                      sizeof(int) * static_cast<size_t>(sort_n);
  if (smem > 48 * 1024)
    fail("mla_attention (CUDA): ", smem, " bytes of shared memory for a latent of ", R,
         " and a choice of ", topk, " (at most 48 KiB)");
  launch("mla_attention", mla_absorbed_kernel, dim3(grid_blocks(n * H, "mla_attention")),
         dim3(kThreads), smem, q_nope, q_pe, H, dn, dr, dv, latent, R, kv_b.data,
         kv_b.dtype == DType::BF16, pos, allowed, topk, sort_n, scale, out);
}

TANDEM_CUDA_TRACE_UNIT(mla)

}  // namespace tandem::cuda
