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

// The best of the block's kArgmaxThreads candidates (sv, si; the bad flags ORed), left in slot 0
// by a halving tree with a barrier per level. Every thread calls it once its candidate is stored.
__device__ inline void block_best(float* sv, int* si, int* sbad) {
  for (int width = kArgmaxThreads / 2; width > 0; width /= 2) {
    if (threadIdx.x < width) {
      float a = sv[threadIdx.x];
      int ai = si[threadIdx.x];
      better(a, ai, sv[threadIdx.x + width], si[threadIdx.x + width]);
      sv[threadIdx.x] = a;
      si[threadIdx.x] = ai;
      sbad[threadIdx.x] |= sbad[threadIdx.x + width];
    }
    __syncthreads();
  }
}

// Grid (slices, rows): block (s, r) finds the winner of slice s of row r; the last block of a row
// to finish (an atomic count) picks the row's winner from the slice winners. `bad` flags a NaN or
// +inf anywhere in the row. The greedy token of a 248k vocabulary is thus read by ~60 blocks at
// once instead of one.
__global__ void __launch_bounds__(kArgmaxThreads)
    argmax_kernel(const float* __restrict__ logits, int64_t V, int64_t slice, int32_t* out,
                  SliceWinners g) {
  pdl_wait();
  pdl_release();
  __shared__ float sv[kArgmaxThreads];
  __shared__ int si[kArgmaxThreads];
  __shared__ int sbad[kArgmaxThreads];
  __shared__ bool last;
  const int64_t row = blockIdx.y;
  const float* l = logits + row * V;
  const int64_t lo = blockIdx.x * slice, hi = min(V, lo + slice);
  float v = -INFINITY;
  int idx = -1, bad = 0;
#pragma unroll 4
  for (int64_t j = lo + threadIdx.x; j < hi; j += kArgmaxThreads) {
    const float x = l[j];
    bad |= isnan(x) || x == INFINITY;
    if (x != -INFINITY) better(v, idx, x, static_cast<int>(j));
  }
  sv[threadIdx.x] = v;
  si[threadIdx.x] = idx;
  sbad[threadIdx.x] = bad;
  __syncthreads();
  block_best(sv, si, sbad);
  const int slot = static_cast<int>(row * gridDim.x + blockIdx.x);
  if (threadIdx.x == 0) {
    g.best_v[slot] = sv[0];
    g.best_i[slot] = si[0];
    g.bad[slot] = sbad[0];
    __threadfence();  // the slice's winner is visible before the count says so
    last = atomicAdd(&g.slices_done[row], 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  // The row's last block: thread s loads slice s's winner (all at once), then the same tree.
  __threadfence();
  const int q = static_cast<int>(row * gridDim.x + threadIdx.x);
  const bool have = threadIdx.x < gridDim.x;
  sv[threadIdx.x] = have ? __ldcg(&g.best_v[q]) : -INFINITY;
  si[threadIdx.x] = have ? __ldcg(&g.best_i[q]) : -1;
  sbad[threadIdx.x] = have ? __ldcg(&g.bad[q]) : 0;
  __syncthreads();
  block_best(sv, si, sbad);
  if (threadIdx.x == 0) {
    out[row] = sbad[0] ? -1 : si[0];
    g.slices_done[row] = 0;
  }
}

// --- sample_rows -------------------------------------------------------------------------------
// One block per logits row computes what core/sampler.cpp's sample_token computes: the same
// integer weights (sample_weights.h), the same filters and the same canonical-order inverse CDF,
// so every token equals the host's. The host walks a sorted list; the block instead finds each
// boundary of the canonical order (top-k's k-th logit, top-p's prefix end, the drawn token) by a
// radix descent: per level, a histogram of the next 11 bits of the key, weighted by what the
// boundary counts (1 per token for top-k, the weight W for top-p and the draw), a scan of the
// bins from the top to find the one the target falls in, and the next level inside that bin.
// Integer sums make every histogram exact in any order. Tokens that share the boundary key are
// ordered by id with one more pass. Each pass reads the row again (the logits sit in L2 after
// the first) and recomputes W: cheaper than storing 8 bytes per token.

constexpr int kSampleThreads = 1024;
constexpr int kSampleWarps = kSampleThreads / 32;
constexpr int kDigitBits = 11;
constexpr int kBins = 1 << kDigitBits;
constexpr int kBinsPerThread = kBins / kSampleThreads;
static_assert(kBinsPerThread == 2, "the bin scan gives each thread two bins");

struct SampleShared {
  unsigned long long bins[kBins];
  unsigned long long warp_u64[kSampleWarps];
  float warp_v[kSampleWarps];
  int warp_i[kSampleWarps];
  unsigned long long pick_excl;  // a descent level's chosen bin: weight above it
  int pick_bin;
  int pick_id;
};

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

// What a token is to the boundary searches: its logit key, its weight, and whether it is in the
// set being searched.
struct RowTokens {
  const float* logits;
  int64_t V;
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
};

// A radix descent: the largest key K (of `bits` bits) such that the tokens of the set with key
// >= K weigh at least `target` (the set must weigh at least that), and the weight of those with
// key > K. key_of(l, i, &key, &w) says whether token i (logit l) is in the set and gives its key
// and weight.
template <class KeyOf>
__device__ void descend(const RowTokens& t, int bits, unsigned long long target, KeyOf key_of,
                        SampleShared& sh, uint64_t* key_out, unsigned long long* above_out) {
  uint64_t prefix = 0, prefix_mask = 0;
  unsigned long long above = 0;
  for (int hi = bits; hi > 0;) {
    const int shift = hi > kDigitBits ? hi - kDigitBits : 0;
    const uint64_t digit_mask = (uint64_t{1} << (hi - shift)) - 1;
    for (int b = threadIdx.x; b < kBins; b += kSampleThreads) sh.bins[b] = 0;
    __syncthreads();
    // A thread's tokens often share a bin (most of a flat row's weights sit in the lowest one):
    // it adds runs of one bin in registers and flushes when the bin changes.
    int run_bin = -1;
    unsigned long long run = 0;
    for (int64_t i = threadIdx.x; i < t.V; i += kSampleThreads) {
      uint64_t key, w;
      if (!key_of(t.logits[i], static_cast<int>(i), &key, &w)) continue;
      if ((key & prefix_mask) != prefix) continue;
      const int bin = static_cast<int>((key >> shift) & digit_mask);
      if (bin != run_bin) {
        if (run_bin >= 0 && run > 0) atomicAdd(&sh.bins[run_bin], run);
        run_bin = bin;
        run = 0;
      }
      run += w;
    }
    if (run_bin >= 0 && run > 0) atomicAdd(&sh.bins[run_bin], run);
    __syncthreads();
    // Bins from the highest digit down: thread j holds the (2j)th and (2j+1)th from the top.
    const int b0 = kBins - 1 - kBinsPerThread * static_cast<int>(threadIdx.x), b1 = b0 - 1;
    const unsigned long long w0 = sh.bins[b0], w1 = sh.bins[b1];
    const unsigned long long excl = block_exclusive_scan(w0 + w1, sh);
    const unsigned long long rem = target - above;
    if (excl < rem && excl + w0 + w1 >= rem) {
      const bool first = excl + w0 >= rem;
      sh.pick_bin = first ? b0 : b1;
      sh.pick_excl = first ? excl : excl + w0;
    }
    __syncthreads();
    prefix |= static_cast<uint64_t>(sh.pick_bin) << shift;
    prefix_mask |= digit_mask << shift;
    above += sh.pick_excl;
    __syncthreads();  // pick_* are rewritten by the next level
    hi = shift;
  }
  *key_out = prefix;
  *above_out = above;
}

// The id of the m-th token (1-based, in id order) for which in_set(l, i) holds; the set has at
// least m tokens. Thread j scans ids [j * chunk, (j + 1) * chunk).
template <class InSet>
__device__ int nth_in_id_order(const RowTokens& t, unsigned long long m, InSet in_set,
                               SampleShared& sh) {
  const int64_t chunk = (t.V + kSampleThreads - 1) / kSampleThreads;
  const int64_t lo = threadIdx.x * chunk, hi = min(t.V, lo + chunk);
  unsigned long long n = 0;
  for (int64_t i = lo; i < hi; ++i) n += in_set(t.logits[i], static_cast<int>(i)) ? 1 : 0;
  const unsigned long long excl = block_exclusive_scan(n, sh);
  if (excl < m && excl + n >= m) {
    unsigned long long seen = excl;
    for (int64_t i = lo; i < hi; ++i)
      if (in_set(t.logits[i], static_cast<int>(i)) && ++seen == m) {
        sh.pick_id = static_cast<int>(i);
        break;
      }
  }
  __syncthreads();
  const int id = sh.pick_id;
  __syncthreads();
  return id;
}

// The first token of the canonical order (weight descending, id ascending) among those kept
// (live, in the top-k set, weight >= min_weight) whose cumulative weight reaches `target`
// (<= the kept weight); *cum_out: the cumulative weight through it.
__device__ int canonical_boundary(const RowTokens& t, unsigned long long target, SampleShared& sh,
                                  unsigned long long* cum_out) {
  auto kept = [&](float l, int i, uint64_t* key, uint64_t* w) {
    if (!t.live(l) || !t.in_top_k(logit_order_key(l), i)) return false;
    *w = t.weight(l);
    *key = *w;
    return *w >= t.min_weight;
  };
  uint64_t theta;
  unsigned long long above;
  descend(t, kSampleWeightBits + 1, target, kept, sh, &theta, &above);
  // Tokens weighing exactly theta follow in id order; the m-th reaches the target.
  const unsigned long long m = (target - above + theta - 1) / theta;
  *cum_out = above + m * theta;
  return nth_in_id_order(
      t, m,
      [&](float l, int i) {
        uint64_t key, w;
        return kept(l, i, &key, &w) && w == theta;
      },
      sh);
}

__global__ void __launch_bounds__(kSampleThreads)
    sample_kernel(const float* __restrict__ logits, int64_t V, const ops::SampleRow* params,
                  int32_t* out) {
  pdl_wait();
  pdl_release();
  __shared__ SampleShared sh;
  const int64_t row = blockIdx.x;
  const ops::SampleRow p = params[row];
  RowTokens t{logits + row * V, V, 0.0f, 0.0, 0u, INT_MAX, 0};

  // The scan: maximum (lowest id on ties), live tokens, NaN or +inf anywhere.
  float best = -INFINITY;
  int best_i = -1;
  unsigned long long live = 0, bad = 0;
  for (int64_t i = threadIdx.x; i < V; i += kSampleThreads) {
    const float x = t.logits[i];
    bad |= isnan(x) || x == INFINITY;
    if (x == -INFINITY) continue;
    ++live;
    if (best_i < 0 || x > best) {  // ascending ids within a thread: the first maximum is kept
      best = x;
      best_i = static_cast<int>(i);
    }
  }
  for (int o = 16; o > 0; o /= 2) {
    const float v2 = __shfl_xor_sync(0xffffffffu, best, o);
    const int i2 = __shfl_xor_sync(0xffffffffu, best_i, o);
    if (i2 >= 0 && (best_i < 0 || v2 > best || (v2 == best && i2 < best_i))) {
      best = v2;
      best_i = i2;
    }
  }
  if (threadIdx.x % 32 == 0) {
    sh.warp_v[threadIdx.x / 32] = best;
    sh.warp_i[threadIdx.x / 32] = best_i;
  }
  live = block_sum(live, sh);
  bad = block_sum(bad, sh);  // (its barriers also publish warp_v / warp_i)
  best = -INFINITY;
  best_i = -1;
  for (int w = 0; w < kSampleWarps; ++w) {
    const float v2 = sh.warp_v[w];
    const int i2 = sh.warp_i[w];
    if (i2 >= 0 && (best_i < 0 || v2 > best || (v2 == best && i2 < best_i))) {
      best = v2;
      best_i = i2;
    }
  }
  const bool valid_params = isfinite(p.temperature) && p.temperature >= 0.0f && p.top_k >= 0 &&
                            p.top_p > 0.0f && p.top_p <= 1.0f && p.min_p >= 0.0f && p.min_p <= 1.0f;
  if (bad || live == 0 || !valid_params) {
    if (threadIdx.x == 0) out[row] = -1;
    return;
  }
  if (p.temperature == 0.0f) {
    if (threadIdx.x == 0) out[row] = best_i;
    return;
  }
  t.max = best;
  t.inv_t = 1.0 / static_cast<double>(p.temperature);
  const uint64_t min_p_w = min_p_weight(p.min_p);
  t.min_weight = min_p_w > 0 ? min_p_w : 1;

  // top-k: the k-th largest logit key, then the ties of that key that fit, lowest ids first.
  if (p.top_k > 0 && static_cast<unsigned long long>(p.top_k) < live) {
    uint64_t k_key;
    unsigned long long above;
    descend(
        t, 32, static_cast<unsigned long long>(p.top_k),
        [&](float l, int, uint64_t* key, uint64_t* w) {
          if (!t.live(l)) return false;
          *key = logit_order_key(l);
          *w = 1;
          return true;
        },
        sh, &k_key, &above);
    const uint32_t kk = static_cast<uint32_t>(k_key);
    t.k_id = nth_in_id_order(
        t, static_cast<unsigned long long>(p.top_k) - above,
        [&](float l, int) { return t.live(l) && logit_order_key(l) == kk; }, sh);
    t.k_key = kk;
  }

  // The weight of the top-k set (top-p's total) and of what min-p keeps of it, and the first
  // token of the canonical order: the lowest id of those weighing 2^40, the most any token can
  // (the maximum does; min-p keeps them all).
  unsigned long long total = 0, kept_total = 0;
  int first = INT_MAX;
  for (int64_t i = threadIdx.x; i < V; i += kSampleThreads) {
    const float l = t.logits[i];
    if (!t.live(l) || !t.in_top_k(logit_order_key(l), static_cast<int>(i))) continue;
    const uint64_t w = t.weight(l);
    total += w;
    if (w >= t.min_weight) kept_total += w;
    if (w == kSampleWeightOne) first = min(first, static_cast<int>(i));
  }
  total = block_sum(total, sh);
  kept_total = block_sum(kept_total, sh);
  first = block_min(first, sh);

  // top-p: the kept set shrinks to the shortest canonical prefix reaching ceil(top_p * total).
  // The draw below then stays inside it by itself: its target is at most the prefix's weight.
  // A prefix target of at most 2^40 ends at `first` (peaked rows skip the descents).
  if (p.top_p < 1.0f) {
    const unsigned long long target = top_p_weight(p.top_p, total);
    if (kept_total >= target) {
      if (target <= kSampleWeightOne)
        kept_total = kSampleWeightOne;
      else
        canonical_boundary(t, target, sh, &kept_total);
    }
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
  unsigned long long cum;
  const int token = target <= kSampleWeightOne ? first : canonical_boundary(t, target, sh, &cum);
  if (threadIdx.x == 0) out[row] = token;
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
  constexpr int64_t kMaxGrid = 0x7fffffff;
  for (int64_t r0 = 0; r0 < rows; r0 += kMaxGrid) {
    const int64_t n = std::min(kMaxGrid, rows - r0);
    launch("sample_rows", sample_kernel, dim3(static_cast<unsigned>(n)), kSampleThreads, 0,
           logits + r0 * V, V, params + r0, out + r0);
  }
}

TANDEM_CUDA_TRACE_UNIT(sampling)

}  // namespace tandem::cuda
