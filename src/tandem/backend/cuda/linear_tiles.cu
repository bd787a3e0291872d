// The many-row decode product: y[m, N] = x[m, K] · Wᵀ for 33 or more bf16 rows (verify windows of
// several tokens per row, decode steps of many rows), bitwise the register kernel of linear.cu.
//
// Why a second kernel: the register kernel streams each weight once per 64 rows but keeps every
// m-tile's accumulators and the next chunk's weights in registers; from two m-tiles on it runs
// out of registers to keep weight bytes in flight and reaches 30-60% of DRAM bandwidth
// (BENCHMARKS.md, issue 18), and a window of 128 rows streams the weights twice. Here the weights
// and inputs go through a ring of shared-memory stages filled with cp.async several chunks ahead,
// so the bytes in flight do not depend on the rows.
//
// From 65 rows on (sm_90a builds) the same tiles run on warpgroup mmas (linear_wgmma_kernel below).
//
// The reduction order is the register kernel's, by construction:
//  - that kernel splits K over C warps (C = 4 or 8, from the weight's shape alone): warp w
//    accumulates chunks w, w + C, w + 2C, ... (64 k each) in ascending order, four m16n8k16 mmas
//    per chunk (j = 0..3, lane (g, t) feeding k = 64·ch + 16t + 4j .. +3 as its k-slots
//    {2t, 2t+1, 2t+8, 2t+9}), then the C partials are summed in warp order;
//  - here the C k-classes are C blocks of one thread block cluster: block c walks chunks
//    c, c + C, ... of its output tile with the same mma sequence per output, then the cluster
//    sums the C partials in rank order through distributed shared memory.
// So a row's outputs are the same bits in a 1-row call (register kernel) and in a 200-row call
// (this kernel), whatever tile or pass it lands in. The tile shape is free: no output's
// arithmetic depends on it.
//
// Layout. A block owns BM rows x BN weight rows (output columns) and 8 warps (WarpsM x WarpsN),
// each warp MT m-tiles x NT n-tiles. A stage holds one chunk: BN weight rows and BM input rows of
// 64 bf16 (128 bytes, eight 16-byte pieces), piece p of row r stored at piece p ^ (r & 1), so the
// lanes of a quarter-warp reading rows g, g+1 at pieces 2t+h hit 32 distinct banks.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <string_view>

#include "tandem/backend/cuda/activation.cuh"
#include "tandem/backend/cuda/async_copy.cuh"
#include "tandem/backend/cuda/check.cuh"
#include "tandem/backend/cuda/linear_mma.cuh"
#include "tandem/core/env_switch.h"
#include "tandem/core/error.h"

namespace tandem::cuda {

namespace {

namespace cg = cooperative_groups;

constexpr int kTileThreads = 256;               // 8 warps
constexpr int kPiecesPerRow = kChunk * 2 / 16;  // 16-byte pieces of one row's chunk

template <int MT, int NT, int WarpsM>
struct TileShape {
  static constexpr int kWarpsN = 8 / WarpsM;
  static constexpr int kRows = kTileRows * MT * WarpsM;  // BM
  static constexpr int kCols = 8 * NT * kWarpsN;         // BN (weight rows)
  static constexpr int kAcc = MT * NT * 4;               // accumulators per thread
  static constexpr int kStageBytes = (kRows + kCols) * kChunk * 2;
  static constexpr int kPartialBytes = kAcc * kTileThreads * 4;
};

// 16 bytes from global src to shared dst, or 16 zero bytes when !valid (src is then not read).
__device__ __forceinline__ void copy16_async(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}

// Byte offset of piece p (0..7) of row r in a stage's array of 128-byte rows.
__device__ __forceinline__ int piece_offset(int r, int p) {
  return (r * kPiecesPerRow + (p ^ (r & 1))) * 16;
}

// Rows [first, first + Rows) of a [rows_total, K] bf16 matrix, chunk ch, into a stage array:
// zeros past rows_total and past K (a chunk's k-groups of 16 are whole: K is a multiple of 16,
// and the register kernel multiplies zeros there too).
template <int Rows>
__device__ __forceinline__ void stage_chunk(const uint16_t* src, int first, int rows_total, int K,
                                            int ch, unsigned char* dst) {
  static_assert(Rows * kPiecesPerRow % kTileThreads == 0, "whole rounds of pieces");
  const int p = threadIdx.x % kPiecesPerRow;
  const int k = ch * kChunk + p * 8;
#pragma unroll
  for (int q = 0; q < Rows * kPiecesPerRow / kTileThreads; ++q) {
    const int r = threadIdx.x / kPiecesPerRow + q * (kTileThreads / kPiecesPerRow);
    const int row = first + r;
    const bool ok = row < rows_total && k < K;
    const uint16_t* from = ok ? src + static_cast<size_t>(row) * K + k : src;
    copy16_async(shared_address(dst + piece_offset(r, p)), from, ok);
  }
}

// The cluster's in-order sum of its blocks' partials: each block stored its accumulators as
// partial[index · kTileThreads + thread] and the cluster synchronised; total(index) is this
// thread's accumulator `index` summed over the blocks in rank order, as the register kernel sums
// its warps.
template <int Classes>
struct ClusterSum {
  const float* parts[Classes];
  __device__ ClusterSum(cg::cluster_group& cluster, float* partial) {
#pragma unroll
    for (int c = 0; c < Classes; ++c) parts[c] = cluster.map_shared_rank(partial, c);
  }
  __device__ float total(int index) const {
    const int at = index * kTileThreads + threadIdx.x;
    float sum = parts[0][at];
#pragma unroll
    for (int c = 1; c < Classes; ++c) sum += parts[c][at];
    return sum;
  }
};

// One block of a Classes-block cluster: output rows [row0, row0 + BM) x weight rows
// [col0, col0 + BN) over k-class `rank` (chunks rank, rank + Classes, ...), then its share of the
// cluster's in-order sum and the store. Block x = tile · Classes + rank, with tile = n_block ·
// m_blocks + m_block, so the m-blocks of one column range run side by side (weights from L2).
// Two blocks per SM (at most 96 KiB of stages each, at most 128 registers): with one block and
// more stages the SMs waited at every chunk's barrier, 10-15% slower (BENCHMARKS.md).
template <int Classes, int MT, int NT, int WarpsM, int Stages, bool SwiGLU>
__global__ void __launch_bounds__(kTileThreads, 2)
    linear_tiles_kernel(const uint16_t* __restrict__ x, int m, const uint16_t* __restrict__ w,
                        int N, int K, int m_blocks, const SplitOut y) {
  using S = TileShape<MT, NT, WarpsM>;
  static_assert(!SwiGLU || NT % 2 == 0, "a warp holds whole gate/up pairs");
  extern __shared__ __align__(128) unsigned char smem[];
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int tile = blockIdx.x / Classes;
  const int row0 = (tile % m_blocks) * S::kRows, col0 = (tile / m_blocks) * S::kCols;
  const int chunks = (K + kChunk - 1) / kChunk;
  const int n_chunks = rank < chunks ? (chunks - rank + Classes - 1) / Classes : 0;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int wm = warp / S::kWarpsN, wn = warp % S::kWarpsN;

  auto stage_at = [&](int s) { return smem + s * S::kStageBytes; };
  auto load_weights = [&](int i) {
    stage_chunk<S::kCols>(w, col0, N, K, rank + i * Classes, stage_at(i % Stages));
  };
  auto load_inputs = [&](int i) {
    stage_chunk<S::kRows>(x, row0, m, K, rank + i * Classes,
                          stage_at(i % Stages) + S::kCols * kChunk * 2);
  };

  // Weights never change: the first stages' weights are requested before waiting on the kernel
  // that writes the inputs. Group s holds stage s's inputs (and, for s = 0, every early weight).
#pragma unroll
  for (int s = 0; s < Stages - 1; ++s)
    if (s < n_chunks) load_weights(s);
  pdl_wait();
  pdl_release();
#pragma unroll
  for (int s = 0; s < Stages - 1; ++s) {
    if (s < n_chunks) load_inputs(s);
    copy_commit();
  }

  float acc[MT][NT][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      acc[i][nt][0] = acc[i][nt][1] = acc[i][nt][2] = acc[i][nt][3] = 0.f;

  for (int i = 0; i < n_chunks; ++i) {
    copy_wait<Stages - 2>();
    __syncthreads();  // stage i is in; every warp is done with stage i - 1, refilled below
    if (i + Stages - 1 < n_chunks) {
      load_weights(i + Stages - 1);
      load_inputs(i + Stages - 1);
    }
    copy_commit();
    const unsigned char* ws = stage_at(i % Stages);
    const unsigned char* xs = ws + S::kCols * kChunk * 2;
    // Half h of the lane's 16 k: pieces 2t + h, i.e. mmas j = 2h, 2h + 1.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      uint4 b[NT];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int r = (wn * NT + nt) * 8 + g;
        b[nt] = *reinterpret_cast<const uint4*>(ws + piece_offset(r, 2 * t + h));
      }
#pragma unroll
      for (int mi = 0; mi < MT; ++mi) {
        const int r = (wm * MT + mi) * kTileRows + g;
        const uint4 lo = *reinterpret_cast<const uint4*>(xs + piece_offset(r, 2 * t + h));
        const uint4 hi = *reinterpret_cast<const uint4*>(xs + piece_offset(r + 8, 2 * t + h));
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          mma_bf16_16816(acc[mi][nt], lo.x, hi.x, lo.y, hi.y, b[nt].x, b[nt].y);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          mma_bf16_16816(acc[mi][nt], lo.z, hi.z, lo.w, hi.w, b[nt].z, b[nt].w);
      }
    }
  }

  // The partials, [accumulator][thread] in this block's (now idle) stages; then each block sums
  // its share of the accumulators over the cluster's blocks in rank order, as the register
  // kernel sums its warps.
  copy_wait<0>();
  __syncthreads();
  float* partial = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        partial[((mi * NT + nt) * 4 + e) * kTileThreads + threadIdx.x] = acc[mi][nt][e];
  cluster.sync();
  const ClusterSum<Classes> sums(cluster, partial);
  const int row_lo = row0 + wm * MT * kTileRows + g;
  const int warp_col0 = col0 + wn * NT * 8;
  if constexpr (SwiGLU) {
    // Unit (mi, pair p): gate n-tile 2p, up n-tile 2p + 1 of the same 8 outputs.
    const int half = N / 2;
    for (int u = rank; u < MT * NT / 2; u += Classes) {
      const int mi = u / (NT / 2), p = u % (NT / 2);
      const int col = warp_col0 / 2 + p * 8 + 2 * t;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = row_lo + mi * kTileRows + (e >= 2 ? 8 : 0), c = col + (e & 1);
        const float gate = sums.total((mi * NT + 2 * p) * 4 + e);
        const float up = sums.total((mi * NT + 2 * p + 1) * 4 + e);
        if (r < m && c < half) y.store(r, c, silu(gate) * up);
      }
    }
  } else {
    for (int u = rank; u < MT * NT; u += Classes) {
      const int mi = u / NT, nt = u % NT;
      const int col = warp_col0 + nt * 8 + 2 * t;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = row_lo + mi * kTileRows + (e >= 2 ? 8 : 0), c = col + (e & 1);
        const float sum = sums.total(u * 4 + e);
        if (r < m && c < N) y.store(r, c, sum);
      }
    }
  }
  cluster.sync();  // no block leaves while another still reads its partials
}

// ---- The same product on Hopper's warpgroup mma (sm_90a) ----
//
// wgmma with k16 is bitwise the m16n8k16 mma.sync on the same k per slot (both operands' roles,
// either k half first, register or shared-memory operands: measured on the H200 over 8M outputs
// with exponents spread over 2^±30, BENCHMARKS.md), so a chain of wgmmas over the register
// kernel's k sets gives its bits. The weights are the A operand (64 rows per warpgroup), loaded
// from the stage into registers exactly as the mma.sync tiles load them (which is where the
// register kernel's k permutation is free); the tokens are the B operand (n = 128), read
// by the tensor cores straight from shared memory in the no-swizzle K-major layout. A
// register-operand k slot and the shared-memory one must hold the same k, so the token rows are
// staged permuted: step j's core matrix of row n holds, at slot 2t, 2t + 1 (first k half) and
// 2t + 8, 2t + 9 (second), x[n][16t + 4j + {0, 1}] and x[n][16t + 4j + {2, 3}]. That is a 4-byte
// gather no copy engine does, so the tokens go global -> registers -> shared memory (16-byte
// loads, 4-byte stores with conflict-free banks), loaded two chunks ahead of their mmas. (Ordering
// the tokens into a scratch copy first, then staging them with cp.async like the weights, measured
// 20% slower: BENCHMARKS.md.)
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define TANDEM_WGMMA_DEVICE 1
#endif

constexpr int kWgmmaWeightRows = 128;  // two warpgroups of 64 weight rows

// A wgmma tile: 128 weight rows x 128 tokens, three stages (two blocks per SM).
struct WgmmaShape {
  static constexpr int kTokens = 128;  // the B operand's n
  static constexpr int kStages = 3;
  static constexpr int kAcc = kTokens / 2;  // f32 accumulators per thread
  static constexpr int kWeightBytes = kWgmmaWeightRows * kChunk * 2;
  static constexpr int kTokenStepBytes = kTokens * 32;  // one k16 step: kTokens/8 x 2 x 128 B
  static constexpr int kStageBytes = kWeightBytes + 4 * kTokenStepBytes;
  static constexpr int kTokenPieces = kTokens * kPiecesPerRow / kTileThreads;  // per thread
  static constexpr int kPartialBytes = kAcc * kTileThreads * 4;
};

// Shared-memory matrix descriptor, no swizzle: byte strides between the two k halves of a k16
// step (leading) and between groups of 8 rows (stride).
__device__ __forceinline__ uint64_t wgmma_descriptor(const void* p, uint32_t k_half_bytes,
                                                     uint32_t row_group_bytes) {
  const uint32_t a = shared_address(p);
  return static_cast<uint64_t>((a & 0x3FFFF) >> 4) |
         static_cast<uint64_t>((k_half_bytes >> 4) & 0x3FFF) << 16 |
         static_cast<uint64_t>((row_group_bytes >> 4) & 0x3FFF) << 32;
}

// Keeps the compiler from moving accumulator accesses across the asynchronous mma.
template <int N>
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

#define TANDEM_ACC4(d, i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define TANDEM_ACC16(d, i) \
  TANDEM_ACC4(d, i), TANDEM_ACC4(d, i + 4), TANDEM_ACC4(d, i + 8), TANDEM_ACC4(d, i + 12)

// d[64 x 128 tokens] += A (registers: this warp's 16 weight rows, mma.sync's A fragment) · B
// (tokens, shared memory at descriptor b): one k16 step.
__device__ __forceinline__ void wgmma_step(float (&d)[WgmmaShape::kAcc], uint32_t a0, uint32_t a1,
                                           uint32_t a2, uint32_t a3, uint64_t b) {
  static_assert(WgmmaShape::kTokens == 128, "the instruction below is m64n128k16");
#if TANDEM_WGMMA_DEVICE
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "
      "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, "
      "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
      : TANDEM_ACC16(d, 0), TANDEM_ACC16(d, 16), TANDEM_ACC16(d, 32), TANDEM_ACC16(d, 48)
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b));
#else
  (void)d, (void)a0, (void)a1, (void)a2, (void)a3, (void)b;
  __trap();
#endif
}
#undef TANDEM_ACC16
#undef TANDEM_ACC4

__device__ __forceinline__ void wgmma_open() {
#if TANDEM_WGMMA_DEVICE
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_close_and_wait() {
#if TANDEM_WGMMA_DEVICE
  asm volatile("wgmma.commit_group.sync.aligned;\nwgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#endif
}
// Shared-memory writes of the generic proxy (st.shared, cp.async) made visible to the tensor
// cores' reads (async proxy); a barrier after it publishes them to the other warps.
__device__ __forceinline__ void fence_proxy_async() {
#if TANDEM_WGMMA_DEVICE
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// This thread's share of a chunk of token rows [first, first + 128), loaded as 16-byte pieces
// (zeros past `rows` and past K). Thread u's piece q: lane bits (t, r8) = row r8 of a group of 8,
// piece 2t + h; warp bits (h, group), so each store below hits 32 distinct banks.
__device__ __forceinline__ void load_token_pieces(const uint16_t* x, int first, int rows, int K,
                                                  int ch, uint4 (&v)[WgmmaShape::kTokenPieces]) {
#pragma unroll
  for (int q = 0; q < WgmmaShape::kTokenPieces; ++q) {
    const int u = threadIdx.x + q * kTileThreads;
    const int t = u % 4, r8 = (u / 4) % 8, h = (u / 32) % 2, group = u / 64;
    const int row = first + group * 8 + r8, k = ch * kChunk + 16 * t + 8 * h;
    v[q] = row < rows && k < K
               ? *reinterpret_cast<const uint4*>(x + static_cast<size_t>(row) * K + k)
               : make_uint4(0, 0, 0, 0);
  }
}

// The pieces into a stage's token area in the permuted K-major layout (see above): piece (t, h)
// holds k 16t + 8h + {0..7} = steps 2h (pairs .x, .y) and 2h + 1 (.z, .w), first and second k
// half, at slot 2t of row r8 of its group's core matrices.
__device__ __forceinline__ void store_token_pieces(unsigned char* tokens,
                                                   const uint4 (&v)[WgmmaShape::kTokenPieces]) {
  using S = WgmmaShape;
#pragma unroll
  for (int q = 0; q < S::kTokenPieces; ++q) {
    const int u = threadIdx.x + q * kTileThreads;
    const int t = u % 4, r8 = (u / 4) % 8, h = (u / 32) % 2, group = u / 64;
    unsigned char* base = tokens + group * 256 + r8 * 16 + t * 4;
    *reinterpret_cast<uint32_t*>(base + (2 * h) * S::kTokenStepBytes) = v[q].x;
    *reinterpret_cast<uint32_t*>(base + (2 * h) * S::kTokenStepBytes + 128) = v[q].y;
    *reinterpret_cast<uint32_t*>(base + (2 * h + 1) * S::kTokenStepBytes) = v[q].z;
    *reinterpret_cast<uint32_t*>(base + (2 * h + 1) * S::kTokenStepBytes + 128) = v[q].w;
  }
}

// One block of a Classes-block cluster, as linear_tiles_kernel: output rows [row0, row0 + 128)
// x weight rows [col0, col0 + 128) over k-class `rank`, then its share of the in-order sum.
// Warpgroup wg owns weight rows col0 + 64 wg .. + 63; warp q of it rows 16q .. 16q + 15 of those
// (the A fragment), and its accumulator d[4s + e] is (weight row 16q + g + 8 (e / 2), token
// 8s + 2t + e % 2).
template <int Classes, bool SwiGLU>
__global__ void __launch_bounds__(kTileThreads, 2)
    linear_wgmma_kernel(const uint16_t* __restrict__ x, int m, const uint16_t* __restrict__ w,
                        int N, int K, int m_blocks, const SplitOut y) {
  using S = WgmmaShape;
  constexpr int Tokens = S::kTokens, Stages = S::kStages;
  extern __shared__ __align__(128) unsigned char smem[];
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int tile = blockIdx.x / Classes;
  const int row0 = (tile % m_blocks) * Tokens, col0 = (tile / m_blocks) * kWgmmaWeightRows;
  const int chunks = (K + kChunk - 1) / kChunk;
  const int n_chunks = rank < chunks ? (chunks - rank + Classes - 1) / Classes : 0;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int r_lo = warp * 16 + g;  // weight row of the stage (warpgroup wg = warp / 4)

  auto stage_at = [&](int s) { return smem + s * S::kStageBytes; };
  auto load_weights = [&](int i) {
    stage_chunk<kWgmmaWeightRows>(w, col0, N, K, rank + i * Classes, stage_at(i % Stages));
  };
  // Chunk i's tokens go into stage i at the end of iteration i - 1, loaded into registers one
  // iteration before that, so a load has a whole iteration to arrive.
  uint4 pieces[S::kTokenPieces];
  auto load_tokens = [&](int i) { load_token_pieces(x, row0, m, K, rank + i * Classes, pieces); };
  auto store_tokens = [&](int i) {
    store_token_pieces(stage_at(i % Stages) + S::kWeightBytes, pieces);
  };

  // Weights never change: the first stages' weights are requested before waiting on the kernel
  // that writes the tokens.
#pragma unroll
  for (int s = 0; s < Stages - 1; ++s) {
    if (s < n_chunks) load_weights(s);
    copy_commit();
  }
  pdl_wait();
  pdl_release();
  if (n_chunks > 0) {
    load_tokens(0);
    store_tokens(0);
  }
  if (n_chunks > 1) load_tokens(1);

  float d[S::kAcc];
#pragma unroll
  for (int i = 0; i < S::kAcc; ++i) d[i] = 0.f;

  for (int i = 0; i < n_chunks; ++i) {
    copy_wait<Stages - 2>();
    fence_proxy_async();
    __syncthreads();  // stage i is in; every warpgroup is done with stage i - 1, refilled below
    if (i + Stages - 1 < n_chunks) load_weights(i + Stages - 1);
    copy_commit();
    const unsigned char* ws = stage_at(i % Stages);
    const unsigned char* ts = ws + S::kWeightBytes;
    uint4 lo[2], hi[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      lo[h] = *reinterpret_cast<const uint4*>(ws + piece_offset(r_lo, 2 * t + h));
      hi[h] = *reinterpret_cast<const uint4*>(ws + piece_offset(r_lo + 8, 2 * t + h));
    }
    wgmma_fence_operands(d);
    wgmma_open();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      wgmma_step(d, lo[h].x, hi[h].x, lo[h].y, hi[h].y,
                 wgmma_descriptor(ts + (2 * h) * S::kTokenStepBytes, 128, 256));
      wgmma_step(d, lo[h].z, hi[h].z, lo[h].w, hi[h].w,
                 wgmma_descriptor(ts + (2 * h + 1) * S::kTokenStepBytes, 128, 256));
    }
    // Stage i + 1's tokens (its earlier chunk i + 1 - Stages was read two barriers ago).
    if (i + 1 < n_chunks) store_tokens(i + 1);
    if (i + 2 < n_chunks) load_tokens(i + 2);
    wgmma_close_and_wait();
    wgmma_fence_operands(d);
  }

  copy_wait<0>();
  __syncthreads();
  float* partial = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int i = 0; i < S::kAcc; ++i) partial[i * kTileThreads + threadIdx.x] = d[i];
  cluster.sync();
  const ClusterSum<Classes> sums(cluster, partial);
  const int col = col0 + r_lo;  // weight row of accumulators e = 0, 1 (e = 2, 3: col + 8)
  for (int s = rank; s < Tokens / 8; s += Classes) {
    const int r = row0 + 8 * s + 2 * t;
    if constexpr (SwiGLU) {
      // Rows 16q + g (gate) and 16q + 8 + g (up) are the pair of output (col0 + 16 warp) / 2 + g.
      const int out = (col0 + warp * 16) / 2 + g;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float gate = sums.total(4 * s + e), up = sums.total(4 * s + 2 + e);
        if (r + e < m && out < N / 2) y.store(r + e, out, silu(gate) * up);
      }
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float sum = sums.total(4 * s + e);
        const int c = col + (e >= 2 ? 8 : 0);
        if (r + (e & 1) < m && c < N) y.store(r + (e & 1), c, sum);
      }
    }
  }
  cluster.sync();  // no block leaves while another still reads its partials
}

// Launches the kernel for one tile shape.
template <int Classes, int MT, int NT, int WarpsM, int Stages, bool SwiGLU>
void launch_tiles(const uint16_t* xs, int m, const uint16_t* w, int N, int K, const SplitOut& y) {
  using S = TileShape<MT, NT, WarpsM>;
  constexpr auto kernel = linear_tiles_kernel<Classes, MT, NT, WarpsM, Stages, SwiGLU>;
  constexpr size_t smem = std::max<size_t>(size_t(Stages) * S::kStageBytes, S::kPartialBytes);
  allow_dynamic_smem(kernel, smem, "cuda linear (tiles): the tile stages");
  const int64_t m_blocks = ceil_div(m, S::kRows), n_blocks = ceil_div(N, S::kCols);
  const unsigned grid = grid_blocks(Classes * m_blocks * n_blocks, "linear (tiles)");
  launch_clustered("linear (tiles)", Classes, kernel, dim3(grid), dim3(kTileThreads), smem, xs, m,
                   w, N, K, static_cast<int>(m_blocks), y);
}

// Whether the many-row products run on warpgroup mmas: built for sm_90a (TANDEM_CUDA_WGMMA),
// running on a compute capability 9.0 device (a build for several architectures may run
// elsewhere, where the kernel holds no wgmma), and not turned off by TANDEM_CUDA_WGMMA=0 in the
// environment (A/B timing).
bool wgmma_tiles() {
#if defined(TANDEM_CUDA_WGMMA)
  static const bool enabled = [] {
    if (!env_switch_on("TANDEM_CUDA_WGMMA")) return false;
    int device = 0, major = 0, minor = 0;
    return cudaGetDevice(&device) == cudaSuccess &&
           cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) ==
               cudaSuccess &&
           cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) ==
               cudaSuccess &&
           major == 9 && minor == 0;
  }();
  return enabled;
#else
  return false;
#endif
}

template <int Classes, bool SwiGLU>
void launch_wgmma(const uint16_t* xs, int m, const uint16_t* w, int N, int K, const SplitOut& y) {
  using S = WgmmaShape;
  constexpr auto kernel = linear_wgmma_kernel<Classes, SwiGLU>;
  constexpr size_t smem = std::max<size_t>(size_t(S::kStages) * S::kStageBytes, S::kPartialBytes);
  allow_dynamic_smem(kernel, smem, "cuda linear (wgmma tiles): the tile stages");
  const int64_t m_blocks = ceil_div(m, S::kTokens), n_blocks = ceil_div(N, kWgmmaWeightRows);
  const unsigned grid = grid_blocks(Classes * m_blocks * n_blocks, "linear (wgmma tiles)");
  launch_clustered("linear (wgmma tiles)", Classes, kernel, dim3(grid), dim3(kTileThreads), smem,
                   xs, m, w, N, K, static_cast<int>(m_blocks), y);
}

template <int Classes, bool SwiGLU>
void linear_tiles_classes(const uint16_t* xs, int m, const uint16_t* w, int N, int K,
                          const SplitOut& y) {
  // Tile rows follow m, so that the weights stream once without idle m-tiles; from 129 rows on,
  // 128-row blocks side by side (the m-blocks of one column range are neighbours in the grid, so
  // the second reads the weights from L2). 128 columns per tile: narrower tiles that fill the
  // resident clusters' last round better (64 or 32 columns) measured slower on every shape, as
  // did one block per SM with deeper rings (BENCHMARKS.md).
  // From 65 rows on, warpgroup mmas: 13-15% faster windows of 128 and 256 rows; at 64 rows they
  // measured 3-4% slower than the mma.sync tiles (BENCHMARKS.md).
  if (m > 64 && wgmma_tiles()) return launch_wgmma<Classes, SwiGLU>(xs, m, w, N, K, y);
  if (m <= 64)
    launch_tiles<Classes, 2, 4, 2, 4, SwiGLU>(xs, m, w, N, K, y);
  else
    launch_tiles<Classes, 4, 4, 2, 3, SwiGLU>(xs, m, w, N, K, y);
}

}  // namespace

bool tiles_enabled() {
  static const bool enabled = env_switch_on("TANDEM_CUDA_TILES");
  return enabled;
}

void linear_tiles(const uint16_t* xs, int m, const uint16_t* w, int N, int K, int classes,
                  bool swiglu, const SplitOut& y) {
  if (K % 16 != 0) fail("cuda linear (tiles): K = ", K, " is not a multiple of 16");
  if (classes == 4)
    swiglu ? linear_tiles_classes<4, true>(xs, m, w, N, K, y)
           : linear_tiles_classes<4, false>(xs, m, w, N, K, y);
  else if (classes == 8)
    swiglu ? linear_tiles_classes<8, true>(xs, m, w, N, K, y)
           : linear_tiles_classes<8, false>(xs, m, w, N, K, y);
  else
    fail("cuda linear (tiles): ", classes, " k-classes (4 or 8 supported)");
}

TANDEM_CUDA_TRACE_UNIT(linear_tiles)

}  // namespace tandem::cuda
