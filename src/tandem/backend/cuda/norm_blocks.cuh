// A projection's input norm computed by the first blocks of the projection's own grid (internal:
// included by linear.cu and linear_ring.cu).
//
// From two rows on, and for the DeltaNet's gated norm at any row count, the input norm of a
// decode-shaped product was a kernel of its own that wrote the rows in bf16 for the product: in a
// 9B step of 8 rows on the H100, 65 such launches of ~4.4 µs, mostly the boundary between two
// dependent kernels (BENCHMARKS.md, issue 18). Here the product's first blocks do that kernel's
// work into the same bf16 rows, and every block waits on a counter before it reads an input.
//
// Units: a row of an RMSNorm (a whole block: Threads threads), or a (row, head) of a gated norm
// (a group of kGatedUnitThreads threads; a block runs Threads / kGatedUnitThreads at once). Block
// b < blocks runs units b, b + blocks, ... (gated: b·G + g, then + blocks·G). Their arithmetic is
// the norm kernels' (elementwise.cu), so the rows hold the same bits:
//  - RMSNorm: row_norm.cuh's order for d = K (VT virtual threads summing CW-wide chunks, then the
//    virtual warps in order), then bf16(normed(x, s, w));
//  - gated: the Narrow order over the head (thread t sums elements t, t + 128, ...; then the four
//    warps in order), then bf16(w · (x · s) · silu(z)).
// A row unit stages its row in shared memory with cp.async first (one memory round trip, no
// registers held across the sum), `stage` holding K floats; gated units read from L1/L2.
//
// Progress: a block waits only for the units of blocks of lower index, which the GPU dispatches
// before it, so those blocks are resident and finish whatever the grid's size (the rule a
// decoupled look-back scan relies on).
// The counters: sync[0] counts the norm blocks that are done, sync[1] the blocks past the wait.
// They are zero between launches: the last block past the wait zeroes both, when no block of the
// launch reads them any more, and the next launch touches them only after its pdl_wait, when
// this grid has completed (calls are ordered on the context's stream).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "tandem/backend/cuda/activation.cuh"
#include "tandem/backend/cuda/linear_mma.cuh"
#include "tandem/backend/cuda/row_norm.cuh"

namespace tandem::cuda {

constexpr int kGatedUnitThreads = kNormThreads;  // the gated norm kernel's block

// What a product's norm blocks do; blocks == 0: no norm (the rows are already in `out`).
struct NormBlocks {
  const float* x = nullptr;  // the fp32 input rows [m, K] (16-byte aligned, K % 4 == 0)
  const float* z = nullptr;  // gated norm: the gates [m, K]; null: an RMSNorm of whole rows
  const float* w = nullptr;  // the norm weight: [K] (16-byte aligned), or [head_dim] (gated)
  uint16_t* out = nullptr;   // the bf16 rows [m, K] the product reads
  unsigned* sync = nullptr;  // two counters, zero between launches
  int units = 0;             // m rows, or m · K / head_dim heads
  int blocks = 0;            // the grid's first `blocks` blocks run the units
  int head_dim = 0;          // gated only
  float eps = 0.0f;
  bool zero_centred = false;  // RMSNorm only
};

// Named barrier Id over `threads` threads (0 is __syncthreads'; the ring kernel uses 1). An
// immediate id, so that the kernel reserves only the barriers it names.
template <int Id>
__device__ __forceinline__ void named_barrier(int threads) {
  asm volatile("bar.sync %0, %1;" ::"n"(Id), "r"(threads) : "memory");
}

// Group g's barrier (g < 2) over the kGatedUnitThreads threads of a gated unit.
__device__ __forceinline__ void gated_group_barrier(int g) {
  if (g == 0)
    named_barrier<2>(kGatedUnitThreads);
  else
    named_barrier<3>(kGatedUnitThreads);
}

// A relaxed load for the wait's spin: the fence after the spin makes it an acquire, once (an
// acquiring load in the loop would order the SM's caches on every trip).
__device__ __forceinline__ unsigned load_relaxed(const unsigned* p) {
  unsigned v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// The virtual-warp totals of row x[d] (shared memory) in norm order (VT, CW), by Threads
// threads (thread t plays virtual threads t, t + Threads, ...); row_square_partials' sums.
template <int Threads, int VT, int CW>
__device__ __forceinline__ void staged_square_partials(const float* x, int d, double* s_warp) {
  for (int v = threadIdx.x; v < VT; v += Threads) {  // uniform per warp
    double ss = 0.0;
    for (int c = v; c * CW < d; c += VT)
#pragma unroll
      for (int e = 0; e < CW; ++e) {
        const float f = x[c * CW + e];
        ss += static_cast<double>(f) * f;
      }
    ss = warp_sum(ss);
    if (threadIdx.x % 32 == 0) s_warp[v / 32] = ss;
  }
}

// Row r of an RMSNorm by the block's Threads threads; ends with them synchronised (barrier Bar).
template <int Threads, int Bar>
__device__ __forceinline__ void norm_row_unit(const NormBlocks& a, int r, int K, float* stage,
                                              double* s_warp) {
  const float* x = a.x + static_cast<size_t>(r) * K;
  const int k4 = K / 4;
  for (int c = threadIdx.x; c < k4; c += Threads) {
    const unsigned dst = shared_address(stage + 4 * c);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst),
                 "l"(__cvta_generic_to_global(x + 4 * c))
                 : "memory");
  }
  asm volatile("cp.async.wait_all;" ::: "memory");
  named_barrier<Bar>(Threads);
  const NormOrder order = norm_order(K);
  int vt = kWideNormThreads;
  if (order == NormOrder::Chunked) {
    staged_square_partials<Threads, kWideNormThreads, 4>(stage, K, s_warp);
  } else if (order == NormOrder::Wide) {
    staged_square_partials<Threads, kWideNormThreads, 1>(stage, K, s_warp);
  } else {
    staged_square_partials<Threads, kNormThreads, 1>(stage, K, s_warp);
    vt = kNormThreads;
  }
  named_barrier<Bar>(Threads);
  double ss = 0.0;
  for (int w = 0; w < vt / 32; ++w) ss += s_warp[w];  // row_square_total's order
  const float s = inv_rms_from_sum(ss, K, a.eps);
  const float4* w4 = reinterpret_cast<const float4*>(a.w);
  uint2* out = reinterpret_cast<uint2*>(a.out + static_cast<size_t>(r) * K);
  for (int c = threadIdx.x; c < k4; c += Threads) {
    const float4 v = reinterpret_cast<const float4*>(stage)[c], wv = w4[c];
    out[c] = make_uint2(
        pack_bf16(normed(v.x, s, wv.x, a.zero_centred), normed(v.y, s, wv.y, a.zero_centred)),
        pack_bf16(normed(v.z, s, wv.z, a.zero_centred), normed(v.w, s, wv.w, a.zero_centred)));
  }
  named_barrier<Bar>(Threads);  // stage and s_warp are free again
}

// Gated unit u = (row, head) by group g's kGatedUnitThreads threads (gated_group_barrier).
__device__ __forceinline__ void gated_unit(const NormBlocks& a, int u, int K, int g,
                                           double* s_warp) {
  const int hd = a.head_dim, heads = K / hd;
  const size_t off = static_cast<size_t>(u / heads) * K + static_cast<size_t>(u % heads) * hd;
  const float *x = a.x + off, *z = a.z + off;
  const int t = threadIdx.x % kGatedUnitThreads;
  double ss = 0.0;
  for (int i = t; i < hd; i += kGatedUnitThreads) ss += static_cast<double>(x[i]) * x[i];
  ss = warp_sum(ss);
  if (t % 32 == 0) s_warp[t / 32] = ss;
  gated_group_barrier(g);
  double total = 0.0;
  for (int w = 0; w < kGatedUnitThreads / 32; ++w) total += s_warp[w];
  const float s = inv_rms_from_sum(total, hd, a.eps);
  __nv_bfloat16* out = reinterpret_cast<__nv_bfloat16*>(a.out) + off;
  for (int i = t; i < hd; i += kGatedUnitThreads)
    out[i] = __float2bfloat16_rn(a.w[i] * (x[i] * s) * silu(z[i]));
  gated_group_barrier(g);  // s_warp is free again
}

// Runs this block's units (if any), then waits until every norm block is done. Called by the
// product's Threads computing threads (all of them, after pdl_wait); `stage` holds K floats
// (RMSNorm) and Bar is a named barrier over those threads. Ends with them synchronised, the
// rows in a.out visible to their loads.
template <int Threads, int Bar>
__device__ __forceinline__ void run_norm_blocks(const NormBlocks& a, int K, float* stage) {
  static_assert(Threads % kGatedUnitThreads == 0 && Threads <= 2 * kGatedUnitThreads,
                "one or two whole gated groups");
  constexpr int G = Threads / kGatedUnitThreads;
  __shared__ double s_warp[G][kWideNormThreads / 32];
  const int b = blockIdx.x;
  if (b < a.blocks) {
    if (a.z == nullptr) {
      for (int r = b; r < a.units; r += a.blocks)
        norm_row_unit<Threads, Bar>(a, r, K, stage, s_warp[0]);
    } else {
      const int g = threadIdx.x / kGatedUnitThreads;
      for (int u = b * G + g; u < a.units; u += a.blocks * G) gated_unit(a, u, K, g, s_warp[g]);
    }
    named_barrier<Bar>(Threads);
    if (threadIdx.x == 0) {
      __threadfence();  // the block's rows (ordered before by the barrier), then the count
      atomicAdd(&a.sync[0], 1u);
    }
  }
  if (threadIdx.x == 0) {
    while (load_relaxed(&a.sync[0]) < static_cast<unsigned>(a.blocks)) {
    }
    __threadfence();  // acquire: the rows the count stands for, for this block's loads after the
                      // barrier
    const unsigned grid = gridDim.x * gridDim.y * gridDim.z;
    if (atomicAdd(&a.sync[1], 1u) == grid - 1) {
      atomicExch(&a.sync[0], 0u);
      atomicExch(&a.sync[1], 0u);
    }
  }
  named_barrier<Bar>(Threads);
}

}  // namespace tandem::cuda
