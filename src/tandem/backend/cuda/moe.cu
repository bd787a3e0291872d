// Mixture-of-experts MLP on the GPU (ops::moe_mlp_add): routing, grouping, the experts' grouped
// products and the per-token combination, all on the stream (no host round trip, so a decode
// step with MoE layers is captured into a CUDA graph like any other).
//
//   1. router logits [T, E] = x · routerᵀ (cuda::linear);
//   2. moe_route_kernel: per token, softmax in fp32, the top k by probability (the lower expert
//      id on equal probabilities), renormalised — route_top_k's rule;
//   3. moe_group_kernel: the T·k (token, choice) pairs grouped by expert, experts ascending and
//      pairs in order within an expert ("pair rows");
//   4. the input rows gathered in pair-row order; linear_grouped multiplies each expert's rows by
//      its gate/up rows [2I, H], moe_swiglu_kernel forms silu(gate) · up, and linear_grouped
//      multiplies them by each expert's down [H, I];
//   5. the shared expert (gate, up, SwiGLU, down) and its gate logit over all tokens;
//   6. moe_combine_kernel: per token, its experts' outputs weighted and summed in ascending
//      expert id, then + sigmoid(gate) · shared, added to y (cpu::moe_mlp_add's order).
//
// Batch invariance: a pair row's products are the ones cuda::linear of its expert computes for
// that row alone (linear_grouped), whichever other rows share the expert; the combination's order
// depends on the token's own routing only. So speculation's verify windows give decoding's bits.
#include <cuda_runtime.h>

#include <cmath>

#include "tandem/backend/cuda/activation.cuh"
#include "tandem/backend/cuda/check.cuh"
#include "tandem/backend/cuda/cuda_ops.h"
#include "tandem/core/error.h"

namespace tandem::cuda {

namespace {

constexpr int kRouteThreads = 256;
constexpr int kGroupThreads = 1024;
constexpr int kMaxTopK = 32;

// (probability, expert) ordered as route_top_k orders them: larger probability first, the lower
// id on a tie. Ties between equal keys never arise (ids differ).
struct Candidate {
  float p;
  int e;
};
__device__ __forceinline__ bool before(const Candidate& a, const Candidate& b) {
  return a.p > b.p || (a.p == b.p && a.e < b.e);
}

__device__ __forceinline__ Candidate warp_best(Candidate c) {
  for (int offset = 16; offset > 0; offset /= 2) {
    Candidate o{__shfl_xor_sync(0xffffffffu, c.p, offset),
                __shfl_xor_sync(0xffffffffu, c.e, offset)};
    if (before(o, c)) c = o;
  }
  return c;
}

// Grid: one block per token. probs (dynamic shared memory) holds the token's E probabilities.
// The softmax's max and sum are reduced in a fixed tree (shape of E only); the top k are chosen
// one at a time, each the best remaining candidate under `before`.
__global__ void __launch_bounds__(kRouteThreads)
    moe_route_kernel(const float* __restrict__ logits, int E, int k, bool renormalise,
                     int32_t* __restrict__ ids, float* __restrict__ weights) {
  pdl_wait();
  pdl_release();
  extern __shared__ float probs[];
  __shared__ float s_red[kRouteThreads / 32];
  __shared__ Candidate s_best[kRouteThreads / 32];
  __shared__ float s_top[kMaxTopK];
  __shared__ int s_id[kMaxTopK];
  const float* l = logits + static_cast<size_t>(blockIdx.x) * E;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float mx = -INFINITY;
  for (int e = threadIdx.x; e < E; e += kRouteThreads) mx = fmaxf(mx, l[e]);
  for (int offset = 16; offset > 0; offset /= 2)
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, offset));
  if (lane == 0) s_red[warp] = mx;
  __syncthreads();
  mx = s_red[0];
  for (int w = 1; w < kRouteThreads / 32; ++w) mx = fmaxf(mx, s_red[w]);
  __syncthreads();
  float sum = 0.0f;
  for (int e = threadIdx.x; e < E; e += kRouteThreads) {
    probs[e] = expf(l[e] - mx);
    sum += probs[e];
  }
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane == 0) s_red[warp] = sum;
  __syncthreads();
  sum = 0.0f;
  for (int w = 0; w < kRouteThreads / 32; ++w) sum += s_red[w];
  for (int e = threadIdx.x; e < E; e += kRouteThreads) probs[e] /= sum;
  __syncthreads();
  for (int j = 0; j < k; ++j) {
    Candidate c{-1.0f, E};
    for (int e = threadIdx.x; e < E; e += kRouteThreads) {
      const Candidate o{probs[e], e};
      if (before(o, c)) c = o;
    }
    c = warp_best(c);
    if (lane == 0) s_best[warp] = c;
    __syncthreads();
    if (threadIdx.x == 0) {
      Candidate b = s_best[0];
      for (int w = 1; w < kRouteThreads / 32; ++w)
        if (before(s_best[w], b)) b = s_best[w];
      s_top[j] = b.p;
      s_id[j] = b.e;
      probs[b.e] = -1.0f;  // taken (probabilities are >= 0)
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    float top = 0.0f;
    for (int j = 0; j < k; ++j) top += s_top[j];
    for (int j = 0; j < k; ++j) {
      ids[blockIdx.x * k + j] = s_id[j];
      weights[blockIdx.x * k + j] = renormalise ? s_top[j] / top : s_top[j];
    }
  }
}

// One block. pairs = T·k routed (token, choice) pairs, ids[i] the expert of pair i. Writes:
//   expert[g], start[g] for the used experts in ascending id (g < used), start[g] = pairs for
//   used <= g <= groups (empty groups);
//   row_of[i]: pair i's row in expert order; token_of[r]: the token of pair row r.
// Counting is a scan per expert (deterministic: no atomics), fine for decode-sized pair counts.
__global__ void __launch_bounds__(kGroupThreads)
    moe_group_kernel(const int32_t* __restrict__ ids, int pairs, int k, int E, int groups,
                     int32_t* __restrict__ expert, int32_t* __restrict__ start,
                     int32_t* __restrict__ row_of, int32_t* __restrict__ token_of) {
  pdl_wait();
  pdl_release();
  extern __shared__ int32_t s_count[];  // [E], then the first row of each expert [E]
  int32_t* s_first = s_count + E;
  for (int e = threadIdx.x; e < E; e += kGroupThreads) {
    int n = 0;
    for (int i = 0; i < pairs; ++i) n += ids[i] == e;
    s_count[e] = n;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int row = 0, g = 0;
    for (int e = 0; e < E; ++e) {
      s_first[e] = row;
      if (s_count[e] == 0) continue;
      if (g < groups) {
        expert[g] = e;
        start[g] = row;
      }
      ++g;
      row += s_count[e];
    }
    for (; g <= groups; ++g) start[g] = row;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += kGroupThreads) {
    if (s_count[e] == 0) continue;
    int r = s_first[e];
    for (int i = 0; i < pairs; ++i)
      if (ids[i] == e) {
        row_of[i] = r;
        token_of[r] = i / k;
        ++r;
      }
  }
}

// xg[r, :] = x[token_of[r], :] for the pair rows r < rows.
__global__ void moe_gather_kernel(const float* __restrict__ x, const int32_t* __restrict__ token_of,
                                  int64_t rows, int64_t H, float* __restrict__ xg) {
  pdl_wait();
  pdl_release();
  const int64_t n = rows * H;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / H, c = i % H;
    xg[i] = x[static_cast<int64_t>(token_of[r]) * H + c];
  }
}

// act[r, c] = silu(h[r, c]) · h[r, I + c] for h [rows, 2I] (an expert's gate then up outputs).
__global__ void moe_swiglu_kernel(const float* __restrict__ h, int64_t rows, int64_t I,
                                  float* __restrict__ act) {
  pdl_wait();
  pdl_release();
  const int64_t n = rows * I;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / I, c = i % I;
    const float* row = h + r * 2 * I;
    act[i] = silu(row[c]) * row[I + c];
  }
}

// Grid: one block per token. y[t] += Σ (its choices in ascending expert id) w · out[row] and,
// with a shared expert, + sigmoid(gate[t]) · shared[t], as one term.
__global__ void moe_combine_kernel(const int32_t* __restrict__ ids, const float* __restrict__ wts,
                                   const int32_t* __restrict__ row_of,
                                   const float* __restrict__ out, const float* __restrict__ shared,
                                   const float* __restrict__ gate, int k, int64_t H,
                                   float* __restrict__ y) {
  pdl_wait();
  pdl_release();
  const int t = blockIdx.x;
  int order[kMaxTopK];
  for (int j = 0; j < k; ++j) order[j] = j;
  for (int a = 1; a < k; ++a)  // insertion sort by expert id (k is small)
    for (int b = a; b > 0 && ids[t * k + order[b]] < ids[t * k + order[b - 1]]; --b) {
      const int s = order[b];
      order[b] = order[b - 1];
      order[b - 1] = s;
    }
  const float g = shared ? 1.0f / (1.0f + expf(-gate[t])) : 0.0f;
  float* yt = y + static_cast<int64_t>(t) * H;
  for (int64_t i = threadIdx.x; i < H; i += blockDim.x) {
    float acc = 0.0f;
    for (int j = 0; j < k; ++j) {
      const int p = t * k + order[j];
      acc += wts[p] * out[static_cast<int64_t>(row_of[p]) * H + i];
    }
    yt[i] += shared ? acc + g * shared[static_cast<int64_t>(t) * H + i] : acc;
  }
}

// Scratch of one call, grown to the largest seen (calls are stream-ordered). Growing bumps the
// scratch generation so that no captured graph replays freed memory.
struct MoeScratch {
  void* p[12] = {};
  size_t bytes[12] = {};
  template <class T>
  T* get(int slot, int64_t n) {
    const size_t want = sizeof(T) * static_cast<size_t>(n > 0 ? n : 1);
    if (want > bytes[slot]) {
      cuda::free(p[slot]);
      p[slot] = cuda::alloc(want);
      bytes[slot] = want;
      bump_scratch_generation();
    }
    return static_cast<T*>(p[slot]);
  }
};

}  // namespace

void moe_mlp_add(const float* x, int64_t T, const ops::MoeWeights& w, float* y,
                 std::vector<int32_t>* routed_ids, std::vector<float>* routed_weights) {
  if (T <= 0) return;
  const int64_t E = w.router.rows, H = w.router.cols, k = w.top_k;
  const int64_t I = w.experts_down.cols, Is = w.shared_gate_proj.rows;
  if (k > kMaxTopK) fail("moe_mlp_add: top ", k, " experts (at most ", kMaxTopK, " on CUDA)");
  const int64_t P = T * k;                // pair rows
  const int64_t groups = std::min(E, P);  // experts a call can use
  if (P > INT32_MAX || E > 8192) fail("moe_mlp_add: ", T, " tokens x top ", k, " of ", E);
  static MoeScratch s;
  float* logits = s.get<float>(0, T * E);
  auto* ids = s.get<int32_t>(1, P);
  float* wts = s.get<float>(2, P);
  auto* expert = s.get<int32_t>(3, groups);
  auto* start = s.get<int32_t>(4, groups + 1);
  auto* row_of = s.get<int32_t>(5, P);
  auto* token_of = s.get<int32_t>(6, P);
  float* xg = s.get<float>(7, P * H);
  float* h = s.get<float>(8, P * 2 * I);
  float* act = s.get<float>(9, P * I);
  float* out = s.get<float>(10, P * H);
  cuda::linear(x, T, w.router, logits);
  launch("moe_route", moe_route_kernel, grid_blocks(T, "moe_route"), kRouteThreads,
         sizeof(float) * static_cast<size_t>(E), logits, static_cast<int>(E), static_cast<int>(k),
         w.renormalise, ids, wts);
  launch("moe_group", moe_group_kernel, 1, kGroupThreads,
         2 * sizeof(int32_t) * static_cast<size_t>(E), ids, static_cast<int>(P),
         static_cast<int>(k), static_cast<int>(E), static_cast<int>(groups), expert, start, row_of,
         token_of);
  launch("moe_gather", moe_gather_kernel, grid_stride_blocks(P * H, 256), 256, 0, x, token_of, P, H,
         xg);
  // A token picks an expert once, so no group has more rows than there are tokens.
  linear_grouped(xg, P, T, w.experts_gate_up, E, groups, expert, start, h);
  launch("moe_swiglu", moe_swiglu_kernel, grid_stride_blocks(P * I, 256), 256, 0, h, P, I, act);
  linear_grouped(act, P, T, w.experts_down, E, groups, expert, start, out);
  float* shared = nullptr;
  float* gate = nullptr;
  if (Is > 0) {
    float* sg = s.get<float>(11, 2 * T * Is + T * H + T);  // gate, up | shared | gate logit
    float* su = sg + T * Is;
    shared = su + T * Is;
    gate = shared + T * H;
    cuda::linear(x, T, w.shared_gate_proj, sg);
    cuda::linear(x, T, w.shared_up_proj, su);
    cuda::swiglu(sg, su, T * Is, sg);
    cuda::linear(sg, T, w.shared_down_proj, shared);
    cuda::linear(x, T, w.shared_gate, gate);
  }
  launch("moe_combine", moe_combine_kernel, grid_blocks(T, "moe_combine"), 256, 0, ids, wts, row_of,
         out, shared, gate, static_cast<int>(k), H, y);
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
