// Paged-KV causal attention (GQA) and the KV write, fp32 throughout.
//
// Batch invariance. A query at absolute position P attends to positions 0..P. Those positions are
// cut into partitions of kPartition positions at fixed absolute boundaries [s·kPartition,
// (s+1)·kPartition); the last one ends at P. Each partition yields (max score, sum of exp, sum of
// exp · value) computed by one block in a fixed order, and a second kernel merges the
// partitions of a query in partition order. Nothing in that arithmetic depends on how many
// queries the call holds or how the grid is cut, so a token's output is bitwise the same alone,
// in a verify window or in a prefill.
//
// Partials live in a fixed device buffer (g_partials), not allocated per call; a call that needs
// more is cut into launches over consecutive (query, head) items, which changes no number.
#include <cuda_runtime.h>

#include <algorithm>

#include "tandem/backend/cuda/check.cuh"
#include "tandem/backend/cuda/cuda_ops.h"
#include "tandem/core/error.h"

namespace tandem::cuda {

namespace {

constexpr int kPartition = 256;  // positions per partition (changing it changes rounding only)
constexpr int kPartialThreads = 128;
constexpr int kPartialWarps = kPartialThreads / 32;
constexpr int kScoreUnroll = 4;  // positions a warp scores together, for loads in flight
constexpr int kCombineThreads = 128;
constexpr int kKvWriteThreads = 256;
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxItemsPerLaunch = 65535;  // items run on gridDim.y

// Partial results of one launch of `items` (query, head) items and `splits` partitions each:
//   [0, items·splits·head_dim)      sum of exp · value, [item][split][head_dim]
//   then items·splits maxima, then items·splits sums of exp, both [item][split].
// 32 MiB: a verify window of 16 queries × 32 heads × 256 dims fits one launch up to ~16k
// positions, a single decode query up to ~250k; longer calls take more launches.
constexpr int64_t kScratchFloats = int64_t(1) << 23;
__device__ float g_partials[kScratchFloats];

// The read side of a KVLayerView, with the block table, for kernels.
struct PagedKV {
  const float* pool;
  const int32_t* block_table;
  int64_t block_size;
  int64_t row;  // n_kv_heads * head_dim floats per position
  // Float offset of position p's key row in pool; its value row is block_size * row further.
  __device__ int64_t key_offset(int64_t p) const {
    const int64_t block = block_table[p / block_size];
    return (block * 2 * block_size + p % block_size) * row;
  }
};

// Butterfly reductions: every lane ends with the same bits (a ∘ b == b ∘ a for + and max), and
// the order depends only on the lane values, so a sum is a fixed function of its 32 inputs.
__device__ inline float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}
__device__ inline float warp_max(float v) {
  for (int offset = 16; offset > 0; offset /= 2)
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// One block per (partition, item); grid = (splits, items), item = (t, h) of this launch.
// KD = dims per lane in the score dot products (head_dim <= 32 · KD). Per partition of plen
// positions:
//  1. score[j] = (q · k_j) · scale. A warp owns positions in groups of kScoreUnroll; lane l
//     accumulates dims l, l + 32, ... in order, then warp_sum: an order fixed by head_dim,
//     whichever warp computes the position.
//  2. mx = max score; e_j = exp(score_j - mx); sum = Σ e_j, thread t adding j = t, t + 128, ...
//     in order, then warp_sum, then the four warp totals in warp order.
//  3. acc[i] = Σ_j e_j · v_j[i]: per warp over its positions in order, then the warps in order.
template <int KD>
__global__ void __launch_bounds__(kPartialThreads)
    attention_partial_kernel(PagedKV kv, int64_t start, int64_t first_item, int64_t n_heads,
                             int64_t group, int64_t head_dim, const float* q, float scale,
                             int64_t splits, int64_t m_offset, int64_t l_offset) {
  __shared__ int64_t s_row[kPartition];  // key row offset of each position (incl. kv head)
  __shared__ float s_p[kPartition];      // scores, then their exponentials
  __shared__ float s_max[kPartialWarps];
  __shared__ float s_sum[kPartialWarps];
  __shared__ float s_acc[kPartialWarps][32 * KD];  // per-warp sums of e · v

  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int64_t item = blockIdx.y;
  const int64_t w = first_item + item;  // t * n_heads + h over the whole call
  const int64_t t = w / n_heads;
  const int64_t h = w % n_heads;
  const int64_t len = start + t + 1;  // causal: positions 0..start+t
  const int64_t p0 = static_cast<int64_t>(blockIdx.x) * kPartition;
  if (p0 >= len) return;  // past this query's prefix (whole block, before any barrier)
  const int plen = static_cast<int>(min(static_cast<int64_t>(kPartition), len - p0));
  const int64_t head_offset = (h / group) * head_dim;

  for (int j = threadIdx.x; j < plen; j += kPartialThreads)
    s_row[j] = kv.key_offset(p0 + j) + head_offset;
  float qr[KD];
  const float* qv = q + w * head_dim;
#pragma unroll
  for (int k = 0; k < KD; ++k) {
    const int i = lane + 32 * k;
    qr[k] = i < head_dim ? qv[i] : 0.0f;
  }
  __syncthreads();  // s_row complete

  // 1. Scores. A group's key rows are loaded before any arithmetic so that all
  // kScoreUnroll · KD loads are in flight together; a slot past plen re-reads the last position
  // (always in bounds) and its score is dropped. Dims past head_dim are zero in qr and kr and
  // add exact zeros.
  for (int j0 = warp * kScoreUnroll; j0 < plen; j0 += kPartialWarps * kScoreUnroll) {
    float kr[kScoreUnroll][KD];
#pragma unroll
    for (int u = 0; u < kScoreUnroll; ++u) {
      const float* kp = kv.pool + s_row[min(j0 + u, plen - 1)];
#pragma unroll
      for (int k = 0; k < KD; ++k) {
        const int i = lane + 32 * k;
        kr[u][k] = i < head_dim ? __ldg(kp + i) : 0.0f;
      }
    }
#pragma unroll
    for (int u = 0; u < kScoreUnroll; ++u) {
      float dot = 0.0f;
#pragma unroll
      for (int k = 0; k < KD; ++k) dot = fmaf(qr[k], kr[u][k], dot);
      dot = warp_sum(dot);
      if (lane == 0 && j0 + u < plen) s_p[j0 + u] = dot * scale;
    }
  }
  __syncthreads();  // all scores in s_p

  // 2. Partition max and sum of exponentials. Each thread rewrites only the s_p[j] it read.
  float mx = -INFINITY;
  for (int j = threadIdx.x; j < plen; j += kPartialThreads) mx = fmaxf(mx, s_p[j]);
  mx = warp_max(mx);
  if (lane == 0) s_max[warp] = mx;
  __syncthreads();
  mx = s_max[0];
  for (int k = 1; k < kPartialWarps; ++k) mx = fmaxf(mx, s_max[k]);
  float sum = 0.0f;
  for (int j = threadIdx.x; j < plen; j += kPartialThreads) {
    const float e = expf(s_p[j] - mx);
    s_p[j] = e;
    sum += e;
  }
  sum = warp_sum(sum);
  if (lane == 0) s_sum[warp] = sum;
  __syncthreads();  // s_sum complete, and every e_j in s_p
  sum = s_sum[0];
  for (int k = 1; k < kPartialWarps; ++k) sum += s_sum[k];

  // 3. Weighted values. Warp w takes the position groups it scored in 1, lanes over dims as
  // for q, and accumulates e_j · v_j in position order; the four warp sums are then added in
  // warp order. Both orders are fixed by plen, that is by the query's own prefix.
  float acc[KD];
#pragma unroll
  for (int k = 0; k < KD; ++k) acc[k] = 0.0f;
  const int64_t value_shift = kv.block_size * kv.row;
  for (int j0 = warp * kScoreUnroll; j0 < plen; j0 += kPartialWarps * kScoreUnroll) {
    float vr[kScoreUnroll][KD];  // loaded first, as the key rows in 1
#pragma unroll
    for (int u = 0; u < kScoreUnroll; ++u) {
      const float* vp = kv.pool + s_row[min(j0 + u, plen - 1)] + value_shift;
#pragma unroll
      for (int k = 0; k < KD; ++k) {
        const int i = lane + 32 * k;
        vr[u][k] = i < head_dim ? __ldg(vp + i) : 0.0f;
      }
    }
#pragma unroll
    for (int u = 0; u < kScoreUnroll; ++u) {
      if (j0 + u < plen) {  // warp-uniform
        const float e = s_p[j0 + u];
#pragma unroll
        for (int k = 0; k < KD; ++k) acc[k] = fmaf(e, vr[u][k], acc[k]);
      }
    }
  }
#pragma unroll
  for (int k = 0; k < KD; ++k) {
    const int i = lane + 32 * k;
    if (i < head_dim) s_acc[warp][i] = acc[k];
  }
  __syncthreads();  // every warp's sums in s_acc
  const int64_t slot = item * splits + blockIdx.x;
  float* acc_out = g_partials + slot * head_dim;
  for (int i = threadIdx.x; i < head_dim; i += kPartialThreads) {
    float o = s_acc[0][i];
    for (int k = 1; k < kPartialWarps; ++k) o += s_acc[k][i];
    acc_out[i] = o;
  }
  if (threadIdx.x == 0) {
    g_partials[m_offset + slot] = mx;
    g_partials[l_offset + slot] = sum;
  }
}

// One block per item of the launch; threads over head_dim. Merges the item's partitions
// 0..n_parts-1 in order: M = max m_s, L = Σ_s exp(m_s - M) · l_s, out = Σ_s exp(m_s - M) · acc_s
// / L. Every thread computes M and L itself (same inputs, same order, same bits).
__global__ void __launch_bounds__(kCombineThreads)
    attention_combine_kernel(int64_t start, int64_t first_item, int64_t n_heads, int64_t head_dim,
                             int64_t splits, int64_t m_offset, int64_t l_offset, float* out) {
  const int64_t item = blockIdx.x;
  const int64_t w = first_item + item;
  const int64_t t = w / n_heads;
  const int64_t n_parts = (start + t + kPartition) / kPartition;  // ceil((start + t + 1) / P)
  const float* m = g_partials + m_offset + item * splits;
  const float* l = g_partials + l_offset + item * splits;
  const float* acc = g_partials + item * splits * head_dim;
  float mx = -INFINITY;
  for (int64_t s = 0; s < n_parts; ++s) mx = fmaxf(mx, m[s]);
  float total = 0.0f;
  for (int64_t s = 0; s < n_parts; ++s) total = fmaf(expf(m[s] - mx), l[s], total);
  for (int64_t i = threadIdx.x; i < head_dim; i += kCombineThreads) {
    float o = 0.0f;
    for (int64_t s = 0; s < n_parts; ++s) o = fmaf(expf(m[s] - mx), acc[s * head_dim + i], o);
    out[w * head_dim + i] = o / total;
  }
}

// One block per token; threads copy the token's key and value rows (n_kv_heads · head_dim).
__global__ void kv_write_kernel(float* pool, const int32_t* block_table, int64_t block_size,
                                int64_t row, int64_t start, const float* k, const float* v) {
  const int64_t t = blockIdx.x;
  const int64_t p = start + t;
  const int64_t block = block_table[p / block_size];
  float* kd = pool + (block * 2 * block_size + p % block_size) * row;
  float* vd = kd + block_size * row;
  for (int64_t i = threadIdx.x; i < row; i += kKvWriteThreads) {
    kd[i] = k[t * row + i];
    vd[i] = v[t * row + i];
  }
}

void check_kv_view(const ops::KVLayerView& kv, const char* op) {
  if (kv.pool == nullptr) fail(op, ": KV pool is null");
  if (kv.block_size < 1 || kv.n_kv_heads < 1 || kv.head_dim < 1)
    fail(op, ": bad KV layout: block_size ", kv.block_size, ", n_kv_heads ", kv.n_kv_heads,
         ", head_dim ", kv.head_dim);
}

}  // namespace

void kv_write(const ops::KVLayerView& kv, const int32_t* block_table, int64_t start, int64_t n,
              const float* k, const float* v) {
  if (n < 0 || start < 0) fail("kv_write: bad range start ", start, ", n ", n);
  if (n == 0) return;
  check_kv_view(kv, "kv_write");
  kv_write_kernel<<<grid_blocks(n, "kv_write"), kKvWriteThreads, 0, op_stream()>>>(
      kv.pool, block_table, kv.block_size, kv.n_kv_heads * kv.head_dim, start, k, v);
  check_launch("kv_write");
}

void attention(const ops::KVLayerView& kv, const int32_t* block_table, int64_t start, int64_t n,
               const float* q, int64_t n_heads, float scale, float* out) {
  if (n < 0 || start < 0) fail("attention: bad range start ", start, ", n ", n);
  if (n == 0) return;
  check_kv_view(kv, "attention");
  const int64_t head_dim = kv.head_dim;
  if (head_dim > kMaxHeadDim)
    fail("attention: head_dim ", head_dim, " exceeds the CUDA kernel's maximum ", kMaxHeadDim);
  if (n_heads < kv.n_kv_heads || n_heads % kv.n_kv_heads != 0)
    fail("attention: ", n_heads, " query heads is not a multiple of ", kv.n_kv_heads, " kv heads");

  const int64_t total_items = n * n_heads;
  const int64_t max_parts = ceil_div(start + n, kPartition);
  const int64_t floats_per_item = max_parts * (head_dim + 2);
  if (floats_per_item > kScratchFloats)
    fail("attention: a prefix of ", start + n, " positions needs ", floats_per_item,
         " floats of partial results per head, over the ", kScratchFloats, " reserved");
  const int64_t items_per_launch = std::min(kScratchFloats / floats_per_item, kMaxItemsPerLaunch);

  using PartialKernel = void (*)(PagedKV, int64_t, int64_t, int64_t, int64_t, int64_t, const float*,
                                 float, int64_t, int64_t, int64_t);
  const PartialKernel partial = head_dim <= 32    ? attention_partial_kernel<1>
                                : head_dim <= 64  ? attention_partial_kernel<2>
                                : head_dim <= 128 ? attention_partial_kernel<4>
                                                  : attention_partial_kernel<8>;
  const PagedKV paged{kv.pool, block_table, kv.block_size, kv.n_kv_heads * head_dim};
  const int64_t group = n_heads / kv.n_kv_heads;
  const cudaStream_t s = op_stream();

  for (int64_t first = 0; first < total_items; first += items_per_launch) {
    const int64_t items = std::min(items_per_launch, total_items - first);
    const int64_t last_t = (first + items - 1) / n_heads;
    const int64_t splits = ceil_div(start + last_t + 1, kPartition);
    const int64_t m_offset = items * splits * head_dim;
    const int64_t l_offset = m_offset + items * splits;
    const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(items));
    partial<<<grid, kPartialThreads, 0, s>>>(paged, start, first, n_heads, group, head_dim, q,
                                             scale, splits, m_offset, l_offset);
    check_launch("attention (partitions)");
    attention_combine_kernel<<<static_cast<unsigned>(items), kCombineThreads, 0, s>>>(
        start, first, n_heads, head_dim, splits, m_offset, l_offset, out);
    check_launch("attention (merge)");
  }
}

}  // namespace tandem::cuda
