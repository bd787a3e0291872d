// Mixture-of-experts MLP on the GPU (ops::moe_mlp_add): routing, grouping, the experts' grouped
// products and the per-token combination, all on the stream (no host round trip, so a decode
// step with MoE layers is captured into a CUDA graph like any other).
//
//   1. router logits [T, E] = x · routerᵀ (cuda::linear); with the shared expert's gate stacked
//      as the router's last row (stack_moe_experts), [T, E + 1], the gate logits in column E.
//      Given the input norm (ops::MoeInputNorm), the router normalises a single token as it
//      stages it and writes the normalised row for the experts (linear_split_keeping_norm), else
//      rms_norm runs first;
//   2. moe_route_kernel: one warp per token, softmax in fp32, the top k by probability (the
//      lower expert id on equal probabilities), renormalised — route_top_k's rule (TopKRule); or,
//      for GLM-5's mixtures, route_noaux_tc's rule (NoauxRule);
//   3. moe_group_kernel: the T·k (token, choice) pairs grouped by expert, experts ascending and
//      pairs in order within an expert ("pair rows"), by counts per run of pairs and block-wide
//      scans; up to 32 tokens, routing and grouping are one block (moe_route_group_kernel), and
//      up to 64 pairs (decode of a few rows) one warp groups them;
//   4. linear_grouped multiplies each expert's pair rows (read from the tokens' rows through
//      token_of) by its gate/up rows [2I, H] with silu(gate) · up in the epilogue, then the
//      activations by each expert's down [H, I];
//   5. the shared expert over all tokens: where it has the routed experts' shape
//      (MoeWeights::shared_in_groups), one more group of step 4's two launches, its T rows after
//      the pair rows; else gate and up as one product with the SwiGLU in its epilogue
//      (gate_up_swiglu, when stacked in its pair layout), then down;
//   6. moe_combine_kernel: per token and 256 columns, its experts' outputs weighted and summed in
//      ascending expert id, then + sigmoid(gate) · shared (+ shared where it has no gate: GLM-5),
//      added to y (cpu::moe_mlp_add's order).
//   At one token (decode at batch 1) steps 2-4's routing and gate/up product are one kernel
//   (moe_token_gate_up_kernel: every block routes the token itself, a producer warp streams the
//   chosen experts' rows), and step 4's down product and step 6 another (moe_token_down_kernel:
//   its blocks own output columns of every expert the token chose, with the weights streamed into
//   shared memory before the gate/up product has finished).
//
// Batch invariance: a pair row's products are the ones cuda::linear of its expert computes for
// that row alone (linear_grouped), whichever other rows share the expert; the routing's
// reductions have an order fixed by E, and the combination's depends on the token's own routing
// only. So speculation's verify windows give decoding's bits. The stacked router and shared
// gate/up give the separate products' bits (gate_up_swiglu's epilogue is swiglu's, and a
// column's arithmetic in cuda::linear depends on K and on the warps per block, which are the
// same for the stacked and the separate weights below 8192 rows: Qwen3.5's are far below).
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "tandem/backend/cuda/activation.cuh"
#include "tandem/backend/cuda/bulk_copy.cuh"
#include "tandem/backend/cuda/check.cuh"
#include "tandem/backend/cuda/cuda_ops.h"
#include "tandem/backend/cuda/linear_mma.cuh"
#include "tandem/backend/cuda/row_norm.cuh"
#include "tandem/backend/cuda/scratch.cuh"
#include "tandem/core/env_switch.h"
#include "tandem/core/error.h"

namespace tandem::cuda {

namespace {

constexpr int kRouteWarps = 4;            // tokens per routing block, one warp each
constexpr int kMaxExperts = 32 * 32;      // a routing lane holds up to 32 experts' values
constexpr int kGroupThreads = 1024;       // one thread per expert in the grouping's scan
constexpr int kGroupSmem = 48 << 10;      // the grouping's per-chunk counts, at most
constexpr int kCombineThreads = 256;      // hidden-size columns per combining block
constexpr int kMaxTopK = 32;              // a token's choices fit in one warp
constexpr int64_t kSharedGroupRows = 32;  // tokens up to which the shared expert is a group
static_assert(kMaxExperts <= kGroupThreads, "the grouping scans one expert per thread");

// (probability, expert) ordered as route_top_k orders them: larger probability first, the lower
// id on a tie. Ties between equal keys never arise (ids differ).
struct Candidate {
  float p;
  int e;
};
__device__ __forceinline__ bool before(const Candidate& a, const Candidate& b) {
  return a.p > b.p || (a.p == b.p && a.e < b.e);
}

// A butterfly: every lane ends with the warp's best (`before` is a total order, so the result
// does not depend on the pairing).
__device__ __forceinline__ Candidate warp_best(Candidate c) {
  for (int offset = 16; offset > 0; offset /= 2) {
    Candidate o{__shfl_xor_sync(0xffffffffu, c.p, offset),
                __shfl_xor_sync(0xffffffffu, c.e, offset)};
    if (before(o, c)) c = o;
  }
  return c;
}

// warp_best for candidates that are never NaN nor -0 (route_token's probabilities): the best
// probability by one warp reduction over order-preserving keys, then the lowest expert among the
// lanes holding it by another. Two instructions where the butterfly takes ten shuffles: the
// top-k's rounds are a chain of these at one token.
__device__ __forceinline__ Candidate warp_best_reduced(Candidate c) {
  const unsigned u = __float_as_uint(c.p);
  const unsigned key = u & 0x80000000u ? ~u : u | 0x80000000u;  // ascending with c.p
  const unsigned best = __reduce_max_sync(0xffffffffu, key);
  const int e = static_cast<int>(
      __reduce_min_sync(0xffffffffu, key == best ? static_cast<unsigned>(c.e) : 0xffffffffu));
  return {__uint_as_float(best & 0x80000000u ? best & 0x7fffffffu : ~best), e};
}

// Grid: ceil(T / kRouteWarps) blocks of kRouteWarps warps; warp w of block b routes token
// b·kRouteWarps + w, whose logits start at logits + t·ld. Lane l holds the values of experts
// l + 32j, j < PerLane (E <= 32·PerLane; PerLane is chosen from E alone).
// Softmax in fp32: the max and the sum are each lane's values in ascending j, then a butterfly
// over the lanes (xor 16, 8, .., 1), which leaves the same bits in every lane (a + b = b + a at
// each stage); the order depends on E only, never on T. The top k are chosen one at a time,
// each the best remaining candidate under `before` (route_top_k's rule), and renormalised by
// their sum in the order chosen, as route_top_k sums them.
// A NaN probability counts as -1, below every probability, so k distinct experts are always
// chosen (the grouping relies on it: no expert gets more rows than there are tokens).
// route_top_k for token t, by one whole warp. Returns lane j's choice j (j < k), else INT_MAX.
// Writes ids and weights unless ids is null (the one-token kernels' blocks other than the first
// route only to know the experts). The logits are read through L2 (__ldcg): a kernel that routes
// before its wait (moe_token_down_kernel) must never see a stale L1 line of the previous layer's.
struct TopKRule {
  bool renormalise;
};
template <int PerLane>
__device__ __forceinline__ int route_token(const TopKRule& rule, const float* __restrict__ logits,
                                           int64_t ld, int t, int E, int k,
                                           int32_t* __restrict__ ids, float* __restrict__ weights) {
  // Below every probability and below a NaN's -1: experts past E, and the ones already chosen.
  constexpr float kOut = -2.0f;
  const bool renormalise = rule.renormalise;
  const int lane = threadIdx.x % 32;
  const float* l = logits + static_cast<size_t>(t) * ld;
  float p[PerLane];
  float mx = -INFINITY;
#pragma unroll
  for (int j = 0; j < PerLane; ++j) {
    const int e = lane + 32 * j;
    p[j] = e < E ? __ldcg(l + e) : -INFINITY;
    mx = fmaxf(mx, p[j]);
  }
  for (int offset = 16; offset > 0; offset /= 2)
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, offset));
  float sum = 0.0f;
#pragma unroll
  for (int j = 0; j < PerLane; ++j) {
    p[j] = lane + 32 * j < E ? expf(p[j] - mx) : 0.0f;
    sum += p[j];
  }
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
#pragma unroll
  for (int j = 0; j < PerLane; ++j) {
    const float q = p[j] / sum;
    p[j] = lane + 32 * j >= E ? kOut : isnan(q) ? -1.0f : q;
  }
  float top = 0.0f, my_p = 0.0f;  // lane j < k keeps choice j
  int my_e = 0;
  for (int r = 0; r < k; ++r) {
    // k <= E, so an expert not yet chosen (p >= -1) always beats every kOut.
    Candidate c{p[0], lane};
#pragma unroll
    for (int j = 1; j < PerLane; ++j) {
      const Candidate o{p[j], lane + 32 * j};
      if (before(o, c)) c = o;
    }
    c = warp_best_reduced(c);  // p: probabilities (no NaN: -1), kOut; never -0
#pragma unroll
    for (int j = 0; j < PerLane; ++j)
      if (lane + 32 * j == c.e) p[j] = kOut;
    top += c.p;
    if (lane == r) {
      my_p = c.p;
      my_e = c.e;
    }
  }
  if (lane < k && ids) {
    ids[static_cast<size_t>(t) * k + lane] = my_e;
    weights[static_cast<size_t>(t) * k + lane] = renormalise ? my_p / top : my_p;
  }
  return lane < k ? my_e : INT_MAX;
}

// GLM-5 / DeepSeek-V3's noaux_tc routing (route_noaux_tc's rule), one warp per token as above:
// score = sigmoid(logit), choice = score + bias; a group's worth is the sum of its best two
// choices (best first); the topk_group best groups are kept (lower group on a tie), the other
// groups' experts drop out; the k best choices are the experts, weighted by their unbiased scores
// (renormalised by their sum in the order chosen, + 1e-20) times `scale`. Every comparison is
// `before`'s (lower id on a tie) and every sum's order depends on E and the groups alone.
struct NoauxRule {
  int n_group, topk_group;
  bool renormalise;
  float scale;
  const float* bias;
};
template <int PerLane>
__device__ __forceinline__ int route_token(const NoauxRule& rule, const float* __restrict__ logits,
                                           int64_t ld, int t, int E, int k,
                                           int32_t* __restrict__ ids, float* __restrict__ weights) {
  const int n_group = rule.n_group, topk_group = rule.topk_group;
  const bool renormalise = rule.renormalise;
  const float scale = rule.scale;
  const float* __restrict__ bias = rule.bias;
  const int lane = threadIdx.x % 32;
  const float* l = logits + static_cast<size_t>(t) * ld;
  const int per = E / n_group;
  float score[PerLane], choice[PerLane];
#pragma unroll
  for (int j = 0; j < PerLane; ++j) {
    const int e = lane + 32 * j;
    score[j] = e < E ? 1.0f / (1.0f + expf(-__ldcg(l + e))) : 0.0f;
    choice[j] = e < E ? score[j] + bias[e] : -INFINITY;
  }
  // The best of the candidates `in` accepts (experts outside it count as -inf, past E as well).
  auto best_of = [&](auto in) {
    Candidate c{-INFINITY, 0x7fffffff};
#pragma unroll
    for (int j = 0; j < PerLane; ++j) {
      const int e = lane + 32 * j;
      const Candidate o{e < E && in(e) ? choice[j] : -INFINITY, e < E ? e : 0x7fffffff};
      if (before(o, c)) c = o;
    }
    return warp_best(c);
  };
  if (n_group > 1) {
    unsigned kept = 0;        // bit g: group g stays
    float worth = -INFINITY;  // lane g < n_group holds group g's
    for (int g = 0; g < n_group; ++g) {
      const Candidate a = best_of([&](int e) { return e / per == g; });
      const Candidate b = best_of([&](int e) { return e / per == g && e != a.e; });
      if (lane == g) worth = a.p + b.p;
    }
    for (int r = 0; r < topk_group; ++r) {
      Candidate c{lane < n_group && !((kept >> lane) & 1u) ? worth : -INFINITY,
                  lane < n_group ? lane : 0x7fffffff};
      c = warp_best(c);
      kept |= 1u << c.e;
    }
#pragma unroll
    for (int j = 0; j < PerLane; ++j) {
      const int e = lane + 32 * j;
      if (e < E && !((kept >> (e / per)) & 1u)) choice[j] = -INFINITY;
    }
  }
  float top = 0.0f, my_s = 0.0f;  // lane j < k keeps choice j
  int my_e = 0;
  unsigned taken = 0;  // bit j: this lane's expert lane + 32j was chosen
  for (int r = 0; r < k; ++r) {
    // Each lane judges its own experts (e = lane + 32j), so bit e / 32 of its own mask.
    const Candidate c = best_of([&](int e) { return !((taken >> (e / 32)) & 1u); });
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < PerLane; ++j)
      if (lane + 32 * j == c.e) {
        s = score[j];
        taken |= 1u << j;
      }
    s = __shfl_sync(0xffffffffu, s, c.e % 32);
    top += s;
    if (lane == r) {
      my_s = s;
      my_e = c.e;
    }
  }
  if (lane < k && ids) {
    const float w = renormalise ? my_s / (top + 1e-20f) : my_s;
    ids[static_cast<size_t>(t) * k + lane] = my_e;
    weights[static_cast<size_t>(t) * k + lane] = w * scale;
  }
  return lane < k ? my_e : INT_MAX;
}

// Grid: ceil(T / kRouteWarps) blocks of kRouteWarps warps; warp w of block b routes token
// b·kRouteWarps + w under Rule (TopKRule or NoauxRule).
template <int PerLane, class Rule>
__global__ void __launch_bounds__(kRouteWarps * 32)
    moe_route_kernel(Rule rule, const float* __restrict__ logits, int64_t ld, int T, int E, int k,
                     int32_t* __restrict__ ids, float* __restrict__ weights) {
  pdl_wait();
  pdl_release();
  const int t = blockIdx.x * kRouteWarps + threadIdx.x / 32;
  if (t >= T) return;  // the whole warp
  route_token<PerLane>(rule, logits, ld, t, E, k, ids, weights);
}

// Calls f(std::integral_constant<int, PerLane>{}) with the fewest experts per routing lane that
// cover E (a power of two, so few instantiations).
template <class F>
void with_per_lane(int64_t E, F&& f) {
  if (E <= 32)
    f(std::integral_constant<int, 1>{});
  else if (E <= 64)
    f(std::integral_constant<int, 2>{});
  else if (E <= 128)
    f(std::integral_constant<int, 4>{});
  else if (E <= 256)
    f(std::integral_constant<int, 8>{});
  else if (E <= 512)
    f(std::integral_constant<int, 16>{});
  else
    f(std::integral_constant<int, 32>{});
}

// The block-wide exclusive scan of one int2 per thread (kGroupThreads threads, component-wise);
// *total receives the sums. Every thread calls it; it ends with the block synchronised.
__device__ __forceinline__ int2 block_exclusive_scan(int2 v, int2* total) {
  __shared__ int2 s_warp[kGroupThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int2 inc = v;
  for (int offset = 1; offset < 32; offset *= 2) {
    const int x = __shfl_up_sync(0xffffffffu, inc.x, offset);
    const int y = __shfl_up_sync(0xffffffffu, inc.y, offset);
    if (lane >= offset) inc = make_int2(inc.x + x, inc.y + y);
  }
  if (lane == 31) s_warp[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    const int2 w = s_warp[lane];
    int2 wi = w;
    for (int offset = 1; offset < 32; offset *= 2) {
      const int x = __shfl_up_sync(0xffffffffu, wi.x, offset);
      const int y = __shfl_up_sync(0xffffffffu, wi.y, offset);
      if (lane >= offset) wi = make_int2(wi.x + x, wi.y + y);
    }
    s_warp[lane] = make_int2(wi.x - w.x, wi.y - w.y);
    if (lane == 31) *total = wi;
  }
  __syncthreads();
  const int2 base = s_warp[warp];
  return make_int2(base.x + inc.x - v.x, base.y + inc.y - v.y);
}

// One block of kGroupThreads (E <= kGroupThreads). pairs = T·k routed (token, choice) pairs,
// ids[i] the expert of pair i = t·k + j. Writes:
//   expert[g], start[g] for the used experts in ascending id (g < used), start[g] = pairs for
//   used <= g <= groups (empty groups);
//   row_of[i]: pair i's row in expert order; token_of[r]: the token of pair row r.
// The rows are a stable sort of the pairs by expert: experts ascending, pairs in order within
// one. The pairs are cut into `chunks` runs of consecutive pairs, run c walked by warp c:
//   1. hist[c][e] = the pairs of run c routed to e (shared atomics: a count, in any order);
//   2. thread e scans its column over the runs: hist[c][e] = e's pairs in runs before c, and
//      count[e] their total;
//   3. a block-wide exclusive scan over the experts of (count[e], count[e] > 0) gives e's first
//      row and, if used, its group; hist[c][e] += e's first row;
//   4. warp c walks its run 32 pairs at a time: lanes with the same expert rank themselves by
//      lane (match_any), row = hist[c][e] + rank, and the lowest of them advances hist[c][e].
// The result depends on ids alone, never on the chunking.
// shared_rows > 0 (a mixture's shared expert run as one more group, SharedGroup): after the used
// experts comes group `used` with expert id E and rows pairs .. pairs + shared_rows (token t's
// shared-expert row is pair row pairs + t), and the groups after it are empty.
// ids are read after the caller's wait (or written by this block before a barrier).
struct SharedGroup {
  int rows;  // 0: no shared group
  int id;    // the expert id it carries (E: one past the routed experts)
};

// The groups after the `used` routed ones: the shared group if there is one, then empty groups
// (start = every row). Threads `first`, `first + stride`, ... of the caller write it.
__device__ __forceinline__ void close_groups(int used, int pairs, int groups, SharedGroup sh,
                                             int first, int stride, int32_t* __restrict__ expert,
                                             int32_t* __restrict__ start,
                                             int32_t* __restrict__ token_of) {
  if (sh.rows > 0 && first == 0) {
    expert[used] = sh.id;
    start[used] = pairs;
  }
  for (int g = used + (sh.rows > 0 ? 1 : 0) + first; g <= groups; g += stride)
    start[g] = pairs + sh.rows;
  for (int t = first; t < sh.rows; t += stride) token_of[pairs + t] = t;
}

__device__ __forceinline__ void group_pairs(const int32_t* ids, int pairs, int k, int E, int groups,
                                            int chunks, SharedGroup sh,
                                            int32_t* __restrict__ expert,
                                            int32_t* __restrict__ start,
                                            int32_t* __restrict__ row_of,
                                            int32_t* __restrict__ token_of) {
  extern __shared__ int32_t s_hist[];  // [chunks][E]
  __shared__ int2 s_total;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int i = threadIdx.x; i < chunks * E; i += kGroupThreads) s_hist[i] = 0;
  __syncthreads();
  const int per_chunk = (pairs + chunks - 1) / chunks;
  const int c0 = warp * per_chunk, c1 = min(pairs, c0 + per_chunk);
  int32_t* hist = s_hist + warp * E;  // this warp's run (warp < chunks)
  if (warp < chunks)
    for (int i = c0 + lane; i < c1; i += 32) atomicAdd(&hist[ids[i]], 1);
  __syncthreads();
  const int e = threadIdx.x;
  int count = 0;
  if (e < E)
    for (int c = 0; c < chunks; ++c) {
      const int n = s_hist[c * E + e];
      s_hist[c * E + e] = count;
      count += n;
    }
  const int2 before_e = block_exclusive_scan(make_int2(count, count > 0 ? 1 : 0), &s_total);
  if (e < E) {
    for (int c = 0; c < chunks; ++c) s_hist[c * E + e] += before_e.x;
    if (count > 0) {
      expert[before_e.y] = e;
      start[before_e.y] = before_e.x;
    }
  }
  close_groups(s_total.y, pairs, groups, sh, threadIdx.x, kGroupThreads, expert, start, token_of);
  __syncthreads();
  if (warp >= chunks) return;
  for (int base = c0; base < c1; base += 32) {  // uniform across the warp
    const int i = base + lane;
    const int mine = i < c1 ? ids[i] : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, mine);
    const unsigned lower = peers & ((1u << lane) - 1u);
    int row = 0;
    if (i < c1) {
      row = hist[mine] + __popc(lower);
      row_of[i] = row;
      token_of[row] = i / k;
    }
    __syncwarp();
    if (i < c1 && lower == 0) hist[mine] += __popc(peers);
    __syncwarp();
  }
}

__global__ void __launch_bounds__(kGroupThreads)
    moe_group_kernel(const int32_t* __restrict__ ids, int pairs, int k, int E, int groups,
                     int chunks, SharedGroup sh, int32_t* __restrict__ expert,
                     int32_t* __restrict__ start, int32_t* __restrict__ row_of,
                     int32_t* __restrict__ token_of) {
  pdl_wait();
  pdl_release();
  group_pairs(ids, pairs, k, E, groups, chunks, sh, expert, start, row_of, token_of);
}

// group_pairs for at most 32·PP pairs, by one warp, lane l holding pairs l + 32q (q < PP); same
// results: a pair's row is the number of pairs with a lower expert, or the same expert and a
// lower index; an expert's group is the number of distinct lower experts among the pairs. For
// decode steps of a few rows, where group_pairs' block-wide scans and barriers were most of the
// routing's time.
template <int PP>
__device__ __forceinline__ void group_pairs_warp(const int32_t* ids, int pairs, int k, int groups,
                                                 SharedGroup sh, int32_t* __restrict__ expert,
                                                 int32_t* __restrict__ start,
                                                 int32_t* __restrict__ row_of,
                                                 int32_t* __restrict__ token_of) {
  static_assert(PP == 1 || PP == 2, "of_pair below picks between at most two pairs a lane");
  const int lane = threadIdx.x % 32;
  int e[PP], row[PP], group[PP];
  bool first[PP];
  // Lane j % 32's value of pair j (j uniform; a select, so the arrays stay in registers).
  auto of_pair = [](const auto(&v)[PP], int j) { return PP == 1 || j < 32 ? v[0] : v[PP - 1]; };
#pragma unroll
  for (int q = 0; q < PP; ++q) {
    const int i = lane + 32 * q;
    e[q] = i < pairs ? ids[i] : INT_MAX;
    row[q] = group[q] = 0;
    first[q] = i < pairs;  // until an earlier pair of the same expert shows up
  }
  for (int j = 0; j < pairs; ++j) {  // pairs is uniform
    const int ej = __shfl_sync(0xffffffffu, of_pair(e, j), j % 32);
#pragma unroll
    for (int q = 0; q < PP; ++q) {
      const int i = lane + 32 * q;
      row[q] += ej < e[q] || (ej == e[q] && j < i);
      if (ej == e[q] && j < i) first[q] = false;
    }
  }
  for (int j = 0; j < pairs; ++j) {  // a second pass: every pair's first-ness is known now
    const int ej = __shfl_sync(0xffffffffu, of_pair(e, j), j % 32);
    const bool fj = __shfl_sync(0xffffffffu, of_pair(first, j), j % 32);
#pragma unroll
    for (int q = 0; q < PP; ++q) group[q] += fj && ej < e[q];
  }
  int used = 0;
#pragma unroll
  for (int q = 0; q < PP; ++q) {
    const int i = lane + 32 * q;
    if (i < pairs) {
      row_of[i] = row[q];
      token_of[row[q]] = i / k;
    }
    if (first[q]) {
      expert[group[q]] = e[q];
      start[group[q]] = row[q];
    }
    used += __popc(__ballot_sync(0xffffffffu, first[q]));
  }
  close_groups(used, pairs, groups, sh, lane, 32, expert, start, token_of);
}

// A choice's place among a token's k choices in ascending expert id, by the whole routing warp
// (lane j < k holds choice j's expert e, as route_token returns it; the experts are distinct):
// the number of its choices with a lower id.
__device__ __forceinline__ int choice_place(int e, int k) {
  int place = 0;
  for (int q = 0; q < k; ++q) place += __shfl_sync(0xffffffffu, e, q) < e;
  return place;
}

// group_pairs_warp for one token, from the routing warp's registers (lane j < k holds choice j,
// its expert e_j, distinct): pair j's row and group are both its choice_place. The same results
// without the ids' round trip through memory and the pair loops.
__device__ __forceinline__ void group_one_token(int e, int k, int groups, SharedGroup sh,
                                                int32_t* __restrict__ expert,
                                                int32_t* __restrict__ start,
                                                int32_t* __restrict__ row_of,
                                                int32_t* __restrict__ token_of) {
  const int lane = threadIdx.x % 32;
  const int row = choice_place(e, k);
  if (lane < k) {
    row_of[lane] = row;
    token_of[row] = 0;
    expert[row] = e;
    start[row] = row;
  }
  close_groups(k, k, groups, sh, lane, 32, expert, start, token_of);
}

// Routing and grouping in one block, for calls of at most kGroupThreads / 32 tokens (decode and
// short windows, where each launch is a few microseconds of a step's latency): warp t routes
// token t as moe_route_kernel does, then the block groups the pairs as moe_group_kernel does
// (the ids it reads were written by the block before the barrier). The same values as the two
// kernels.
// PairsPerLane > 0: T·k <= 32·PairsPerLane pairs, a block of T warps whose warp 0 then groups
// them (group_pairs_warp; one token: group_one_token, from the routing warp's registers); 0: the
// block groups them (group_pairs).
template <int PerLane, class Rule, int PairsPerLane>
__global__ void __launch_bounds__(kGroupThreads)
    moe_route_group_kernel(Rule rule, const float* __restrict__ logits, int64_t ld, int T, int E,
                           int k, int32_t* ids, float* __restrict__ weights, int groups, int chunks,
                           SharedGroup sh, int32_t* __restrict__ expert,
                           int32_t* __restrict__ start, int32_t* __restrict__ row_of,
                           int32_t* __restrict__ token_of) {
  pdl_wait();
  pdl_release();
  const int t = threadIdx.x / 32;
  const int chosen = t < T ? route_token<PerLane>(rule, logits, ld, t, E, k, ids, weights) : 0;
  if constexpr (PairsPerLane > 0) {
    if (T == 1) {  // the block is one warp
      group_one_token(chosen, k, groups, sh, expert, start, row_of, token_of);
      return;
    }
  }
  __syncthreads();
  if constexpr (PairsPerLane > 0) {
    if (t == 0)
      group_pairs_warp<PairsPerLane>(ids, T * k, k, groups, sh, expert, start, row_of, token_of);
  } else {
    group_pairs(ids, T * k, k, E, groups, chunks, sh, expert, start, row_of, token_of);
  }
}

// y += acc + sigmoid(*gate) · shared, or + shared without a gate (GLM-5: the shared experts'
// output added as it is), or acc alone without a shared expert: the last step of a token's
// combination, one rounding order for both combining kernels.
__device__ __forceinline__ void combine_into(float& y, float acc, bool has_shared, float shared,
                                             const float* gate) {
  if (!has_shared)
    y += acc;
  else if (gate)
    y += fmaf(sigmoid(*gate), shared, acc);
  else
    y += acc + shared;
}

// A token's choices in combining order, by threads 0..k-1 (thread j: choice j of ids, wts and
// row_of, the token's k entries): s_w and s_row at the choice's place in ascending expert id,
// the number of its choices with a lower id (a token's ids are distinct).
__device__ __forceinline__ void order_choices(const int32_t* ids, const float* wts,
                                              const int32_t* row_of, int k, float* s_w,
                                              int32_t* s_row) {
  if (threadIdx.x >= k) return;
  const int j = threadIdx.x, e = ids[j];
  int place = 0;
  for (int q = 0; q < k; ++q) place += ids[q] < e;
  s_w[place] = wts[j];
  s_row[place] = row_of[j];
}

// Grid (T, ceil(H / kCombineThreads)): block (t, b) adds to y[t] its columns b·kCombineThreads
// .. (b + 1)·kCombineThreads - 1, each Σ (the token's choices in ascending expert id) w · out[row]
// and, with a shared expert, + sigmoid(gate logit) · shared[t], as one term (cpu::moe_mlp_add's
// order, order_choices). The gate logit of token t is gate[t · gate_ld].
__global__ void __launch_bounds__(kCombineThreads)
    moe_combine_kernel(const int32_t* __restrict__ ids, const float* __restrict__ wts,
                       const int32_t* __restrict__ row_of, const float* __restrict__ out,
                       const float* __restrict__ shared, const float* __restrict__ gate,
                       int64_t gate_ld, int k, int64_t H, float* __restrict__ y) {
  pdl_wait();
  pdl_release();
  __shared__ float s_w[kMaxTopK];
  __shared__ int32_t s_row[kMaxTopK];
  const int64_t t = blockIdx.x;
  order_choices(ids + t * k, wts + t * k, row_of + t * k, k, s_w, s_row);
  __syncthreads();
  const int64_t i = static_cast<int64_t>(blockIdx.y) * kCombineThreads + threadIdx.x;
  if (i >= H) return;
  float acc = 0.0f;
  for (int j = 0; j < k; ++j) acc = fmaf(s_w[j], out[static_cast<int64_t>(s_row[j]) * H + i], acc);
  combine_into(y[t * H + i], acc, shared != nullptr, shared ? shared[t * H + i] : 0.0f,
               gate ? gate + t * gate_ld : nullptr);
}

// --- One token's products from shared memory -----------------------------------------------------
//
// The one-token kernels below multiply the token's row x (bf16 in shared memory) by weight rows
// staged in shared memory (bf16, `row_stride` bytes apart): warp `warp` of Warps accumulates
// chunks warp, warp + Warps, ... of K into c[nt], n-tile nt holding rows 8·nt .. 8·nt + 7 (rows
// from `rows` on read as zeros), with linear.cu's mma sequence and lane-to-k mapping (mma j takes
// k + 4j .. k + 4j + 3 of the lane's 16). Tile row g is input row g: only row 0 exists (lanes
// g = 0), so c[nt][0..1] of lanes 0..3 hold the token's columns 2·lane, 2·lane + 1. The caller
// sums the warps' partials in warp order, as finish_group does.
template <int Warps, int NT>
__device__ __forceinline__ void one_row_product(float (&c)[NT][4], const unsigned char* w_rows,
                                                int row_stride, int rows, const uint16_t* x_row,
                                                int K) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int chunks = (K + kChunk - 1) / kChunk;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) c[nt][0] = c[nt][1] = c[nt][2] = c[nt][3] = 0.0f;
  for (int ch = warp; ch < chunks; ch += Warps) {
    const int k0 = ch * kChunk + 16 * t;
    const bool k_ok = k0 < K;
    uint4 wv[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      if (k_ok && nt * 8 + g < rows) {
        const uint4* p =
            reinterpret_cast<const uint4*>(w_rows + (nt * 8 + g) * row_stride + 2 * k0);
        wv[nt][0] = p[0];
        wv[nt][1] = p[1];
      } else {
        wv[nt][0] = wv[nt][1] = make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint2 lo = make_uint2(0, 0);
      if (k_ok && g == 0) lo = *reinterpret_cast<const uint2*>(x_row + k0 + 4 * j);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const uint32_t* wb = reinterpret_cast<const uint32_t*>(&wv[nt][0]);
        mma_bf16_16816(c[nt], lo.x, 0u, lo.y, 0u, wb[2 * j], wb[2 * j + 1]);
      }
    }
  }
}

// --- One token's routing and gate/up products (decode at batch 1) ----------------------------
//
// At one token the routing kernel (one warp: a launch and a dependent chain of its own between
// the router and the experts) and the grouped gate/up product (blocks walking two or three column
// groups of their expert, each a DRAM round trip) become one kernel. Its work is cut into items
// of kItemCols activation columns of one term (the token's k experts in ascending id, then the
// shared expert where it runs as a group, the "extra" term): the term's gate rows c .. c + 3 and
// up rows I + c .. I + c + 3 (gate_up_proj's stacking), 8 weight rows, one m16n8 n-tile. Block b
// takes items b, b + gridDim.x, ...; the extra term's items are numbered first, so most blocks'
// first item needs no routing.
// A producer warp (the last) streams its block's items into a ring of shared-memory stages with
// bulk copies: the extra term's before the wait on the previous kernel (weights), then, after
// it, routes the token itself from the router's logits (route_token: every block reaches the
// same choices; block 0 also writes the routing and the one-token grouping, which the down
// products and the combination read after their own waits) and streams the routed items. The
// Warps k-split warps stage the token's normalised row as bf16, as the grouped product stages it,
// and multiply item by item.
// Bits: an activation is linear_grouped's for that row — chunks of 64 k ascending in each of the
// k_split_warps(2I) warps with the same four mmas per chunk and lane-to-k mapping, the partials
// summed in warp order and silu(gate) · up as finish_group computes them. A column's place in the
// mma's n-tile is free (no output's arithmetic depends on it). So a token decoded alone is
// bitwise the same token in a verify window (GPU tests).
constexpr int kTokenWarps = 8;    // k-split warps of the one-token kernels (2I, H < kWideRows)
constexpr int kItemCols = 4;      // activation columns of a gate/up item: one 8-row n-tile
constexpr int kGateUpStages = 4;  // ring depth: 128 KiB of a 2,048-wide model's rows in flight
constexpr size_t kTokenSmemMax = size_t(200) << 10;  // dynamic shared memory, at most

// The routing outputs block 0 of moe_token_gate_up_kernel writes (moe_route_group_kernel's).
struct RoutingOut {
  int32_t* ids;
  float* weights;
  int groups;
  SharedGroup sh;
  int32_t* expert;
  int32_t* start;
  int32_t* row_of;
  int32_t* token_of;
};

// Dynamic shared memory: `stages` items of 8 weight rows, each padded by 16 bytes (consecutive
// rows start 4 banks apart), then the token's row in bf16.
__host__ __device__ constexpr size_t token_gate_up_smem(int stages, int H) {
  return static_cast<size_t>(stages) * 2 * kItemCols * (2 * H + 16) + (2 * H + 16);
}

template <int PerLane, class Rule>
__global__ void __launch_bounds__((kTokenWarps + 1) * 32, 1)
    moe_token_gate_up_kernel(Rule rule, const float* __restrict__ logits, int64_t ld, int E, int k,
                             const float* __restrict__ x, const uint16_t* __restrict__ gate_up,
                             const uint16_t* __restrict__ extra, int H, int I, int stages,
                             float* __restrict__ act, RoutingOut out) {
  constexpr int W = kTokenWarps;
  constexpr int kRows = 2 * kItemCols;  // weight rows of an item
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) uint64_t full[kGateUpStages], empty[kGateUpStages];
  __shared__ float partial[2][W][4][2];   // lanes 0..3's accumulators, double-buffered by item
  __shared__ int32_t s_expert[kMaxTopK];  // the token's experts in ascending id
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row_stride = 2 * H + 16;  // bytes
  const int stage_bytes = kRows * row_stride;
  const int per_term = I / kItemCols;
  const int extra_items = extra ? per_term : 0;
  const int items = extra_items + k * per_term;
  const uint16_t* x_smem = reinterpret_cast<const uint16_t*>(smem + stages * stage_bytes);

  init_barriers(full, empty, stages, W);

  if (warp == W) {
    const uint64_t policy = evict_first_policy();
    const unsigned row_bytes = static_cast<unsigned>(2 * H);
    int q = 0;  // items issued
    // Item rows 0..3: gate rows c..c+3 of the expert's [2I, H]; rows 4..7: its up rows.
    auto issue = [&](const uint16_t* w, int c) {
      const int slot = q % stages;
      if (q >= stages) mbar_wait(shared_address(&empty[slot]), ((q / stages) - 1) & 1);
      const uint32_t bar = shared_address(&full[slot]);
      if (lane == 0) mbar_arrive_expect(bar, row_bytes * kRows);
      __syncwarp();
      if (lane < kRows) {
        const int row = lane < kItemCols ? c + lane : I + c + lane - kItemCols;
        bulk_copy(shared_address(smem + slot * stage_bytes + lane * row_stride),
                  w + static_cast<size_t>(row) * H, row_bytes, bar, policy);
      }
      ++q;
    };
    int i = blockIdx.x;
    for (; i < extra_items; i += gridDim.x) issue(extra, i * kItemCols);
    pdl_wait();
    const bool first = blockIdx.x == 0;
    const int e = route_token<PerLane>(rule, logits, ld, 0, E, k, first ? out.ids : nullptr,
                                       first ? out.weights : nullptr);
    const int place = choice_place(e, k);
    if (lane < k) s_expert[place] = e;
    __syncwarp();
    if (first)
      group_one_token(e, k, out.groups, out.sh, out.expert, out.start, out.row_of, out.token_of);
    const size_t per_expert = static_cast<size_t>(2) * I * H;
    for (; i < items; i += gridDim.x) {
      const int j = i - extra_items;
      issue(gate_up + static_cast<size_t>(s_expert[j / per_term]) * per_expert,
            (j % per_term) * kItemCols);
    }
    return;
  }

  pdl_wait();
  pdl_release();
  // The normalised row in bf16, rounded as the grouped product stages it.
  for (int c = threadIdx.x; c < H / 4; c += W * 32) {
    const float4 v = reinterpret_cast<const float4*>(x)[c];
    *reinterpret_cast<uint2*>(smem + stages * stage_bytes + 8 * c) =
        make_uint2(pack_bf16(v.x, v.y), pack_bf16(v.z, v.w));
  }
  group_barrier<W * 32>();  // the mma warps only

  int q = 0;
  for (int i = blockIdx.x; i < items; i += gridDim.x, ++q) {
    const int slot = q % stages;
    float c[1][4];
    mbar_wait(shared_address(&full[slot]), (q / stages) & 1);
    one_row_product<W, 1>(c, smem + slot * stage_bytes, row_stride, kRows, x_smem, H);
    __syncwarp();
    if (lane == 0) mbar_arrive(shared_address(&empty[slot]));
    if (lane < 4) {  // row 0's columns 2·lane, 2·lane + 1 of the n-tile
      partial[q & 1][warp][lane][0] = c[0][0];
      partial[q & 1][warp][lane][1] = c[0][1];
    }
    group_barrier<W * 32>();        // the mma warps only
    if (threadIdx.x < kItemCols) {  // activation column j: n-tile columns j (gate) and 4 + j (up)
      const int j = threadIdx.x;
      float gs = partial[q & 1][0][j / 2][j % 2];
      float us = partial[q & 1][0][2 + j / 2][j % 2];
#pragma unroll
      for (int w = 1; w < W; ++w) {
        gs += partial[q & 1][w][j / 2][j % 2];
        us += partial[q & 1][w][2 + j / 2][j % 2];
      }
      const int term = i < extra_items ? k : (i - extra_items) / per_term;
      const int col = (i < extra_items ? i : (i - extra_items) % per_term) * kItemCols + j;
      act[static_cast<size_t>(term) * I + col] = silu(gs) * us;
    }
  }
}

// --- One token's router (decode at batch 1) -----------------------------------------------------
//
// At one token the router product (E + 1 rows of H: 1 MiB for the 35B-A3B shape) is a latency
// chain, not bytes: the generic folded-norm product's 33 blocks wait on the previous kernel,
// normalise the row, and only then fetch their rows from DRAM. Here each block owns one 8-row
// n-tile, and a producer warp bulk-copies those rows into shared memory before the wait (weights),
// so after it the block normalises the row and multiplies at once.
// Bits: the folded-norm product's (linear.cu, one staged row with a chunked norm): the row's
// squares summed in row_norm.cuh's Chunked order from registers, the bf16 roundings of normed(),
// the kTokenWarps (= k_split_warps of the router's rows) warps' chunks ascending with the same
// mma sequence and fragments, partials summed in warp order; block 0 writes the normalised fp32
// row, as that product's first block does. NC: the norm's 4-float chunks per group thread (4 up
// to H = 2,048, else 8).
constexpr int kRouterRows = 8;     // router rows a block owns: one n-tile
constexpr int kNormChunksMax = 8;  // a group thread's 4-float chunks of the row, at most

__host__ __device__ constexpr size_t token_router_smem(int H) {
  return static_cast<size_t>(kRouterRows + 1) * (2 * H + 16);
}

template <int NC>
__global__ void __launch_bounds__((kTokenWarps + 1) * 32, 1)
    moe_token_router_kernel(const float* __restrict__ x, const uint16_t* __restrict__ router, int N,
                            int H, const float* __restrict__ norm_w, float eps, bool zero_centred,
                            float* __restrict__ normed_row, float* __restrict__ logits) {
  constexpr int W = kTokenWarps;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) uint64_t full;
  __shared__ double s_warp[kWideNormThreads / 32];
  __shared__ float partial[W][4][2];  // lanes 0..3's accumulators (row 0)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row_stride = 2 * H + 16;  // bytes
  const int n0 = blockIdx.x * kRouterRows;
  const int rows = min(kRouterRows, N - n0);
  unsigned char* x_bytes = smem + kRouterRows * row_stride;
  const uint16_t* x_smem = reinterpret_cast<const uint16_t*>(x_bytes);

  init_barriers(&full, nullptr, 1, 0);

  if (warp == W) {  // the producer: weights, before the wait
    const unsigned bytes = static_cast<unsigned>(2 * H);
    const uint32_t bar = shared_address(&full);
    if (lane == 0) mbar_arrive_expect(bar, bytes * rows);
    __syncwarp();
    if (lane < rows)
      bulk_copy(shared_address(smem + lane * row_stride),
                router + static_cast<size_t>(n0 + lane) * H, bytes, bar, evict_first_policy());
    return;
  }

  const int t = threadIdx.x, per_row = H / 4;
  const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
  float4 wv[NC];  // the norm weight's chunks, before the wait (a weight)
  const float4* w4 = reinterpret_cast<const float4*>(norm_w);
#pragma unroll
  for (int k = 0; k < NC; ++k) {
    const int c = t + kNormGroup * k;
    wv[k] = t < kNormGroup && c < per_row ? w4[c] : zero;
  }
  pdl_wait();
  pdl_release();
  if (t < kNormGroup) {  // whole warps; named barrier 2 (barrier 1: the mma warps)
    float4* out = blockIdx.x == 0 ? reinterpret_cast<float4*>(normed_row) : nullptr;
    normalise_chunked_row<NC, 2>(x, H, wv, eps, zero_centred, s_warp, [&](int c, float4 n) {
      *reinterpret_cast<uint2*>(x_bytes + 8 * c) =
          make_uint2(pack_bf16(n.x, n.y), pack_bf16(n.z, n.w));
      if (out) out[c] = n;
    });
  }
  group_barrier<W * 32>();  // the mma warps only: the row is staged

  float c[1][4];
  mbar_wait(shared_address(&full), 0);
  one_row_product<W, 1>(c, smem, row_stride, rows, x_smem, H);
  if (lane < 4) {  // row 0's columns 2·lane, 2·lane + 1 of the n-tile
    partial[warp][lane][0] = c[0][0];
    partial[warp][lane][1] = c[0][1];
  }
  group_barrier<W * 32>();
  if (threadIdx.x < rows) {  // column j of the n-tile: finish_group's sum over the warps in order
    const int j = threadIdx.x;
    float v = partial[0][j / 2][j % 2];
#pragma unroll
    for (int w = 1; w < W; ++w) v += partial[w][j / 2][j % 2];
    logits[n0 + j] = v;
  }
}

// --- One token's down products and their combination (decode at batch 1) ----------------------
//
// At one token the grouped down product (a block row per chosen expert, blocks over its columns)
// and moe_combine_kernel become one kernel whose blocks own output columns instead: block b takes
// columns 8·NT·b .. 8·NT·(b + 1) - 1 of every term (the token's k experts in ascending id, then
// the shared expert where it runs as a group, the "extra" term) and adds their combination to y.
// A producer warp (the last) copies every term's weight rows of the block into shared memory with
// bulk copies, all at once, before the wait on the previous kernel: it routes the token itself
// from the router's logits (route_token, the same choices as every other routing of the token),
// and the router ran at least two launches back (then the gate/up product), while a kernel starts
// only once every block of the one before it has passed its own wait — so the router had
// completed and its logits were visible (read through L2, never a stale L1 line). The weights
// then stream while the gate/up product drains, and no column group waits on its own loads.
// The Warps k-split warps wait for the gate/up product, stage the token's activation rows as bf16
// (the grouped product's staging) and multiply term by term.
// Bits: a term's value is linear_grouped's for that row — the k-split of the weight's shape
// (k_split_warps), each warp's chunks ascending with the same mma sequence and fragments, the
// partials summed in warp order as finish_group sums them — and the terms are combined with
// moe_combine_kernel's arithmetic in its order (combine_into). So a token decoded alone is
// bitwise the same token in a verify window (GPU test
// OneTokenKernelsAreBitwiseTheGroupedPath).

// Dynamic shared memory of a block: every term's weight rows (each padded by 16 bytes so that
// consecutive rows start 4 banks apart) and its activation row in bf16 (padded alike).
__host__ __device__ constexpr size_t token_down_smem(int terms, int rows, int I) {
  return static_cast<size_t>(terms) * (static_cast<size_t>(rows) * (2 * I + 16) + (2 * I + 16));
}

template <int NT, int PerLane, class Rule>
__global__ void __launch_bounds__((kTokenWarps + 1) * 32, 1)
    moe_token_down_kernel(Rule rule, const float* __restrict__ logits, int64_t ld, int E,
                          const float* __restrict__ act, const int32_t* __restrict__ ids,
                          const float* __restrict__ wts, const int32_t* __restrict__ row_of, int k,
                          const uint16_t* __restrict__ down, const uint16_t* __restrict__ extra,
                          int extra_row, const float* __restrict__ shared,
                          const float* __restrict__ gate, int H, int I, float* __restrict__ y) {
  constexpr int Warps = kTokenWarps;  // k_split_warps(H) (the host checks)
  constexpr int kRows = 8 * NT;       // output columns of a block: weight rows of each term
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) uint64_t full[kMaxTopK + 1];  // term s's weights have landed
  __shared__ float s_w[kMaxTopK];
  __shared__ int32_t s_row[kMaxTopK + 1];
  __shared__ float partial[2][Warps][NT][4][2];  // row 0's partial sums, double-buffered by term
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int terms = k + (extra ? 1 : 0);
  const int row_stride = 2 * I + 16;  // bytes
  const int n_base = blockIdx.x * kRows;
  const int rows = min(kRows, H - n_base);
  unsigned char* w_smem = smem;  // [terms][kRows][row_stride]
  const uint16_t* x_smem = reinterpret_cast<const uint16_t*>(smem + terms * kRows * row_stride);

  init_barriers(full, nullptr, terms, 0);

  if (warp == Warps) {
    // Lane j < k holds choice j; its place among the choices in ascending id is its term.
    const int e = route_token<PerLane>(rule, logits, ld, 0, E, k, nullptr, nullptr);
    const int place = choice_place(e, k);
    const uint64_t policy = evict_first_policy();
    const unsigned bytes = static_cast<unsigned>(2 * I);
    for (int s = 0; s < terms; ++s) {  // uniform across the warp
      const unsigned owner = __ballot_sync(0xffffffffu, lane < k && place == s);
      const uint16_t* src =
          s < k ? down + (static_cast<size_t>(__shfl_sync(0xffffffffu, e, __ffs(owner) - 1)) * H +
                          n_base) *
                             I
                : extra + static_cast<size_t>(n_base) * I;
      const uint32_t bar = shared_address(&full[s]);
      if (lane == 0) mbar_arrive_expect(bar, bytes * rows);
      __syncwarp();
      const uint32_t base = shared_address(w_smem + s * kRows * row_stride);
      for (int r = lane; r < rows; r += 32)
        bulk_copy(base + r * row_stride, src + static_cast<size_t>(r) * I, bytes, bar, policy);
    }
    return;
  }

  pdl_wait();
  pdl_release();
  order_choices(ids, wts, row_of, k, s_w, s_row);  // moe_combine_kernel's places
  if (threadIdx.x == 0 && extra) s_row[k] = extra_row;
  group_barrier<Warps * 32>();  // the mma warps only
  // The terms' activation rows in bf16, rounded as the grouped product stages them.
  const int q4 = I / 4;
  for (int i = threadIdx.x; i < terms * q4; i += Warps * 32) {
    const int s = i / q4, c = i % q4;
    const float4 v = reinterpret_cast<const float4*>(act + static_cast<size_t>(s_row[s]) * I)[c];
    *reinterpret_cast<uint2*>(smem + terms * kRows * row_stride + s * row_stride + 8 * c) =
        make_uint2(pack_bf16(v.x, v.y), pack_bf16(v.z, v.w));
  }
  group_barrier<Warps * 32>();  // the mma warps only

  float acc = 0.0f, extra_value = 0.0f;  // threads < kRows: their column's
  for (int s = 0; s < terms; ++s) {
    float c[NT][4];
    mbar_wait(shared_address(&full[s]), 0);
    one_row_product<Warps, NT>(c, w_smem + s * kRows * row_stride, row_stride, rows,
                               x_smem + s * (row_stride / 2), I);
    if (lane < 4)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        partial[s & 1][warp][nt][lane][0] = c[nt][0];
        partial[s & 1][warp][nt][lane][1] = c[nt][1];
      }
    group_barrier<Warps * 32>();  // the mma warps only
    if (threadIdx.x < kRows) {    // column nt·8 + 2t' + e of the block: finish_group's sum
      const int col = threadIdx.x, nt = col / 8, tt = (col % 8) / 2, e = col % 2;
      float v = partial[s & 1][0][nt][tt][e];
#pragma unroll
      for (int w = 1; w < Warps; ++w) v += partial[s & 1][w][nt][tt][e];
      if (s < k)
        acc = fmaf(s_w[s], v, acc);
      else
        extra_value = v;
    }
  }
  if (threadIdx.x < rows) {
    const int i = n_base + threadIdx.x;
    combine_into(y[i], acc, extra || shared, extra ? extra_value : shared ? shared[i] : 0.0f, gate);
  }
}

// The mixture's intermediates in a context (moe_mlp_add).
struct MoeScratch {
  DeviceScratch s[11];
};

}  // namespace

void moe_mlp_add(const float* x, int64_t T, const ops::MoeWeights& w, float* y,
                 std::vector<int32_t>* routed_ids, std::vector<float>* routed_weights,
                 const ops::MoeInputNorm* norm) {
  if (T <= 0) return;
  const int64_t E = w.router.rows, H = w.router.cols, k = w.top_k;
  const int64_t I = w.experts_down.cols, Is = w.shared_gate_proj.rows;
  if (k > kMaxTopK) fail("moe_mlp_add: top ", k, " experts (at most ", kMaxTopK, " on CUDA)");
  if (E > kMaxExperts) fail("moe_mlp_add: ", E, " experts (at most ", kMaxExperts, " on CUDA)");
  const int64_t P = T * k;  // pair rows
  // The shared expert as one more group of the grouped products (stack_moe_experts stacked its
  // gate and up as an expert's), its T rows after the pair rows: up to kSharedGroupRows tokens
  // (the grouped products of up to two m-tiles), where it saves two launches. Beyond, its own
  // products take the many-row kernels the grouped ones lack. Same bits either way: a grouped
  // row is cuda::linear's row.
  const bool shared_grouped = Is > 0 && w.shared_in_groups && T <= kSharedGroupRows;
  const int64_t S = shared_grouped ? T : 0;
  const int64_t groups = std::min(E, P) + (shared_grouped ? 1 : 0);  // groups a call can use
  if (P + S > INT32_MAX) fail("moe_mlp_add: ", T, " tokens x top ", k, " of ", E);
  if (shared_grouped && (w.shared_gate_up.rows != 2 * I || w.shared_down_proj.cols != I))
    fail("moe_mlp_add: a shared expert of ", Is, " run as a routed expert of ", I);
  // The shared expert's gate logit as the router's last row (stack_moe_experts): one product.
  const bool gate_row = Is > 0 && w.router_shared_gate.rows == E + 1;
  if (gate_row && w.router_shared_gate.cols != H)
    fail("moe_mlp_add: the stacked router is [", w.router_shared_gate.rows, " x ",
         w.router_shared_gate.cols, "], expected [", E + 1, " x ", H, "]");
  const bool fused_gate_up = Is > 0 && w.shared_gate_up.rows == 2 * Is;
  if (fused_gate_up && w.shared_gate_up.cols != H)
    fail("moe_mlp_add: the shared expert's gate/up is [", w.shared_gate_up.rows, " x ",
         w.shared_gate_up.cols, "], expected [", 2 * Is, " x ", H, "]");
  const int64_t ld = gate_row ? E + 1 : E;            // floats per token of the router's output
  DeviceScratch* s = current().unit<MoeScratch>().s;  // one per intermediate below
  float* logits = s[0].get<float>(T * ld);
  auto* ids = s[1].get<int32_t>(P);
  float* wts = s[2].get<float>(P);
  auto* expert = s[3].get<int32_t>(groups);
  auto* start = s[4].get<int32_t>(groups + 1);
  auto* row_of = s[5].get<int32_t>(P);
  auto* token_of = s[6].get<int32_t>(P + S);
  float* act = s[7].get<float>((P + S) * I);
  float* out = s[8].get<float>((P + S) * H);
  const SharedGroup sh{static_cast<int>(S), static_cast<int>(E)};
  // With a norm, x is the raw residual: the router normalises it (folded into its staging at one
  // token, one launch fewer) and writes the normalised rows the experts read.
  const ops::WeightRef& router = gate_row ? w.router_shared_gate : w.router;
  static const bool fold_norm = env_switch_on("TANDEM_CUDA_MOE_FOLD_NORM");
  // One token with its norm folded: the router's own kernel (moe_token_router_kernel), whose
  // rows are fetched before its wait, where the row's norm runs from registers and the shapes are
  // the kernel's. TANDEM_CUDA_MOE_TOKEN_ROUTER=0 keeps the generic folded-norm product.
  static const bool token_router_on = env_switch_on("TANDEM_CUDA_MOE_TOKEN_ROUTER");
  const auto aligned16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool token_router =
      token_router_on && T == 1 && norm && fold_norm && router.dtype == DType::BF16 &&
      router.cols == H && H % 16 == 0 && norm_order(H) == NormOrder::Chunked &&
      H <= kNormChunksMax * 4 * kNormGroup && k_split_warps(router.rows) == kTokenWarps &&
      norm->norm.w.dtype == DType::F32 && norm->norm.w.rows * norm->norm.w.cols == H &&
      aligned16(x) && aligned16(norm->normed) && aligned16(norm->norm.w.data) &&
      aligned16(router.data) && token_router_smem(static_cast<int>(H)) <= kTokenSmemMax;
  if (token_router) {
    const size_t smem = token_router_smem(static_cast<int>(H));
    auto go = [&](auto kernel) {
      allow_dynamic_smem(kernel, smem, "moe_mlp_add: one token's router rows");
      launch("moe_token_router", kernel,
             static_cast<unsigned>(ceil_div(router.rows, int64_t{kRouterRows})),
             (kTokenWarps + 1) * 32, smem, x, static_cast<const uint16_t*>(router.data),
             static_cast<int>(router.rows), static_cast<int>(H),
             static_cast<const float*>(norm->norm.w.data), norm->norm.eps, norm->norm.zero_centred,
             norm->normed, logits);
    };
    if (H <= 4 * 4 * kNormGroup)
      go(moe_token_router_kernel<4>);
    else
      go(moe_token_router_kernel<kNormChunksMax>);
  } else if (norm && fold_norm && router.dtype == DType::BF16) {
    const ops::OutputSlice all{logits, router.rows};
    cuda::linear_split_keeping_norm(x, T, router, &all, 1, norm->norm, norm->normed);
  } else {
    if (norm)
      cuda::rms_norm(x, T, H, norm->norm.w, norm->norm.zero_centred, norm->norm.eps, norm->normed);
    cuda::linear(norm ? norm->normed : x, T, router, logits);
  }
  if (norm) x = norm->normed;
  // Runs of at least 32 pairs, one per warp, as many as the per-run counts fit in kGroupSmem.
  const int64_t chunks = std::max<int64_t>(
      1, std::min({int64_t{kGroupThreads / 32}, kGroupSmem / (4 * E), ceil_div(P, 32)}));
  const size_t group_smem = sizeof(int32_t) * static_cast<size_t>(chunks * E);
  auto route_and_group = [&](const auto& rule) {
    with_per_lane(E, [&](auto per_lane) {
      constexpr int PL = decltype(per_lane)::value;
      using Rule = std::decay_t<decltype(rule)>;
      auto by_warp = [&](auto kernel) {
        launch("moe_route_group", kernel, 1, static_cast<unsigned>(32 * T), 0, rule, logits, ld,
               static_cast<int>(T), static_cast<int>(E), static_cast<int>(k), ids, wts,
               static_cast<int>(groups), 0, sh, expert, start, row_of, token_of);
      };
      if (P <= 32) return by_warp(moe_route_group_kernel<PL, Rule, 1>);
      if (P <= 64) return by_warp(moe_route_group_kernel<PL, Rule, 2>);
      if (T <= kGroupThreads / 32) {
        launch("moe_route_group", moe_route_group_kernel<PL, Rule, 0>, 1, kGroupThreads, group_smem,
               rule, logits, ld, static_cast<int>(T), static_cast<int>(E), static_cast<int>(k), ids,
               wts, static_cast<int>(groups), static_cast<int>(chunks), sh, expert, start, row_of,
               token_of);
        return;
      }
      launch("moe_route", moe_route_kernel<PL, Rule>,
             grid_blocks(ceil_div(T, kRouteWarps), "moe_route"), kRouteWarps * 32, 0, rule, logits,
             ld, static_cast<int>(T), static_cast<int>(E), static_cast<int>(k), ids, wts);
      launch("moe_group", moe_group_kernel, 1, kGroupThreads, group_smem, ids, static_cast<int>(P),
             static_cast<int>(k), static_cast<int>(E), static_cast<int>(groups),
             static_cast<int>(chunks), sh, expert, start, row_of, token_of);
    });
  };
  // The routing rule, checked once; with_rule(f) calls f(rule).
  if (w.routing == ops::MoeRouting::NoauxTc) {
    const int64_t per = w.n_group > 0 ? E / w.n_group : 0;
    if (w.n_group < 1 || w.n_group > 32 || E % w.n_group != 0 || (w.n_group > 1 && per < 2) ||
        w.topk_group < 1 || w.topk_group > w.n_group || k > w.topk_group * per)
      fail("moe_mlp_add: noaux_tc routing of top ", k, " over ", E, " experts in ", w.n_group,
           " groups keeping ", w.topk_group, " (CUDA: at most 32 groups of at least 2)");
    if (w.score_bias.dtype != DType::F32 || w.score_bias.rows * w.score_bias.cols != E)
      fail("moe_mlp_add: noaux_tc needs an F32 score bias of ", E, " values");
  }
  auto with_rule = [&](auto&& f) {
    if (w.routing == ops::MoeRouting::NoauxTc)
      f(NoauxRule{static_cast<int>(w.n_group), static_cast<int>(w.topk_group), w.renormalise,
                  w.routed_scale, static_cast<const float*>(w.score_bias.data)});
    else
      f(TopKRule{w.renormalise});
  };
  // One token: the routing and the gate/up products in one kernel (moe_token_gate_up_kernel),
  // for bf16 experts whose k-split is kTokenWarps and whose rows fit its ring at least twice (the
  // token's row 16-byte aligned, read as float4s).
  // TANDEM_CUDA_MOE_TOKEN_GATE_UP=0 keeps the routing kernel and the grouped product (A/B timing).
  static const bool token_gate_up_on = env_switch_on("TANDEM_CUDA_MOE_TOKEN_GATE_UP");
  int token_stages = 0;  // the ring's depth; 0: the routing kernel and the grouped product
  if (token_gate_up_on && T == 1 && w.experts_gate_up.dtype == DType::BF16 &&
      w.experts_gate_up.rows == E * 2 * I && w.experts_gate_up.cols == H && H % 16 == 0 &&
      I % kItemCols == 0 && k_split_warps(2 * I) == kTokenWarps &&
      reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
      (!shared_grouped || w.shared_gate_up.dtype == DType::BF16)) {
    for (int st = kGateUpStages; st >= 2 && token_stages == 0; --st)
      if (token_gate_up_smem(st, static_cast<int>(H)) <= kTokenSmemMax) token_stages = st;
  }
  // A token picks an expert once, so no group has more rows than there are tokens.
  GroupedOptions gate_up, down;
  gate_up.gather = token_of;
  gate_up.swiglu = true;
  if (shared_grouped) {
    gate_up.extra_expert = &w.shared_gate_up;
    down.extra_expert = &w.shared_down_proj;
  }
  if (token_stages > 0) {
    if (shared_grouped && (w.shared_gate_up.rows != 2 * I || w.shared_gate_up.cols != H))
      fail("moe_mlp_add: the shared expert's gate/up is [", w.shared_gate_up.rows, " x ",
           w.shared_gate_up.cols, "], expected [", 2 * I, " x ", H, "]");
    const auto* gu = static_cast<const uint16_t*>(w.experts_gate_up.data);
    const auto* extra =
        shared_grouped ? static_cast<const uint16_t*>(w.shared_gate_up.data) : nullptr;
    RoutingOut routing{};
    routing.ids = ids;
    routing.weights = wts;
    routing.groups = static_cast<int>(groups);
    routing.sh = sh;
    routing.expert = expert;
    routing.start = start;
    routing.row_of = row_of;
    routing.token_of = token_of;
    const size_t smem = token_gate_up_smem(token_stages, static_cast<int>(H));
    const int items = static_cast<int>((k + (shared_grouped ? 1 : 0)) * (I / kItemCols));
    with_rule([&](const auto& rule) {
      with_per_lane(E, [&](auto per_lane) {
        using Rule = std::decay_t<decltype(rule)>;
        const auto kernel = moe_token_gate_up_kernel<decltype(per_lane)::value, Rule>;
        constexpr int kThreads = (kTokenWarps + 1) * 32;
        allow_dynamic_smem(kernel, smem, "moe_mlp_add: one token's gate/up weights");
        const int resident = resident_blocks(kernel, kThreads, smem);
        launch("moe_token_gate_up", kernel, static_cast<unsigned>(std::min(items, resident)),
               kThreads, smem, rule, static_cast<const float*>(logits), ld, static_cast<int>(E),
               static_cast<int>(k), x, gu, extra, static_cast<int>(H), static_cast<int>(I),
               token_stages, act, routing);
      });
    });
  } else {
    with_rule(route_and_group);
    linear_grouped(x, P + S, T, w.experts_gate_up, E, groups, expert, start, act, gate_up);
  }
  // One token: the down products and the combination in one kernel (moe_token_down_kernel), where
  // its blocks' weights fit in shared memory. TANDEM_CUDA_MOE_TOKEN_DOWN=0 keeps the grouped
  // product and the combining kernel (A/B timing).
  static const bool token_down_on = env_switch_on("TANDEM_CUDA_MOE_TOKEN_DOWN");
  const int terms = static_cast<int>(k) + (shared_grouped ? 1 : 0);
  int token_down_nt = 0;  // n-tiles a block takes: 2, else 1 where the weights fit; 0: grouped
  if (token_down_on && T == 1 && w.experts_down.dtype == DType::BF16 &&
      w.experts_gate_up.dtype == DType::BF16 && I % 16 == 0 && k_split_warps(H) == kTokenWarps) {
    for (const int nt : {2, 1})
      if (token_down_nt == 0 &&
          token_down_smem(terms, 8 * nt, static_cast<int>(I)) <= kTokenSmemMax)
        token_down_nt = nt;
  }
  if (token_down_nt == 0)
    linear_grouped(act, P + S, T, w.experts_down, E, groups, expert, start, out, down);
  const float* shared = nullptr;
  if (shared_grouped) {
    shared = out + P * H;
  } else if (Is > 0) {
    // activations [T, Is] | up (unfused only) [T, Is] | shared [T, H]
    float* sa = s[9].get<float>(2 * T * Is + T * H);
    float* su = sa + T * Is;
    float* sh = su + T * Is;
    if (fused_gate_up && w.shared_in_groups) {
      // Gate rows then up rows: one product into the two halves' buffers, then the SwiGLU.
      const ops::OutputSlice halves[] = {{sa, Is}, {su, Is}};
      cuda::linear_split(x, T, w.shared_gate_up, halves, 2, nullptr);
      cuda::swiglu(sa, su, T * Is, sa);
    } else if (fused_gate_up) {
      cuda::gate_up_swiglu(x, T, w.shared_gate_up, sa);
    } else {
      cuda::linear(x, T, w.shared_gate_proj, sa);
      cuda::linear(x, T, w.shared_up_proj, su);
      cuda::swiglu(sa, su, T * Is, sa);
    }
    cuda::linear(sa, T, w.shared_down_proj, sh);
    shared = sh;
  }
  // The shared expert's gate logit: the router's last column where stacked, else its own product.
  const float* gate = nullptr;
  int64_t gate_ld = 1;
  if (Is > 0 && gate_row) {
    gate = logits + E;
    gate_ld = ld;
  } else if (Is > 0 && w.shared_gate.rows > 0) {
    float* g = s[10].get<float>(T);
    cuda::linear(x, T, w.shared_gate, g);
    gate = g;
  }
  if (token_down_nt > 0) {
    if (w.experts_down.rows != E * H || w.experts_down.cols != I)
      fail("moe_mlp_add: the stacked down weights are [", w.experts_down.rows, " x ",
           w.experts_down.cols, "], expected [", E * H, " x ", I, "]");
    const auto* dn = static_cast<const uint16_t*>(w.experts_down.data);
    if (shared_grouped && (w.shared_down_proj.dtype != DType::BF16 ||
                           w.shared_down_proj.rows != H || w.shared_down_proj.cols != I))
      fail("moe_mlp_add: the shared expert's down is ", dtype_name(w.shared_down_proj.dtype), " [",
           w.shared_down_proj.rows, " x ", w.shared_down_proj.cols, "], expected BF16 [", H, " x ",
           I, "]");
    const auto* extra =
        shared_grouped ? static_cast<const uint16_t*>(w.shared_down_proj.data) : nullptr;
    const float* sh_row = shared_grouped ? nullptr : shared;
    const int rows = 8 * token_down_nt;  // output columns of a block
    const size_t smem = token_down_smem(terms, rows, static_cast<int>(I));
    with_rule([&](const auto& rule) {
      with_per_lane(E, [&](auto per_lane) {
        using Rule = std::decay_t<decltype(rule)>;
        constexpr int PL = decltype(per_lane)::value;
        const auto kernel = token_down_nt == 2 ? moe_token_down_kernel<2, PL, Rule>
                                               : moe_token_down_kernel<1, PL, Rule>;
        allow_dynamic_smem(kernel, smem, "moe_mlp_add: one token's down weights");
        launch("moe_token_down", kernel, static_cast<unsigned>(ceil_div(H, int64_t{rows})),
               (kTokenWarps + 1) * 32, smem, rule, static_cast<const float*>(logits), ld,
               static_cast<int>(E), static_cast<const float*>(act), ids, wts, row_of,
               static_cast<int>(k), dn, extra, static_cast<int>(P), sh_row, gate,
               static_cast<int>(H), static_cast<int>(I), y);
      });
    });
  } else {
    launch("moe_combine", moe_combine_kernel,
           dim3(grid_blocks(T, "moe_combine"), static_cast<unsigned>(ceil_div(H, kCombineThreads))),
           kCombineThreads, 0, ids, wts, row_of, out, shared, gate, gate_ld, static_cast<int>(k), H,
           y);
  }
  if (routed_ids) {
    routed_ids->resize(static_cast<size_t>(P));
    copy_to_host(routed_ids->data(), ids, sizeof(int32_t) * static_cast<size_t>(P));
  }
  if (routed_weights) {
    routed_weights->resize(static_cast<size_t>(P));
    copy_to_host(routed_weights->data(), wts, sizeof(float) * static_cast<size_t>(P));
  }
}

TANDEM_CUDA_TRACE_UNIT(moe)

}  // namespace tandem::cuda
