// What the decode-shaped tensor-core products share (internal: included by linear.cu and
// linear_tiles.cu): the mma instruction, the chunk of k a lane pair walks, and where an output
// column goes. The reduction order these define is the contract of DESIGN.md principle 2: see
// linear.cu's header for the order itself and linear_tiles.cu for the many-row kernel that
// reproduces it.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace tandem::cuda {

constexpr int kChunk = 64;     // k per warp chunk: 4 lanes x 16
constexpr int kTileRows = 16;  // rows of one m-tile (the mma's m)

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
constexpr int kMaxSlices = 4;
struct SplitOut {
  float* dst[kMaxSlices];
  int start[kMaxSlices + 1];  // first column of each slice; start[parts] = N
  int parts;
  bool accumulate;
  bool bf16;
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

// The many-row product (linear_tiles.cu): y = xs · wᵀ for many bf16 rows xs [m, K]
// (16-byte aligned rows, K a multiple of 16), w bf16 [N, K], with the reduction order of the
// decode kernel that splits K over `classes` warps (4 or 8), bitwise. swiglu: w is
// gate_up_swiglu's pair layout and y receives silu(gate) · up (N / 2 columns).
void linear_tiles(const uint16_t* xs, int m, const uint16_t* w, int N, int K, int classes,
                  bool swiglu, const SplitOut& y);

// Whether linear_tiles takes the many-row products (the default);
// TANDEM_CUDA_TILES=0 in the environment keeps them on the register kernel (A/B timing).
bool tiles_enabled();

}  // namespace tandem::cuda
