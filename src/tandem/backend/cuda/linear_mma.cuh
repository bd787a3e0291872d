// What the decode-shaped tensor-core products share (internal: included by linear.cu and
// linear_tiles.cu): the mma instruction, the chunk of k a lane pair walks, and where an output
// column goes. The reduction order these define is the contract of DESIGN.md principle 2: see
// linear.cu's header for the order itself and linear_tiles.cu for the many-row kernel that
// reproduces it.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "tandem/backend/cuda/activation.cuh"
#include "tandem/backend/cuda/conv_channel.cuh"

namespace tandem::cuda {

constexpr int kChunk = 64;       // k per warp chunk: 4 lanes x 16
constexpr int kTileRows = 16;    // rows of one m-tile (the mma's m)
constexpr int kWideRows = 8192;  // weights with at least this many rows: 4 warps per block, else 8

// The k-split warps of a weight of `rows` rows (a function of the weight's shape alone, part of
// every output's reduction order): the decode kernels' warps per block.
__host__ __device__ constexpr int k_split_warps(int64_t rows) {
  return rows >= kWideRows ? 4 : 8;
}

// A shared-memory pointer as the 32-bit shared::cta address that cp.async and mbarriers take.
__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (lo) in the low 16 bits
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                               uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Where output column `col` of a row goes: consecutive column slices, each its own row-major
// [m, width] array (linear_split), or one slice for a plain linear. accumulate (linear_add, one
// slice): the value is added to what the destination holds, as add_inplace would add it.
// bf16 (one slice): the destination is bf16 [m, width] and receives the value rounded to nearest
// even, the rounding a consuming linear applies to its inputs (swiglu_mlp_add's activations).
// conv: a DeltaNet's conv the register kernel (linear.cu) runs on the first slice after its
// columns are stored (ConvFold; conv.out == nullptr: none).
constexpr int kMaxSlices = 4;
struct SplitOut {
  float* dst[kMaxSlices];
  int start[kMaxSlices + 1];  // first column of each slice; start[parts] = N
  int parts;
  bool accumulate;
  bool bf16;
  ConvFold conv;
  __device__ __forceinline__ void store(int r, int col, float v) const {
    if (bf16) {
      reinterpret_cast<__nv_bfloat16*>(dst[0])[static_cast<size_t>(r) * start[1] + col] =
          __float2bfloat16_rn(v);
      return;
    }
    float* d = dst[0];
    int s0 = 0, s1 = start[1];
#pragma unroll
    for (int q = 1; q < kMaxSlices; ++q)
      if (q < parts && col >= start[q]) {
        d = dst[q];
        s0 = start[q];
        s1 = start[q + 1];
      }
    float& out = d[static_cast<size_t>(r) * (s1 - s0) + (col - s0)];
    out = accumulate ? out + v : v;
  }
};

// The end of a column group of the register kernel (linear.cu) and the ring kernel
// (linear_ring.cu): the Warps k-split warps' partial sums c (this lane's mma accumulators, rows
// row0 .. row0 + 16·Tiles of the call) are summed in warp order through shared memory and stored
// (SwiGLU: as silu(gate) · up). Every one of the Warps warps calls it, and it ends with them
// synchronised, so `partial` may be reused. BarrierThreads = 0: the Warps warps are the whole
// block (__syncthreads); else named barrier 1 over the first BarrierThreads (= 32·Warps) threads,
// for a block whose other warps never take part.
template <int BarrierThreads>
__device__ __forceinline__ void group_barrier() {
  if constexpr (BarrierThreads == 0)
    __syncthreads();
  else
    asm volatile("bar.sync 1, %0;" ::"n"(BarrierThreads) : "memory");
}

template <int Warps, int Tiles, int NT, bool SwiGLU, int BarrierThreads = 0>
__device__ __forceinline__ void finish_group(float (&partial)[Warps][Tiles][NT][32][4],
                                             const float (&c)[Tiles][NT][4], int warp, int lane,
                                             int row0, int m, int n_base, int N, int row_base,
                                             const SplitOut& y) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int i = 0; i < Tiles; ++i)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) partial[warp][i][nt][lane][e] = c[i][nt][e];
  group_barrier<BarrierThreads>();
  // Column sums over the warps in order 0, 1, ...
  auto warp_sum = [&](int i, int nt, float(&sum)[4]) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      sum[e] = partial[0][i][nt][lane][e];
#pragma unroll
      for (int v = 1; v < Warps; ++v) sum[e] += partial[v][i][nt][lane][e];
    }
  };
  if constexpr (SwiGLU) {
    // Warp v finishes pairs v, v + Warps, ...: gate tile 2p, up tile 2p + 1.
    const int half = N / 2;
    for (int pr = warp; pr < NT / 2; pr += Warps) {
#pragma unroll
      for (int i = 0; i < Tiles; ++i) {
        float gs[4], us[4];
        warp_sum(i, 2 * pr, gs);
        warp_sum(i, 2 * pr + 1, us);
        const int col = n_base / 2 + pr * 8 + 2 * t;
        const int r_lo = row0 + i * 16 + g, r_hi = r_lo + 8;
        if (r_lo < m) {
          if (col < half) y.store(row_base + r_lo, col, silu(gs[0]) * us[0]);
          if (col + 1 < half) y.store(row_base + r_lo, col + 1, silu(gs[1]) * us[1]);
        }
        if (r_hi < m) {
          if (col < half) y.store(row_base + r_hi, col, silu(gs[2]) * us[2]);
          if (col + 1 < half) y.store(row_base + r_hi, col + 1, silu(gs[3]) * us[3]);
        }
      }
    }
  } else {
    // Warp v finishes n-tiles v, v + Warps, ...
    for (int nt = warp; nt < NT; nt += Warps) {
#pragma unroll
      for (int i = 0; i < Tiles; ++i) {
        float sum[4];
        warp_sum(i, nt, sum);
        const int col = n_base + nt * 8 + 2 * t;
        const int r_lo = row0 + i * 16 + g, r_hi = r_lo + 8;
        if (r_lo < m) {
          if (col < N) y.store(row_base + r_lo, col, sum[0]);
          if (col + 1 < N) y.store(row_base + r_lo, col + 1, sum[1]);
        }
        if (r_hi < m) {
          if (col < N) y.store(row_base + r_hi, col, sum[2]);
          if (col + 1 < N) y.store(row_base + r_hi, col + 1, sum[3]);
        }
      }
    }
  }
  group_barrier<BarrierThreads>();
}

// The many-row product (linear_tiles.cu): y = xs · wᵀ for many bf16 rows xs [m, K]
// (16-byte aligned rows, K a multiple of 16), w bf16 [N, K], with the reduction order of the
// decode kernel that splits K over `classes` warps (4 or 8), bitwise. swiglu: w is
// gate_up_swiglu's pair layout and y receives silu(gate) · up (N / 2 columns).
void linear_tiles(const uint16_t* xs, int m, const uint16_t* w, int N, int K, int classes,
                  bool swiglu, const SplitOut& y);

// The product of 17..32 bf16 rows with the register kernel's bits, its weights streamed through a
// shared-memory ring by a producer warp (linear_ring.cu); same arguments as linear_tiles.
void linear_ring(const uint16_t* xs, int m, const uint16_t* w, int N, int K, int classes,
                 bool swiglu, const SplitOut& y);

// Whether linear_ring takes a product of m rows: 17..32 rows, unless TANDEM_CUDA_RING=0 in the
// environment keeps them on the register kernel (A/B timing).
bool ring_takes(int m);

// Whether linear_tiles takes the many-row products (the default);
// TANDEM_CUDA_TILES=0 in the environment keeps them on the register kernel (A/B timing).
bool tiles_enabled();

}  // namespace tandem::cuda
