// Token choice on the device, so a decode step copies token ids, not logits, to the host: the
// greedy argmax, and sampling at any temperature with the host sampler's exact result.
#include <Random123/philox.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>

#include "tandem/backend/cuda/check.cuh"
#include "tandem/backend/cuda/cuda_ops.h"
#include "tandem/backend/cuda/scratch.cuh"
#include "tandem/core/rng.h"
#include "tandem/core/sample_weights.h"

namespace tandem::cuda {

namespace {

constexpr int kArgmaxThreads = 256;
constexpr int64_t kSliceMin = 4096;  // logits per block at least (a slice)
constexpr int kArgmaxLoads = 16;     // a slice of up to this many logits per thread loads at once
constexpr int kMaxSlices = 64;       // blocks per row at most (<= kArgmaxThreads: one per thread)
constexpr int64_t kMaxRowsPerLaunch = 1024;

// Per-slice winners of the running launch ([row][slice], kMaxRowsPerLaunch x kMaxSlices) and
// per-row counts of finished slices ([kMaxRowsPerLaunch], zero when allocated). The last block
// of a row resets its count to 0, so every launch starts from zeros. In the context's scratch.
struct SliceWinners {
  float* best_v;
  int* best_i;
  int* bad;
  unsigned* slices_done;
};

struct ArgmaxScratch {
  DeviceScratch best_v, best_i, bad, slices_done;
};

// Of two candidates (value, index), the larger value; on equal values the lower index. Index -1
// means "none yet" and loses to any candidate. A total order on candidates: the winner of a set
// does not depend on the order it is scanned in.
__device__ inline void better(float& v, int& i, float v2, int i2) {
  if (i2 < 0) return;
  if (i < 0 || v2 > v || (v2 == v && i2 < i)) {
    v = v2;
    i = i2;
  }
}

// The best of the 32 lanes' candidates (the bad flags ORed), in every lane: a butterfly of `better`
// (a total order, so every lane ends with the same winner whatever the pairing).
__device__ inline void warp_best(float& v, int& i, int& bad) {
  for (int offset = 16; offset > 0; offset /= 2) {
    const float v2 = __shfl_xor_sync(0xffffffffu, v, offset);
    const int i2 = __shfl_xor_sync(0xffffffffu, i, offset);
    bad |= __shfl_xor_sync(0xffffffffu, bad, offset);
    better(v, i, v2, i2);
  }
}

constexpr int kArgmaxWarps = kArgmaxThreads / 32;

// The best of the block's candidates (v, i, bad per thread), returned to thread 0: each warp's
// winner through sv/si/sbad (kArgmaxWarps slots), then warp 0 over those. Every thread calls it.
__device__ inline void block_best(float& v, int& i, int& bad, float* sv, int* si, int* sbad) {
  warp_best(v, i, bad);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    sv[warp] = v;
    si[warp] = i;
    sbad[warp] = bad;
  }
  __syncthreads();
  if (warp == 0) {
    v = lane < kArgmaxWarps ? sv[lane] : -INFINITY;
    i = lane < kArgmaxWarps ? si[lane] : -1;
    bad = lane < kArgmaxWarps ? sbad[lane] : 0;
    warp_best(v, i, bad);
  }
}

// Grid (slices, rows): block (s, r) finds the winner of slice s of row r; the last block of a row
// to finish (an atomic count) picks the row's winner from the slice winners. `bad` flags a NaN or
// +inf anywhere in the row. The greedy token of a 248k vocabulary is thus read by ~60 blocks at
// once instead of one; a row of one slice (a small vocabulary: a draft step's) is decided by its
// block alone.
__global__ void __launch_bounds__(kArgmaxThreads)
    argmax_kernel(const float* __restrict__ logits, int64_t V, int64_t slice, int32_t* out,
                  SliceWinners g) {
  pdl_wait();
  pdl_release();
  __shared__ float sv[kArgmaxWarps];
  __shared__ int si[kArgmaxWarps];
  __shared__ int sbad[kArgmaxWarps];
  __shared__ bool last;
  const int64_t row = blockIdx.y;
  const float* l = logits + row * V;
  const int64_t lo = blockIdx.x * slice, hi = min(V, lo + slice);
  float v = -INFINITY;
  int idx = -1, bad = 0;
  auto take = [&](float x, int64_t j) {
    bad |= isnan(x) || x == INFINITY;
    if (x != -INFINITY) better(v, idx, x, static_cast<int>(j));
  };
  if (hi - lo <= kArgmaxLoads * kArgmaxThreads) {
    // Every slice of up to kSliceMin logits (a draft step's whole row, a 248k vocabulary's
    // slices): all of the thread's loads in flight at once, one round trip to L2 instead of one
    // per few. `better` is a total order, so the winner is the loop's.
    float xs[kArgmaxLoads];
#pragma unroll
    for (int k = 0; k < kArgmaxLoads; ++k) {
      const int64_t j = lo + threadIdx.x + static_cast<int64_t>(k) * kArgmaxThreads;
      xs[k] = j < hi ? l[j] : -INFINITY;
    }
#pragma unroll
    for (int k = 0; k < kArgmaxLoads; ++k)
      take(xs[k], lo + threadIdx.x + static_cast<int64_t>(k) * kArgmaxThreads);
  } else {
#pragma unroll 4
    for (int64_t j = lo + threadIdx.x; j < hi; j += kArgmaxThreads) take(l[j], j);
  }
  block_best(v, idx, bad, sv, si, sbad);
  if (gridDim.x == 1) {
    if (threadIdx.x == 0) out[row] = bad ? -1 : idx;
    return;
  }
  const int slot = static_cast<int>(row * gridDim.x + blockIdx.x);
  if (threadIdx.x == 0) {
    g.best_v[slot] = v;
    g.best_i[slot] = idx;
    g.bad[slot] = bad;
    __threadfence();  // the slice's winner is visible before the count says so
    last = atomicAdd(&g.slices_done[row], 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  // The row's last block: thread s loads slice s's winner (all at once), then the same reduction.
  __threadfence();
  const int q = static_cast<int>(row * gridDim.x + threadIdx.x);
  const bool have = threadIdx.x < gridDim.x;
  v = have ? __ldcg(&g.best_v[q]) : -INFINITY;
  idx = have ? __ldcg(&g.best_i[q]) : -1;
  bad = have ? __ldcg(&g.bad[q]) : 0;
  __syncthreads();  // every warp read its slots of the first reduction: they are reused
  block_best(v, idx, bad, sv, si, sbad);
  if (threadIdx.x == 0) {
    out[row] = bad ? -1 : idx;
    g.slices_done[row] = 0;
  }
}

// --- sample_rows -------------------------------------------------------------------------------
// Each logits row is sampled to what core/sampler.cpp's sample_token gives: the same integer
// weights (sample_weights.h), the same filters and the same canonical-order inverse CDF, so every
// token equals the host's. The host walks a sorted list; the device finds each boundary of the
// canonical order (top-k's k-th token, top-p's prefix end, the drawn token) by a radix descent
// over the tokens' keys (the logit's order key for top-k, the weight W for top-p and the draw):
// per level, a histogram of the next 11 bits of the key holding each bin's measure (1 per token
// for top-k, W otherwise) and token count, and a scan of the bins from the top to the one the
// target falls in. Integer sums make every histogram exact in any order. As soon as the chosen
// bin holds at most kListCap tokens, they are listed and sorted in one block, and the walk over
// the sorted list ends the search; a model's peaked rows get there at the first level, flat rows
// (random weights) at the second. Only a bin of one key shared by more tokens than a list takes
// falls to a pass that orders those ties by id.
//
// A row is spread over `slices` blocks (grid (slices, rows)), each owning a contiguous id range:
// a 248k vocabulary is read, and its weights computed, by ~60 multiprocessors instead of one.
// The blocks of a row meet at row barriers (a counter per row) between the phases: the scan
// (maximum, live tokens, bad values), top-k's boundary, the totals (whose pass also builds the
// first level of the weight descents), top-p's boundary, the draw's. Every block of a row takes
// the same branches (they depend only on row-wide sums, which every block reduces alike), so all
// meet at every barrier. The launch is cooperative: the blocks are resident together, so a
// barrier cannot wait on a block that has not started.

constexpr int kSampleThreads = 256;
constexpr int kSampleWarps = kSampleThreads / 32;
constexpr int kDigitBits = 11;
constexpr int kBins = 1 << kDigitBits;
constexpr int kBinsPerThread = kBins / kSampleThreads;
constexpr int64_t kSampleSliceMin = 4096;              // ids per block at least
constexpr int kMaxSampleSlices = 64;                   // blocks per row at most (<= kSampleThreads)
constexpr int kWeightKeyBits = kSampleWeightBits + 1;  // W <= 2^40
constexpr int kHistograms = 4;   // per row: the weights' first level, then three in rotation
constexpr int kListCap = kBins;  // tokens a boundary's list takes (the sort reuses the bins)
constexpr int kStages = 3;       // top-k, top-p, the draw: one list each
constexpr uint64_t kIdMask = (uint64_t{1} << 23) - 1;  // ids < kMaxSampleVocab = 2^23
static_assert(kBins % kSampleThreads == 0 && kMaxSampleSlices <= kSampleThreads);

// One slice's part of the row-wide sums, [row][kMaxSampleSlices]. Each field is written by the
// slice's block before a barrier and read by the row's blocks after it.
struct SliceSums {
  float max;
  int max_id;
  int bad;
  int first;
  unsigned long long live, total, kept, ties;
};

// One level of a descent for one row: each bin's measure and token count.
struct LevelHistogram {
  unsigned long long measure[kBins];
  unsigned count[kBins];
};

// Per row, zero between launches: the barrier's arrivals, the blocks that left (the last one
// out returns the counters to zero), top-k's last admitted id, and the tokens each stage's list
// received.
struct RowControl {
  unsigned arrived;
  unsigned exited;
  int k_id;
  unsigned listed[kStages];
};

struct SampleScratch {
  DeviceScratch sums, hist, lists, control;
};

struct SampleShared {
  // A level's measures, its running chunk's (low 20 bits and the rest: native 32-bit atomics,
  // where a 64-bit add to shared memory is a compare-and-swap loop), its counts; bins is also a
  // list's sort.
  unsigned long long bins[kBins];
  unsigned chunk_lo[kBins], chunk_hi[kBins];
  unsigned counts[kBins];
  unsigned long long warp_u64[kSampleWarps];
  float warp_v[kSampleWarps];
  int warp_i[kSampleWarps];
  unsigned long long pick_excl;  // a level's chosen bin: measure above it; a list's: through it
  unsigned long long pick_key;
  unsigned pick_count;
  int pick_bin;
  int pick_id;
};

// Where a block stands: its row and slice, its ids [lo, hi), the row's scratch, and what it has
// passed (barrier arrivals expected so far, histogram levels built).
struct SampleBlock {
  int slice, slices;
  int64_t lo, hi;
  SliceSums* sums;            // the row's [kMaxSampleSlices]
  LevelHistogram* hist;       // the row's [kHistograms]
  unsigned long long* lists;  // the row's [kStages][kListCap]
  RowControl* control;        // the row's
  unsigned epoch;
  int level;
};

__device__ inline unsigned load_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// All blocks of the row wait here until each has arrived; what any of them wrote before is then
// visible to all (read it with __ldcg: L1 may hold stale lines of another block's data).
__device__ void row_barrier(SampleBlock& b) {
  __syncthreads();
  b.epoch += static_cast<unsigned>(b.slices);
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(&b.control->arrived, 1u);
    while (load_acquire(&b.control->arrived) < b.epoch) __nanosleep(20);
    __threadfence();
  }
  __syncthreads();
}

// Sum of v over the block, returned to every thread. Uses sh.warp_u64.
__device__ unsigned long long block_sum(unsigned long long v, SampleShared& sh) {
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) sh.warp_u64[warp] = v;
  __syncthreads();
  unsigned long long t = 0;
  for (int w = 0; w < kSampleWarps; ++w) t += sh.warp_u64[w];
  return t;
}

// Minimum of v over the block, returned to every thread. Uses sh.warp_i.
__device__ int block_min(int v, SampleShared& sh) {
  for (int o = 16; o > 0; o /= 2) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if (threadIdx.x % 32 == 0) sh.warp_i[threadIdx.x / 32] = v;
  __syncthreads();
  int m = INT_MAX;
  for (int w = 0; w < kSampleWarps; ++w) m = min(m, sh.warp_i[w]);
  return m;
}

// The best candidate (value, id) of the block by better()'s order, returned to every thread.
// Uses sh.warp_v / sh.warp_i.
__device__ void block_best_candidate(float& v, int& i, SampleShared& sh) {
  for (int o = 16; o > 0; o /= 2)
    better(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
  __syncthreads();
  if (threadIdx.x % 32 == 0) {
    sh.warp_v[threadIdx.x / 32] = v;
    sh.warp_i[threadIdx.x / 32] = i;
  }
  __syncthreads();
  v = -INFINITY;
  i = -1;
  for (int w = 0; w < kSampleWarps; ++w) better(v, i, sh.warp_v[w], sh.warp_i[w]);
}

// Exclusive prefix sum of v over the threads in thread order. Uses sh.warp_u64.
__device__ unsigned long long block_exclusive_scan(unsigned long long v, SampleShared& sh) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  unsigned long long inc = v;
  for (int o = 1; o < 32; o *= 2) {
    const unsigned long long n = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc += n;
  }
  __syncthreads();
  if (lane == 31) sh.warp_u64[warp] = inc;
  __syncthreads();
  unsigned long long before = 0;
  for (int w = 0; w < warp; ++w) before += sh.warp_u64[w];
  return before + inc - v;
}

// Sum over the row's slices of one SliceSums field; every block gets the same value. `below`:
// only the slices before this block's.
template <class T>
__device__ unsigned long long slices_sum(const SampleBlock& b, T SliceSums::*field, bool below,
                                         SampleShared& sh) {
  const int n = below ? b.slice : b.slices;
  const int j = static_cast<int>(threadIdx.x);
  return block_sum(j < n ? static_cast<unsigned long long>(__ldcg(&(b.sums[j].*field))) : 0, sh);
}

// What a token is to the boundary searches: its logit key, its weight, and whether it is in the
// set being searched.
struct RowTokens {
  const float* logits;
  float max;
  double inv_t;
  // The top-k set: key > k_key, or key == k_key and id <= k_id (everything when k_key == 0 and
  // k_id == INT_MAX: key 0 is below every live logit's).
  uint32_t k_key;
  int k_id;
  uint64_t min_weight;

  __device__ bool live(float l) const { return l != -INFINITY; }
  __device__ bool in_top_k(uint32_t key, int id) const {
    return key > k_key || (key == k_key && id <= k_id);
  }
  __device__ uint64_t weight(float l) const { return sample_weight(l, max, inv_t); }
  // Kept for top-p and the draw: live, in the top-k set and not cut by min-p (*w: its weight).
  __device__ bool kept(float l, int i, uint64_t* w) const {
    if (!live(l) || !in_top_k(logit_order_key(l), i)) return false;
    *w = weight(l);
    return *w >= min_weight;
  }
};

// Histogram chunks: 8 walk steps of kSampleThreads tokens, so that no 32-bit half of a chunk's
// bin (each token adds under 2^20 to each) can overflow before the chunk is added into `bins`.
constexpr int kChunkSteps = 8;
static_assert(kChunkSteps * kSampleThreads < 4096);

// Adds w (<= 2^40) and one token to the running chunk's bin `bin` for each lane of the warp with
// bin >= 0. A warp whose lanes all share a bin (flat rows) adds once. All 32 lanes call it.
__device__ void add_to_bin(SampleShared& sh, int bin, unsigned long long w) {
  const unsigned lo = static_cast<unsigned>(w & 0xfffffu), hi = static_cast<unsigned>(w >> 20);
  const int bin0 = __shfl_sync(0xffffffffu, bin, 0);
  if (__all_sync(0xffffffffu, bin == bin0)) {
    if (bin0 < 0) return;
    const unsigned sum_lo = __reduce_add_sync(0xffffffffu, lo);
    const unsigned sum_hi = __reduce_add_sync(0xffffffffu, hi);
    if (threadIdx.x % 32 == 0) {
      atomicAdd(&sh.chunk_lo[bin0], sum_lo);
      atomicAdd(&sh.chunk_hi[bin0], sum_hi);
      atomicAdd(&sh.counts[bin0], 32u);
    }
    return;
  }
  if (bin < 0) return;
  atomicAdd(&sh.chunk_lo[bin], lo);
  atomicAdd(&sh.chunk_hi[bin], hi);
  atomicAdd(&sh.counts[bin], 1u);
}

// Adds the running chunk into the measures and starts a new one (between block barriers).
__device__ void fold_chunk(SampleShared& sh) {
  for (int i = threadIdx.x; i < kBins; i += kSampleThreads) {
    sh.bins[i] += (static_cast<unsigned long long>(sh.chunk_hi[i]) << 20) + sh.chunk_lo[i];
    sh.chunk_lo[i] = 0;
    sh.chunk_hi[i] = 0;
  }
}

__device__ void clear_bins(SampleShared& sh) {
  for (int i = threadIdx.x; i < kBins; i += kSampleThreads) {
    sh.bins[i] = 0;
    sh.chunk_lo[i] = 0;
    sh.chunk_hi[i] = 0;
    sh.counts[i] = 0;
  }
}

// Adds the block's shared histogram to the row's (after a barrier of the block).
__device__ void flush_bins(const SampleShared& sh, LevelHistogram* h) {
  for (int i = threadIdx.x; i < kBins; i += kSampleThreads) {
    if (sh.counts[i] == 0) continue;
    atomicAdd(&h->measure[i], sh.bins[i]);
    atomicAdd(&h->count[i], sh.counts[i]);
  }
}

// The block walks its slice kSampleThreads consecutive ids a step (thread j takes ids lo + j,
// lo + j + kSampleThreads, ...), every thread the same number of steps: visit(i) runs for every
// id, with i >= hi past the slice's end. With `chunks`, the block meets after every
// kChunkSteps steps and at the end to fold the histogram's chunk.
template <class Visit>
__device__ void walk_slice(const SampleBlock& b, Visit visit, SampleShared* chunks = nullptr) {
  const int64_t steps = (b.hi - b.lo + kSampleThreads - 1) / kSampleThreads;
  for (int64_t k = 0; k < steps; ++k) {
    visit(b.lo + k * kSampleThreads + threadIdx.x);
    if (chunks != nullptr && (k + 1) % kChunkSteps == 0 && k + 1 < steps) {
      __syncthreads();
      fold_chunk(*chunks);
      __syncthreads();
    }
  }
  if (chunks != nullptr) {
    __syncthreads();
    fold_chunk(*chunks);
    __syncthreads();
  }
}

// Zeroes this block's share of a row histogram (the row's blocks together clear all of it).
__device__ void clear_share(const SampleBlock& b, LevelHistogram* h) {
  const int lo = b.slice * kBins / b.slices, hi = (b.slice + 1) * kBins / b.slices;
  for (int i = lo + static_cast<int>(threadIdx.x); i < hi; i += kSampleThreads) {
    h->measure[i] = 0;
    h->count[i] = 0;
  }
}

// The bin of row histogram h where the cumulative measure, from the highest bin down, reaches
// rem (h's total is at least rem), the measure of the bins above it, and its token count. Every
// thread gets all three.
__device__ void pick_bin(const LevelHistogram* h, unsigned long long rem, SampleShared& sh,
                         int* bin, unsigned long long* above, unsigned* count) {
  // Thread j holds the kBinsPerThread bins from kBins - 1 - kBinsPerThread * j downwards.
  const int top = kBins - 1 - kBinsPerThread * static_cast<int>(threadIdx.x);
  unsigned long long w[kBinsPerThread], sum = 0;
#pragma unroll
  for (int j = 0; j < kBinsPerThread; ++j) {
    w[j] = __ldcg(&h->measure[top - j]);
    sum += w[j];
  }
  const unsigned long long excl = block_exclusive_scan(sum, sh);
  if (excl < rem && excl + sum >= rem) {
    unsigned long long cum = excl;
    for (int j = 0; j < kBinsPerThread; ++j) {
      if (cum + w[j] >= rem) {
        sh.pick_bin = top - j;
        sh.pick_excl = cum;
        sh.pick_count = __ldcg(&h->count[top - j]);
        break;
      }
      cum += w[j];
    }
  }
  __syncthreads();
  *bin = sh.pick_bin;
  *above = sh.pick_excl;
  *count = sh.pick_count;
  __syncthreads();  // pick_* are rewritten by the next pick
}

// One level of a descent: the row's histogram of digit (key >> shift) & digit_mask over the
// set's tokens whose key matches prefix under prefix_mask, complete once returned (the row met).
// key_of(l, i, &key, &w) says whether token i (logit l) is in the set and gives its key and
// measure. It takes rotating buffer (level % 3) and clears the next one, last read two barriers
// ago.
template <class KeyOf>
__device__ const LevelHistogram* build_level(SampleBlock& b, const RowTokens& t, uint64_t prefix,
                                             uint64_t prefix_mask, int shift, uint64_t digit_mask,
                                             KeyOf key_of, SampleShared& sh) {
  LevelHistogram* g = b.hist + 1 + b.level % 3;
  clear_share(b, b.hist + 1 + (b.level + 1) % 3);
  ++b.level;
  clear_bins(sh);
  __syncthreads();
  walk_slice(
      b,
      [&](int64_t i) {
        int bin = -1;
        uint64_t key = 0, w = 0;
        if (i < b.hi && key_of(t.logits[i], static_cast<int>(i), &key, &w) &&
            (key & prefix_mask) == prefix)
          bin = static_cast<int>((key >> shift) & digit_mask);
        add_to_bin(sh, bin, bin >= 0 ? w : 0);
      },
      &sh);
  flush_bins(sh, g);
  row_barrier(b);
  return g;
}

// The m-th token (1-based, in id order) of the row for which in_set(l, i) holds; the set has at
// least m tokens. Returns its id in the block whose slice holds it, -1 in the others. Thread j
// scans a contiguous chunk of the slice, so thread order is id order.
template <class InSet>
__device__ int nth_in_id_order(SampleBlock& b, const RowTokens& t, unsigned long long m,
                               InSet in_set, SampleShared& sh) {
  const int64_t chunk = (b.hi - b.lo + kSampleThreads - 1) / kSampleThreads;
  const int64_t lo = b.lo + threadIdx.x * chunk, hi = min(b.hi, lo + chunk);
  unsigned long long n = 0;
  for (int64_t i = lo; i < hi; ++i) n += in_set(t.logits[i], static_cast<int>(i)) ? 1 : 0;
  const unsigned long long in_slice = block_sum(n, sh);
  if (threadIdx.x == 0) b.sums[b.slice].ties = in_slice;
  row_barrier(b);
  const unsigned long long before = slices_sum(b, &SliceSums::ties, true, sh);
  if (!(before < m && before + in_slice >= m)) return -1;
  const unsigned long long excl = before + block_exclusive_scan(n, sh);
  if (excl < m && excl + n >= m) {
    unsigned long long seen = excl;
    for (int64_t i = lo; i < hi; ++i)
      if (in_set(t.logits[i], static_cast<int>(i)) && ++seen == m) {
        sh.pick_id = static_cast<int>(i);
        break;
      }
  }
  __syncthreads();
  return sh.pick_id;
}

// A boundary of the canonical order: the token (-1 in blocks that do not know it), its key, and
// the measure of the order through it (in every block).
struct Boundary {
  int id;
  uint64_t key;
  unsigned long long cum;
};

// The tokens of the set whose key matches prefix under prefix_mask (at most kListCap, `above`
// measured before them), listed by the row (list `stage`), sorted and walked in every block or
// (every_block false) in the row's first only: the first of them in canonical order whose
// cumulative measure reaches target.
template <class KeyOf>
__device__ Boundary list_boundary(SampleBlock& b, const RowTokens& t, uint64_t prefix,
                                  uint64_t prefix_mask, unsigned long long above,
                                  unsigned long long target, KeyOf key_of, bool unit, int stage,
                                  bool every_block, SampleShared& sh) {
  // Each token as (key << 23 | (kIdMask - id)): sorting these descending gives the canonical
  // order (keys have at most 41 bits). Warps append their tokens with one atomic each.
  unsigned long long* list = b.lists + stage * kListCap;
  unsigned* listed = &b.control->listed[stage];
  const int lane = static_cast<int>(threadIdx.x % 32);
  walk_slice(b, [&](int64_t i) {
    uint64_t key = 0, w = 0;
    const bool in = i < b.hi && key_of(t.logits[i], static_cast<int>(i), &key, &w) &&
                    (key & prefix_mask) == prefix;
    const unsigned ballot = __ballot_sync(0xffffffffu, in);
    if (ballot == 0) return;
    unsigned first_slot = 0;
    if (lane == 0) first_slot = atomicAdd(listed, static_cast<unsigned>(__popc(ballot)));
    first_slot = __shfl_sync(0xffffffffu, first_slot, 0);
    if (in) {
      const unsigned slot = first_slot + __popc(ballot & ((1u << lane) - 1u));
      if (slot < kListCap) list[slot] = (key << 23) | (kIdMask - static_cast<uint64_t>(i));
    }
  });
  row_barrier(b);
  Boundary r{-1, 0, 0};
  if (!every_block && b.slice != 0) return r;
  const int n = static_cast<int>(min(__ldcg(listed), static_cast<unsigned>(kListCap)));
  // A bitonic network over the next power of two, descending; the padding (0) sorts last and
  // measures nothing.
  unsigned long long* e = sh.bins;
  for (int j = threadIdx.x; j < kListCap; j += kSampleThreads) e[j] = j < n ? __ldcg(&list[j]) : 0;
  __syncthreads();
  int width = 1;
  while (width < n) width *= 2;
  for (int k = 2; k <= width; k *= 2) {
    for (int j = k / 2; j > 0; j /= 2) {
      for (int i = threadIdx.x; i < width; i += kSampleThreads) {
        const int partner = i ^ j;
        if (partner > i) {
          const unsigned long long x = e[i], y = e[partner];
          if ((i & k) == 0 ? x < y : x > y) {
            e[i] = y;
            e[partner] = x;
          }
        }
      }
      __syncthreads();
    }
  }
  constexpr int kPerThread = kListCap / kSampleThreads;
  const int first = kPerThread * static_cast<int>(threadIdx.x);
  auto measure = [&](unsigned long long c) -> unsigned long long {
    return c == 0 ? 0 : unit ? 1 : c >> 23;
  };
  unsigned long long sum = 0;
  for (int j = 0; j < kPerThread; ++j) sum += measure(e[first + j]);
  const unsigned long long excl = block_exclusive_scan(sum, sh);
  const unsigned long long rem = target - above;
  if (excl < rem && excl + sum >= rem) {
    unsigned long long cum = excl;
    for (int j = 0; j < kPerThread; ++j) {
      const unsigned long long c = e[first + j];
      cum += measure(c);
      if (cum >= rem) {
        sh.pick_id = static_cast<int>(kIdMask - (c & kIdMask));
        sh.pick_key = c >> 23;
        sh.pick_excl = above + cum;
        break;
      }
    }
  }
  __syncthreads();
  r = Boundary{sh.pick_id, sh.pick_key, sh.pick_excl};
  __syncthreads();
  return r;
}

// Which blocks must know a boundary's token: none (only its cumulative measure counts), the one
// that finds it, or all of them.
enum class TokenTo { Nobody, Finder, Everyone };

// The first token of the set's canonical order (key descending, id ascending; keys of `bits`
// bits, each token measuring its weight, or 1 where `unit`) whose cumulative measure reaches
// `target` (at most the set's): descent levels until the chosen bin holds at most kListCap
// tokens, then that bin's sorted list (list `stage`, sorted in every block or, for TokenTo::Finder,
// in the row's first). top_level: the set's first level, already complete, or null. A bin of one
// key with more tokens than a list takes is ordered by id.
template <class KeyOf>
__device__ Boundary find_boundary(SampleBlock& b, const RowTokens& t, int bits,
                                  unsigned long long target, KeyOf key_of, bool unit,
                                  const LevelHistogram* top_level, int stage, TokenTo token_to,
                                  SampleShared& sh) {
  uint64_t prefix = 0, prefix_mask = 0;
  unsigned long long above = 0;
  for (int hi = bits; hi > 0;) {
    const int shift = hi > kDigitBits ? hi - kDigitBits : 0;
    const uint64_t digit_mask = (uint64_t{1} << (hi - shift)) - 1;
    const LevelHistogram* h =
        hi == bits && top_level != nullptr
            ? top_level
            : build_level(b, t, prefix, prefix_mask, shift, digit_mask, key_of, sh);
    int bin;
    unsigned long long excl;
    unsigned count;
    pick_bin(h, target - above, sh, &bin, &excl, &count);
    prefix |= static_cast<uint64_t>(bin) << shift;
    prefix_mask |= digit_mask << shift;
    above += excl;
    if (count <= kListCap)
      return list_boundary(b, t, prefix, prefix_mask, above, target, key_of, unit, stage,
                           token_to != TokenTo::Finder, sh);
    hi = shift;
  }
  // One key, more tokens than a list takes: they follow in id order, each measuring `per`.
  const unsigned long long per = unit ? 1 : prefix;
  const unsigned long long m = (target - above + per - 1) / per;
  Boundary r{-1, prefix, above + m * per};
  if (token_to == TokenTo::Nobody) return r;
  r.id = nth_in_id_order(
      b, t, m,
      [&](float l, int i) {
        uint64_t key, w;
        return key_of(l, i, &key, &w) && key == prefix;
      },
      sh);
  if (token_to == TokenTo::Everyone) {
    if (r.id >= 0 && threadIdx.x == 0) b.control->k_id = r.id;
    row_barrier(b);
    r.id = __ldcg(&b.control->k_id);
  }
  return r;
}

// Grid (slices, rows). out[row] is written by one block of the row.
__device__ void sample_row_blocks(SampleBlock& b, const float* logits, const ops::SampleRow& p,
                                  int32_t* out, SampleShared& sh) {
  RowTokens t{logits, 0.0f, 0.0, 0u, INT_MAX, 0};
  const bool lead = b.slice == 0 && threadIdx.x == 0;  // writes the row's result where all agree

  // The scan: maximum (lowest id on ties), live tokens, NaN or +inf anywhere. The weights' first
  // histogram and the first rotating one are cleared for the phases after it.
  float best = -INFINITY;
  int best_i = -1;
  unsigned long long live = 0;
  int bad = 0;
  for (int64_t i = b.lo + threadIdx.x; i < b.hi; i += kSampleThreads) {
    const float x = t.logits[i];
    bad |= isnan(x) || x == INFINITY;
    if (x == -INFINITY) continue;
    ++live;
    better(best, best_i, x, static_cast<int>(i));
  }
  clear_share(b, b.hist);
  clear_share(b, b.hist + 1);
  block_best_candidate(best, best_i, sh);
  live = block_sum(live, sh);
  bad = static_cast<int>(block_sum(static_cast<unsigned long long>(bad), sh));
  if (threadIdx.x == 0) {
    b.sums[b.slice].max = best;
    b.sums[b.slice].max_id = best_i;
    b.sums[b.slice].live = live;
    b.sums[b.slice].bad = bad;
  }
  row_barrier(b);
  best = -INFINITY;
  best_i = -1;
  if (static_cast<int>(threadIdx.x) < b.slices)
    better(best, best_i, __ldcg(&b.sums[threadIdx.x].max), __ldcg(&b.sums[threadIdx.x].max_id));
  block_best_candidate(best, best_i, sh);
  live = slices_sum(b, &SliceSums::live, false, sh);
  const bool any_bad = slices_sum(b, &SliceSums::bad, false, sh) != 0;

  const bool valid_params = isfinite(p.temperature) && p.temperature >= 0.0f && p.top_k >= 0 &&
                            p.top_p > 0.0f && p.top_p <= 1.0f && p.min_p >= 0.0f && p.min_p <= 1.0f;
  if (any_bad || live == 0 || !valid_params) {
    if (lead) *out = -1;
    return;
  }
  if (p.temperature == 0.0f) {
    if (lead) *out = best_i;
    return;
  }
  t.max = best;
  t.inv_t = 1.0 / static_cast<double>(p.temperature);
  const uint64_t min_p_w = min_p_weight(p.min_p);
  t.min_weight = min_p_w > 0 ? min_p_w : 1;

  // top-k: the k-th token of the order by logit (descending, lowest ids first on ties).
  if (p.top_k > 0 && static_cast<unsigned long long>(p.top_k) < live) {
    const Boundary kth = find_boundary(
        b, t, 32, static_cast<unsigned long long>(p.top_k),
        [&](float l, int, uint64_t* key, uint64_t* w) {
          if (!t.live(l)) return false;
          *key = logit_order_key(l);
          *w = 1;
          return true;
        },
        true, nullptr, 0, TokenTo::Everyone, sh);
    t.k_key = static_cast<uint32_t>(kth.key);
    t.k_id = kth.id;
  }

  // The weight of the top-k set (top-p's total) and of what min-p keeps of it, the first token
  // of the canonical order (the lowest id of those weighing 2^40, the most any token can: the
  // maximum does, and min-p keeps them all), and the first level of the weight descents.
  {
    clear_bins(sh);
    __syncthreads();
    constexpr int kShift = kWeightKeyBits - kDigitBits;
    unsigned long long total = 0, kept_total = 0;
    int first = INT_MAX;
    walk_slice(
        b,
        [&](int64_t i) {
          int bin = -1;
          uint64_t w = 0;
          if (i < b.hi) {
            const float l = t.logits[i];
            if (t.live(l) && t.in_top_k(logit_order_key(l), static_cast<int>(i))) {
              w = t.weight(l);
              total += w;
              if (w >= t.min_weight) {
                kept_total += w;
                bin = static_cast<int>(w >> kShift);
                if (w == kSampleWeightOne) first = min(first, static_cast<int>(i));
              }
            }
          }
          add_to_bin(sh, bin, bin >= 0 ? w : 0);
        },
        &sh);
    total = block_sum(total, sh);
    kept_total = block_sum(kept_total, sh);
    first = block_min(first, sh);
    flush_bins(sh, b.hist);
    if (threadIdx.x == 0) {
      b.sums[b.slice].total = total;
      b.sums[b.slice].kept = kept_total;
      b.sums[b.slice].first = first;
    }
    row_barrier(b);
  }
  const unsigned long long total = slices_sum(b, &SliceSums::total, false, sh);
  unsigned long long kept_total = slices_sum(b, &SliceSums::kept, false, sh);
  const int first = block_min(
      static_cast<int>(threadIdx.x) < b.slices ? __ldcg(&b.sums[threadIdx.x].first) : INT_MAX, sh);
  auto kept_key = [&](float l, int i, uint64_t* key, uint64_t* w) {
    if (!t.kept(l, i, w)) return false;
    *key = *w;
    return true;
  };

  // top-p: the kept set shrinks to the shortest canonical prefix reaching ceil(top_p * total).
  // The draw below then stays inside it by itself: its target is at most the prefix's weight.
  // A prefix target of at most 2^40 ends at `first` (peaked rows skip the search).
  if (p.top_p < 1.0f) {
    const unsigned long long target = top_p_weight(p.top_p, total);
    if (kept_total >= target)
      kept_total = target <= kSampleWeightOne
                       ? kSampleWeightOne
                       : find_boundary(b, t, kWeightKeyBits, target, kept_key, false, b.hist, 1,
                                       TokenTo::Nobody, sh)
                             .cum;
  }

  // The draw: Philox at (seed, index, stream 0), as core/rng.cpp maps it.
  r123::Philox4x32_R<10> cipher;
  const r123::Philox4x32_R<10>::ctr_type ctr = {
      {static_cast<uint32_t>(p.index), static_cast<uint32_t>(p.index >> 32), kRngStreamToken, 0}};
  const r123::Philox4x32_R<10>::key_type key = {
      {static_cast<uint32_t>(p.seed), static_cast<uint32_t>(p.seed >> 32)}};
  const auto bits = cipher(ctr, key);
  const double u = uniform_from_words(bits.v[0], bits.v[1]);
  const unsigned long long target = draw_weight(u, kept_total);
  if (target <= kSampleWeightOne) {
    if (lead) *out = first;
    return;
  }
  const Boundary drawn =
      find_boundary(b, t, kWeightKeyBits, target, kept_key, false, b.hist, 2, TokenTo::Finder, sh);
  if (drawn.id >= 0 && threadIdx.x == 0) *out = drawn.id;
}

__global__ void __launch_bounds__(kSampleThreads, 3)
    sample_kernel(const float* __restrict__ logits, int64_t V, const ops::SampleRow* params,
                  int32_t* out, SliceSums* sums, LevelHistogram* hist, unsigned long long* lists,
                  RowControl* control) {
  pdl_wait();
  pdl_release();
  __shared__ SampleShared sh;
  const int64_t row = blockIdx.y;
  const int64_t slice = (V + gridDim.x - 1) / gridDim.x;
  SampleBlock b{static_cast<int>(blockIdx.x),
                static_cast<int>(gridDim.x),
                min(V, blockIdx.x * slice),
                min(V, (blockIdx.x + 1) * slice),
                sums + row * kMaxSampleSlices,
                hist + row * kHistograms,
                lists + row * kStages * kListCap,
                control + row,
                0u,
                0};
  sample_row_blocks(b, logits + row * V, params[row], out + row, sh);
  // The last block of the row to leave returns its counters to zero for the next launch: every
  // other block has passed its last barrier by then.
  __syncthreads();
  if (threadIdx.x == 0 && atomicAdd(&b.control->exited, 1u) == gridDim.x - 1) {
    b.control->arrived = 0;
    b.control->exited = 0;
    for (int s = 0; s < kStages; ++s) b.control->listed[s] = 0;
  }
}

}  // namespace

void argmax_rows(const float* logits, int64_t rows, int64_t V, int32_t* out) {
  if (rows == 0) return;
  if (V <= 0 || V > 0x7fffffff) fail("argmax_rows: vocabulary ", V, " out of range");
  const int64_t slices = std::min<int64_t>(kMaxSlices, ceil_div(V, kSliceMin));
  const int64_t slice = ceil_div(V, slices);
  ArgmaxScratch& sc = current().unit<ArgmaxScratch>();
  constexpr int64_t kSlots = kMaxRowsPerLaunch * kMaxSlices;
  const SliceWinners winners{sc.best_v.get<float>(kSlots), sc.best_i.get<int>(kSlots),
                             sc.bad.get<int>(kSlots),
                             sc.slices_done.get_zeroed<unsigned>(kMaxRowsPerLaunch)};
  for (int64_t r0 = 0; r0 < rows; r0 += kMaxRowsPerLaunch) {
    const int64_t n = std::min(kMaxRowsPerLaunch, rows - r0);
    launch("argmax_rows", argmax_kernel,
           dim3(static_cast<unsigned>(slices), static_cast<unsigned>(n)), kArgmaxThreads, 0,
           logits + r0 * V, V, slice, out + r0, winners);
  }
}

void sample_rows(const float* logits, int64_t rows, int64_t V, const ops::SampleRow* params,
                 int32_t* out) {
  if (rows == 0) return;
  if (V <= 0 || V > kMaxSampleVocab)
    fail("sample_rows: vocabulary of ", V, " is outside the sampler's 1..", kMaxSampleVocab);
  // Rows per launch: all blocks must be resident at once (the row barriers), so a launch takes
  // at most what the GPU holds, and spreads each row over as many blocks as fit.
  constexpr int64_t kMaxRows = 256;
  const int64_t resident = resident_blocks(sample_kernel, kSampleThreads, 0);
  const int64_t most_slices =
      std::clamp<int64_t>(ceil_div(V, kSampleSliceMin), 1, kMaxSampleSlices);
  const int64_t chunk = std::min({rows, resident, kMaxRows});
  const int64_t slices = std::clamp<int64_t>(resident / chunk, 1, most_slices);
  SampleScratch& sc = current().unit<SampleScratch>();
  SliceSums* sums = sc.sums.get<SliceSums>(chunk * kMaxSampleSlices);
  LevelHistogram* hist = sc.hist.get<LevelHistogram>(chunk * kHistograms);
  unsigned long long* lists = sc.lists.get<unsigned long long>(chunk * kStages * kListCap);
  RowControl* control = sc.control.get_zeroed<RowControl>(chunk);
  for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
    const int64_t n = std::min(chunk, rows - r0);
    launch_cooperative(
        "sample_rows", sample_kernel, dim3(static_cast<unsigned>(slices), static_cast<unsigned>(n)),
        kSampleThreads, 0, logits + r0 * V, V, params + r0, out + r0, sums, hist, lists, control);
  }
}

TANDEM_CUDA_TRACE_UNIT(sampling)

}  // namespace tandem::cuda
