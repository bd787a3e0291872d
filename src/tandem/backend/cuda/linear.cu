// y[m, N] = x[m, K] · Wᵀ on the GPU, W bf16 [N, K] (row-major, as a Linear stores it).
//
// Decode and verify shapes (every call outside prefill) go through one tensor-core kernel whose
// reduction order is fixed by the weight's shape alone, so a row's result is bitwise the same
// whether it is alone, in a verify window or next to other rows (DESIGN.md principle 2):
//  - a block owns 8·NT output columns (NT m16n8k16 n-tiles) and splits K over its W warps in
//    64-wide chunks, warp w taking chunks w, w+W, w+2W, ... in ascending order. W is a function
//    of the weight's shape alone (linear_mma: 8 below kWideRows rows, where the column groups
//    are too few to keep enough weight bytes in flight with 4, else 4), never of m;
//  - each warp accumulates its chunks with mma.sync in fp32; the W warp partials are then summed
//    in warp order through shared memory;
//  - rows are processed 16 per m-tile, up to 64 per pass; more rows take more passes over the
//    same weights. A row's arithmetic never depends on which tile or pass it lands in.
// Calls of more than two m-tiles (verify windows of many rows) go to linear_tiles.cu,
// which stages weights and inputs in shared memory and runs the same mma sequence per output
// with the k-splits as the blocks of a cluster: the same bits (TANDEM_CUDA_TILES=0: this kernel).
// Calls of exactly two m-tiles (17..32 rows) go to linear_ring.cu, these warps (wider column
// groups for the narrow weights) with the weights streamed by a producer warp: the same bits
// (TANDEM_CUDA_RING=0: this kernel).
// Weights are streamed once per pass with 16-byte loads (the memory roofline at m = 1). Up to
// kNarrowRows rows, each block rounds the fp32 inputs to bf16 into its shared memory; larger
// batches round them once into a bf16 scratch copy first. Either way the same bf16 values enter
// the same mma sequence, so the choice depends on m freely.
//
// The sublayer seams of the model live here too, each bitwise its unfused parts:
//  - an input norm (RowNorm): a single row is normalised by each block as it stages the row,
//    with rms_norm's reduction order (row_norm.cuh); from two rows on, rms_norm_bf16 writes the
//    rows once and the product reads them unstaged (prefill: rms_norm, then cuBLAS);
//  - linear_add: the residual add in the epilogue (each output has one writer); its optional
//    gated norm (the DeltaNet output's) runs as a kernel writing the rows in bf16, which the
//    product reads as they are;
//  - swiglu_mlp_add: gate_up_swiglu's epilogue writes its activations in bf16, which the down
//    projection reads as its already-rounded input rows (no staging, half the bytes).
//
// Within one mma the 16 k-slots of the instruction need not be 16 consecutive k: any bijection
// works if A and B use the same one. Lane (g, t) loads 16 consecutive weights W[n0+g][kb+16t ..]
// (two 16-byte loads) and feeds mma j (0..3) with its elements 4j..4j+3, which the instruction
// sees as k-slots {2t, 2t+1, 2t+8, 2t+9}; the A fragment takes x at the same four k.
//
// Prompt prefill (set_prefill(true, tile)) uses cuBLASLt (bf16 inputs, fp32 accumulation and
// output) with one algorithm per (weight shape, tile): the heuristic's first choice for a product
// of `tile` rows among those that do not split K, kept for the process. Every row of such a
// product is computed alike wherever it falls and however many rows share the call, so a
// projection of a 4,096-token prompt is one product that streams the weight once, and a prompt
// token's numbers depend on the tile and on nothing else in the call. The tile follows the
// engine's prefill chunk (16..4096 rows): engines that must agree (generate and serve) use the same
// chunk. The input norm writes the bf16 rows the product reads in one pass, and the MLP's SwiGLU
// writes its activations in bf16 for the down projection, as in decode.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <map>
#include <string_view>
#include <tuple>
#include <type_traits>

#include "tandem/backend/cuda/activation.cuh"
#include "tandem/backend/cuda/check.cuh"
#include "tandem/backend/cuda/cuda_ops.h"
#include "tandem/backend/cuda/linear_mma.cuh"
#include "tandem/backend/cuda/lt.cuh"
#include "tandem/backend/cuda/row_norm.cuh"
#include "tandem/backend/cuda/scratch.cuh"
#include "tandem/core/env_switch.h"
#include "tandem/core/error.h"

namespace tandem::cuda {

namespace {

// How a prompt-prefill product of (N, K, tile) runs (prefill_algo).
using AlgoKey = std::tuple<int64_t, int64_t, int64_t>;

// This file's state in a context: cuBLASLt's workspace and chosen algorithms, and the scratch
// of each path, each grown to the largest call seen and reused by the next (calls are ordered
// on the context's stream).
struct LinearUnit {
  DeviceScratch lt_workspace;  // kLtWorkspaceBytes, shared with linear_fp8.cu
  std::map<AlgoKey, cublasLtMatmulAlgo_t> algos;
  DeviceScratch prefill_xb;       // prompt prefill: the bf16 input rows
  DeviceScratch prefill_full;     // prompt prefill: a split projection's fp32 output
  DeviceScratch normalised;       // rms_norm'd input rows of the paths that do not fold the norm
  DeviceScratch bf16_rows;        // the bf16 input rows of one tensor-core call
  DeviceScratch swiglu_full;      // gate_up_swiglu's [m, 2I] where it is not fused
  DeviceScratch swiglu_act;       // swiglu_mlp_add's fp32 activations (unfused path)
  DeviceScratch swiglu_act_bf16;  // swiglu_mlp_add's bf16 activations (tensor-core path)
};

LinearUnit& linear_unit() {
  return current().unit<LinearUnit>();
}

}  // namespace

cublasLtHandle_t cublas_lt() {
  return current().blas_lt();
}

void* lt_workspace() {
  return linear_unit().lt_workspace.get<std::byte>(kLtWorkspaceBytes);
}

cublasLtMatmulDesc_t transposed_weight_desc() {
  cublasLtMatmulDesc_t desc;
  if (cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS)
    fail("cuBLASLt: cublasLtMatmulDescCreate failed");
  const cublasOperation_t t = CUBLAS_OP_T;
  if (cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t) !=
      CUBLAS_STATUS_SUCCESS)
    fail("cuBLASLt: setting the transposed weight");
  return desc;
}

namespace {

constexpr int kMaxTiles = 4;            // m-tiles per pass
constexpr int64_t kTilesFromRows = 32;  // more rows than this: linear_tiles.cu
constexpr int64_t kNarrowRows = 4;      // up to this many rows: bf16 inputs staged per block (F32X)
constexpr int64_t kFoldedNormRows = 1;  // up to this many rows: an input norm folded into staging
// Shared memory for the bf16 input rows of the in-register path at most; wider inputs take the
// scratch path (the same arithmetic).
constexpr size_t kNarrowSmemMax = size_t(128) << 10;

// The RMSNorm a decode-shaped linear applies to its input rows while staging them (rms_norm's
// weight, flag and epsilon); w == nullptr: none. out (optional, the hidden-size rows folded in
// registers only: stage_normed_rows): the grid's first block also writes the normalised fp32
// rows there, rms_norm's output, for later kernels that read them.
struct RowNormArgs {
  const float* w;
  float eps;
  bool zero_centred;
  float* out = nullptr;
};

// Bytes of a weight that a later kernel reads, which a projection's blocks ask L2 to fetch once
// their own columns are done (linear_split's prefetch): from p (16-byte aligned), a multiple of
// 16. None when bytes is 0.
struct L2Prefetch {
  const char* p;
  unsigned long long bytes;
};
constexpr unsigned kPrefetchPiece = 16384;  // bytes per bulk prefetch

// The rows of a grouped product (linear_grouped, a mixture's experts): block row g = blockIdx.y
// multiplies rows start[g] .. start[g + 1] of the inputs by stacked weight expert[g] (at
// w + expert[g]·N·K) into the same rows of the output; a group without rows returns at once.
// gather (staged fp32 inputs only): input row r is row gather[r] of x, so the mixture's pair
// rows are read from the tokens' rows without a gathered copy. The arrays are written by an
// earlier kernel, so they are read after pdl_wait(); plain products pass an empty GroupRows.
// extra: the weights of expert id `extra_id` (one past the stack), where they are not at the
// stacked stride (a mixture's shared expert); products of up to two m-tiles only.
struct GroupRows {
  const int32_t* expert;
  const int32_t* start;
  const int32_t* gather;
  const uint16_t* extra;
  int extra_id;
};

// This block's share of pf, issued as its last act: pieces dealt round-robin over the grid's
// blocks, so the blocks that finish first (the projection's tail, when HBM has spare bandwidth)
// fetch slices of the whole range. Bulk prefetches hold no registers and complete on their own.
__device__ __forceinline__ void prefetch_l2_share(const L2Prefetch& pf) {
  if (pf.bytes == 0) return;
  const unsigned long long pieces = (pf.bytes + kPrefetchPiece - 1) / kPrefetchPiece;
  const unsigned long long stride = static_cast<unsigned long long>(blockDim.x) * gridDim.x;
  for (unsigned long long i = blockIdx.x + static_cast<unsigned long long>(threadIdx.x) * gridDim.x;
       i < pieces; i += stride) {
    const unsigned long long off = i * kPrefetchPiece;
    const unsigned size =
        static_cast<unsigned>(pf.bytes - off < kPrefetchPiece ? pf.bytes - off : kPrefetchPiece);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(pf.p + off), "r"(size)
                 : "memory");
  }
}

// Row stride, in bf16 elements, of the input rows a block stages in shared memory: 16 bytes
// more than a row, so that rows whose K·2 bytes are a multiple of 128 (every hidden size) start
// in different banks, and the lanes reading rows 0..3 at one k do not conflict.
__host__ __device__ constexpr int staged_row_stride(int K) {
  return K + 8;
}

// 16-byte loads a thread issues before it converts any while staging rows, so the rows arrive in
// about one memory latency, not one per loop trip (a 4-row verify input of K = 12288 is 48 loads
// per thread of a 256-thread block).
constexpr int kStageBatch = 8;

// The rows [m, K] to bf16 shared memory in batches of B 16-byte loads per thread, issued before
// any is converted. Normalise: each element becomes normed(x, s_row[r], w) first (s_row ready).
// src_rows (optional): staged row r is row src_rows[r] of x.
template <int Threads, int B, bool Normalise>
__device__ __forceinline__ void stage_batches(const float* x, int m, int K, const RowNormArgs& norm,
                                              const float* s_row, uint2* x_smem,
                                              const int32_t* src_rows = nullptr) {
  const float4* x4 = reinterpret_cast<const float4*>(x);
  const float4* w4 = reinterpret_cast<const float4*>(norm.w);
  const int per_row = K / 4, stride = staged_row_stride(K) / 4, total = m * per_row;
  for (int base = threadIdx.x; base < total; base += B * Threads) {
    // Element i = base + b·Threads is (row r[b], float4 column c[b]); one division per batch.
    int r[B], c[B];
    float4 f[B], wv[Normalise ? B : 1];
    r[0] = base / per_row;
    c[0] = base % per_row;
#pragma unroll
    for (int b = 0; b < B; ++b) {
      if (b > 0) {
        r[b] = r[b - 1];
        c[b] = c[b - 1] + Threads;
        while (c[b] >= per_row) c[b] -= per_row, ++r[b];
      }
      if (base + b * Threads < total) {
        f[b] = src_rows ? x4[static_cast<size_t>(src_rows[r[b]]) * per_row + c[b]]
                        : x4[base + b * Threads];
        if constexpr (Normalise) wv[b] = w4[c[b]];
      }
    }
#pragma unroll
    for (int b = 0; b < B; ++b) {
      if (base + b * Threads >= total) break;
      float4 v = f[b];
      if constexpr (Normalise) {
        const float sr = s_row[r[b]];
        v = make_float4(normed(v.x, sr, wv[b].x, norm.zero_centred),
                        normed(v.y, sr, wv[b].y, norm.zero_centred),
                        normed(v.z, sr, wv[b].z, norm.zero_centred),
                        normed(v.w, sr, wv[b].w, norm.zero_centred));
      }
      x_smem[r[b] * stride + c[b]] = make_uint2(pack_bf16(v.x, v.y), pack_bf16(v.z, v.w));
    }
  }
}

// The folded norm of hidden-size rows (norm_order Chunked, K <= kNormChunks · 4 · kNormGroup):
// group thread t (t < kNormGroup) holds the row's and the norm weight's 4-float chunks
// t + kNormGroup·k, k < NC (NC = 4 or 8, the fewest that cover K).
constexpr int kNormChunks = 8;

// Rows of K normalised from registers where a norm is folded (the host asks too:
// norm_folds_writing).
__host__ __device__ inline bool rows_normed_in_registers(int64_t K) {
  return norm_order(K) == NormOrder::Chunked && K <= kNormChunks * 4 * kNormGroup;
}

__device__ __forceinline__ bool norm_chunked(const RowNormArgs& norm, int K) {
  return norm.w != nullptr && rows_normed_in_registers(K);
}

// The norm weight's chunks of this thread (zeros past the row and for threads outside the
// group). A kernel loads them before it waits on its inputs: weights never change, and the L2
// round trip, which every block of the projection makes for the same 16 KB at once, then
// overlaps the previous kernel instead of following the row's (0.5% of a batch-1 step on the
// H200, BENCHMARKS.md).
__device__ __forceinline__ void load_norm_chunks(const RowNormArgs& norm, int K,
                                                 float4 (&wv)[kNormChunks]) {
  const int t = threadIdx.x, per_row = K / 4;
  const float4* w4 = reinterpret_cast<const float4*>(norm.w);
#pragma unroll
  for (int k = 0; k < kNormChunks; ++k) {
    const int c = t + kNormGroup * k;
    wv[k] = t < kNormGroup && c < per_row ? w4[c] : make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

// Rows normalised from registers, one after another by the block's first kNormGroup threads
// (the norm is folded for a single row only, kFoldedNormRows; the other threads go straight to
// the closing barrier): one round of loads of the row's chunks, chunked_square_partials, a group
// barrier, and the normalised chunks (with the preloaded weight chunks wv) go straight to shared
// memory.
template <int Threads, int NC>
__device__ __forceinline__ void stage_normed_rows(const float* x, int m, int K,
                                                  const RowNormArgs& norm,
                                                  const float4 (&wv)[kNormChunks], uint2* x_smem,
                                                  double (*s_warp)[kWideNormThreads / 32]) {
  static_assert(Threads >= kNormGroup, "one norm group per block");
  static_assert(NC <= kNormChunks, "the preloaded weight chunks cover the row");
  const int t = threadIdx.x;
  const int per_row = K / 4, stride = staged_row_stride(K) / 4;
  float4* out = blockIdx.x == 0 && blockIdx.y == 0 ? reinterpret_cast<float4*>(norm.out) : nullptr;
  for (int r = 0; t < kNormGroup && r < m; ++r) {  // whole warps; named barrier 1
    normalise_chunked_row<NC, 1>(x + static_cast<size_t>(r) * K, K, wv, norm.eps, norm.zero_centred,
                                 s_warp[r], [&](int c, float4 n) {
                                   x_smem[r * stride + c] =
                                       make_uint2(pack_bf16(n.x, n.y), pack_bf16(n.z, n.w));
                                   if (out) out[static_cast<size_t>(r) * per_row + c] = n;
                                 });
  }
  __syncthreads();
}

// x [m, K] fp32 → bf16 rows in shared memory (stride staged_row_stride(K)), by the Threads
// threads of a block, m <= kNarrowRows. With a norm, the rows are first normalised with
// rms_norm's arithmetic (row_norm.cuh: the sum of squares in norm_order(K)'s order, then
// normed()), so the staged values are the bf16 roundings of what rms_norm writes. norm_w: the
// norm weight's chunks from load_norm_chunks (used where norm_chunked). Ends with the block
// synchronised.
// src_rows (optional, no norm): staged row r is row src_rows[r] of x.
template <int Threads>
__device__ __forceinline__ void stage_rows(const float* x, int m, int K, const RowNormArgs& norm,
                                           const float4 (&norm_w)[kNormChunks], uint2* x_smem,
                                           const int32_t* src_rows = nullptr) {
  __shared__ double s_warp[kNarrowRows][kWideNormThreads / 32];
  __shared__ float s_row[kNarrowRows];
  const bool normalise = norm.w != nullptr;
  if (norm_chunked(norm, K)) {
    if (K <= 4 * 4 * kNormGroup)
      stage_normed_rows<Threads, 4>(x, m, K, norm, norm_w, x_smem, s_warp);
    else
      stage_normed_rows<Threads, 8>(x, m, K, norm, norm_w, x_smem, s_warp);
    return;
  }
  // Any other row size: the sum of squares in its order, then a batched normalising pass.
  if (normalise) {
    const NormOrder order = norm_order(K);
    for (int r = 0; r < m; ++r) {
      const float* row = x + static_cast<size_t>(r) * K;
      if (order == NormOrder::Chunked)
        row_square_partials<Threads, kWideNormThreads, 4>(row, K, s_warp[r]);
      else if (order == NormOrder::Wide)
        row_square_partials<Threads, kWideNormThreads, 1>(row, K, s_warp[r]);
      else
        row_square_partials<Threads, kNormThreads, 1>(row, K, s_warp[r]);
    }
    __syncthreads();
    if (threadIdx.x < m) {
      const double ss = order == NormOrder::Narrow
                            ? row_square_total<kNormThreads>(s_warp[threadIdx.x])
                            : row_square_total<kWideNormThreads>(s_warp[threadIdx.x]);
      s_row[threadIdx.x] = inv_rms_from_sum(ss, K, norm.eps);
    }
    __syncthreads();
  }
  if (normalise)
    stage_batches<Threads, kStageBatch / 2, true>(x, m, K, norm, s_row, x_smem);
  else
    stage_batches<Threads, kStageBatch, false>(x, m, K, norm, s_row, x_smem, src_rows);
  __syncthreads();
}

// Four consecutive inputs x[r, k..k+3] as bf16 pairs (k a multiple of 4). F32X: from the block's
// bf16 copy of the rows in shared memory (stage_rows); else from the bf16 scratch copy (xin).
template <bool F32X>
__device__ __forceinline__ uint2 load_x4(const void* xin, const uint16_t* x_smem, int r, int K,
                                         int k) {
  if constexpr (F32X) {
    return *reinterpret_cast<const uint2*>(x_smem + r * staged_row_stride(K) + k);
  } else {
    return *reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(xin) +
                                           static_cast<size_t>(r) * K + k);
  }
}

// The kernel. Each warp applies every A fragment it loads to NT n-tiles (8·NT columns per block),
// so the activations, which every block reads in full, come from L2 NT times less often. Per
// output the mma sequence is fixed: chunks ascending, j = 0..3 within a chunk, then warps in order.
// F32X (m <= kNarrowRows): the inputs are fp32; each block first rounds all m rows to bf16 into
// dynamic shared memory (stage_rows: m · staged_row_stride(K) · 2 bytes), so the A fragments of
// the weight loop come from shared memory rather than L2, and decode-sized calls pay no
// conversion launch. Else `xin` holds the rows as bf16 already.
// SwiGLU: the weight is gate_up_swiglu's pair layout (8 gate rows, then the same 8 up rows), so
// n-tiles 2p and 2p + 1 of a block hold the gate and up of the same 8 outputs; the epilogue
// writes silu(gate) · up to y (N / 2 columns) instead of both.
// With one m-tile (decode and verify shapes) the weights of the next chunks are loaded before the
// current ones are multiplied, which doubles the bytes each warp keeps in flight; without F32X
// the first group's first weights are loaded before the kernel waits on its inputs.
// pf: a later kernel's weight bytes, whose L2 fetch each block issues once its groups are done
// (prefetch_l2_share).
// y.conv (one m-tile, neither grouped nor SwiGLU; the host passes it to no other kernel): after
// its last column group each block runs a DeltaNet's conv on the first slice's columns it stored
// (ConvFold), whose inputs it asked L1 for before the wait.
// Registers: with two m-tiles (17..32 rows, e.g. a decode step of 32 rows) the kernel declares a
// minimum of one block per SM, which lets ptxas give it ~124 registers instead of ~100: 32 rows
// ran 14% faster on the H200 (BENCHMARKS.md). The other tile counts keep ptxas's default budget
// (0: no minimum), which measured best for them (one tile: batch 1; four: 64-row windows),
// except the grouped one-tile products: their one wave of blocks (linear_grouped_warps) counts on
// 16 warps per SM, i.e. at most 128 registers.
// Grouped: see GroupRows; m is then the largest group's row count, which sized the staging, and
// every group's rows are one call's rows to the arithmetic above. (A template flag, so that the
// plain products compile exactly as they would without it.)
template <int Warps, int Tiles, int NT, bool F32X = false, bool SwiGLU = false,
          bool Grouped = false>
__global__ void __launch_bounds__(Warps * 32, Tiles == 2              ? 1
                                              : Grouped && Tiles == 1 ? 16 / Warps
                                                                      : 0)
    linear_mma_wide_kernel(const void* __restrict__ xin, int m, const uint16_t* __restrict__ w,
                           int N, int K, const SplitOut y, const RowNormArgs norm,
                           const L2Prefetch pf, const GroupRows gr) {
  static_assert(!SwiGLU || NT % 2 == 0, "SwiGLU pairs need an even number of n-tiles");
  constexpr int U = NT >= 4 ? 1 : 4 / NT;  // chunks per step: weights stay at 8·NT·U registers
  constexpr bool kPipelined = Tiles == 1;
  __shared__ float partial[Warps][Tiles][NT][32][4];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int groups = (N + 8 * NT - 1) / (8 * NT);
  const int chunks = (K + kChunk - 1) / kChunk;
  // This lane's weight rows of column group grp.
  const uint4* wrow[NT];
  bool n_ok[NT];
  // A grouped SwiGLU product reads its experts as transformers stacks them (gate_up_proj: the I
  // gate rows, then the I up rows), so gate tile 2p and up tile 2p + 1 of column group grp are
  // rows grp·4·NT + 8p + g and I + the same; elsewhere n-tile nt is rows grp·8·NT + 8·nt + g.
  auto point_at = [&](int grp) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      int n = grp * 8 * NT + nt * 8 + g;
      if constexpr (SwiGLU && Grouped) {
        const int col = grp * 4 * NT + (nt / 2) * 8 + g;
        n = col < N / 2 ? col + (nt % 2) * (N / 2) : N;
      }
      n_ok[nt] = n < N;
      wrow[nt] = reinterpret_cast<const uint4*>(w + static_cast<size_t>(n_ok[nt] ? n : 0) * K);
    }
  };
  // The weights of chunks ch0, ch0 + Warps, ... (U of them) for this lane; zeros past K.
  auto load_w = [&](uint4(&wv)[U][NT][2], int ch0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = (ch0 + u * Warps) * kChunk + 16 * t;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        if (n_ok[nt] && k < K) {
          wv[u][nt][0] = __ldcs(wrow[nt] + k / 8);
          wv[u][nt][1] = __ldcs(wrow[nt] + k / 8 + 1);
        } else {
          wv[u][nt][0] = wv[u][nt][1] = make_uint4(0, 0, 0, 0);
        }
      }
    }
  };
  // Weights never change: with the inputs already in bf16 (no staging registers to make room
  // for), the first group's first loads are issued before waiting on the previous kernel, so
  // their latency overlaps the wait. Not for a grouped product: most experts get no rows.
  constexpr bool kEarlyWeights = kPipelined && !F32X && !Grouped;
  // A grouped block walks several column groups of its expert (linear_grouped_warps sizes the
  // grid to one wave): each warp loads the first weights of its next column group while it
  // multiplies its last chunk of the current one, and the first group's before the inputs are
  // staged, so the block's loads never wait on its barriers. Loads only: the same arithmetic.
  constexpr bool kGroupWeights = kPipelined && Grouped;
  uint4 cur[U][NT][2];  // kPipelined: the weights being multiplied
  if constexpr (kEarlyWeights) {
    if (blockIdx.x < groups) {
      point_at(blockIdx.x);
      load_w(cur, warp);
    }
  }
  if constexpr (!Grouped && !SwiGLU && Tiles == 1) {
    if (y.conv.out != nullptr)
      for (int grp = blockIdx.x; grp < groups; grp += gridDim.x)
        y.conv.prefetch(m, grp * 8 * NT, (grp + 1) * 8 * NT);
  }
  bool have_cur = false;       // kGroupWeights: cur already holds this warp's first chunk of grp
  float4 norm_w[kNormChunks];  // F32X with a chunked norm: its weight, loaded before the wait
  if constexpr (F32X)
    if (norm_chunked(norm, K)) load_norm_chunks(norm, K, norm_w);
  pdl_wait();
  pdl_release();
  int row_base = 0;
  const int32_t* src_rows = nullptr;
  if constexpr (Grouped) {  // uniform across the block
    row_base = gr.start[blockIdx.y];
    m = gr.start[blockIdx.y + 1] - row_base;
    if (m <= 0) return;
    const int e = gr.expert[blockIdx.y];
    // (Up to two m-tiles: in the four-tile variants the branch cost registers, and spills.)
    if constexpr (Tiles <= 2)
      w = gr.extra && e == gr.extra_id ? gr.extra : w + static_cast<size_t>(e) * N * K;
    else
      w += static_cast<size_t>(e) * N * K;
    if (F32X && gr.gather)
      src_rows = gr.gather + row_base;
    else
      xin = F32X ? static_cast<const void*>(static_cast<const float*>(xin) +
                                            static_cast<size_t>(row_base) * K)
                 : static_cast<const void*>(static_cast<const uint16_t*>(xin) +
                                            static_cast<size_t>(row_base) * K);
  }
  if constexpr (kGroupWeights) {
    if (blockIdx.x < groups && warp < chunks) {
      point_at(blockIdx.x);
      load_w(cur, warp);
      have_cur = true;
    }
  }
  extern __shared__ uint2 x_smem_raw[];
  const uint16_t* x_smem = reinterpret_cast<const uint16_t*>(x_smem_raw);
  if constexpr (F32X)
    stage_rows<Warps * 32>(static_cast<const float*>(xin), m, K, norm, norm_w, x_smem_raw,
                           src_rows);
  for (int grp = blockIdx.x; grp < groups; grp += gridDim.x) {
    const int n_base = grp * 8 * NT;
    point_at(grp);
    for (int row0 = 0; row0 < m; row0 += Tiles * 16) {
      float c[Tiles][NT][4];
#pragma unroll
      for (int i = 0; i < Tiles; ++i)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) c[i][nt][0] = c[i][nt][1] = c[i][nt][2] = c[i][nt][3] = 0.f;

      auto multiply = [&](const uint4(&wv)[U][NT][2], int ch0) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int ch = ch0 + u * Warps;
          if (ch >= chunks) break;  // uniform across the warp
          const int k = ch * kChunk + 16 * t;
          const bool k_ok = k < K;
#pragma unroll
          for (int j = 0; j < 4; ++j) {
#pragma unroll
            for (int i = 0; i < Tiles; ++i) {
              const int r_lo = row0 + i * 16 + g, r_hi = r_lo + 8;
              uint2 lo = make_uint2(0, 0), hi = lo;
              if (k_ok && r_lo < m) lo = load_x4<F32X>(xin, x_smem, r_lo, K, k + 4 * j);
              if (k_ok && r_hi < m) hi = load_x4<F32X>(xin, x_smem, r_hi, K, k + 4 * j);
#pragma unroll
              for (int nt = 0; nt < NT; ++nt) {
                const uint32_t* wb = reinterpret_cast<const uint32_t*>(&wv[u][nt][0]);
                mma_bf16_16816(c[i][nt], lo.x, hi.x, lo.y, hi.y, wb[2 * j], wb[2 * j + 1]);
              }
            }
          }
        }
      };

      if constexpr (kPipelined) {
        if constexpr (kGroupWeights) {
          if (!have_cur) load_w(cur, warp);
          have_cur = false;
        } else if (!kEarlyWeights || grp != blockIdx.x) {
          load_w(cur, warp);
        }
        const int next_grp = grp + gridDim.x;  // (kGroupWeights only)
        const bool last_pass = row0 + Tiles * 16 >= m;
        for (int ch0 = warp; ch0 < chunks; ch0 += Warps * U) {
          uint4 next[U][NT][2];
          // kGroupWeights, the last step of a group: the next column group's first weights.
          if (kGroupWeights && ch0 + Warps * U >= chunks && last_pass && next_grp < groups) {
            point_at(next_grp);  // this group's loads are all issued
            load_w(next, warp);
            have_cur = true;
          } else {
            load_w(next, ch0 + Warps * U);
          }
          multiply(cur, ch0);
#pragma unroll
          for (int u = 0; u < U; ++u)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
              cur[u][nt][0] = next[u][nt][0];
              cur[u][nt][1] = next[u][nt][1];
            }
        }
      } else {
        for (int ch0 = warp; ch0 < chunks; ch0 += Warps * U) {
          uint4 wv[U][NT][2];
          load_w(wv, ch0);
          multiply(wv, ch0);
        }
      }

      finish_group<Warps, Tiles, NT, SwiGLU>(partial, c, warp, lane, row0, m, n_base, N, row_base,
                                             y);
    }
  }
  if constexpr (!Grouped && !SwiGLU && Tiles == 1) {
    if (y.conv.out != nullptr) {  // uniform: a kernel argument
      __syncthreads();            // the block's stored columns, visible to all its threads
      for (int grp = blockIdx.x; grp < groups; grp += gridDim.x)
        y.conv.run(m, grp * 8 * NT, (grp + 1) * 8 * NT);
    }
  }
  prefetch_l2_share(pf);
}

// act[r, c] = silu(y[r, gate(c)]) · y[r, up(c)] for y [m, 2I] in the pair layout of
// gate_up_swiglu (row 16·(c / 8) + c % 8 is gate c, 8 rows further is up c): the path for
// outputs computed whole first (prompt prefill, K not a multiple of 16). Same arithmetic as the
// fused epilogue.
template <class Out>
__global__ void swiglu_pairs_kernel(const float* __restrict__ y, int64_t m, int64_t I,
                                    Out* __restrict__ act) {
  pdl_wait();
  pdl_release();
  const int64_t n = m * I;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = e / I, c = e % I;
    const float* row = y + r * 2 * I + (c / 8) * 16 + c % 8;
    const float v = silu(row[0]) * row[8];
    if constexpr (std::is_same_v<Out, float>)
      act[e] = v;
    else
      act[e] = __float2bfloat16_rn(v);
  }
}

// Inputs whose K is not a multiple of 16: one warp per output, lanes over k, fixed shuffle tree.
// Also batch invariant (each output is computed on its own).
__global__ void linear_warp_kernel(const float* __restrict__ x, int m,
                                   const uint16_t* __restrict__ w, int N, int K, const SplitOut y) {
  pdl_wait();
  pdl_release();
  const int64_t out = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (out >= static_cast<int64_t>(m) * N) return;
  const int r = static_cast<int>(out / N), n = static_cast<int>(out % N);
  const float* xr = x + static_cast<size_t>(r) * K;
  const uint16_t* wr = w + static_cast<size_t>(n) * K;
  float s = 0.0f;
  for (int k = lane; k < K; k += 32) {
    const float xv = __bfloat162float(__float2bfloat16_rn(xr[k]));
    const float wv = __uint_as_float(static_cast<uint32_t>(wr[k]) << 16);
    s = fmaf(xv, wv, s);
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) s += __shfl_down_sync(0xffffffffu, s, off);
  if (lane == 0) y.store(r, n, s);
}

// out[i] = bf16(x[i]) for i < n, 0 for n <= i < padded.
__global__ void to_bf16_kernel(const float* __restrict__ x, int64_t n, int64_t padded,
                               __nv_bfloat16* __restrict__ out) {
  pdl_wait();
  pdl_release();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < padded) out[i] = __float2bfloat16_rn(i < n ? x[i] : 0.0f);
}

// out[i] = bf16(x[i]), four values per thread (x and out 16- and 8-byte aligned, n a multiple of
// 4): the same rounding as to_bf16_kernel, at the memory roofline for prompt-sized inputs.
__global__ void to_bf16_x4_kernel(const float4* __restrict__ x, int64_t n4,
                                  uint2* __restrict__ out) {
  pdl_wait();
  pdl_release();
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n4;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float4 v = x[i];
    out[i] = make_uint2(pack_bf16(v.x, v.y), pack_bf16(v.z, v.w));
  }
}

// The columns of full [m, N] to out's slices, four at a time (every slice start and N a multiple
// of 4, every destination 16-byte aligned): one launch for all slices, where a copy per slice
// moved its narrow slices (DeltaNet's a and b are 32 columns) a few bytes per row per block.
__global__ void scatter_slices_x4_kernel(const float4* __restrict__ full, int64_t m, int n4,
                                         SplitOut out) {
  pdl_wait();
  pdl_release();
  for (int64_t r = blockIdx.y; r < m; r += gridDim.y) {
    for (int c4 = blockIdx.x * blockDim.x + threadIdx.x; c4 < n4; c4 += gridDim.x * blockDim.x) {
      const int col = 4 * c4;
      int q = 0;
#pragma unroll
      for (int p = 1; p < kMaxSlices; ++p)
        if (p < out.parts && col >= out.start[p]) q = p;
      const int width = out.start[q + 1] - out.start[q];
      float* d = out.dst[q] + r * width + (col - out.start[q]);
      *reinterpret_cast<float4*>(d) = full[r * n4 + c4];
    }
  }
}

// --- Prompt prefill: one cuBLASLt product per projection ----------------------------------------
//
// yᵀ[N, m] = W[N, K] · xᵀ[K, m] in cuBLASLt's column-major terms: W is a K x N column-major
// matrix taken transposed, x a K x m one, y an N x m fp32 one (row-major [m, N]); fp32
// accumulation. The algorithm is fixed per (N, K, tile): cuBLASLt's first heuristic choice for
// an m of `tile` rows among the configurations without a split of K (no reduction across
// blocks), asked once and kept. In such a configuration each output element is one block's
// accumulation over all of K in an order set by the configuration alone, so a row's result does
// not depend on how many rows the call has or where the row falls: any number of rows runs in one
// call, which streams each weight once instead of once per tile. The GPU tests check this
// invariance on every projection shape they run.

constexpr int kLtCandidates = 8;

// The bf16 prefill product's layouts; fails when cuBLASLt refuses them.
struct Bf16Layouts : LtLayouts {
  Bf16Layouts(int64_t N, int64_t K, int64_t m) : LtLayouts(N, K, m, CUDA_R_16BF, CUDA_R_32F) {
    if (!ok) fail("cuBLASLt: matrix layouts for [", N, " x ", K, "] and ", m, " rows");
  }
};

// The matmul description every bf16 prefill product shares.
cublasLtMatmulDesc_t prefill_matmul_desc() {
  static cublasLtMatmulDesc_t d = transposed_weight_desc();
  return d;
}

// The algorithm of (N, K, tile), chosen on the first call and kept: keyed exactly, so two
// shapes never share an entry.
const cublasLtMatmulAlgo_t& prefill_algo(int64_t N, int64_t K, int64_t tile) {
  std::map<AlgoKey, cublasLtMatmulAlgo_t>& chosen = linear_unit().algos;
  const auto key = std::make_tuple(N, K, tile);
  if (auto it = chosen.find(key); it != chosen.end()) return it->second;
  cublasLtMatmulPreference_t pref;
  if (cublasLtMatmulPreferenceCreate(&pref) != CUBLAS_STATUS_SUCCESS)
    fail("cuBLASLt: cublasLtMatmulPreferenceCreate failed");
  const uint64_t ws = kLtWorkspaceBytes;
  const uint32_t no_reduction = CUBLASLT_REDUCTION_SCHEME_NONE, align = 16;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                       sizeof ws);
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                       &no_reduction, sizeof no_reduction);
  for (auto attr :
       {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
    cublasLtMatmulPreferenceSetAttribute(pref, attr, &align, sizeof align);
  const Bf16Layouts l(N, K, tile);
  cublasLtMatmulHeuristicResult_t found[kLtCandidates];
  int n = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(
      cublas_lt(), prefill_matmul_desc(), l.w, l.x, l.y, l.y, pref, kLtCandidates, found, &n);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS) n = 0;
  for (int i = 0; i < n; ++i) {
    int32_t splits = 0;
    size_t written = 0;
    cublasLtMatmulAlgoConfigGetAttribute(&found[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splits,
                                         sizeof splits, &written);
    if (found[i].state == CUBLAS_STATUS_SUCCESS && splits <= 1)
      return chosen.emplace(key, found[i].algo).first->second;
  }
  fail("cuBLASLt: no single-pass algorithm for a [", N, " x ", K, "] bf16 weight at ", tile,
       " rows (heuristic status ", int(st), ", ", n, " candidates)");
}

// y[m, N] (= y + x·Wᵀ when accumulate) from bf16 rows xb [m, K], in one product.
void prefill_product(const __nv_bfloat16* xb, int64_t m, const ops::WeightRef& w, float* y,
                     bool accumulate) {
  const int64_t N = w.rows, K = w.cols;
  const cublasLtMatmulAlgo_t& algo = prefill_algo(N, K, current().prefill_rows);
  const Bf16Layouts l(N, K, m);
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  const cublasStatus_t st = cublasLtMatmul(cublas_lt(), prefill_matmul_desc(), &alpha, w.data, l.w,
                                           xb, l.x, &beta, y, l.y, y, l.y, &algo, lt_workspace(),
                                           kLtWorkspaceBytes, static_cast<cudaStream_t>(stream()));
  if (st != CUBLAS_STATUS_SUCCESS)
    fail("cuBLASLt: the prefill product of a [", N, " x ", K, "] weight and ", m,
         " rows failed (status ", int(st), ")");
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// A projection of bf16 rows into `out`: straight into a single aligned destination (adding
// into it for linear_add), else into scratch and then a copy per slice. The product is the same
// either way, so the route does not change a bit.
void prefill_linear_bf16(const __nv_bfloat16* xb, int64_t m, const ops::WeightRef& w,
                         const SplitOut& out) {
  if (out.accumulate && out.parts != 1) fail("cuda linear: accumulating into several slices");
  if (out.bf16) fail("cuda linear: bf16 outputs are not a prefill route");
  const int64_t N = w.rows;
  if (out.parts == 1 && aligned16(out.dst[0]))
    return prefill_product(xb, m, w, out.dst[0], out.accumulate);
  float* full = linear_unit().prefill_full.get<float>(m * N);
  prefill_product(xb, m, w, full, false);
  if (out.accumulate) return cuda::add_inplace(out.dst[0], full, m * N);
  bool by4 = N % 4 == 0;
  for (int p = 0; p < out.parts; ++p) by4 = by4 && out.start[p] % 4 == 0 && aligned16(out.dst[p]);
  if (by4) {
    const int n4 = static_cast<int>(N / 4);
    const dim3 grid(static_cast<unsigned>((n4 + 255) / 256),
                    static_cast<unsigned>(std::min<int64_t>(m, 65535)));
    launch("linear (slices)", scatter_slices_x4_kernel, grid, 256, 0,
           reinterpret_cast<const float4*>(full), m, n4, out);
    return;
  }
  for (int p = 0; p < out.parts; ++p) {
    const int64_t width = out.start[p + 1] - out.start[p];
    copy_rows(out.dst[p], width, full + out.start[p], N, m, width);
  }
}

// fp32 rows [m, K] to bf16 in `out` (K a multiple of 4 and aligned rows: four at a time).
void rows_to_bf16(const float* x, int64_t m, int64_t K, __nv_bfloat16* out) {
  const int64_t n = m * K;
  if (K % 4 == 0 && aligned16(x)) {
    launch("linear (bf16 convert)", to_bf16_x4_kernel, grid_stride_blocks(n / 4, 256), 256, 0,
           reinterpret_cast<const float4*>(x), n / 4, reinterpret_cast<uint2*>(out));
  } else {
    launch("linear (bf16 convert)", to_bf16_kernel, static_cast<unsigned>((n + 255) / 256), 256, 0,
           x, n, n, out);
  }
}

// Blocks for `groups` column groups: as many as the GPU keeps resident (occupancy x SMs) at
// most, and then the fewest that give every block the same number of groups.
template <class Kernel>
unsigned balanced_grid(Kernel kernel, int threads, int groups, size_t smem = 0) {
  const int resident = resident_blocks(kernel, threads, smem);
  const int rounds = (groups + resident - 1) / resident;
  return static_cast<unsigned>((groups + rounds - 1) / rounds);
}

}  // namespace

void set_prefill(bool on, int64_t gemm_rows) {
  current().prefill_rows = on ? gemm_rows : 0;
}

bool prefill_mode() {
  return current().prefill_rows > 0;
}

int64_t prefill_rows() {
  return current().prefill_rows;
}

namespace {

// A projection's input norm on the host side: at most one of the two kinds.
struct InputNorm {
  const ops::RowNorm* row = nullptr;
  const ops::GatedNorm* gated = nullptr;
  // With row, folded into the staging (norm_folds_writing): the normalised rows written here too.
  float* row_out = nullptr;
  explicit operator bool() const { return row || gated; }
};

SplitOut split_out(const ops::OutputSlice* slices, int n_slices, int64_t rows,
                   bool accumulate = false) {
  if (n_slices < 1 || n_slices > kMaxSlices)
    fail("cuda linear: ", n_slices, " output slices (1..", kMaxSlices, " supported)");
  SplitOut y{};
  y.parts = n_slices;
  y.accumulate = accumulate;
  int64_t col = 0;
  for (int p = 0; p < n_slices; ++p) {
    y.dst[p] = slices[p].dst;
    y.start[p] = static_cast<int>(col);
    col += slices[p].cols;
  }
  y.start[n_slices] = static_cast<int>(col);
  if (col != rows)
    fail("cuda linear: output slices cover ", col, " columns of a ", rows, "-row weight");
  return y;
}

void check_weight(int64_t m, const ops::WeightRef& w, InputNorm norm) {
  if (w.dtype != DType::BF16)
    fail("cuda linear: weights must be BF16 on the device, got ", dtype_name(w.dtype));
  if (w.rows > INT32_MAX || w.cols > INT32_MAX || m > INT32_MAX)
    fail("cuda linear: shape [", m, " x ", w.cols, "] x [", w.rows, " x ", w.cols,
         "] exceeds 32-bit indexing");
  if (norm.row) check_f32_vector(norm.row->w, w.cols, "cuda linear", "input norm weight");
  if (norm.gated) {
    const int64_t hd = norm.gated->head_dim();
    if (hd < 1 || w.cols % hd != 0)
      fail("cuda linear: a gated norm over heads of ", hd, " floats does not tile rows of ",
           w.cols);
    check_f32_vector(norm.gated->w, hd, "cuda linear", "gated norm weight");
  }
}

// The L2 fetch of `w` that the tensor-core kernel's blocks issue as they finish. Only for
// one m-tile (decode steps, verify windows, batches of up to 16 rows): at 32 rows it measured
// 0.4-0.9% slower (BENCHMARKS.md). TANDEM_CUDA_L2_PREFETCH=0 in the environment turns it off
// (A/B timing). A hint: w is only read, by the L2, never by the kernel.
L2Prefetch l2_prefetch(const ops::WeightRef* w, int64_t m) {
  static const bool enabled = env_switch_on("TANDEM_CUDA_L2_PREFETCH");
  if (!enabled || !w || !w->data || m > kTileRows) return {};
  const auto begin = reinterpret_cast<uintptr_t>(w->data);
  const uintptr_t end = begin + static_cast<uintptr_t>(w->rows * w->cols) * dtype_size(w->dtype);
  const uintptr_t first = (begin + 15) & ~uintptr_t(15), last = end & ~uintptr_t(15);
  if (last <= first) return {};
  return {reinterpret_cast<const char*>(first), last - first};
}

bool mma_path(const float* x, const ops::WeightRef& w) {
  if (w.cols % 16 != 0) return false;
  if (reinterpret_cast<uintptr_t>(x) % 16 != 0 || reinterpret_cast<uintptr_t>(w.data) % 16 != 0)
    fail("cuda linear: input and weight rows must be 16-byte aligned (K = ", w.cols, ")");
  return true;
}

// The input rows normalised by rms_norm into a scratch buffer: the input norm of every path that
// does not normalise while staging (prefill, batches, K not a multiple of 16). The scratch is
// reused by the next call; calls are ordered on the stream.
const float* normalised_rows(const float* x, int64_t m, int64_t K, InputNorm norm) {
  float* out = linear_unit().normalised.get<float>(m * K);
  if (norm.row) {
    cuda::rms_norm(x, m, K, norm.row->w, norm.row->zero_centred, norm.row->eps, out);
  } else {
    const ops::GatedNorm& g = *norm.gated;
    cuda::gated_rms_norm(x, g.z, m * (K / g.head_dim()), g.head_dim(), g.w, g.eps, out);
  }
  return out;
}

// The same rows rounded to bf16 (what the product reads), in one pass.
void normalised_rows_bf16(const float* x, int64_t m, int64_t K, InputNorm norm, uint16_t* out) {
  if (norm.row) {
    rms_norm_bf16(x, m, K, norm.row->w, norm.row->zero_centred, norm.row->eps, out);
  } else {
    const ops::GatedNorm& g = *norm.gated;
    gated_rms_norm_bf16(x, g.z, m * (K / g.head_dim()), g.head_dim(), g.w, g.eps, out);
  }
}

// Prompt prefill's input rows [m, K]: normalised or converted to bf16 in one pass (the values a
// product reads) into the prefill scratch, which holds at least `capacity` values.
__nv_bfloat16* prefill_rows_bf16(const float* x, int64_t m, int64_t K, InputNorm norm,
                                 int64_t capacity) {
  auto* xb = linear_unit().prefill_xb.get<__nv_bfloat16>(std::max(m * K, capacity));
  if (norm)
    normalised_rows_bf16(x, m, K, norm, reinterpret_cast<uint16_t*>(xb));
  else
    rows_to_bf16(x, m, K, xb);
  return xb;
}

void linear_prefill(const float* x, int64_t m, const ops::WeightRef& w, const SplitOut& out,
                    InputNorm norm) {
  prefill_linear_bf16(prefill_rows_bf16(x, m, w.cols, norm, 0), m, w, out);
}

// Whether a block applies the norm while it stages the rows (stage_rows): an RMSNorm of a single
// row. A gated norm never is: every block would redo all heads' reductions (four shuffle trees
// per head), which measured slower than the norm kernel it saves (203.5 vs 208-210 tok/s).
bool norm_folds(InputNorm norm, int64_t m) {
  return norm.row && m <= kFoldedNormRows &&
         reinterpret_cast<uintptr_t>(norm.row->w.data) % 16 == 0;
}

// Whether a folded norm can also write the normalised rows (InputNorm::row_out): the path
// linear_any takes to the tensor-core kernel, with rows normalised from registers (norm_chunked).
bool norm_folds_writing(const float* x, int64_t m, const ops::WeightRef& w, InputNorm norm) {
  return !prefill_mode() && w.dtype == DType::BF16 && mma_path(x, w) && norm_folds(norm, m) &&
         rows_normed_in_registers(w.cols);
}

template <int Warps, bool SwiGLU>
void linear_mma_bf16_rows(const uint16_t* xs, int64_t m, const ops::WeightRef& w, const SplitOut& y,
                          const L2Prefetch& pf);

// Scratch for the bf16 input rows of one call (reused by the next; calls are stream-ordered).
uint16_t* bf16_rows(int64_t n) {
  return linear_unit().bf16_rows.get<uint16_t>(n);
}

// The tensor-core path (decode and verify shapes, K a multiple of 16). SwiGLU: y has N / 2
// columns (gate_up_swiglu). Warps per block follow the weight's row count alone (see the header).
// norm (optional): normalised while staging (m <= kNarrowRows), else by rms_norm first.
template <int Warps, bool SwiGLU>
void linear_mma_warps(const float* x, int64_t m, const ops::WeightRef& w, const SplitOut& y,
                      InputNorm norm, const L2Prefetch& pf) {
  constexpr int kThreads = Warps * 32;
  const int N = static_cast<int>(w.rows), K = static_cast<int>(w.cols), M = static_cast<int>(m);
  const auto* wp = static_cast<const uint16_t*>(w.data);
  const size_t staged = sizeof(uint16_t) * static_cast<size_t>(m * staged_row_stride(K));
  const bool stages = m <= kNarrowRows && staged <= kNarrowSmemMax;
  // The norm is folded into the staging for a single row (decode) only: a block normalises its
  // rows one after another, and from two rows on, a norm kernel first is cheaper. That kernel
  // writes the rows in bf16, ready for the product (no staging, no conversion launch). So does a
  // row too long to stage (K > 65,528), whose folded norm would otherwise be skipped.
  if (norm && (!norm_folds(norm, m) || !stages)) {
    if (norm.row_out)
      fail("cuda linear: the normalised row of ", K, " inputs cannot be kept (not staged)");
    uint16_t* xs = bf16_rows(m * K);
    normalised_rows_bf16(x, m, K, norm, xs);
    return linear_mma_bf16_rows<Warps, SwiGLU>(xs, m, w, y, pf);
  }
  if (stages) {
    RowNormArgs row_norm{nullptr, 0.0f, false};
    if (norm.row)
      row_norm = {static_cast<const float*>(norm.row->w.data), norm.row->eps,
                  norm.row->zero_centred, norm.row_out};
    auto go = [&](auto kernel, int cols_per_block) {
      allow_dynamic_smem(kernel, staged, "cuda linear: the input rows");
      launch("linear", kernel,
             balanced_grid(kernel, kThreads, (N + cols_per_block - 1) / cols_per_block, staged),
             kThreads, staged, x, M, wp, N, K, y, row_norm, pf, GroupRows{});
    };
    // Two n-tiles per warp halve the activation reads (every block reads all of x). A weight of
    // so few rows that its 16-column groups leave most SMs idle (a mixture's router: 257 rows,
    // 17 blocks of 64 KiB each, every one a chain of DRAM round trips) takes one n-tile per warp:
    // twice the blocks, each half the bytes (0.6-0.7% off a 35B-A3B step at 1 and 8 rows on an
    // H100, BENCHMARKS.md). The same arithmetic per output.
    if constexpr (!SwiGLU) {
      const auto narrow = linear_mma_wide_kernel<Warps, 1, 1, true, false>;
      if ((N + 15) / 16 < resident_blocks(narrow, kThreads, staged) / 4) return go(narrow, 8);
    }
    go(linear_mma_wide_kernel<Warps, 1, 2, true, SwiGLU>, 16);
    return;
  }
  // Batches: a bf16 copy of the inputs first.
  uint16_t* xs = bf16_rows(m * K);
  const int64_t n = m * K;
  launch("linear (bf16 convert)", to_bf16_kernel, static_cast<unsigned>((n + 255) / 256), 256, 0, x,
         n, n, reinterpret_cast<__nv_bfloat16*>(xs));
  linear_mma_bf16_rows<Warps, SwiGLU>(xs, m, w, y, pf);
}

// The tensor-core path on inputs already in bf16 (xs [m, K], 16-byte aligned rows).
template <int Warps, bool SwiGLU>
void linear_mma_bf16_rows(const uint16_t* xs, int64_t m, const ops::WeightRef& w, const SplitOut& y,
                          const L2Prefetch& pf) {
  constexpr int kThreads = Warps * 32;
  const int N = static_cast<int>(w.rows), K = static_cast<int>(w.cols), M = static_cast<int>(m);
  const auto* wp = static_cast<const uint16_t*>(w.data);
  auto launch_wide = [&](auto kernel, int cols_per_block) {
    launch("linear", kernel,
           balanced_grid(kernel, kThreads, (N + cols_per_block - 1) / cols_per_block), kThreads, 0,
           xs, M, wp, N, K, y, RowNormArgs{nullptr, 0.0f, false}, pf, GroupRows{});
  };
  // More than two m-tiles (verify windows of many rows): the staged kernel of linear_tiles.cu,
  // the same bits. Up to 32 rows this kernel measured faster (BENCHMARKS.md).
  if (m > kTilesFromRows && tiles_enabled()) return linear_tiles(xs, M, wp, N, K, Warps, SwiGLU, y);
  // Two m-tiles (a 32-row decode step, a 4-token window of 8 rows): the weights through a ring
  // that a producer warp keeps full (linear_ring.cu), the same bits.
  if (ring_takes(M)) return linear_ring(xs, M, wp, N, K, Warps, SwiGLU, y);
  // Wide weights (4 warps) take 4 n-tiles per warp, narrow ones 2 (to keep more blocks).
  constexpr int NT = Warps == 4 ? 4 : 2;
  if (m <= kTileRows)
    launch_wide(linear_mma_wide_kernel<Warps, 1, NT, false, SwiGLU>, 8 * NT);
  else if (m <= 2 * kTileRows)
    launch_wide(linear_mma_wide_kernel<Warps, 2, NT, false, SwiGLU>, 8 * NT);
  else
    launch_wide(linear_mma_wide_kernel<Warps, kMaxTiles, NT, false, SwiGLU>, 8 * NT);
}

// Calls f(std::integral_constant<int, Warps>{}) with the warps per block of weight w: a function
// of its shape alone (see the header), the one rule every tensor-core launch follows.
template <class F>
void with_warps(const ops::WeightRef& w, F&& f) {
  if (k_split_warps(w.rows) == 4)
    f(std::integral_constant<int, 4>{});
  else
    f(std::integral_constant<int, 8>{});
}

template <bool SwiGLU>
void linear_mma(const float* x, int64_t m, const ops::WeightRef& w, const SplitOut& y,
                InputNorm norm, const L2Prefetch& pf = {}) {
  with_warps(w,
             [&](auto W) { linear_mma_warps<decltype(W)::value, SwiGLU>(x, m, w, y, norm, pf); });
}

void linear_mma_bf16(const uint16_t* xs, int64_t m, const ops::WeightRef& w, const SplitOut& y,
                     const L2Prefetch& pf) {
  with_warps(w, [&](auto W) { linear_mma_bf16_rows<decltype(W)::value, false>(xs, m, w, y, pf); });
}

// xs[r, :] = bf16(x[src_rows[r], :]) for r < rows (K a multiple of 4): a mixture's pair rows
// gathered from the tokens' rows and rounded as to_bf16_kernel rounds, in one pass.
__global__ void gather_bf16_x4_kernel(const float4* __restrict__ x,
                                      const int32_t* __restrict__ src_rows, int64_t rows,
                                      int64_t k4, uint2* __restrict__ out) {
  pdl_wait();
  pdl_release();
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * k4;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / k4, c = i % k4;
    const float4 v = x[static_cast<int64_t>(src_rows[r]) * k4 + c];
    out[i] = make_uint2(pack_bf16(v.x, v.y), pack_bf16(v.z, v.w));
  }
}

// The grouped product (GroupRows), on the tensor-core kernels of linear_mma_warps: every group
// takes the path a call of max_rows rows would (staged fp32 rows up to kNarrowRows, else a bf16
// copy and the m-tiles of max_rows), so a row's value is the one a plain linear of that expert
// gives it whatever its group's size. SwiGLU: see point_at (transformers' gate-then-up halves).
template <int Warps, bool SwiGLU>
void linear_grouped_warps(const float* x, int64_t rows, int64_t max_rows,
                          const ops::WeightRef& expert, int64_t groups, const GroupRows& gr,
                          const SplitOut& y) {
  constexpr int kThreads = Warps * 32;
  const int N = static_cast<int>(expert.rows), K = static_cast<int>(expert.cols);
  const int M = static_cast<int>(max_rows);
  const auto* wp = static_cast<const uint16_t*>(expert.data);
  // One wave of blocks over all groups' column blocks where the kernel walks several column
  // blocks with their loads overlapped (one m-tile: kGroupWeights); else rounds of blocks over
  // each group's columns (balanced_grid).
  auto grid = [&](auto kernel, int cols_per_block, size_t smem, bool one_wave) {
    const int cols = (N + cols_per_block - 1) / cols_per_block;
    if (!one_wave)
      return dim3(balanced_grid(kernel, kThreads, cols, smem), static_cast<unsigned>(groups));
    const int64_t blocks = static_cast<int64_t>(cols) * groups;
    const int64_t rounds = ceil_div(blocks, int64_t{resident_blocks(kernel, kThreads, smem)});
    return dim3(static_cast<unsigned>(ceil_div(int64_t{cols}, rounds)),
                static_cast<unsigned>(groups));
  };
  const size_t staged = sizeof(uint16_t) * static_cast<size_t>(max_rows * staged_row_stride(K));
  if (max_rows <= kNarrowRows && staged <= kNarrowSmemMax) {
    const auto kernel = linear_mma_wide_kernel<Warps, 1, 2, true, SwiGLU, true>;
    allow_dynamic_smem(kernel, staged, "cuda linear: the input rows");
    launch("linear_grouped", kernel, grid(kernel, 16, staged, true), kThreads, staged, x, M, wp, N,
           K, y, RowNormArgs{nullptr, 0.0f, false}, L2Prefetch{}, gr);
    return;
  }
  uint16_t* xs = bf16_rows(rows * K);
  if (gr.gather) {
    const int64_t n4 = rows * K / 4;
    launch("linear_grouped (gather bf16)", gather_bf16_x4_kernel, grid_stride_blocks(n4, 256), 256,
           0, reinterpret_cast<const float4*>(x), gr.gather, rows, int64_t{K / 4},
           reinterpret_cast<uint2*>(xs));
  } else {
    launch("linear_grouped (bf16 convert)", to_bf16_kernel,
           static_cast<unsigned>((rows * K + 255) / 256), 256, 0, x, rows * K, rows * K,
           reinterpret_cast<__nv_bfloat16*>(xs));
  }
  constexpr int NT = Warps == 4 ? 4 : 2;
  auto go = [&](auto kernel, int n_tiles, bool one_wave) {
    launch("linear_grouped", kernel, grid(kernel, 8 * n_tiles, 0, one_wave), kThreads, 0, xs, M, wp,
           N, K, y, RowNormArgs{nullptr, 0.0f, false}, L2Prefetch{},
           GroupRows{gr.expert, gr.start, nullptr, gr.extra, gr.extra_id});
  };
  // One m-tile with at most one chunk of K per warp (the experts' down, K = I): at two n-tiles
  // the second chunk of a step (U = 2) is empty, so each step loads half a warp's budget and a
  // block walks twice the column groups, each exposing a load latency (55% of the bandwidth at
  // 8 rows on the H200). Four n-tiles, one chunk a step: the same arithmetic per output.
  if constexpr (!SwiGLU && NT == 2) {
    if (max_rows <= kTileRows && K <= kChunk * Warps)
      return go(linear_mma_wide_kernel<Warps, 1, 4, false, false, true>, 4, true);
  }
  if (max_rows <= kTileRows)
    go(linear_mma_wide_kernel<Warps, 1, NT, false, SwiGLU, true>, NT, true);
  else if (max_rows <= 2 * kTileRows)
    go(linear_mma_wide_kernel<Warps, 2, NT, false, SwiGLU, true>, NT, false);
  else
    go(linear_mma_wide_kernel<Warps, kMaxTiles, NT, false, SwiGLU, true>, NT, false);
}

void linear_any(const float* x, int64_t m, const ops::WeightRef& w, const SplitOut& y,
                InputNorm norm, const L2Prefetch& pf = {}) {
  if (prefill_mode()) return linear_prefill(x, m, w, y, norm);
  if (mma_path(x, w)) return linear_mma<false>(x, m, w, y, norm, pf);
  if (norm) x = normalised_rows(x, m, w.cols, norm);
  const int N = static_cast<int>(w.rows), K = static_cast<int>(w.cols), M = static_cast<int>(m);
  launch("linear", linear_warp_kernel, static_cast<unsigned>((m * w.rows + 7) / 8), 256, 0, x, M,
         static_cast<const uint16_t*>(w.data), N, K, y);
}

// Whether linear_split's conv runs inside the product (ConvFold): decode steps of up to one m-tile
// (the register kernel's calls), whose descriptors (laid out in token order) then give row r
// token r alone, at the tap count the fold is compiled for; never in prompt prefill.
// TANDEM_CUDA_CONV_FOLD=0 keeps the conv kernel after the product (A/B timing).
bool conv_folds(const float* x, const ops::WeightRef& w, const ops::SliceConv& conv, int64_t m) {
  static const bool enabled = env_switch_on("TANDEM_CUDA_CONV_FOLD");
  return enabled && !prefill_mode() && m <= kTileRows && mma_path(x, w) &&
         conv.kernel == kFoldedConvTaps && conv.max_n == 1 && conv.n_rows == m;
}

}  // namespace

void linear_split(const float* x, int64_t m, const ops::WeightRef& w,
                  const ops::OutputSlice* slices, int n_slices, const ops::RowNorm* norm,
                  const ops::WeightRef* prefetch, const ops::SliceConv* conv) {
  SplitOut y = split_out(slices, n_slices, w.rows);
  if (m == 0 || w.rows == 0) return;
  check_weight(m, w, {norm, nullptr});
  if (conv != nullptr) {  // checked before the product writes anything
    const int64_t channels = slices[0].cols;
    check_f32_vector(conv->w, channels * conv->kernel, "cuda linear", "conv weight");
    if (conv->w.rows != channels || conv->w.cols != conv->kernel)
      fail("cuda linear: the conv weight is [", conv->w.rows, ", ", conv->w.cols, "], expected [",
           channels, ", ", conv->kernel, "]");
  }
  const bool fold = conv != nullptr && conv_folds(x, w, *conv, m);
  if (fold)
    y.conv = {static_cast<const float*>(conv->w.data), conv->rows, slices[0].dst, conv->out,
              static_cast<int>(slices[0].cols)};
  linear_any(x, m, w, y, {norm, nullptr}, l2_prefetch(prefetch, m));
  if (conv != nullptr && !fold)
    cuda::causal_conv_silu_rows(slices[0].dst, slices[0].cols, conv->kernel, conv->w, conv->rows,
                                conv->n_rows, conv->max_n, conv->out);
}

void linear_split_keeping_norm(const float* x, int64_t m, const ops::WeightRef& w,
                               const ops::OutputSlice* slices, int n_slices,
                               const ops::RowNorm& norm, float* normed) {
  const SplitOut y = split_out(slices, n_slices, w.rows);
  if (m == 0 || w.rows == 0) return;
  check_weight(m, w, {&norm, nullptr});
  const InputNorm folded{&norm, nullptr, normed};
  if (norm_folds_writing(x, m, w, folded)) return linear_mma<false>(x, m, w, y, folded);
  cuda::rms_norm(x, m, w.cols, norm.w, norm.zero_centred, norm.eps, normed);
  linear_any(normed, m, w, y, {});
}

void linear_prefill_bf16(const float* x, int64_t m, const ops::WeightRef& w, float* y,
                         bool accumulate) {
  if (!prefill_mode()) fail("linear_prefill_bf16: not in prompt-prefill mode");
  if (w.dtype != DType::BF16) fail("linear_prefill_bf16: weight dtype ", dtype_name(w.dtype));
  if (m == 0 || w.rows == 0) return;
  const ops::OutputSlice all{y, w.rows};
  linear_prefill(x, m, w, split_out(&all, 1, w.rows, accumulate), {});
}

void linear(const float* x, int64_t m, const ops::WeightRef& w, float* y) {
  if (w.dtype == DType::F8_E4M3) return linear_fp8(x, m, w, y);
  const ops::OutputSlice all{y, w.rows};
  cuda::linear_split(x, m, w, &all, 1, nullptr);
}

void linear_add(const float* x, int64_t m, const ops::WeightRef& w, float* y,
                const ops::GatedNorm* norm, const ops::WeightRef* prefetch) {
  if (w.dtype == DType::F8_E4M3) {
    if (norm) fail("linear_add: a gated input norm is not supported for fp8 weights");
    return linear_fp8(x, m, w, y, /*accumulate=*/true);
  }
  const ops::OutputSlice all{y, w.rows};
  const SplitOut out = split_out(&all, 1, w.rows, /*accumulate=*/true);
  if (m == 0 || w.rows == 0) return;
  check_weight(m, w, {nullptr, norm});
  linear_any(x, m, w, out, {nullptr, norm}, l2_prefetch(prefetch, m));
}

void gate_up_swiglu(const float* x, int64_t m, const ops::WeightRef& gate_up, float* act,
                    const ops::RowNorm* norm) {
  if (gate_up.rows % 16 != 0)
    fail("gate_up_swiglu: the stacked weight has ", gate_up.rows,
         " rows; the pair layout needs a multiple of 16");
  if (m == 0 || gate_up.rows == 0) return;
  check_weight(m, gate_up, {norm, nullptr});
  const int64_t I = gate_up.rows / 2;
  if (!prefill_mode() && mma_path(x, gate_up)) {
    const ops::OutputSlice out{act, I};
    return linear_mma<true>(x, m, gate_up, split_out(&out, 1, I), {norm, nullptr});
  }
  // Prompt prefill and K not a multiple of 16: the whole [m, 2I] output, then its SwiGLU.
  float* y = linear_unit().swiglu_full.get<float>(m * 2 * I);
  const ops::OutputSlice all{y, 2 * I};
  linear_any(x, m, gate_up, split_out(&all, 1, 2 * I), {norm, nullptr});
  launch("gate_up_swiglu", swiglu_pairs_kernel<float>, grid_stride_blocks(m * I, 256), 256, 0, y, m,
         I, act);
}

void swiglu_mlp_add(const float* x, int64_t m, const ops::WeightRef& gate_up,
                    const ops::WeightRef& down, float* y, const ops::RowNorm* norm,
                    const ops::WeightRef* prefetch) {
  const int64_t I = gate_up.rows / 2;
  if (down.cols != I || down.rows != gate_up.cols)
    fail("swiglu_mlp_add: the down projection is [", down.rows, " x ", down.cols, "], expected [",
         gate_up.cols, " x ", I, "] for a [", gate_up.rows, " x ", gate_up.cols,
         "] gate/up weight");
  if (m == 0 || I == 0) return;
  check_weight(m, down, {});
  if (prefill_mode() && gate_up.cols % 4 == 0 && I % 4 == 0) {
    // Prompt prefill: the activations go to the down projection as the bf16 values it would
    // round them to, as in decode (bitwise gate_up_swiglu, then linear_add); they overwrite the
    // input rows in the scratch once the gate/up product has read them.
    check_weight(m, gate_up, {norm, nullptr});
    __nv_bfloat16* xb = prefill_rows_bf16(x, m, gate_up.cols, {norm, nullptr}, m * I);
    float* full = linear_unit().prefill_full.get<float>(m * 2 * I);
    prefill_product(xb, m, gate_up, full, false);
    launch("gate_up_swiglu", swiglu_pairs_kernel<__nv_bfloat16>, grid_stride_blocks(m * I, 256),
           256, 0, full, m, I, xb);
    const ops::OutputSlice residual{y, down.rows};
    return prefill_linear_bf16(xb, m, down, split_out(&residual, 1, down.rows, true));
  }
  if (prefill_mode() || down.cols % 16 != 0 || !mma_path(x, gate_up)) {
    float* a = linear_unit().swiglu_act.get<float>(m * I);
    cuda::gate_up_swiglu(x, m, gate_up, a, norm);
    return cuda::linear_add(a, m, down, y, nullptr, prefetch);
  }
  check_weight(m, gate_up, {norm, nullptr});
  if (reinterpret_cast<uintptr_t>(down.data) % 16 != 0)
    fail("cuda linear: weight rows must be 16-byte aligned (K = ", down.cols, ")");
  // The activations go to the down projection as the bf16 values it would round them to.
  uint16_t* a = linear_unit().swiglu_act_bf16.get<uint16_t>(m * I);
  const ops::OutputSlice act_out{reinterpret_cast<float*>(a), I};
  SplitOut to_act = split_out(&act_out, 1, I);
  to_act.bf16 = true;
  linear_mma<true>(x, m, gate_up, to_act, {norm, nullptr});
  const ops::OutputSlice residual{y, down.rows};
  linear_mma_bf16(a, m, down, split_out(&residual, 1, down.rows, /*accumulate=*/true),
                  l2_prefetch(prefetch, m));
}

void linear_grouped(const float* x, int64_t rows, int64_t max_rows, const ops::WeightRef& stacked,
                    int64_t experts, int64_t groups, const int32_t* expert, const int32_t* start,
                    float* y, const GroupedOptions& opt) {
  if (stacked.dtype == DType::F8_E4M3)
    return linear_grouped_fp8(x, rows, max_rows, stacked, experts, groups, expert, start, y, opt);
  if (experts < 1 || stacked.rows % experts != 0)
    fail("linear_grouped: ", stacked.rows, " stacked rows do not split into ", experts, " experts");
  const int64_t ids = experts + (opt.extra_expert ? 1 : 0);  // expert ids a group may name
  if (groups < 1 || groups > ids) fail("linear_grouped: ", groups, " groups of ", ids, " experts");
  if (rows == 0 || stacked.rows == 0) return;
  if (max_rows < 1 || max_rows > rows)
    fail("linear_grouped: a group of up to ", max_rows, " of ", rows, " rows");
  ops::WeightRef one = stacked;  // expert 0's rows: the shape every group multiplies by
  one.rows = stacked.rows / experts;
  check_weight(rows, one, {});
  if (!mma_path(x, one))
    fail("linear_grouped: rows of ", one.cols, " need a multiple of 16 (the tensor-core path)");
  if (opt.swiglu && one.rows % 16 != 0)
    fail("linear_grouped: SwiGLU over ", one.rows, " rows per expert (a multiple of 16 needed)");
  const int64_t width = opt.swiglu ? one.rows / 2 : one.rows;
  const ops::OutputSlice all{y, width};
  const SplitOut out = split_out(&all, 1, width);
  const uint16_t* extra = nullptr;
  if (const ops::WeightRef* x2 = opt.extra_expert) {
    if (max_rows > 2 * kTileRows)
      fail("linear_grouped: an extra expert in groups of up to ", max_rows, " rows (at most ",
           2 * kTileRows, ")");
    if (x2->dtype != DType::BF16 || x2->rows != one.rows || x2->cols != one.cols)
      fail("linear_grouped: the extra expert is ", dtype_name(x2->dtype), " [", x2->rows, " x ",
           x2->cols, "], expected BF16 [", one.rows, " x ", one.cols, "]");
    if (!mma_path(x, *x2)) fail("linear_grouped: the extra expert's rows must be 16-byte aligned");
    extra = static_cast<const uint16_t*>(x2->data);
  }
  const GroupRows gr{expert, start, opt.gather, extra, static_cast<int>(experts)};
  with_warps(one, [&](auto W) {
    if (opt.swiglu)
      linear_grouped_warps<decltype(W)::value, true>(x, rows, max_rows, one, groups, gr, out);
    else
      linear_grouped_warps<decltype(W)::value, false>(x, rows, max_rows, one, groups, gr, out);
  });
}

TANDEM_CUDA_TRACE_UNIT(linear)

}  // namespace tandem::cuda
