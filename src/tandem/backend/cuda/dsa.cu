// GLM-5's DSA indexer choice on CUDA (ops::dsa_select; the CPU's is cpu/dsa.cpp). Two launches:
// the scoring spreads each query's positions over blocks, a warp per position (each head's dot
// product over lanes with a fixed butterfly, the heads' weighted ReLUs summed in head order), into
// (score, position) sort keys — descending score, the lower position on a tie, as one 64-bit key
// — in global scratch; then one block per query bitonic-sorts its keys and keeps the first
// min(topk, pos + 1). A query's choice depends on its own q, w and the keys alone (batch
// invariance, DESIGN.md principle 2).
#include <cmath>

#include "tandem/backend/cuda/check.cuh"
#include "tandem/backend/cuda/scratch.cuh"

namespace tandem::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// Ascending keys = descending score, then ascending position.
__device__ __forceinline__ uint64_t order_key(float score, int p) {
  uint32_t u = __float_as_uint(score + 0.0f);      // -0 as +0: equal scores tie on the position
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // ascending with the float
  return (static_cast<uint64_t>(~u) << 32) | static_cast<uint32_t>(p);
}

// Scoring: grid (queries, ceil(sort_n / kScorePositions)); warp w of a block scores positions
// p0 + w, p0 + w + kWarps, .. of its query (p0 = blockIdx.y · kScorePositions) into its sort
// keys; positions past the query's own get the largest key. Spreading a query's positions over
// blocks changes no score (each is one warp's, in the same order).
constexpr int kScorePositions = 64;

__global__ void dsa_score_kernel(const float* __restrict__ q, const float* __restrict__ w,
                                 int64_t heads, int64_t D, const float* __restrict__ keys,
                                 const int64_t* __restrict__ pos, int64_t sort_n, float scale,
                                 uint64_t* __restrict__ scratch) {
  pdl_wait();
  pdl_release();
  const int64_t i = blockIdx.x;
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int64_t len = pos[i] + 1;
  uint64_t* key = scratch + i * sort_n;
  const int64_t p0 = static_cast<int64_t>(blockIdx.y) * kScorePositions;
  const int64_t p1 = p0 + kScorePositions < sort_n ? p0 + kScorePositions : sort_n;
  for (int64_t p = p0 + warp; p < p1; p += kWarps) {
    if (p >= len) {
      if (lane == 0) key[p] = ~0ull;
      continue;
    }
    const float* k = keys + p * D;
    float s = 0.0f;
    for (int64_t h = 0; h < heads; ++h) {
      const float* qh = q + (i * heads + h) * D;
      float d = 0.0f;
      for (int64_t c = lane; c < D; c += 32) d += qh[c] * k[c];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) d += __shfl_xor_sync(0xffffffffu, d, off);
      s += w[i * heads + h] * fmaxf(0.0f, d * scale);
    }
    if (lane == 0) key[p] = order_key(s, static_cast<int>(p));
  }
}

// Sorting and choosing: one block per query; a bitonic sort of its sort_n keys (in shared memory
// when they fit, SortInShared, else in place in the global scratch: the same exchanges either
// way), then the first min(topk, pos + 1) positions.
constexpr int64_t kSharedSortKeys = 4096;  // 32 KB

template <bool SortInShared>
__global__ void dsa_sort_kernel(const int64_t* __restrict__ pos, int64_t topk, int64_t sort_n,
                                uint64_t* __restrict__ scratch, int32_t* __restrict__ out) {
  __shared__ uint64_t shared_keys[SortInShared ? kSharedSortKeys : 1];
  pdl_wait();
  pdl_release();
  const int64_t i = blockIdx.x;
  const int t = threadIdx.x;
  const int64_t len = pos[i] + 1;
  uint64_t* key = scratch + i * sort_n;
  if constexpr (SortInShared) {
    for (int64_t j = t; j < sort_n; j += kThreads) shared_keys[j] = key[j];
    key = shared_keys;
    __syncthreads();
  }
  for (int64_t size = 2; size <= sort_n; size <<= 1)
    for (int64_t stride = size >> 1; stride > 0; stride >>= 1) {
      for (int64_t j = t; j < sort_n; j += kThreads) {
        const int64_t other = j ^ stride;
        if (other > j) {
          const bool up = (j & size) == 0;
          const uint64_t a = key[j], b = key[other];
          if ((a > b) == up) {
            key[j] = b;
            key[other] = a;
          }
        }
      }
      __syncthreads();
    }
  const int64_t keep = len < topk ? len : topk;
  for (int64_t j = t; j < topk; j += kThreads)
    out[i * topk + j] = j < keep ? static_cast<int32_t>(key[j] & 0xffffffffu) : -1;
}

// The context's sort keys of every query ([n, sort_n]).
struct DsaScratch {
  DeviceScratch keys;
};

}  // namespace

void dsa_select(const float* q, const float* w, int64_t n, int64_t heads, int64_t D,
                const float* keys, int64_t ctx, const int64_t* pos, int64_t topk, int32_t* out) {
  if (heads < 1 || D < 1 || topk < 1)
    fail("dsa_select: ", heads, " heads of ", D, " values, top ", topk);
  if (ctx > 0x7fffffff) fail("dsa_select: ", ctx, " positions");
  if (n == 0) return;
  // Positions are device data: every query's sort covers the whole context (pos[i] < ctx).
  int64_t sort_n = 1;
  while (sort_n < ctx) sort_n <<= 1;
  uint64_t* keys_scratch = current().unit<DsaScratch>().keys.get<uint64_t>(n * sort_n);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  launch("dsa_select (score)", dsa_score_kernel,
         dim3(grid_blocks(n, "dsa_select"),
              grid_blocks(ceil_div(sort_n, kScorePositions), "dsa_select")),
         dim3(kThreads), 0, q, w, heads, D, keys, pos, sort_n, scale, keys_scratch);
  const auto sort = sort_n <= kSharedSortKeys ? dsa_sort_kernel<true> : dsa_sort_kernel<false>;
  launch("dsa_select (sort)", sort, dim3(grid_blocks(n, "dsa_select")), dim3(kThreads), 0, pos,
         topk, sort_n, keys_scratch, out);
}

TANDEM_CUDA_TRACE_UNIT(dsa)

}  // namespace tandem::cuda
