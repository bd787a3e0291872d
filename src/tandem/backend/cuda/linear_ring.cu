// The decode product of 17-32 bf16 rows (a decode step of 32 rows, a 4-token verify window of 8
// rows): y[m, N] = x[m, K] · Wᵀ with the register kernel's k-split and mma sequence
// (linear.cu), bitwise, but with the weights fed to the mma warps by a producer warp.
//
// Why: the register kernel keeps each warp's accumulators and its weights in registers. With two
// m-tiles there is no room left to load the next chunk's weights while multiplying the current
// one, so each warp has one chunk in flight, the 12-16 warps of an SM do not cover DRAM's
// latency, and the projections of a 32-row step reach 30-60% of the bandwidth (BENCHMARKS.md,
// issue 18). Here one extra warp per block does nothing but stream the block's weight rows into a
// ring of shared-memory stages with bulk copies (the TMA engine: no registers, no per-thread
// instructions per 16 bytes), Stages ahead, across column groups; the mma warps request their
// input fragments (from L1/L2, as the register kernel does), wait on the stage's mbarrier, copy
// their weight fragments to registers, release the stage and multiply. The bytes in flight no
// longer depend on the registers the accumulators take. The input fragments' latency is what
// the mma warps still wait on, so the ring is kept as shallow as covers DRAM's latency and the
// rest of shared memory is left to L1 (launch_ring).
//
// The reduction order is the register kernel's, by construction:
//  - a block owns the 8·NT weight rows of a column group; k-split warp w (of Warps, a function of
//    the weight's shape alone) accumulates chunks w, w + Warps, ... (64 k each) in ascending
//    order with the same four m16n8k16 mmas per chunk and the same lane-to-k mapping;
//  - stage s holds chunks s·Warps .. s·Warps + Warps - 1 of every row of the group, so each warp
//    takes exactly its own chunk of each stage, in ascending order;
//  - finish_group sums the Warps partials in warp order, as there.
// So a row's outputs are the same bits here as in a 1-row call (GPU test
// ManyRowProductsEqualSingleRowCalls).
//
// Stage layout: 8·NT rows of Warps · 128 bytes (64 bf16 per warp), each row padded by 16 bytes so
// that consecutive rows start 4 banks apart: the 8 lanes of a quarter-warp (rows g, g + 1, lanes
// t = 0..3 at bytes 32t) then touch 32 distinct banks with their 16-byte reads. A bulk copy
// writes one row's span of a stage (512 or 1,024 bytes, contiguous in the weight).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdlib>
#include <string_view>

#include "tandem/backend/cuda/bulk_copy.cuh"
#include "tandem/backend/cuda/check.cuh"
#include "tandem/backend/cuda/linear_mma.cuh"
#include "tandem/core/env_switch.h"
#include "tandem/core/error.h"

namespace tandem::cuda {

namespace {

template <int Warps, int NT>
struct RingShape {
  static constexpr int kRows = 8 * NT;                  // weight rows of a column group
  static constexpr int kRowBytes = Warps * kChunk * 2;  // one stage's span of a row
  static constexpr int kRowStride = kRowBytes + 16;     // padded: rows 4 banks apart
  static constexpr int kStageBytes = kRows * kRowStride;
};

// Warps k-split warps and one producer warp (the last). Blocks walk column groups blockIdx.x,
// blockIdx.x + gridDim.x, ...; the producer's stage sequence runs on across groups, so the ring
// stays full while the mma warps finish a group.
template <int Warps, int Tiles, int NT, int Stages, bool SwiGLU>
__global__ void __launch_bounds__((Warps + 1) * 32)
    linear_ring_kernel(const uint16_t* __restrict__ x, int m, const uint16_t* __restrict__ w, int N,
                       int K, const SplitOut y) {
  using S = RingShape<Warps, NT>;
  static_assert(!SwiGLU || NT % 2 == 0, "SwiGLU pairs need an even number of n-tiles");
  extern __shared__ __align__(128) unsigned char ring[];
  __shared__ __align__(8) uint64_t full[Stages], empty[Stages];
  __shared__ float partial[Warps][Tiles][NT][32][4];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int groups = (N + S::kRows - 1) / S::kRows;
  const int chunks = (K + kChunk - 1) / kChunk;
  const int per_group = (chunks + Warps - 1) / Warps;  // stages of one column group

  init_barriers(full, empty, Stages, Warps);

  if (warp == Warps) {
    // The producer. Weights never change, so it starts before the previous kernel is done and
    // never waits on it.
    const uint64_t policy = evict_first_policy();
    int q = 0;  // stages issued by this block so far
    for (int grp = blockIdx.x; grp < groups; grp += gridDim.x) {
      const int n0 = grp * S::kRows;
      const int rows = N - n0 < S::kRows ? N - n0 : S::kRows;
      for (int s = 0; s < per_group; ++s, ++q) {
        const int slot = q % Stages;
        if (q >= Stages) mbar_wait(shared_address(&empty[slot]), ((q / Stages) - 1) & 1);
        const int k0 = s * Warps * kChunk;
        const unsigned bytes =
            static_cast<unsigned>(K - k0 < Warps * kChunk ? K - k0 : Warps * kChunk) * 2;
        const uint32_t bar = shared_address(&full[slot]);
        if (lane == 0) mbar_arrive_expect(bar, bytes * rows);
        __syncwarp();
        const uint32_t base = shared_address(ring + slot * S::kStageBytes);
        for (int r = lane; r < rows; r += 32)
          bulk_copy(base + r * S::kRowStride, w + static_cast<size_t>(n0 + r) * K + k0, bytes, bar,
                    policy);
      }
    }
    return;
  }

  pdl_wait();
  pdl_release();
  const int g = lane / 4, t = lane % 4;
  // This lane's inputs at k (rows r, k .. k + 15: two 16-byte loads), requested before the
  // stage's wait, so their latency overlaps its arrival. m <= 16·Tiles: one pass per group.
  auto load_a = [&](uint4(&a)[Tiles][2][2], int k) {
#pragma unroll
    for (int i = 0; i < Tiles; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = i * kTileRows + g + 8 * h;
        if (k < K && r < m) {
          const uint4* p = reinterpret_cast<const uint4*>(x + static_cast<size_t>(r) * K + k);
          a[i][h][0] = p[0];
          a[i][h][1] = p[1];
        } else {
          a[i][h][0] = a[i][h][1] = make_uint4(0, 0, 0, 0);
        }
      }
  };
  int q = 0;
  for (int grp = blockIdx.x; grp < groups; grp += gridDim.x) {
    const int n_base = grp * S::kRows;
    bool n_ok[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) n_ok[nt] = n_base + nt * 8 + g < N;
    float c[Tiles][NT][4];
#pragma unroll
    for (int i = 0; i < Tiles; ++i)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) c[i][nt][0] = c[i][nt][1] = c[i][nt][2] = c[i][nt][3] = 0.f;
    uint4 a[Tiles][2][2];
    for (int s = 0; s < per_group; ++s, ++q) {
      const int slot = q % Stages;
      const int ch = s * Warps + warp;
      const int k = ch * kChunk + 16 * t;
      const bool k_ok = k < K;
      load_a(a, k);
      mbar_wait(shared_address(&full[slot]), (q / Stages) & 1);
      uint4 wv[NT][2];
      const unsigned char* stage = ring + slot * S::kStageBytes + warp * kChunk * 2 + 32 * t;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        if (n_ok[nt] && k_ok) {
          const uint4* p = reinterpret_cast<const uint4*>(stage + (nt * 8 + g) * S::kRowStride);
          wv[nt][0] = p[0];
          wv[nt][1] = p[1];
        } else {
          wv[nt][0] = wv[nt][1] = make_uint4(0, 0, 0, 0);
        }
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(shared_address(&empty[slot]));
      if (ch < chunks) {  // uniform across the warp: the group's last stage is short
        // mma j takes k + 4j .. k + 4j + 3: 32-bit words 2j, 2j + 1 of the lane's 16 values.
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
          for (int i = 0; i < Tiles; ++i) {
            const uint32_t* lo = reinterpret_cast<const uint32_t*>(&a[i][0][0]);
            const uint32_t* hi = reinterpret_cast<const uint32_t*>(&a[i][1][0]);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
              const uint32_t* wb = reinterpret_cast<const uint32_t*>(&wv[nt][0]);
              mma_bf16_16816(c[i][nt], lo[2 * j], hi[2 * j], lo[2 * j + 1], hi[2 * j + 1],
                             wb[2 * j], wb[2 * j + 1]);
            }
          }
        }
      }
    }
    finish_group<Warps, Tiles, NT, SwiGLU, Warps * 32>(partial, c, warp, lane, 0, m, n_base, N, 0,
                                                       y);
  }
}

// Column groups and stages per class, measured (BENCHMARKS.md, issue 18). The group's width is
// free (no output's arithmetic depends on it), and every block reads all m input rows once per
// group, from L2: 32-row groups for both classes, so a narrow weight of 12,288 columns (the MLP's
// down projection) reads its 32 input rows as often as its weight bytes rather than twice
// (16-row groups: 0.7% slower 32-row steps on an H100; 64-row groups of the wide weights took
// 190 registers and 38% longer steps). The mma warps read their input fragments through L1, so
// shared memory is worth more as L1 than as a deeper ring once the ring covers DRAM's latency:
// wide weights (4 warps) run three blocks per SM with two stages (13% faster at 32 rows than
// four stages); narrow ones (8 warps, 126 registers) run one block per SM, two stages measuring
// 0.2-0.6% faster than three.
template <int Warps, bool SwiGLU>
void launch_ring(const uint16_t* xs, int m, const uint16_t* w, int N, int K, const SplitOut& y) {
  constexpr int NT = 4;
  constexpr int kStages = 2;
  using S = RingShape<Warps, NT>;
  constexpr auto kernel = linear_ring_kernel<Warps, 2, NT, kStages, SwiGLU>;
  constexpr int kThreads = (Warps + 1) * 32;
  constexpr size_t smem = size_t(kStages) * S::kStageBytes;
  allow_dynamic_smem(kernel, smem, "cuda linear (ring): the weight stages");
  // One block per column group up to the blocks that fit at once; beyond that, resident blocks
  // walk several groups (the producer streams on across them). Whole rounds of fewer blocks
  // (balanced_grid's rule) left SMs with one block where two fit, and measured 0.5% slower.
  const int resident = resident_blocks(kernel, kThreads, smem);
  const int groups = (N + S::kRows - 1) / S::kRows;
  const unsigned grid = static_cast<unsigned>(groups < resident ? groups : resident);
  launch("linear (ring)", kernel, dim3(grid), dim3(kThreads), smem, xs, m, w, N, K, y);
}

}  // namespace

bool ring_takes(int m) {
  // TANDEM_CUDA_RING=0 keeps these rows on the register kernel (A/B timing).
  static const bool enabled = env_switch_on("TANDEM_CUDA_RING");
  return enabled && m > kTileRows && m <= 2 * kTileRows;
}

void linear_ring(const uint16_t* xs, int m, const uint16_t* w, int N, int K, int classes,
                 bool swiglu, const SplitOut& y) {
  if (K % 16 != 0) fail("cuda linear (ring): K = ", K, " is not a multiple of 16");
  if (m < 1 || m > 2 * kTileRows) fail("cuda linear (ring): ", m, " rows (1..32 supported)");
  if (classes == 4)
    swiglu ? launch_ring<4, true>(xs, m, w, N, K, y) : launch_ring<4, false>(xs, m, w, N, K, y);
  else if (classes == 8)
    swiglu ? launch_ring<8, true>(xs, m, w, N, K, y) : launch_ring<8, false>(xs, m, w, N, K, y);
  else
    fail("cuda linear (ring): ", classes, " k-classes (4 or 8 supported)");
}

TANDEM_CUDA_TRACE_UNIT(linear_ring)

}  // namespace tandem::cuda
