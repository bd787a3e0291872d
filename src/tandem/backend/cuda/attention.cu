// Paged-KV causal attention (GQA) and the KV write. Arithmetic is fp32 throughout; the KV is
// stored in fp32 or bf16 (kv_element.cuh: bf16 values are widened exactly as they are loaded).
//
// Positions are device memory. A query at position P (read from `positions`) attends to
// positions 0..P; the host knows only an upper bound on P (position_bound), which sizes the grid
// and the scratch. So a decode step captured into a CUDA graph replays at any later position
// below the bound: only the positions array changes between replays.
//
// Batch invariance. The positions 0..P of a query are cut into partitions of
// partition_size(P + 1) positions at fixed absolute boundaries; the size grows with the
// query's own prefix (about sqrt(2 · len): a few short partitions for a short prefix, enough
// long ones to fill the GPU for a long one) and depends on nothing else. Each partition is reduced
// by one block in an order fixed by its length, and the partitions are merged in partition order.
// Nothing in that arithmetic depends on how many queries the call holds, on position_bound or on
// how the grid is cut, so a token's output is bitwise the same alone, in a verify window, in a
// prefill, or replayed from a graph captured under another bound.
//
// Work split. One block per (partition, group of queries, head chunk): a head chunk is G query
// heads that share one kv head, so each key/value row is read once for all G heads; a group is up
// to 4 consecutive queries, and those of one row cut alike (a verify window's) run in the same
// block, one after another, the later ones reading the rows from L1. Which queries share a block
// is a matter of the work, not the arithmetic: each query keeps its own rows, rounds and state.
// The block that finishes a query's last partition (an atomic counter per (query, chunk)) merges
// the partitions, so there is one launch per call and no second kernel; which block that is
// changes no number, because the merge reads every partition's result from memory in partition
// order.
//
// Partials live in a fixed buffer of the context (PartialResults), allocated once, so its address
// never changes under a captured graph; a call that needs more is cut into launches over
// consecutive queries, which changes no number. The buffer and its counters are shared by the
// context's calls, which its stream orders; another context has its own.
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "tandem/backend/cuda/activation.cuh"
#include "tandem/backend/cuda/check.cuh"
#include "tandem/backend/cuda/cuda_ops.h"
#include "tandem/backend/cuda/kv_element.cuh"
#include "tandem/backend/cuda/scratch.cuh"
#include "tandem/core/env_switch.h"
#include "tandem/core/error.h"

namespace tandem::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kRowsPerWarp = 4;  // rows a warp loads together (keys and values in flight at once)
constexpr int kRoundRows = kWarps * kRowsPerWarp;  // rows a block takes per round
constexpr int64_t kMinPartition = kRoundRows;      // a partition is whole rounds
constexpr int64_t kMaxPartitions = 256;            // per query; bounds the merge's shared memory
constexpr int kMaxChunkHeads = 4;                  // G: query heads per block
constexpr int kMergeBatch = 16;                    // partitions whose partials load together
constexpr int kMaxRun = 4;        // queries a block serves (W: their rows in shared memory)
constexpr int64_t kRunWaves = 3;  // waves of resident blocks a grid keeps when runs form
// Blocks per SM the kernel is compiled for: 2 caps it at 128 registers (no spills), so a second
// block's loads hide the first's latency when the grid holds more than one block per SM (verify
// windows, long contexts).
constexpr int kMinBlocksPerSm = 2;
constexpr int64_t kMaxHeadDim = 256;
constexpr int kKvWriteThreads = 256;
constexpr int64_t kMaxGridY = 65535;  // queries run on gridDim.y
// Steps 2 and 3 of the kernel give each thread one float4 of a chunk's [G, head_dim] output.
static_assert(kMaxChunkHeads * kMaxHeadDim / 4 <= kThreads, "one float4 of output per thread");

// Partial results of one launch of Q queries × C head chunks × S partition slots (S = the
// launch's max_partitions), per slot G heads:
//   [0, Q·C·S·G·head_dim)   sum of exp · value, [query][chunk][slot][head][head_dim]
//   then Q·C·S·G maxima, then Q·C·S·G sums of exp, both [query][chunk][slot][head].
// 64 MiB: 254 queries of 16 heads × 256 dims (a 4-token window of 32 rows and more) fit one
// launch for bounds up to 1,024 positions, 16 queries for bounds up to ~60k, a single decode
// query for any bound; larger calls take several launches of equal size.
constexpr int64_t kScratchFloats = int64_t(1) << 24;
// Partitions of a (query, chunk) finished so far in the running launch. The last block to finish
// resets its counter to 0, so every launch starts from zeros (they are zeroed when allocated).
constexpr int64_t kMaxCounters = int64_t(1) << 16;

// A launch's view of its context's partial results: sums [kScratchFloats] (16-byte aligned, for
// float4 access) and done [kMaxCounters].
struct PartialResults {
  float* sums;
  unsigned* done;
};

struct AttentionScratch {
  DeviceScratch sums, done;
};

// Positions per partition for a query with `len` positions: the smallest kMinPartition · 2^k
// that cuts len into at most min(p / 2, kMaxPartitions) partitions. Partition count and length
// then grow together (len 512: 16 × 32; 4096: 32 × 128; 32768: 128 × 256), which balances a
// partition's reads (2 · p rows) against its merge's (count · G rows).
__host__ __device__ constexpr int64_t partition_size(int64_t len) {
  int64_t p = kMinPartition;
  while (len > p * (p / 2 < kMaxPartitions ? p / 2 : kMaxPartitions)) p *= 2;
  return p;
}

// The most partitions any query below position_bound (len <= bound) can have: the grid's x.
int64_t max_partitions(int64_t bound) {
  int64_t most = 0;
  int64_t lo = 1;  // the first len of the size-p tier
  for (int64_t p = kMinPartition; lo <= bound; p *= 2) {
    const int64_t top = p * std::min(p / 2, kMaxPartitions);  // its last len
    if (top >= lo) most = std::max(most, ceil_div(std::min(top, bound), p));
    lo = std::max(lo, top + 1);
  }
  return most;
}

// The read side of a KVLayerView, with the block table, for kernels. T: the stored element
// (float, or uint16_t holding bf16).
template <class T>
struct PagedKV {
  const T* pool;
  const int32_t* block_table;
  uint32_t block_size;
  int64_t row;  // n_kv_heads * head_dim elements per position
  // Element offset of position p's key row in pool; its value row is block_size * row further.
  // Positions fit 32 bits (checked on the host), which keeps the division cheap.
  __device__ int64_t key_offset(uint32_t p) const {
    const int64_t block = __ldg(block_table + p / block_size);
    return (block * 2 * block_size + p % block_size) * row;
  }
};

__device__ inline float4 ldg4(const float* p) {
  return __ldg(reinterpret_cast<const float4*>(p));
}
// Partials are written by other blocks of the same launch: read them from L2, never from a
// possibly stale L1 line.
__device__ inline float4 ldcg4(const float* p) {
  return __ldcg(reinterpret_cast<const float4*>(p));
}
__device__ inline float dot4(float4 a, float4 b, float acc) {
  acc = fmaf(a.x, b.x, acc);
  acc = fmaf(a.y, b.y, acc);
  acc = fmaf(a.z, b.z, acc);
  return fmaf(a.w, b.w, acc);
}
__device__ inline float4 fma4(float s, float4 v, float4 acc) {
  return make_float4(fmaf(s, v.x, acc.x), fmaf(s, v.y, acc.y), fmaf(s, v.z, acc.z),
                     fmaf(s, v.w, acc.w));
}
__device__ inline float4 scale4(float s, float4 v) {
  return make_float4(s * v.x, s * v.y, s * v.z, s * v.w);
}

// One halving step at lane offset O on the first n of x, then the next (compile-time recursion,
// so every index into x is a constant and x stays in registers).
template <int n, int O, int N>
__device__ inline void halve_and_add(float (&x)[N], int lane) {
  if constexpr (n > 1) {
    const bool upper = (lane & O) != 0;
#pragma unroll
    for (int i = 0; i < n / 2; ++i) {
      const float send = upper ? x[i] : x[i + n / 2];
      const float keep = upper ? x[i + n / 2] : x[i];
      x[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
    }
    halve_and_add<n / 2, O / 2>(x, lane);
  }
}

// Sums N values (N a power of two <= 32) over the warp at once: x[i] is lane l's share of value
// i. Each halving step at offset o trades half the values with lane l ^ o (a lane keeps the half
// its bit o selects) and adds; then a plain butterfly finishes. Lane l ends with the total of
// value l >> (5 - log2 N), and every lane holding a value holds the same bits (a + b == b + a).
// The addition tree depends only on the lane, so each total is a fixed function of its 32
// inputs. N + 4 - log2 N shuffles instead of 5N for N separate butterflies.
template <int N>
__device__ inline float warp_sum_transposed(float (&x)[N], int lane) {
  static_assert(N >= 1 && N <= 32 && (N & (N - 1)) == 0, "N is a power of two up to 32");
  halve_and_add<N, 16>(x, lane);
  float v = x[0];
#pragma unroll
  for (int o = 16 / N; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

constexpr int log2_int(int v) {
  return v <= 1 ? 0 : 1 + log2_int(v / 2);
}

// One block per (partition s, group of `run` consecutive queries, head chunk c); grid = (max
// partitions, groups, chunks). KV4 = float4s per lane in a row (head_dim <= 128 · KV4), G =
// query heads of the chunk, all reading kv head (c · G) / group, W >= run the most queries whose
// rows a block holds. Lane l holds dims 4f..4f+3 of every row, f = l + 32k. Scores are kept in
// base 2: score = (q · k) · scale · log2(e), weights exp2(score - max).
//
// Runs. The group's queries of one block table whose prefixes are cut alike (the same partition
// size: a verify window's queries, short of a tier boundary) read the same rows in partition s,
// each up to its own end. The block serves such a run's queries one after another, each through
// exactly the steps below as it would run alone (so its bits do not depend on the run); the
// first reads the keys and values from L2 or memory, the others find them in L1. What a run
// saves is the blocks: their start, their block-table and query reads, their merges.
//
//  1. Rows. Round r covers rows r·32 .. r·32+31 of the partition; warp w takes rows w·4 .. w·4+3
//     of each round (R = 4 rows, G·R scores). Per round: the lane-ordered fmaf dot products of
//     the lane's dims for all G·R scores, one transposed warp sum (lane l then owns score
//     (g, u) = divmod(l >> (5 - log2(G·R)), R)), the round max per head (butterfly over the
//     owners of the head's rows), and online softmax: a running max m, sum of weights l and
//     weighted value sums per head, rescaled by exp2(m - m') when the max grows, then the rows
//     added in row order. A row past the partition scores -inf (weight exactly 0).
//  2. The warps' (m, l, sums) are merged in warp order into the partition's result, which goes
//     to the partial results.
//  3. The last block of (t, c) merges the query's partitions in partition order:
//     M = max m_s, w_s = exp2(m_s - M), out = (Σ_s w_s · acc_s) / (Σ_s w_s · l_s).
// Every order above is fixed by the query's position alone.
template <int KV4, int G, int W, class T>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    attention_kernel(PagedKV<T> kv, const int32_t* tables, int64_t table_stride,
                     const int64_t* query_rows, const int64_t* positions, int64_t position_bound,
                     int64_t first_query, int64_t queries, int run, int64_t n_heads, int64_t group,
                     int64_t head_dim, const float* q, float score_scale, int64_t slots,
                     int64_t m_offset, int64_t l_offset, float* out, const float* gate,
                     PartialResults partials) {
  constexpr int R = kRowsPerWarp;
  constexpr int N = G * R;                        // scores per warp, round and query
  constexpr int kOwners = 32 / N;                 // lanes owning one score
  constexpr int kOwnerShift = 5 - log2_int(N);    // score of lane l: l >> kOwnerShift
  constexpr int kDims = 128 * KV4;                // dims a warp covers (>= head_dim)
  constexpr int kSums4 = kWarps * G * kDims / 4;  // float4s of one query's per-warp sums
  constexpr int kQuery4 = G * kDims / 4;          // float4s of one query's rows, zero past head_dim
  // Dynamic: [kSums4] per-warp sums of weight · value during 1 and 2 of one query (reused for
  // the merges of 3), then [W][kQuery4] the queries' rows.
  extern __shared__ float4 s_dynamic[];
  float4* s_sums4 = s_dynamic;
  float4* s_query4 = s_dynamic + kSums4;
  __shared__ float s_m[kWarps][G], s_l[kWarps][G], s_w[kWarps][G];
  __shared__ float s_max[G];
  __shared__ bool s_last[W];
  static_assert(kSums4 * 4 >= 3 * kMaxPartitions * G, "merge buffers fit in one query's sums");
  static_assert(kQuery4 <= kThreads, "one float4 of the query rows per thread");

  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int64_t first = static_cast<int64_t>(blockIdx.y) * run;  // within the launch
  const int members = static_cast<int>(min(static_cast<int64_t>(run), queries - first));
  const int64_t chunk = blockIdx.z;
  const int64_t n_chunks = gridDim.z;
  const int64_t h0 = chunk * G;  // the chunk's first query head
  const int64_t kv_off = (h0 / group) * head_dim;
  const int64_t vec = head_dim / 4;  // float4s per head
  const int64_t s = blockIdx.x;
  // Query i of the group's [G, head_dim] of out and q.
  auto out_base = [&](int i) { return ((first_query + first + i) * n_heads + h0) * head_dim; };

  // The members' rows, prefixes and partition sizes, before the wait: rows, positions and block
  // tables are uploaded before the forward's first kernel (check.cuh), so only the query rows
  // (the kernel before this one writes them) wait for it. A skipped query (row -1) is in no run;
  // one whose position breaks the caller's bound neither. Shared: the row loop keeps none of it
  // in registers.
  __shared__ int64_t s_row[W], s_len[W], s_part[W];
  if (threadIdx.x < W) {
    const int i = threadIdx.x;
    int64_t row = -1, len = 0;  // len 0: in no run; -1: a position outside the bound
    if (i < members) {
      const int64_t t = first_query + first + i;
      row = query_rows ? query_rows[t] : 0;
      if (row >= 0) {
        const int64_t pos = positions[t];
        len = pos < 0 || pos >= position_bound ? -1 : pos + 1;
      }
    }
    s_row[i] = row;
    s_len[i] = len;
    s_part[i] = len > 0 ? partition_size(len) : 0;
  }
  __syncthreads();
  unsigned ok = 0, bad = 0, starts = 0;  // a run starts at every query that cannot join the last
#pragma unroll
  for (int i = 0; i < W; ++i) {
    if (s_len[i] < 0) bad |= 1u << i;
    if (s_len[i] <= 0) continue;
    ok |= 1u << i;
    if (i == 0 || !(ok >> (i - 1) & 1u) || s_row[i] != s_row[i - 1] || s_part[i] != s_part[i - 1])
      starts |= 1u << i;
  }
  if (bad != 0) {
    // The caller broke its bound: NaN marks the output, and no counter moves.
    pdl_wait();
    pdl_release();
    if (blockIdx.x == 0)
      for (int i = 0; i < W; ++i)
        if (bad >> i & 1u)
          for (int64_t j = threadIdx.x; j < G * head_dim; j += kThreads) out[out_base(i) + j] = NAN;
  }

  // The lane's own score (g, u), the same for every query:
  const int own = lane >> kOwnerShift;
  const int own_g = own / R, own_u = own % R;
  bool live[KV4];
#pragma unroll
  for (int k = 0; k < KV4; ++k) live[k] = lane + 32 * k < vec;
  const int64_t value_shift = static_cast<int64_t>(kv.block_size) * kv.row;

  unsigned merge = 0;  // the queries whose last partition this block finished
  for (unsigned todo = starts; todo != 0;) {
    // The run: from its first query up to the next start or the first query not in a run (~ok
    // holds every bit from W up, so there is one).
    const int a = __ffs(todo) - 1;
    todo &= todo - 1;
    const int b = __ffs((todo | ~ok) & ~((2u << a) - 1u)) - 1;
    const unsigned in_run = ((1u << b) - 1u) & ~((1u << a) - 1u);
    // Partition arithmetic in 32 bits (positions are below 2^31, checked on the host): fewer
    // registers held through the row loop.
    const int psize = static_cast<int>(s_part[a]);
    unsigned served = 0;  // the queries whose prefix reaches partition s
#pragma unroll
    for (int i = 0; i < W; ++i)
      if ((in_run >> i & 1u) && s * psize < s_len[i]) served |= 1u << i;
    if (served == 0) continue;                   // the whole block alike
    const int p0 = static_cast<int>(s * psize);  // below a served query's length
    if (query_rows) kv.block_table = tables + s_row[a] * table_stride;

    // Key offsets of the warp's rows of round r of a partition of plen rows; a row past the
    // partition re-reads its last row (always in the row's blocks) and scores -inf.
    int64_t off[R];
    auto row_offsets = [&](int r0, int plen) {
#pragma unroll
      for (int u = 0; u < R; ++u) {
        const int j = min(r0 + warp * R + u, plen - 1);
        off[u] = kv.key_offset(static_cast<uint32_t>(p0 + j)) + kv_off;
      }
    };
    auto plen_of = [&](int i) {
      return static_cast<int>(min(static_cast<int64_t>(psize), s_len[i] - p0));
    };
    // A round's keys and values of the warp's rows (at off) into registers.
    float4 kr[R][KV4], vr[R][KV4];
    auto load_round = [&] {
#pragma unroll
      for (int u = 0; u < R; ++u)
#pragma unroll
        for (int k = 0; k < KV4; ++k) {
          const T* kp = kv.pool + off[u] + 4 * (lane + 32 * k);
          kr[u][k] = live[k] ? load_kv4(kp) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
          vr[u][k] = live[k] ? load_kv4(kp + value_shift) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
    };
    const int lead = __ffs(served) - 1;  // the first query served, whose first round goes first
    row_offsets(0, plen_of(lead));
    pdl_wait();
    pdl_release();
    // The first query's first round and every served query's rows, all in flight at once (the
    // kernel before this one writes the window's own keys and values and the query rows).
    load_round();
    for (int i = 0; i < W; ++i)
      if ((served >> i & 1u) && threadIdx.x < kQuery4) {
        const int64_t g = threadIdx.x / (kDims / 4), f = threadIdx.x % (kDims / 4);
        s_query4[i * kQuery4 + threadIdx.x] = f < vec ? ldg4(q + out_base(i) + g * head_dim + 4 * f)
                                                      : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
    __syncthreads();  // the query rows complete

    // The queries of the run one after another, each through 1 and 2 exactly as it runs alone;
    // the keys and values the first one loaded are still in L1 for the others.
#pragma unroll 1
    for (int i = lead; i < b; ++i) {
      if (!(served >> i & 1u)) continue;  // the whole block alike
      const int plen = plen_of(i);
      if (i != lead) {
        row_offsets(0, plen);
        load_round();
      }
      const float4* query4 = s_query4 + i * kQuery4;

      // 1. This warp's rows, round by round. m, l: of head own_g (the same in all of its owner
      // lanes). The weighted value sums live in shared memory rather than in 32 registers
      // (which would push the row loop past 128): each lane reads and writes only its own
      // float4s, so no barrier is needed until step 2.
      float m = -INFINITY, l = 0.0f;
      float4* acc = s_sums4 + warp * G * (kDims / 4) + lane;  // acc[(g · kDims/4 + 32k)]
#pragma unroll
      for (int g = 0; g < G; ++g)
#pragma unroll
        for (int k = 0; k < KV4; ++k)
          acc[g * (kDims / 4) + 32 * k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      for (int r0 = 0; r0 < plen; r0 += kRoundRows) {
        const int j0 = r0 + warp * R;
        if (j0 >= plen) break;  // warp-uniform; later rounds start further still
        if (r0 > 0) load_round();
        // The next round's block-table reads go out with this round's rows.
        if (r0 + kRoundRows < plen) row_offsets(r0 + kRoundRows, plen);

        float x[N];  // this lane's share of every score
#pragma unroll
        for (int g = 0; g < G; ++g) {
          float4 qg[KV4];
#pragma unroll
          for (int k = 0; k < KV4; ++k) qg[k] = query4[g * (kDims / 4) + lane + 32 * k];
#pragma unroll
          for (int u = 0; u < R; ++u) {
            float d = 0.0f;
#pragma unroll
            for (int k = 0; k < KV4; ++k) d = dot4(qg[k], kr[u][k], d);
            x[g * R + u] = d;
          }
        }
        // All lanes reduce (the shuffles need the whole warp); then a row past plen drops out.
        const float dot = warp_sum_transposed<N>(x, lane);
        const float score = j0 + own_u < plen ? dot * score_scale : -INFINITY;
        // The head's round max and weight sum over the owners of its R rows (lane bits
        // kOwnerShift .. kOwnerShift + log2 R - 1).
        float mx = score;
#pragma unroll
        for (int o = kOwners; o < kOwners * R; o *= 2)
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        mx = fmaxf(m, mx);                 // finite: row j0 is in the partition
        const float corr = exp2f(m - mx);  // 0 on the first round (m = -inf)
        const float e = exp2f(score - mx);
        float esum = e;
#pragma unroll
        for (int o = kOwners; o < kOwners * R; o *= 2)
          esum += __shfl_xor_sync(0xffffffffu, esum, o);
        l = fmaf(l, corr, esum);
        m = mx;
        // Every lane adds every row's weighted values to its dims, in row order.
#pragma unroll
        for (int g = 0; g < G; ++g) {
          const float c = __shfl_sync(0xffffffffu, corr, g * R * kOwners);
          float4 a4[KV4];
#pragma unroll
          for (int k = 0; k < KV4; ++k) a4[k] = scale4(c, acc[g * (kDims / 4) + 32 * k]);
#pragma unroll
          for (int u = 0; u < R; ++u) {
            const float w = __shfl_sync(0xffffffffu, e, (g * R + u) * kOwners);
#pragma unroll
            for (int k = 0; k < KV4; ++k) a4[k] = fma4(w, vr[u][k], a4[k]);
          }
#pragma unroll
          for (int k = 0; k < KV4; ++k) acc[g * (kDims / 4) + 32 * k] = a4[k];
        }
      }
      // A warp without rows keeps m = -inf, l = 0, sums 0: weight 0 below.
      if (lane % (R * kOwners) == 0) {
        s_m[warp][own_g] = m;
        s_l[warp][own_g] = l;
      }
      __syncthreads();  // every warp's m, l and sums

      // 2. The partition's result: warps merged in warp order (warp 0 always has rows, so the
      // max is finite).
      const int64_t slot = ((first + i) * n_chunks + chunk) * slots + s;
      if (threadIdx.x < G) {
        const int g = threadIdx.x;
        float mp = s_m[0][g];
        for (int w = 1; w < kWarps; ++w) mp = fmaxf(mp, s_m[w][g]);
        float sum = 0.0f;
        for (int w = 0; w < kWarps; ++w) {
          const float wt = exp2f(s_m[w][g] - mp);
          s_w[w][g] = wt;
          sum = fmaf(wt, s_l[w][g], sum);
        }
        partials.sums[m_offset + slot * G + g] = mp;
        partials.sums[l_offset + slot * G + g] = sum;
      }
      __syncthreads();  // s_w complete
      // One float4 of [G, head_dim] per thread (G · 256 / 4 <= kThreads).
      const int64_t o4 = threadIdx.x;
      if (o4 < G * vec) {
        const int og = static_cast<int>(o4 / vec);  // its head within the chunk
        const int64_t oi = 4 * (o4 % vec);          // its first dim
        float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (int w = 0; w < kWarps; ++w)
          o = fma4(s_w[w][og], s_sums4[(w * G + og) * (kDims / 4) + oi / 4], o);
        *reinterpret_cast<float4*>(partials.sums + (slot * G + og) * head_dim + oi) = o;
      }
      __syncthreads();  // the sums and s_w are free for the next query
    }

    // Publish, and elect each query's last finished partition to merge it.
    __threadfence();
    __syncthreads();
    if (threadIdx.x < W) {
      const int i = threadIdx.x;
      bool last = false;
      if (served >> i & 1u) {
        const int64_t n_parts = (s_len[i] + psize - 1) / psize;
        unsigned* done = partials.done + (first + i) * n_chunks + chunk;
        last = atomicAdd(done, 1u) == static_cast<unsigned>(n_parts - 1);
        if (last) atomicExch(done, 0u);  // every partition has counted: ready for the next launch
        __threadfence();
      }
      s_last[i] = last;
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < W; ++i)
      if (s_last[i]) merge |= 1u << i;
  }

  // 3. Merge the partitions of each query this block finished last (after the runs, whose
  // registers are then free). The first batch of partial sums is requested before the weights
  // are computed, so those loads overlap the max and exp2 below.
  const int64_t o4 = threadIdx.x;
  const bool has_out = o4 < G * vec;
  const int og = static_cast<int>(o4 / vec);
  const int64_t oi = 4 * (o4 % vec);
#pragma unroll 1
  for (int i = 0; i < W; ++i) {
    if (!(merge >> i & 1u)) continue;  // the whole block alike
    const int64_t n_parts = (s_len[i] + s_part[i] - 1) / s_part[i];
    const int64_t first_slot = ((first + i) * n_chunks + chunk) * slots;
    const float* part_acc = partials.sums + first_slot * G * head_dim + og * head_dim + oi;
    float4 a[kMergeBatch];
#pragma unroll
    for (int bt = 0; bt < kMergeBatch; ++bt)
      if (has_out && bt < n_parts) a[bt] = ldcg4(part_acc + bt * G * head_dim);
    float* s_pm = reinterpret_cast<float*>(s_sums4);  // [n_parts][G] maxima
    float* s_pl = s_pm + kMaxPartitions * G;          // [n_parts][G] sums of weights
    float* s_pw = s_pm + 2 * kMaxPartitions * G;      // [n_parts][G] partition weights
    for (int64_t j = threadIdx.x; j < n_parts * G; j += kThreads) {
      s_pm[j] = __ldcg(partials.sums + m_offset + first_slot * G + j);
      s_pl[j] = __ldcg(partials.sums + l_offset + first_slot * G + j);
    }
    __syncthreads();
    if (threadIdx.x < G) {
      float mx = s_pm[threadIdx.x];
      for (int64_t p = 1; p < n_parts; ++p) mx = fmaxf(mx, s_pm[p * G + threadIdx.x]);
      s_max[threadIdx.x] = mx;
    }
    __syncthreads();
    for (int64_t j = threadIdx.x; j < n_parts * G; j += kThreads)
      s_pw[j] = exp2f(s_pm[j] - s_max[j % G]);
    __syncthreads();
    if (has_out) {
      float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      float total = 0.0f;
      for (int64_t pb = 0; pb < n_parts; pb += kMergeBatch) {
        if (pb > 0) {
#pragma unroll
          for (int bt = 0; bt < kMergeBatch; ++bt)
            if (pb + bt < n_parts) a[bt] = ldcg4(part_acc + (pb + bt) * G * head_dim);
        }
#pragma unroll
        for (int bt = 0; bt < kMergeBatch; ++bt) {
          if (pb + bt < n_parts) {
            const float wt = s_pw[(pb + bt) * G + og];
            total = fmaf(wt, s_pl[(pb + bt) * G + og], total);
            o = fma4(wt, a[bt], o);
          }
        }
      }
      float4 r = make_float4(o.x / total, o.y / total, o.z / total, o.w / total);
      const int64_t base = out_base(i) + og * head_dim + oi;
      if (gate) {  // sigmoid_gate's product, on the value it would read back
        const float4 g = ldg4(gate + base);
        r = make_float4(r.x * sigmoid(g.x), r.y * sigmoid(g.y), r.z * sigmoid(g.z),
                        r.w * sigmoid(g.w));
      }
      *reinterpret_cast<float4*>(out + base) = r;
    }
    __syncthreads();  // the merge buffers are free again
  }
}

// Position p's key row in a pool of rows of `row` elements: its block from the table, then its
// slot (the value row follows block_size rows later). -1 for a negative position (the caller's
// bug; better no write than one before the pool).
__device__ inline int64_t key_row_offset(const int32_t* block_table, int64_t block_size,
                                         int64_t row, int64_t p) {
  if (p < 0) return -1;
  const int64_t block = block_table[p / block_size];
  return (block * 2 * block_size + p % block_size) * row;
}

// One block per token; threads store the token's key and value rows (n_kv_heads · head_dim
// fp32 values) at its position, read from `positions`, in the pool's storage (bf16: rounded).
__global__ void kv_write_kernel(void* pool, bool bf16, const int32_t* block_table,
                                int64_t block_size, int64_t row, const int64_t* positions,
                                const float* k, const float* v) {
  pdl_wait();
  pdl_release();
  const int64_t t = blockIdx.x;
  const int64_t kd = key_row_offset(block_table, block_size, row, positions[t]);
  if (kd < 0) return;
  const int64_t vd = kd + block_size * row;
  for (int64_t i = threadIdx.x; i < row; i += kKvWriteThreads) {
    store_kv(pool, kd + i, k[t * row + i], bf16);
    store_kv(pool, vd + i, v[t * row + i], bf16);
  }
}

// kv_write_kernel for rows already in the pool's storage: `words` 32-bit words per row (a row
// of either storage is a whole number of them: head_dim is even, checked on the host).
__global__ void kv_write_stored_kernel(uint32_t* pool, const int32_t* block_table,
                                       int64_t block_size, int64_t words, const int64_t* positions,
                                       const uint32_t* k, const uint32_t* v) {
  pdl_wait();
  pdl_release();
  const int64_t t = blockIdx.x;
  const int64_t off = key_row_offset(block_table, block_size, words, positions[t]);
  if (off < 0) return;
  uint32_t* kd = pool + off;
  uint32_t* vd = kd + block_size * words;
  for (int64_t i = threadIdx.x; i < words; i += kKvWriteThreads) {
    kd[i] = k[t * words + i];
    vd[i] = v[t * words + i];
  }
}

void check_kv_view(const ops::KVLayerView& kv, const char* op) {
  if (kv.pool == nullptr) fail(op, ": KV pool is null");
  if (kv.block_size < 1 || kv.n_kv_heads < 1 || kv.head_dim < 1)
    fail(op, ": bad KV layout: block_size ", kv.block_size, ", n_kv_heads ", kv.n_kv_heads,
         ", head_dim ", kv.head_dim);
  ops::check_kv_dtype(kv.dtype, op);
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

}  // namespace

void kv_write(const ops::KVLayerView& kv, const int32_t* block_table, const int64_t* positions,
              int64_t n, const float* k, const float* v) {
  if (n < 0) fail("kv_write: bad token count ", n);
  if (n == 0) return;
  check_kv_view(kv, "kv_write");
  launch("kv_write", kv_write_kernel, grid_blocks(n, "kv_write"), kKvWriteThreads, 0, kv.pool,
         kv.dtype == DType::BF16, block_table, kv.block_size, kv.row_elements(), positions, k, v);
}

void kv_write_stored(const ops::KVLayerView& kv, const int32_t* block_table,
                     const int64_t* positions, int64_t n, const void* k, const void* v) {
  if (n < 0) fail("kv_write_stored: bad token count ", n);
  if (n == 0) return;
  check_kv_view(kv, "kv_write_stored");
  if (kv.row_bytes() % 4 != 0 || !aligned16(kv.pool) || !aligned16(k) || !aligned16(v))
    fail("kv_write_stored: rows of ", kv.row_bytes(),
         " bytes; rows must be whole 32-bit words and the pool, k and v 16-byte aligned");
  launch("kv_write_stored", kv_write_stored_kernel, grid_blocks(n, "kv_write_stored"),
         kKvWriteThreads, 0, static_cast<uint32_t*>(kv.pool), block_table, kv.block_size,
         static_cast<int64_t>(kv.row_bytes() / 4), positions, static_cast<const uint32_t*>(k),
         static_cast<const uint32_t*>(v));
}

namespace {

// The most queries a block serves, fixed: 0 lets the grid decide (the default), 1, 2 or 4 fix
// it whatever the grid (TANDEM_CUDA_ATTENTION_RUN at start-up, set_attention_runs; A/B timing
// and tests: no output bit changes).
int& attention_runs() {
  static int most = env_choice("TANDEM_CUDA_ATTENTION_RUN", {1, 2, kMaxRun});
  return most;
}

// attention_kernel's dynamic shared memory: one query's per-warp sums and the rows of W queries,
// each [chunk_heads, 128 · KV4] floats (KV4 = 2 for head_dim above 128).
size_t attention_smem(int W, int chunk_heads, bool wide) {
  return sizeof(float4) * (kWarps + W) * chunk_heads * 32 * (wide ? 2 : 1);
}

template <class T, int W>
auto attention_kernel_for(int chunk_heads, bool wide) {
  return chunk_heads == 4   ? (wide ? attention_kernel<2, 4, W, T> : attention_kernel<1, 4, W, T>)
         : chunk_heads == 2 ? (wide ? attention_kernel<2, 2, W, T> : attention_kernel<1, 2, W, T>)
                            : (wide ? attention_kernel<2, 1, W, T> : attention_kernel<1, 1, W, T>);
}

// attention() and attention_rows(): query t reads block_table, or with query_rows its row's
// table at tables + query_rows[t] * table_stride. Blocks serve groups of consecutive queries, a
// performance choice only: up to kMaxRun (or attention_runs()), a divisor of `window` (the queries
// of each row start at multiples of it; 0: one table, any group), and only while the grid keeps
// kRunWaves waves of blocks. A block serves its queries one after another, so in a grid of
// fewer waves than that it is the blocks' parallelism that a run would take away (a single
// row's window: 64-256 blocks; measured on the H100, BENCHMARKS.md).
void launch_attention(const char* op, const ops::KVLayerView& kv, const int32_t* block_table,
                      const int32_t* tables, int64_t table_stride, const int64_t* query_rows,
                      const int64_t* positions, int64_t n, int64_t position_bound, int64_t window,
                      const float* q, int64_t n_heads, float scale, float* out, const float* gate) {
  if (n < 0) fail(op, ": bad query count ", n);
  if (n == 0) return;
  check_kv_view(kv, op);
  if (position_bound < 1 || position_bound > (int64_t(1) << 31))
    fail(op, ": position bound ", position_bound, " is outside [1, 2^31]");
  const int64_t head_dim = kv.head_dim;
  if (head_dim > kMaxHeadDim || head_dim % 4 != 0)
    fail(op, ": head_dim ", head_dim, " is not a multiple of 4 up to the CUDA kernel's maximum ",
         kMaxHeadDim);
  if (n_heads < kv.n_kv_heads || n_heads % kv.n_kv_heads != 0)
    fail(op, ": ", n_heads, " query heads is not a multiple of ", kv.n_kv_heads, " kv heads");
  if (!aligned16(kv.pool) || !aligned16(q) || !aligned16(out) || (gate && !aligned16(gate)))
    fail(op, ": the KV pool, q, out and gate must be 16-byte aligned (float4 access)");

  const int64_t group = n_heads / kv.n_kv_heads;
  const int chunk_heads = group % 4 == 0 ? 4 : group % 2 == 0 ? 2 : 1;
  const int64_t n_chunks = n_heads / chunk_heads;
  const int64_t slots = max_partitions(position_bound);
  const int64_t floats_per_query = n_chunks * slots * chunk_heads * (head_dim + 2);
  if (floats_per_query > kScratchFloats)
    fail(op, ": position bound ", position_bound, " needs ", floats_per_query,
         " floats of partial results per query, over the ", kScratchFloats, " reserved");
  if (n_chunks > std::min<int64_t>(kMaxGridY, kMaxCounters))
    fail(op, ": ", n_heads, " query heads exceed the kernel's grid");
  const int64_t per_launch =
      std::min({kScratchFloats / floats_per_query, kMaxGridY, kMaxCounters / n_chunks});

  AttentionScratch& sc = current().unit<AttentionScratch>();
  const PartialResults partials{sc.sums.get<float>(kScratchFloats),
                                sc.done.get_zeroed<unsigned>(kMaxCounters)};
  // Softmax in base 2: exp(x · scale) = exp2(x · scale · log2(e)).
  const float score_scale = scale * 1.44269504088896340736f;
  const bool wide = head_dim > 128;
  // The launches with blocks of `run` queries (run <= W, the rows a block holds).
  auto launch_groups = [&](auto element, auto most, int64_t run) {
    using T = decltype(element);
    constexpr int W = decltype(most)::value;
    const auto kernel = attention_kernel_for<T, W>(chunk_heads, wide);
    const size_t smem = attention_smem(W, chunk_heads, wide);
    allow_dynamic_smem(kernel, smem, "attention (per-query sums)");
    const PagedKV<T> paged{static_cast<const T*>(kv.pool), block_table,
                           static_cast<uint32_t>(kv.block_size), kv.row_elements()};
    // Launches of equal size, of whole groups: a remainder of a few queries would be a launch
    // of its own whose blocks' latency chain costs as much as a full one.
    const int64_t per_most = per_launch / run * run;
    const int64_t per = ceil_div(ceil_div(n, ceil_div(n, per_most)), run) * run;
    for (int64_t first = 0; first < n; first += per) {
      const int64_t queries = std::min(per, n - first);
      const int64_t m_offset = queries * n_chunks * slots * chunk_heads * head_dim;
      const int64_t l_offset = m_offset + queries * n_chunks * slots * chunk_heads;
      const dim3 grid(static_cast<unsigned>(slots), static_cast<unsigned>(ceil_div(queries, run)),
                      static_cast<unsigned>(n_chunks));
      launch(op, kernel, grid, kThreads, smem, paged, tables, table_stride, query_rows, positions,
             position_bound, first, queries, static_cast<int>(run), n_heads, group, head_dim, q,
             score_scale, slots, m_offset, l_offset, out, gate, partials);
    }
  };
  // The group size (see above), then the kernel whose blocks hold that many queries' rows.
  auto choose_and_launch = [&](auto element) {
    using T = decltype(element);
    const int64_t resident = resident_blocks(attention_kernel_for<T, 1>(chunk_heads, wide),
                                             kThreads, attention_smem(1, chunk_heads, wide));
    const int fixed = attention_runs();
    int64_t run = std::min<int64_t>({fixed > 0 ? fixed : kMaxRun, per_launch, n});
    for (; run > 1; --run)
      if ((window == 0 || window % run == 0) &&
          (fixed > 0 || slots * ceil_div(n, run) * n_chunks >= kRunWaves * resident))
        break;
    if (run == 1)
      launch_groups(element, std::integral_constant<int, 1>{}, run);
    else if (run == 2)
      launch_groups(element, std::integral_constant<int, 2>{}, run);
    else
      launch_groups(element, std::integral_constant<int, kMaxRun>{}, run);
  };
  if (kv.dtype == DType::BF16)
    choose_and_launch(uint16_t{});
  else
    choose_and_launch(float{});
}

}  // namespace

void attention(const ops::KVLayerView& kv, const int32_t* block_table, const int64_t* positions,
               int64_t n, int64_t position_bound, const float* q, int64_t n_heads, float scale,
               float* out, const float* gate) {
  // One block table: any consecutive queries may share a block.
  launch_attention("attention", kv, block_table, nullptr, 0, nullptr, positions, n, position_bound,
                   0, q, n_heads, scale, out, gate);
}

void attention_rows(const ops::KVLayerView& kv, const int32_t* tables, int64_t table_stride,
                    const int64_t* query_rows, const int64_t* positions, int64_t n,
                    int64_t position_bound, int64_t window, const float* q, int64_t n_heads,
                    float scale, float* out, const float* gate) {
  if (tables == nullptr || query_rows == nullptr || table_stride < 0)
    fail("attention_rows: tables and query_rows are required, table_stride >= 0");
  if (window < 1) fail("attention_rows: window ", window, " is not a query count >= 1");
  launch_attention("attention_rows", kv, nullptr, tables, table_stride, query_rows, positions, n,
                   position_bound, window, q, n_heads, scale, out, gate);
}

void set_attention_runs(int most) {
  if (most != 0 && most != 1 && most != 2 && most != kMaxRun)
    fail("set_attention_runs: ", most, " queries per block (0, 1, 2 or 4)");
  attention_runs() = most;
}

TANDEM_CUDA_TRACE_UNIT(attention)

}  // namespace tandem::cuda
