// The Gated DeltaNet's recurrent ops: the depthwise causal conv (+ SiLU) and the gated delta rule.
// Both walk a row's tokens in order inside one kernel, carrying the state in registers, and run
// exactly the same per-token step whatever n is: n tokens in one call leave the same bits as n
// calls of one token (the state round-trips through fp32 memory exactly).
//
// Each op has a single-row entry (the row's pointers and n as arguments) and a batched one
// (_rows: every row of a forward in one launch, rows on a grid dimension, each block reading its
// row's pointers and n from a device descriptor). Both kernels of an op run one shared device
// function for a row, so a row's bits are those of the single-row op whatever else is batched
// with it.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdlib>
#include <string_view>
#include <type_traits>

#include "tandem/backend/cuda/activation.cuh"
#include "tandem/backend/cuda/async_copy.cuh"
#include "tandem/backend/cuda/check.cuh"
#include "tandem/backend/cuda/conv_channel.cuh"
#include "tandem/backend/cuda/cuda_ops.h"
#include "tandem/core/env_switch.h"
#include "tandem/core/error.h"

namespace tandem::cuda {

namespace {

__device__ inline float softplus(float x) {
  return x > 20.0f ? x : log1pf(expf(x));
}

// --- causal_conv_silu ----------------------------------------------------------------------------

constexpr int kConvThreads = 128;
constexpr int kMaxConvKernel = 16;
// Tokens per block when causal_conv_silu_rows splits long rows (prompts); >= kMaxConvKernel - 1.
constexpr int64_t kConvChunk = 64;

// One row, from arguments: grid over channels.
template <int K>
__global__ void __launch_bounds__(kConvThreads)
    causal_conv_silu_kernel(const float* x, int64_t n, int64_t channels, const float* w,
                            float* state, float* out, float* state_after) {
  const int64_t c = blockIdx.x * int64_t(kConvThreads) + threadIdx.x;
  ConvChannel<K> ch;
  if (c < channels) ch.load(w, state, c);
  pdl_wait();
  pdl_release();
  if (c >= channels) return;
  ch.run(x, 0, n, channels, c, out, state_after);
  ch.store(state, c);
}

// Rows from device descriptors: grid (channel blocks, rows, token chunks); block (i, r, z) runs
// channel block i of row rows[r] on the row's tokens z·chunk .. (z+1)·chunk - 1 of x and out
// (chunk 0: all of them, z = 0). Rows own disjoint tokens and states, so blocks of different rows
// never touch the same word. A long prompt's tokens are split into chunks because one thread per
// channel walking 4096 tokens in order leaves most of the GPU idle (64 blocks at 8192 channels);
// every output is still the same fmaf sequence over the same window, so the bits do not depend on
// the split. A block that starts part way reads its window from x, and only the row's first
// block reads and writes the conv state (the final window from x when other blocks ran the tail),
// so no block reads a state word another writes. The descriptor, uploaded before the forward's
// first kernel, is read before the wait too.
// Layered (ops::recurrent_layers_rows): row blockIdx.y is row blockIdx.y % layer_rows of layer
// blockIdx.y / layer_rows, whose entry replaces x, w and out.
template <int K, bool Layered = false>
__global__ void __launch_bounds__(kConvThreads)
    causal_conv_silu_rows_kernel(const float* x, int64_t channels, const float* __restrict__ w,
                                 const ops::RecurrentRow* __restrict__ rows, int64_t chunk,
                                 float* out, const ops::RecurrentLayer* __restrict__ layers,
                                 int64_t layer_rows) {
  // w and rows are only read here (the descriptors never alias a state); saying so keeps the
  // row's pointers in registers instead of a spill at the larger tap counts. x is not restrict:
  // out may alias it when the rows are not split into chunks.
  if constexpr (Layered) {
    const ops::RecurrentLayer& layer = layers[blockIdx.y / layer_rows];
    x = layer.conv_input;
    w = static_cast<const float*>(layer.conv_weight.data);
    out = layer.conv_out;
  }
  const int64_t c = blockIdx.x * int64_t(kConvThreads) + threadIdx.x;
  const ops::RecurrentRow row = rows[blockIdx.y];
  const int64_t begin = chunk * blockIdx.z;
  const int64_t end = chunk == 0 ? row.n : min(row.n, begin + chunk);
  const bool live = c < channels && begin < end;  // an idle row: its state stays as it is
  ConvChannel<K> ch;
  if (live) ch.load(w, row.conv_state, c);
  pdl_wait();
  pdl_release();
  if (!live) return;
  const float* xr = x + row.first_token * channels;
  if (begin > 0) ch.seek(xr, begin, channels, c);
  const int64_t settled = ops::settled_tokens(row);
  if (begin == 0 && settled > 0 && settled < end) {
    // The row's state keeps only its first `settled` tokens: the window they leave is stored
    // after the run (no block of this launch uses the stored words).
    ch.run(xr, 0, end, channels, c, out + row.first_token * channels, row.conv_after, settled);
    ch.store_settled(row.conv_state, c);
    return;
  }
  ch.run(xr, begin, end, channels, c, out + row.first_token * channels, row.conv_after);
  if (begin > 0 || settled == 0) return;
  // Later blocks ran the tail (n > chunk >= H): the window before token `settled` is in x.
  if (end < settled) ch.seek(xr, settled, channels, c);
  ch.store(row.conv_state, c);
}

// Calls launch_with(std::integral_constant<int, kernel>{}): the tap count is a template argument so
// the window stays in registers.
template <int K = 1, class Launch>
void with_conv_taps(int64_t kernel, const char* op, Launch&& launch_with) {
  if constexpr (K > kMaxConvKernel) {
    fail(op, ": kernel size ", kernel, " exceeds the CUDA maximum ", kMaxConvKernel);
  } else if (kernel != K) {
    with_conv_taps<K + 1>(kernel, op, launch_with);
  } else {
    launch_with(std::integral_constant<int, K>{});
  }
}

// The weight checks both conv entries make.
void check_conv_weight(const ops::WeightRef& w, int64_t channels, int64_t kernel, const char* op) {
  check_f32_vector(w, channels * kernel, op, "weight");
  if (w.rows != channels || w.cols != kernel)
    fail(op, ": weight is [", w.rows, ", ", w.cols, "], expected [", channels, ", ", kernel, "]");
}

// --- gated_delta_rule ----------------------------------------------------------------------------
//
// Work split. L lanes share a value column, L = 8 on decode and verify calls and 4 in prompt
// prefill (set_prefill). Grid (column tiles of C = 128 / L, value heads); block (tile, vh) owns
// value columns j = C·tile + 0..C-1 of head vh, all dk rows of each: columns evolve independently
// in the delta rule, so blocks never share state. Lane = L·c + s (column c of the warp's 32 / L,
// row part s) keeps ROWS = DK/L of the column's rows in registers: rows i = 4L·m + 4s + e
// (m < ROWS/4, e < 4), i.e. float4 number L·m + s of a row vector. The state enters the registers
// before a row's first token and leaves after its last (DeltaStateTile): at L = 8, where a lane's
// own rows would use half of every memory sector they touch, as 16-byte row segments of the
// block's tile through shared memory; at L = 4, and for per-token state_after, lane by lane. DK is
// dk padded up (64, 128 or 256); padded rows hold 0 and their k̂, q̂ are 0, so they add exact zeros
// (and are never stored). At dk = dv = 128 and 32 value heads, L = 8 gives 1024 warps, two per H200
// warp scheduler: a decode step's token is latency-bound (one token's arithmetic between a state
// load and a store), and the eighth of a column per lane halves each warp's instruction chain and
// doubles the warps that hide it. A prompt is a long chain of tokens per block, where the extra
// shuffle level of every sum costs more than the parallelism gains (4096 tokens: 1.38 ms per layer
// at L = 8, 1.20 at L = 4). Both are batch invariant; prompt tokens, like prompt linears, simply
// have numbers of their own. The batched kernel adds the row as grid dimension z.
//
// Time split. Tokens go in chunks of TOKENS (16; 8 at DK 256), double-buffered in shared memory.
// For chunk c the block (A) waits for its cp.async copies (raw q, k of key head vh / group, the
// tile's v columns, a, b; issued during chunk c-1), issues chunk c+1's copies into the other
// buffer, normalises chunk c's q and k in place and turns a, b into decay and beta, all tokens at
// once, then (B) runs the recurrence over chunk c's tokens with no barrier: per token a column's
// two dk-long sums are L per-lane partials combined by log2(L) xor shuffles.
//
// Per-token arithmetic, the same whatever n is and wherever the token falls in a chunk (the
// chunking only decides when a value is computed, never how), hence n tokens in one call leave
// the same bits as n calls of one token (the state round-trips through fp32 memory exactly):
//   ‖x‖²: the G lanes of a vector (G = 128 / (2·TOKENS)) each sum the float4s G·m + s, m in
//         order, into four running sums (one per float4 component) joined as (x+y)+(z+w); then
//         xor shuffles at offsets 1, 2 (, 4). x̂ = x · (scale / sqrt(‖x‖² + 1e-6)), scale = dk^-½
//         for q and 1 for k (the CPU's expressions).
//   decay = exp(-exp(A_log)·softplus(a + dt_bias)), beta = 1 / (1 + exp(-b)).
//   S *= decay;  u = (v - Σ_i S[i]·k̂[i]) · beta;  S += k̂ uᵀ;  o = Σ_i S[i]·q̂[i]
//   Σ_i: each lane keeps four running sums (row e of each float4, m in order) joined as
//        (s0+s1)+(s2+s3); the column's lanes then add their xor-1, xor-2 (, xor-4) partners.
//        Float addition is commutative, so all L lanes end with the same bits.
// The output reduction of token t is done at the start of token t+1 (or after the last token),
// so its shuffle latency overlaps the next token's dot product.

constexpr int kDeltaThreads = 128;
constexpr int kDeltaDecodeLanes = 8;   // lanes per value column on decode and verify calls
constexpr int kDeltaPrefillLanes = 4;  // ... and in prompt prefill
constexpr int kMaxDk = 256;
constexpr unsigned kFullMask = 0xffffffffu;

// Blocks per SM the decode kernel is compiled for. Its token is latency-bound, so resident warps
// are what hides the state's round trip: at dk = 128, L = 8 (Qwen3.5's shape) the registers are
// capped so that 5 blocks fit, at most 96 registers without spills (uncapped it took 164: 3
// blocks). 6 blocks (80 registers) spilled while each lane loaded its own state entries; since the
// state goes through DeltaStateTile they compile without spills too (not yet measured). Other
// shapes keep the compiler's choice. Registers never change a value.
constexpr int delta_decode_min_blocks(int dk_padded, int lanes) {
  return dk_padded == 128 && lanes == 8 ? 5 : 1;
}

constexpr int delta_chunk_tokens(int dk_padded) {
  return dk_padded <= 128 ? 16 : 8;  // keeps two chunks within 48 KiB of static shared memory
}

// One chunk of tokens in shared memory. Row vectors are padded by 4 floats so that the
// normalisation pass, where neighbouring lanes read different vectors, spreads its float4 reads
// over all banks (the recurrence reads one vector per token, as broadcasts).
template <int DK, int TOKENS, int COLS>
struct alignas(16) DeltaChunk {
  static constexpr int kDkPadded = DK;
  static constexpr int kTokens = TOKENS;
  static constexpr int kStride = kDkPadded + 4;
  float qk[2][TOKENS][kStride];  // [0]: q, [1]: k; raw as copied, then normalised in place
  float v[TOKENS][COLS];         // the tile's value columns
  float decay[TOKENS];           // raw a as copied, then the decay factor
  float beta[TOKENS];            // raw b as copied, then beta
};

// What every row of a call shares (layouts as ops::gated_delta_rule): q, k, v, a, b and out are
// the call's token-major arrays, indexed by the token's place in the call.
struct DeltaArgs {
  const float *q, *k, *v, *a, *b, *A_log, *dt_bias;
  int64_t n_k_heads, n_v_heads, dv;
  int64_t qk_stride, v_stride;  // floats between consecutive tokens of q/k and of v
  int dk;
  float q_scale;
  // q, k, v 16-byte aligned and dk, dv multiples of 4: stage with 16-byte copies. A row's first
  // token then starts 16-byte aligned too (its offsets are multiples of dk and dv floats).
  bool copy16;
  float* out;
};

// One row's part: its tokens first .. first + n - 1 of the call's arrays (0 .. n-1 in a
// single-row call), its state [n_v_heads, dk, dv] and optional state_after [n, n_v_heads, dk, dv].
struct DeltaRow {
  int64_t first, n;
  float *state, *state_after;
  int64_t settled;  // 0..n: the state is stored as it stands after this many tokens (0: not at all)
};

__device__ inline int64_t min64(int64_t x, int64_t y) {
  return x < y ? x : y;
}

// Asynchronous global → shared copies (sm_80+), completed by copy_async_wait_all.
__device__ inline void copy_async16(float* smem, const float* gmem) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst),
               "l"(__cvta_generic_to_global(gmem))
               : "memory");
}
__device__ inline void copy_async4(float* smem, const float* gmem) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst),
               "l"(__cvta_generic_to_global(gmem))
               : "memory");
}
// Waits for this thread's copies only; a barrier after it publishes everyone's.
__device__ inline void copy_async_wait_all() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// Where a thread of a delta-rule block works: lane s of column col of the block's tile (L lanes
// per column, 32 / L columns per warp), on value head vh = blockIdx.y and its key head kh.
template <int L>
struct DeltaLane {
  int tid, lane, s, col;
  int64_t vh, kh;
  __device__ explicit DeltaLane(const DeltaArgs& g)
      : tid(threadIdx.x),
        lane(tid % 32),
        s(lane % L),
        col((tid / 32) * (32 / L) + lane / L),
        vh(blockIdx.y),
        kh(vh / (g.n_v_heads / g.n_k_heads)) {}
};

// Returns x unchanged, hidden from the optimiser: row addresses built from it are recomputed
// where used instead of being kept live (DK/8 64-bit addresses) through the
// token loop.
__device__ inline int64_t opaque(int64_t x) {
  asm volatile("" : "+l"(x));
  return x;
}

// Sum over the L lanes of a column: xor 1, then xor 2, ... Every lane of the column gets the same
// bits.
template <int L>
__device__ inline float column_sum(float x) {
#pragma unroll
  for (int offset = 1; offset < L; offset *= 2) x += __shfl_xor_sync(kFullMask, x, offset);
  return x;
}

// Issues the copies of tokens t0 .. t0+count-1 into `ch`: q and k of key head kh, v columns
// col0 .. col0+ncols-1 of head vh, a and b of head vh. Padding rows are left as they are
// (zeroed by the caller when dk < DK).
template <class Chunk>
__device__ void delta_stage(Chunk& ch, const DeltaArgs& g, int64_t kh, int64_t vh, int64_t col0,
                            int ncols, int64_t t0, int count) {
  const int tid = threadIdx.x;
  if (g.copy16) {
    const int f4 = g.dk / 4;
    for (int e = tid; e < count * f4; e += kDeltaThreads) {
      const int p = e / f4, f = e - p * f4;
      const int64_t src = (t0 + p) * g.qk_stride + kh * g.dk + 4 * f;
      copy_async16(&ch.qk[0][p][4 * f], g.q + src);
      copy_async16(&ch.qk[1][p][4 * f], g.k + src);
    }
    const int c4 = ncols / 4;
    for (int e = tid; e < count * c4; e += kDeltaThreads) {
      const int p = e / c4, f = e - p * c4;
      copy_async16(&ch.v[p][4 * f], g.v + (t0 + p) * g.v_stride + vh * g.dv + col0 + 4 * f);
    }
  } else {
    for (int e = tid; e < count * g.dk; e += kDeltaThreads) {
      const int p = e / g.dk, i = e - p * g.dk;
      const int64_t src = (t0 + p) * g.qk_stride + kh * g.dk + i;
      copy_async4(&ch.qk[0][p][i], g.q + src);
      copy_async4(&ch.qk[1][p][i], g.k + src);
    }
    for (int e = tid; e < count * ncols; e += kDeltaThreads) {
      const int p = e / ncols, c = e - p * ncols;
      copy_async4(&ch.v[p][c], g.v + (t0 + p) * g.v_stride + vh * g.dv + col0 + c);
    }
  }
  if (tid < count) {
    copy_async4(&ch.decay[tid], g.a + (t0 + tid) * g.n_v_heads + vh);
    copy_async4(&ch.beta[tid], g.b + (t0 + tid) * g.n_v_heads + vh);
  }
}

// The per-token pieces both delta kernels run (the order above), so a token's bits cannot depend
// on which kernel ran it.
// ‖x‖² of a vector whose F float4s r (those of one of its G lanes) are summed by component, then
// over the G lanes (every lane of the warp joins the shuffles).
// Adds the squares of F float4s to four running sums, one per component, float4s in order: the
// accumulation both squared_norm and the decode kernel's streamed norms run, so they agree bitwise.
template <int F>
__device__ __forceinline__ void add_squares(float (&acc)[4], const float4 (&r)[F]) {
#pragma unroll
  for (int m = 0; m < F; ++m) {
    acc[0] = fmaf(r[m].x, r[m].x, acc[0]);
    acc[1] = fmaf(r[m].y, r[m].y, acc[1]);
    acc[2] = fmaf(r[m].z, r[m].z, acc[2]);
    acc[3] = fmaf(r[m].w, r[m].w, acc[3]);
  }
}
// The vector's squared norm from each of its G lanes' four sums.
template <int G>
__device__ __forceinline__ float join_squares(const float (&acc)[4]) {
  return column_sum<G>((acc[0] + acc[1]) + (acc[2] + acc[3]));
}
template <int G, int F>
__device__ __forceinline__ float squared_norm(const float4 (&r)[F]) {
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  add_squares<F>(acc, r);
  return join_squares<G>(acc);
}
__device__ __forceinline__ float delta_decay(float A, float a, float bias) {
  return expf(A * softplus(a + bias));
}
__device__ __forceinline__ float delta_beta(float b) {
  return 1.0f / (1.0f + expf(-b));
}
// One token's recurrence on a lane's ROWS entries of its column's state, given that lane's
// entries of k̂ and q̂: returns the lane's share of the output, which column_sum<L> completes.
template <int ROWS, int L>
__device__ __forceinline__ float delta_token(float (&Sr)[ROWS], const float (&kk)[ROWS],
                                             const float (&qq)[ROWS], float decay, float beta,
                                             float vj) {
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    Sr[r] *= decay;
    acc[r % 4] = fmaf(Sr[r], kk[r], acc[r % 4]);
  }
  const float kv = column_sum<L>((acc[0] + acc[1]) + (acc[2] + acc[3]));
  const float u = (vj - kv) * beta;
  float oacc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    Sr[r] = fmaf(kk[r], u, Sr[r]);
    oacc[r % 4] = fmaf(Sr[r], qq[r], oacc[r % 4]);
  }
  return (oacc[0] + oacc[1]) + (oacc[2] + oacc[3]);
}

// A lane's ROWS entries of a normalised vector in shared memory (rows 4(L·m + s) + 0..3, one float4
// each m): what delta_token takes as k̂ or q̂.
template <int ROWS, int L>
__device__ __forceinline__ void lane_entries(const float* x, int s, float (&e)[ROWS]) {
  const float4* x4 = reinterpret_cast<const float4*>(x);
#pragma unroll
  for (int m = 0; m < ROWS / 4; ++m) {
    const float4 v = x4[L * m + s];
    e[4 * m] = v.x, e[4 * m + 1] = v.y, e[4 * m + 2] = v.z, e[4 * m + 3] = v.w;
  }
}

// Component e of v (e is a constant once the loops are unrolled: registers, never local memory).
__device__ __forceinline__ float component(const float4& v, int e) {
  return e == 0 ? v.x : e == 1 ? v.y : e == 2 ? v.z : v.w;
}

// A block's tile of a head's state (all DK rows of its COLS columns) and how it travels between
// global memory and the lanes' registers, Sr[4m + e] = row 4(L·m + s) + e of the lane's column:
// the initial load and the final store (delta_rule_row's per-token state_after stays per lane).
// Direct (the fallback, and L = 4): each lane loads and stores its own entries, one float each.
// A warp's lanes cover 32 / L columns, so at L = 8 an instruction touches 8 rows × 16 bytes, half
// of every 32-byte sector. Staged (L = 8, where a warp's columns fill less than a sector; needs
// 16-byte rows: dv % 4 == 0, S and after 16-byte aligned): the block moves the tile in slots of
// 16 bytes (4 columns of a row, see slot()) through shared memory, where it lies column by column,
// tile[c·kStride + i], so that a lane's four rows 4(L·m + s) + 0..3 are one float4 (a quarter
// warp, one column's s = 0..7, reads or writes 128 contiguous bytes: no bank conflict). __ldca and
// __stwb are the default cache policies, spelled out so that each slot is one 16-byte instruction
// (a plain float4 store was split into four in some unrolled copies). `staged` is uniform over
// the block, whose every thread must then call to_lanes and store (they hold barriers). Every
// value travels unchanged: the route never changes a result.
template <int DK, int L>
struct DeltaStateTile {
  static constexpr int ROWS = DK / L;             // a lane's entries
  static constexpr int COLS = kDeltaThreads / L;  // the block's columns
  static constexpr int kSlots = ROWS / 4;         // a thread's slots: DK·COLS/4 per block
  static constexpr int kStride = DK + 4;          // floats between the tile's columns
  static constexpr int kFloats = COLS * kStride;  // the tile's shared memory, in floats
  static constexpr bool kStaged = (32 / L) * sizeof(float) < 32;
  static_assert(!kStaged || (DK % 16 == 0 && COLS % 8 == 0 && kStride % 8 == 4),
                "slot() needs 16-row groups, pairs of slots per row and kStride % 8 == 4");

  // dk and dv are read from g where used: copies would hold registers through a token loop.
  const DeltaArgs& g;
  float* S;          // the head's state [dk, dv], from the block's first column
  float* after;      // the same in state_after, or null: store() writes both
  int ncols;         // the block's columns below dv
  int s, col;        // the lane's row part and column in the block
  bool staged;       // uniform over the block
  bool write_state;  // false: store() leaves S as it is (no settled token), uniform over the block

  __device__ DeltaStateTile(const DeltaArgs& g_, float* state, float* state_after, int64_t col0,
                            int s_, int col_, bool write_state_ = true)
      : g(g_),
        S(state + col0),
        after(state_after ? state_after + col0 : nullptr),
        ncols(static_cast<int>(min64(COLS, g_.dv - col0))),
        s(s_),
        col(col_),
        write_state(write_state_) {
    const auto aligned16 = [](const float* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
    staged = kStaged && g.dv % 4 == 0 && aligned16(S) && (after == nullptr || aligned16(after));
  }

  // Slot r of this thread: float4 f (columns 4f .. 4f+3) of row i. The 32 slots of a warp's r are
  // 16 rows × 2 float4s: one whole 32-byte sector of each row, and, as kStride ≡ 4 (mod 8), 32
  // distinct banks for each float the slots move to or from the tile.
  __device__ static void slot(int r, int& i, int& f) {
    const int q = threadIdx.x + kDeltaThreads * r;
    const int group = q / 32;  // of 16 rows × 2 float4s
    f = 2 * (group % (COLS / 8)) + q % 2;
    i = 16 * (group / (COLS / 8)) + q / 2 % 16;
  }

  // Issues the global loads (no shared memory, no barrier: the decode kernel runs it before
  // pdl_wait): v gets this thread's slots (staged) or the lane's entries, v[m] = Sr[4m .. 4m+3]
  // (direct). Rows past dk and columns past dv read as 0.
  __device__ void load(float4 (&v)[kSlots]) const {
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (staged) {
#pragma unroll
      for (int r = 0; r < kSlots; ++r) {
        int i, f;
        slot(r, i, f);
        v[r] = i < g.dk && 4 * f < ncols
                   ? __ldca(reinterpret_cast<const float4*>(S + i * g.dv + 4 * f))
                   : zero;
      }
    } else {
#pragma unroll
      for (int m = 0; m < kSlots; ++m) {
        float x[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = 4 * (L * m + s) + e;
          x[e] = col < ncols && i < g.dk ? S[i * g.dv + col] : 0.0f;
        }
        v[m] = make_float4(x[0], x[1], x[2], x[3]);
      }
    }
  }

  // The lane's entries from what load() left in v. Staged: through `tile` (kFloats floats,
  // 16-byte aligned), a barrier between the slots' writes and the lanes' reads; the tile may then
  // be rewritten only after another barrier, or by store(), where each lane writes exactly the
  // words it read here.
  __device__ void to_lanes(const float4 (&v)[kSlots], float (&Sr)[ROWS], float* tile) const {
    if (staged) {
#pragma unroll
      for (int r = 0; r < kSlots; ++r) {
        int i, f;
        slot(r, i, f);
#pragma unroll
        for (int x = 0; x < 4; ++x) tile[(4 * f + x) * kStride + i] = component(v[r], x);
      }
      __syncthreads();
    }
#pragma unroll
    for (int m = 0; m < kSlots; ++m) {
      const float4 x =
          staged ? reinterpret_cast<const float4*>(tile + col * kStride)[L * m + s] : v[m];
#pragma unroll
      for (int e = 0; e < 4; ++e) Sr[4 * m + e] = component(x, e);
    }
  }

  // Stores the lane's entries to S (and after), rows below dk and columns below dv only. Staged:
  // the lanes' float4s go into `tile`, then a barrier, then every thread stores its slots; no
  // other thread may still read the tile (what to_lanes read is rewritten by the same lane).
  __device__ void store(const float (&Sr)[ROWS], float* tile) const {
    // Recomputed from an opaque dv: the row addresses are not kept live from load() (DK/8 64-bit
    // registers through a token loop).
    const int64_t dv = opaque(g.dv);
    if (staged) {
#pragma unroll
      for (int m = 0; m < kSlots; ++m)
        reinterpret_cast<float4*>(tile + col * kStride)[L * m + s] =
            make_float4(Sr[4 * m], Sr[4 * m + 1], Sr[4 * m + 2], Sr[4 * m + 3]);
      __syncthreads();
#pragma unroll
      for (int r = 0; r < kSlots; ++r) {
        int i, f;
        slot(r, i, f);
        if (i >= g.dk || 4 * f >= ncols) continue;
        const float* t = tile + 4 * f * kStride + i;
        const float4 x = make_float4(t[0], t[kStride], t[2 * kStride], t[3 * kStride]);
        if (write_state) __stwb(reinterpret_cast<float4*>(S + i * dv + 4 * f), x);
        if (after) __stwb(reinterpret_cast<float4*>(after + i * dv + 4 * f), x);
      }
    } else {
#pragma unroll
      for (int m = 0; m < kSlots; ++m)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = 4 * (L * m + s) + e;
          if (col < ncols && i < g.dk) {
            if (write_state) S[i * dv + col] = Sr[4 * m + e];
            if (after) after[i * dv + col] = Sr[4 * m + e];
          }
        }
    }
  }
};

// L2-normalises the first `count` tokens' q and k in place (G lanes per vector, see the order
// above) and replaces raw a, b with decay and beta. Every lane runs the shuffles.
template <class Chunk>
__device__ void delta_normalise(Chunk& ch, int count, float q_scale, float A, float bias) {
  constexpr int DK = Chunk::kDkPadded, TOKENS = Chunk::kTokens;
  constexpr int G = kDeltaThreads / (2 * TOKENS);  // lanes per vector
  constexpr int F = DK / 4 / G;                    // float4s per lane
  static_assert(32 % G == 0 && F >= 1 && F * G * 4 == DK, "vector split must tile a warp and dk");
  const int tid = threadIdx.x;
  const int s = tid % G, vec = tid / G;
  const int which = vec / TOKENS, p = vec % TOKENS;
  const bool live = p < count;
  float4* x = reinterpret_cast<float4*>(ch.qk[which][p]);
  float4 r[F];
#pragma unroll
  for (int m = 0; m < F; ++m) r[m] = live ? x[G * m + s] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  const float inv = (which == 0 ? q_scale : 1.0f) / sqrtf(squared_norm<G, F>(r) + 1e-6f);
  if (live) {
#pragma unroll
    for (int m = 0; m < F; ++m)
      x[G * m + s] = make_float4(r[m].x * inv, r[m].y * inv, r[m].z * inv, r[m].w * inv);
  }
  if (tid < count) {
    ch.decay[tid] = delta_decay(A, ch.decay[tid], bias);
    ch.beta[tid] = delta_beta(ch.beta[tid]);
  }
}

// A lane's entries of one column of a [dk, dv] state, rows 4(L·m + s) + e, to dst (the column's
// row-0 word), rows below dk only.
template <int ROWS, int L>
__device__ __forceinline__ void store_lane_column(float* dst, int64_t dv, int dk, int s,
                                                  const float (&Sr)[ROWS]) {
#pragma unroll
  for (int m = 0; m < ROWS / 4; ++m)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = 4 * L * m + 4 * s + e;
      if (i < dk) dst[i * dv] = Sr[4 * m + e];
    }
}

template <int DK, int L>
using DeltaChunks = DeltaChunk<DK, delta_chunk_tokens(DK), kDeltaThreads / L>[2];

// Block (blockIdx.x, blockIdx.y) = (column tile, value head) of one row: the whole recurrence of
// the row's tokens. The single-row and the batched kernel both run exactly this code; they differ
// only in where `row` comes from, so a row's bits are the same whichever kernel runs it and
// whatever other rows share the launch. The kernel owns the shared memory (both AFTER variants
// of the batched kernel use the same buffers). Requires row.n >= 1.
template <int DK, int L, bool AFTER>
__device__ __forceinline__ void delta_rule_row(DeltaChunks<DK, L>& ch, const DeltaArgs& g,
                                               const DeltaRow row) {
  constexpr int TOKENS = delta_chunk_tokens(DK);
  constexpr int ROWS = DK / L;             // of the column, per lane
  constexpr int COLS = kDeltaThreads / L;  // columns per block
  using Chunk = DeltaChunk<DK, TOKENS, COLS>;
  using Tile = DeltaStateTile<DK, L>;
  static_assert(sizeof(Chunk) % sizeof(float4) == 0, "chunks must stay 16-byte aligned");
  // The state tile borrows a chunk buffer: ch[1] for the load (free until chunk 1's copies), the
  // buffer the last chunk left free for the store.
  static_assert(!Tile::kStaged || Tile::kFloats * sizeof(float) <= sizeof(Chunk),
                "the state tile must fit in a chunk buffer");

  const DeltaLane<L> at(g);
  const int tid = at.tid, lane = at.lane, s = at.s, col = at.col;
  const int64_t vh = at.vh, kh = at.kh;
  const int64_t col0 = int64_t(blockIdx.x) * COLS;
  const int ncols = static_cast<int>(min64(COLS, g.dv - col0));
  const bool column = col < ncols;
  const int64_t j = col0 + col;
  const int64_t end = row.first + row.n;  // tokens first .. end-1, absolute in the call
  const float A = -expf(g.A_log[vh]);
  const float bias = g.dt_bias[vh];
  // The state loads go out first: they overlap the shared-memory set-up and chunk 0's copies.
  const Tile st(g, row.state + vh * g.dk * g.dv, nullptr, col0, s, col);
  float4 sv[Tile::kSlots];
  st.load(sv);

  // Padding rows (dk < DK) must read as zeros. Nothing else unwritten is used: tokens past a
  // chunk's count are never read, and a column past dv only feeds its own lanes, which store
  // nothing. Uniform over the block.
  const auto zero = [&](Chunk& c) {
    float4* z = reinterpret_cast<float4*>(&c);
    for (int i = tid; i < int(sizeof(Chunk) / sizeof(float4)); i += kDeltaThreads)
      z[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  };
  if (g.dk < DK) {
    zero(ch[0]);
    __syncthreads();  // the zeros land before any copy into the same words
  }
  delta_stage(ch[0], g, kh, vh, col0, ncols, row.first, static_cast<int>(min64(TOKENS, row.n)));
  float Sr[ROWS];
  st.to_lanes(sv, Sr, reinterpret_cast<float*>(&ch[1]));
  if (g.dk < DK) {
    __syncthreads();  // every lane has read its entries from ch[1] before the zeros overwrite them
    zero(ch[1]);      // barrier (A) below orders them before chunk 1's copies
  }

  float o_part = 0.0f;   // this lane's share of token o_token's output, not yet reduced
  int64_t o_token = -1;  // none yet (absolute token index)
  int buf = 0;
  // Chunks start at the row's first token, so the chunking is the same in either kernel (and it
  // never changes a value anyway, see above).
  for (int64_t t0 = row.first; t0 < end; t0 += TOKENS, buf ^= 1) {
    const int count = static_cast<int>(min64(TOKENS, end - t0));
    copy_async_wait_all();
    // (A) Chunk t0's copies are visible to all; every thread has finished the previous chunk's
    // recurrence, so its buffer (ch[buf ^ 1]) may be refilled.
    __syncthreads();
    if (t0 + TOKENS < end)
      delta_stage(ch[buf ^ 1], g, kh, vh, col0, ncols, t0 + TOKENS,
                  static_cast<int>(min64(TOKENS, end - t0 - TOKENS)));
    delta_normalise(ch[buf], count, g.q_scale, A, bias);
    __syncthreads();  // (B) chunk t0's q̂, k̂, decay, beta are ready
    const Chunk& c = ch[buf];

#pragma unroll 1
    for (int p = 0; p < count; ++p) {
      float kk[ROWS], qq[ROWS];
      lane_entries<ROWS, L>(c.qk[1][p], s, kk);
      lane_entries<ROWS, L>(c.qk[0][p], s, qq);
      const float decay = c.decay[p], beta = c.beta[p], vj = c.v[p][col];

      const float o_prev = column_sum<L>(o_part);
      if (o_token >= 0 && s == 0 && column) g.out[(o_token * g.n_v_heads + vh) * g.dv + j] = o_prev;

      o_part = delta_token<ROWS, L>(Sr, kk, qq, decay, beta, vj);
      o_token = t0 + p;
      // The state keeps the tokens so far only: each lane stores its own entries (no barrier
      // inside the token loop); the tile's store below is skipped.
      if (o_token + 1 == row.first + row.settled && row.settled < row.n && column)
        store_lane_column<ROWS, L>(st.S + col, opaque(g.dv), g.dk, s, Sr);
      if constexpr (AFTER) {
        if (column) {
          const int64_t dv = opaque(g.dv);
          store_lane_column<ROWS, L>(
              row.state_after + ((o_token - row.first) * g.n_v_heads + vh) * g.dk * dv + j, dv,
              g.dk, s, Sr);
        }
      }
    }
  }
  const float o_last = column_sum<L>(o_part);
  if (s == 0 && column) g.out[(o_token * g.n_v_heads + vh) * g.dv + j] = o_last;
  // ch[buf] is the buffer the last chunk did not use: nothing is copied into it any more, and
  // every thread has finished reading it (as chunk or as the loaded tile) before barrier (A) of
  // the last chunk. Uniform over the block.
  if (row.settled == row.n) st.store(Sr, reinterpret_cast<float*>(&ch[buf]));
}

// One row, from arguments. state_after is a template flag so the usual token loop carries no
// store branch (and no registers for it).
template <int DK, int L, bool AFTER>
__global__ void __launch_bounds__(kDeltaThreads, 1)
    gated_delta_rule_kernel(const DeltaArgs g, int64_t n, float* state, float* state_after) {
  pdl_wait();
  pdl_release();
  __shared__ DeltaChunks<DK, L> ch;
  delta_rule_row<DK, L, AFTER>(ch, g, DeltaRow{0, n, state, state_after, n});
}

// Rows from device descriptors: grid (column tiles, value heads, rows), block z = row. Whether a
// row keeps per-token states is read from its descriptor, so each block picks the AFTER variant
// of delta_rule_row at run time (uniform over the block: no divergence). This keeps one launch
// per call whatever mix of speculative and plain rows the descriptors hold, and lets a captured
// graph replay with a different mix; the price is that the kernel is allocated the registers of
// the AFTER variant for all its blocks. Rows own disjoint tokens and states, so blocks of
// different rows never touch the same word.
template <int DK, int L>
__global__ void __launch_bounds__(kDeltaThreads, 1)
    gated_delta_rule_rows_kernel(const DeltaArgs g, const ops::RecurrentRow* __restrict__ rows) {
  pdl_wait();
  pdl_release();
  __shared__ DeltaChunks<DK, L> ch;
  const ops::RecurrentRow r = rows[blockIdx.z];
  const DeltaRow row{r.first_token, r.n, r.state, r.state_after, ops::settled_tokens(r)};
  if (row.n <= 0) return;  // an idle row (uniform over the block, before any barrier)
  if (row.state_after != nullptr)
    delta_rule_row<DK, L, true>(ch, g, row);
  else
    delta_rule_row<DK, L, false>(ch, g, row);
}

// Decode steps of shapes the short-row kernel below does not take (padded dk, dv not a multiple
// of 16): every row of the call holds one token (max_n == 1). The same grid, lanes and
// per-token arithmetic as delta_rule_row on a single token, hence the same bits, without its chunk
// machinery (no staged tokens, no cp.async; only the state tile's two barriers): each lane reads
// its own rows of q and k and its column's v, a and b straight from memory (L2: the conv has just
// written them). The squared norms of q and k are taken by the first 2G lanes of every warp in
// delta_normalise's order (G lanes per vector summing float4s G·m + lane, the same xor shuffles)
// and broadcast.
// Why a kernel of its own: a decode step's delta rule is one token of latency-bound arithmetic;
// the chunked kernel's staging, two barriers and cp.async waits are fixed cost on that path. On
// the H200 a batch-1 step got 46 µs faster (~1.9 µs per layer, BENCHMARKS.md).
// The row's descriptor and its state (DeltaStateTile::load: the thread's 16-byte slots of the
// block's tile, into registers) are loaded before the kernel waits on the conv: no kernel of the
// running forward writes them (the descriptors were uploaded before its first kernel, and only
// this layer's delta rule writes the state, one forward earlier), so their two dependent round
// trips overlap the conv (check.cuh's rule for loads before the wait). The slots go through shared
// memory to the lanes only after q, k, v, a and b are requested; the store returns them the same
// way (with state_after's copy, when the row keeps one).
template <int DK, int L>
__global__ void __launch_bounds__(kDeltaThreads, delta_decode_min_blocks(DK, L))
    gated_delta_rule_decode_kernel(const DeltaArgs g, const ops::RecurrentRow* __restrict__ rows) {
  constexpr int ROWS = DK / L;                                     // of the column, per lane
  constexpr int COLS = kDeltaThreads / L;                          // columns per block
  constexpr int G = kDeltaThreads / (2 * delta_chunk_tokens(DK));  // delta_normalise's lanes
  constexpr int F = DK / 4 / G;                                    // float4s per vector lane
  using Tile = DeltaStateTile<DK, L>;
  __shared__ float4 tile[Tile::kStaged ? Tile::kFloats / 4 : 1];
  const ops::RecurrentRow row = rows[blockIdx.z];
  if (row.n <= 0) return;  // an idle row
  const DeltaLane<L> at(g);
  const int lane = at.lane, s = at.s, col = at.col;
  const int64_t vh = at.vh, kh = at.kh;
  const int64_t col0 = int64_t(blockIdx.x) * COLS;
  const int64_t j = col0 + col;
  const bool column = j < g.dv;
  const int64_t t = row.first_token;
  const int64_t head = vh * g.dk * g.dv;  // [dk, dv] of this head in state and state_after
  const Tile st(g, row.state + head, row.state_after ? row.state_after + head : nullptr, col0, s,
                col, ops::settled_tokens(row) > 0);
  float4 sv[Tile::kSlots];
  st.load(sv);
  pdl_wait();
  pdl_release();
  const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  const float4* q4 = reinterpret_cast<const float4*>(g.q + t * g.qk_stride + kh * g.dk);
  const float4* k4 = reinterpret_cast<const float4*>(g.k + t * g.qk_stride + kh * g.dk);
  const int f4 = g.dk / 4;  // float4s of a vector; those past it are delta_normalise's zero rows
  // ‖q‖², ‖k‖² first: lanes 0..G-1 take q, lanes G..2G-1 take k (the rest repeat them, unused).
  // Their F float4s are summed as squared_norm does (add_squares, then join_squares), in halves of
  // the float4s so that they and the state column are not all in registers at once (the kernel
  // is latency-bound: registers are the warps in flight).
  const bool is_q = (lane / G) % 2 == 0;
  const float4* x4 = is_q ? q4 : k4;
  float nacc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  constexpr int kHalf = F > 1 ? F / 2 : 1;
#pragma unroll
  for (int m0 = 0; m0 < F; m0 += kHalf) {
    float4 r[kHalf];
#pragma unroll
    for (int m = 0; m < kHalf; ++m) {
      const int f = G * (m0 + m) + lane % G;
      r[m] = f < f4 ? x4[f] : zero;
    }
    add_squares<kHalf>(nacc, r);
  }
  const float inv = (is_q ? g.q_scale : 1.0f) / sqrtf(join_squares<G>(nacc) + 1e-6f);
  const float inv_q = __shfl_sync(kFullMask, inv, 0), inv_k = __shfl_sync(kFullMask, inv, G);
  float kk[ROWS], qq[ROWS];
#pragma unroll
  for (int m = 0; m < ROWS / 4; ++m) {
    const int f = L * m + s;
    const float4 kr = f < f4 ? k4[f] : zero, qr = f < f4 ? q4[f] : zero;
    kk[4 * m] = kr.x, kk[4 * m + 1] = kr.y, kk[4 * m + 2] = kr.z, kk[4 * m + 3] = kr.w;
    qq[4 * m] = qr.x, qq[4 * m + 1] = qr.y, qq[4 * m + 2] = qr.z, qq[4 * m + 3] = qr.w;
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    kk[r] = kk[r] * inv_k;
    qq[r] = qq[r] * inv_q;
  }
  const float A = -expf(g.A_log[vh]);
  const float decay = delta_decay(A, g.a[t * g.n_v_heads + vh], g.dt_bias[vh]);
  const float beta = delta_beta(g.b[t * g.n_v_heads + vh]);
  const float vj = column ? g.v[t * g.v_stride + vh * g.dv + j] : 0.0f;
  // Only now the state goes to the lanes (through the tile when staged): every load above is
  // already in flight when the tile's writes wait for the state and the barrier for the block.
  float Sr[ROWS];
  st.to_lanes(sv, Sr, reinterpret_cast<float*>(tile));
  const float o = column_sum<L>(delta_token<ROWS, L>(Sr, kk, qq, decay, beta, vj));
  if (s == 0 && column) g.out[(t * g.n_v_heads + vh) * g.dv + j] = o;
  // Every lane (a barrier when staged); a row that settles nothing and keeps no state_after
  // writes nothing.
  if (st.write_state || row.state_after != nullptr) st.store(Sr, reinterpret_cast<float*>(tile));
}

// --- Short rows: decode steps, verify windows and commit replays ---
// Calls whose rows hold at most kShortRowTokens tokens, at the decode lane count (L = 8), on
// shapes without padding rows (dk == DK) whose column tiles are whole 16-byte chunks
// (dv % 16 == 0). Same grid axes, lanes and per-token arithmetic as delta_rule_row (delta_token,
// norms in delta_normalise's order), so a row's bits are the chunked kernel's for the same tokens.
// Why a kernel of its own: these calls read (and write) each row's whole state for a few tokens
// of arithmetic. The decode kernel reached 2.1 TB/s at 32 rows; what bounded it was the serial
// chain of each block (state, then q and k from L2, norm shuffles, the token), not the state
// bytes in flight (a first version that only streamed more state per block ran at the same speed,
// BENCHMARKS.md). Here a block takes 1 or 2 column tiles: their state goes global → shared memory
// by cp.async before the wait on the conv, the row's token inputs are normalised into shared
// memory once while it arrives, and each tile then runs its tokens from shared memory and is
// stored back (16-byte stores) while the next tile may still arrive.
constexpr int kShortRowTokens = 8;
// Blocks per SM the short-row kernel is compiled for: at 5, up to 102 registers (it takes 90-96,
// no spills); at 6 (80 registers) its token loop spilled.
constexpr int kShortRowBlocks = 5;

// Tile layout in shared memory: row i (0..DK-1) of the tile's 16 columns is four 16-byte chunks
// f = 0..3; chunk (i, f) sits at index short_tile_chunk(i, f): two rows per 128-byte line, the
// line's 8 chunks permuted by (i / 4) % 8. A warp's lanes read column 4w + lane / 8 of rows
// 4(8m + s) + e, s = lane % 8, at fixed m, e: eight rows with the same i % 2 and
// (i / 4) % 8 = s, hence 8 distinct chunks × 4 words, all 32 banks. A warp's 32 consecutive
// chunks (8 whole rows) fill 4 whole lines: its cp.async writes are conflict-free too.
__device__ __forceinline__ int short_tile_chunk(int i, int f) {
  return 8 * (i / 2) + ((4 * (i % 2) + f) ^ ((i / 4) % 8));
}

// copy_wait with a run-time count (its instruction takes an immediate): at most n of this
// thread's committed groups stay pending, n in 0..3.
__device__ __forceinline__ void copy_wait_pending(int n) {
  switch (n) {
    case 0:
      return copy_wait<0>();
    case 1:
      return copy_wait<1>();
    case 2:
      return copy_wait<2>();
    default:
      return copy_wait<3>();
  }
}

// A short-row block's token inputs in shared memory, written once per block and read by every
// tile: q̂ and k̂ of the row's tokens (normalised as delta_normalise does), the block's v columns,
// decay and beta.
template <int DK, int TILES>
struct ShortRowTokens {
  float qk[kShortRowTokens][2][DK];      // [0]: q̂, [1]: k̂
  float v[kShortRowTokens][TILES * 16];  // the block's columns
  float decay[kShortRowTokens], beta[kShortRowTokens];
};

// Block (x, y, z): column tiles TILES·x .. TILES·x + TILES-1 (16 columns each) of value head y of
// row rows[z]. Shared memory: the TILES state tiles (DK × 16 floats each), then ShortRowTokens.
// After the wait on the conv the block normalises the row's tokens into shared memory once (G
// lanes per vector summing float4s G·m + lane, delta_normalise's order); each tile then runs the
// row's tokens in order with its state in registers: outputs per token, state_after (when the
// row keeps one) per token from the lanes, and the state after the row's settled tokens (none,
// some or all: ops::RecurrentRow::settled) through the tile while the rest of them run on.
template <int DK, int TILES>
__device__ __forceinline__ void short_rows_block(const DeltaArgs& g,
                                                 const ops::RecurrentRow* __restrict__ rows) {
  constexpr int L = kDeltaDecodeLanes;
  constexpr int ROWS = DK / L;                                     // of the column, per lane
  constexpr int COLS = kDeltaThreads / L;                          // columns per tile
  constexpr int kChunks = DK * COLS / 4;                           // 16-byte chunks per tile
  constexpr int kPerThread = kChunks / kDeltaThreads;              // of them per thread
  constexpr int G = kDeltaThreads / (2 * delta_chunk_tokens(DK));  // delta_normalise's lanes
  constexpr int F = DK / 4 / G;                                    // float4s per vector lane
  static_assert(L == 8 && COLS == 16 && kChunks % kDeltaThreads == 0 && TILES <= 4,
                "the tile layout assumes 8 lanes per column and 16-column tiles");
  static_assert(2 * kShortRowTokens * G <= kDeltaThreads, "a block normalises all its vectors");
  extern __shared__ float4 short_tiles[];  // [TILES][kChunks], then ShortRowTokens
  auto& in = *reinterpret_cast<ShortRowTokens<DK, TILES>*>(short_tiles + TILES * kChunks);
  const ops::RecurrentRow row = rows[blockIdx.z];
  if (row.n <= 0) return;  // an idle row (uniform over the block, before any barrier)
  const DeltaLane<L> at(g);
  const int tid = at.tid, s = at.s, col = at.col;
  const int64_t vh = at.vh, kh = at.kh;
  const int64_t dv = g.dv;
  const int n = static_cast<int>(row.n);
  const int settled = static_cast<int>(ops::settled_tokens(row));
  float* S = row.state + vh * DK * dv;
  const int64_t col0 = int64_t(blockIdx.x) * TILES * COLS;
  // A state that is not 16-byte aligned (the host checks dv; the row's base is the caller's) is
  // moved with scalar loads and stores instead: the same values, uniform over the block.
  const bool aligned = reinterpret_cast<uintptr_t>(S) % 16 == 0;
#pragma unroll
  for (int t = 0; t < TILES; ++t) {
#pragma unroll
    for (int r = 0; r < kPerThread; ++r) {
      const int c = tid + kDeltaThreads * r, i = c / 4, f = c % 4;
      const float* src = S + i * dv + col0 + t * COLS + 4 * f;
      float4* dst = short_tiles + t * kChunks + short_tile_chunk(i, f);
      if (aligned)
        copy_async16(reinterpret_cast<float*>(dst), src);
      else
        *dst = make_float4(src[0], src[1], src[2], src[3]);
    }
    copy_commit();
  }
  pdl_wait();
  pdl_release();

  // The tokens' inputs, while the state is still arriving. Vector (p, which) of thread group
  // tid / G; groups past the row's tokens sum zeros (every lane joins the shuffles).
  {
    const int vec = tid / G, gl = tid % G, p = vec / 2, which = vec % 2;
    const bool live = p < n;
    const float* x =
        (which == 0 ? g.q : g.k) + (row.first_token + (live ? p : 0)) * g.qk_stride + kh * DK;
    float4 r[F];
#pragma unroll
    for (int m = 0; m < F; ++m)
      r[m] = live ? reinterpret_cast<const float4*>(x)[G * m + gl]
                  : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const float inv = (which == 0 ? g.q_scale : 1.0f) / sqrtf(squared_norm<G, F>(r) + 1e-6f);
    if (live) {
      float4* xh = reinterpret_cast<float4*>(in.qk[p][which]);
#pragma unroll
      for (int m = 0; m < F; ++m)
        xh[G * m + gl] = make_float4(r[m].x * inv, r[m].y * inv, r[m].z * inv, r[m].w * inv);
    }
    const float A = -expf(g.A_log[vh]), bias = g.dt_bias[vh];
    if (tid < n) {
      const int64_t t = row.first_token + tid;
      in.decay[tid] = delta_decay(A, g.a[t * g.n_v_heads + vh], bias);
      in.beta[tid] = delta_beta(g.b[t * g.n_v_heads + vh]);
    }
    for (int e = tid; e < n * TILES * COLS; e += kDeltaThreads) {
      const int p_e = e / (TILES * COLS), c = e % (TILES * COLS);
      in.v[p_e][c] = g.v[(row.first_token + p_e) * g.v_stride + vh * dv + col0 + c];
    }
  }

#pragma unroll 1
  for (int t = 0; t < TILES; ++t) {
    copy_wait_pending(TILES - 1 - t);
    __syncthreads();  // every thread's chunks of tile t (and, at t = 0, the inputs) are in place
    float* tile = reinterpret_cast<float*>(short_tiles + t * kChunks);
    const int64_t j = col0 + t * COLS + col;
    float Sr[ROWS];
#pragma unroll
    for (int m = 0; m < ROWS / 4; ++m)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        Sr[4 * m + e] = tile[4 * short_tile_chunk(4 * (L * m + s) + e, col / 4) + col % 4];
    // The tile's state as it stands, back to global memory: each lane rewrites the words it read
    // (so no other thread's read can be pending on them), then 16-byte stores. Called by every
    // thread at most once per tile, after the settled tokens (uniform over the block); nothing
    // touches the tile after it.
    auto store_tile = [&] {
#pragma unroll
      for (int m = 0; m < ROWS / 4; ++m)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          tile[4 * short_tile_chunk(4 * (L * m + s) + e, col / 4) + col % 4] = Sr[4 * m + e];
      __syncthreads();
#pragma unroll
      for (int r = 0; r < kPerThread; ++r) {
        const int c = tid + kDeltaThreads * r, i = c / 4, f = c % 4;
        const float4 x = short_tiles[t * kChunks + short_tile_chunk(i, f)];
        float* dst = S + i * dv + col0 + t * COLS + 4 * f;
        if (aligned) {
          __stwb(reinterpret_cast<float4*>(dst), x);
        } else {
          dst[0] = x.x, dst[1] = x.y, dst[2] = x.z, dst[3] = x.w;
        }
      }
    };
    auto run_token = [&](int p) {
      float kk[ROWS], qq[ROWS];
      lane_entries<ROWS, L>(in.qk[p][1], s, kk);
      lane_entries<ROWS, L>(in.qk[p][0], s, qq);
      const float o = column_sum<L>(
          delta_token<ROWS, L>(Sr, kk, qq, in.decay[p], in.beta[p], in.v[p][t * COLS + col]));
      const int64_t tok = row.first_token + p;
      if (s == 0) g.out[(tok * g.n_v_heads + vh) * dv + j] = o;
      if (row.state_after != nullptr)
        store_lane_column<ROWS, L>(row.state_after + (p * g.n_v_heads + vh) * DK * dv + j, dv, DK,
                                   s, Sr);
    };
    // Two loops rather than a store inside one: a barrier in the token loop cost registers (the
    // loop spilled at the 102-register cap).
#pragma unroll 1
    for (int p = 0; p < settled; ++p) run_token(p);
    if (settled > 0) store_tile();  // uniform over the block
#pragma unroll 1
    for (int p = settled; p < n; ++p) run_token(p);
  }
}

template <int DK, int TILES>
__global__ void __launch_bounds__(kDeltaThreads, kShortRowBlocks)
    gated_delta_rule_short_kernel(const DeltaArgs g, const ops::RecurrentRow* __restrict__ rows) {
  short_rows_block<DK, TILES>(g, rows);
}

// ops::recurrent_layers_rows: block z runs row z % layer_rows of layer z / layer_rows, its q, k, v
// read from that layer's conv output ([q | k | v] rows), its a, b, weights and output its own.
template <int DK, int TILES>
__global__ void __launch_bounds__(kDeltaThreads, kShortRowBlocks)
    gated_delta_rule_short_layers_kernel(const DeltaArgs call,
                                         const ops::RecurrentRow* __restrict__ rows,
                                         const ops::RecurrentLayer* __restrict__ layers,
                                         int64_t layer_rows) {
  const ops::RecurrentLayer& layer = layers[blockIdx.z / layer_rows];
  DeltaArgs g = call;
  const int64_t kd = g.n_k_heads * g.dk;
  g.q = layer.conv_out;
  g.k = layer.conv_out + kd;
  g.v = layer.conv_out + 2 * kd;
  g.a = layer.a;
  g.b = layer.b;
  g.A_log = static_cast<const float*>(layer.A_log.data);
  g.dt_bias = static_cast<const float*>(layer.dt_bias.data);
  g.out = layer.out;
  short_rows_block<DK, TILES>(g, rows);
}

// The shape and weight checks both delta entries make.
void check_delta_shape(const ops::DeltaHeads& h, const ops::WeightRef& A_log,
                       const ops::WeightRef& dt_bias, const char* op) {
  if (h.n_k_heads < 1 || h.n_v_heads < 1 || h.n_v_heads % h.n_k_heads != 0)
    fail(op, ": ", h.n_v_heads, " value heads is not a multiple of ", h.n_k_heads, " key heads");
  if (h.dk < 1 || h.dk > kMaxDk || h.dv < 1)
    fail(op, ": dk ", h.dk, " (max ", kMaxDk, "), dv ", h.dv, " unsupported");
  if (h.n_v_heads > 65535) fail(op, ": ", h.n_v_heads, " value heads exceed the grid's 65535");
  check_f32_vector(A_log, h.n_v_heads, op, "A_log");
  check_f32_vector(dt_bias, h.n_v_heads, op, "dt_bias");
}

DeltaArgs delta_args(const float* q, const float* k, const float* v, const float* a, const float* b,
                     const ops::WeightRef& A_log, const ops::WeightRef& dt_bias,
                     const ops::DeltaHeads& h, float* out) {
  const auto aligned16 = [](const float* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  DeltaArgs g{};
  g.q = q, g.k = k, g.v = v, g.a = a, g.b = b;
  g.A_log = static_cast<const float*>(A_log.data);
  g.dt_bias = static_cast<const float*>(dt_bias.data);
  g.n_k_heads = h.n_k_heads, g.n_v_heads = h.n_v_heads, g.dv = h.dv;
  g.dk = static_cast<int>(h.dk);
  g.qk_stride = h.qkv_token_stride ? h.qkv_token_stride : h.n_k_heads * h.dk;
  g.v_stride = h.qkv_token_stride ? h.qkv_token_stride : h.n_v_heads * h.dv;
  // The same expression as the CPU's, so the two backends use the same bits.
  g.q_scale = 1.0f / std::sqrt(static_cast<float>(h.dk));
  // Either copy width stages the same words, so the choice never changes a result.
  g.copy16 = h.dk % 4 == 0 && h.dv % 4 == 0 && g.qk_stride % 4 == 0 && g.v_stride % 4 == 0 &&
             aligned16(q) && aligned16(k) && aligned16(v);
  g.out = out;
  return g;
}

// Grid of one row's blocks at L lanes per column: (column tiles, value heads).
dim3 delta_grid(const ops::DeltaHeads& h, int lanes, unsigned rows, const char* op) {
  return dim3(grid_blocks(ceil_div(h.dv, kDeltaThreads / lanes), op),
              static_cast<unsigned>(h.n_v_heads), rows);
}

// Calls with_kernel(std::integral_constant<int, DK>{}, std::integral_constant<int, L>{}): DK from
// dk, L from the prefill mode. Both depend on the shape and the mode, never on n.
template <class WithKernel>
void with_delta_layout(int64_t dk, WithKernel&& with_kernel) {
  auto by_lanes = [&](auto DK) {
    if (prefill_mode())
      with_kernel(DK, std::integral_constant<int, kDeltaPrefillLanes>{});
    else
      with_kernel(DK, std::integral_constant<int, kDeltaDecodeLanes>{});
  };
  if (dk <= 64)
    by_lanes(std::integral_constant<int, 64>{});
  else if (dk <= 128)
    by_lanes(std::integral_constant<int, 128>{});
  else
    by_lanes(std::integral_constant<int, 256>{});
}

// Short rows (gated_delta_rule_short_kernel): whether the call's shape and mode take it, and how
// many column tiles a block streams. TANDEM_CUDA_DELTA_SHORT=0 keeps such calls on the decode and
// chunked kernels and TANDEM_CUDA_DELTA_TILES=1|2|4 fixes the tiles per block (A/B timing; the
// bits are the same either way). By default a block takes two tiles when that still leaves at
// least one full wave of blocks (8 rows and more of the 9B shape), else one, so small batches
// keep every SM busy and large ones keep more state in flight per block.
bool short_rows_take(const DeltaArgs& g, int64_t max_n) {
  static const bool enabled = env_switch_on("TANDEM_CUDA_DELTA_SHORT");
  return enabled && max_n <= kShortRowTokens && !prefill_mode() && g.copy16 &&
         (g.dk == 64 || g.dk == 128) && g.dv % 16 == 0;
}

int& short_delta_tiles() {
  static int tiles = env_choice("TANDEM_CUDA_DELTA_TILES", {1, 2, 4});
  return tiles;
}

// layers (device memory) given: the n_rows descriptors are layer-major, layer_rows per layer
// (gated_delta_rule_short_layers_kernel).
template <int DK>
void launch_short_rows(const DeltaArgs& g, const ops::RecurrentRow* rows, int64_t n_rows,
                       const ops::RecurrentLayer* layers = nullptr, int64_t layer_rows = 1) {
  const int forced = short_delta_tiles();
  const int64_t col_tiles = g.dv / 16;
  auto with_tiles = [&](auto tiles, bool run) {
    constexpr int T = decltype(tiles)::value;
    const auto kernel = gated_delta_rule_short_kernel<DK, T>;
    const size_t smem = sizeof(float) * T * DK * 16 + sizeof(ShortRowTokens<DK, T>);
    const int64_t blocks = col_tiles / T * g.n_v_heads * n_rows;
    if (!run) return col_tiles % T == 0 && blocks >= resident_blocks(kernel, kDeltaThreads, smem);
    const dim3 grid(grid_blocks(col_tiles / T, "gated_delta_rule_rows"),
                    static_cast<unsigned>(g.n_v_heads), static_cast<unsigned>(n_rows));
    if (layers != nullptr)
      launch("recurrent_layers_rows", gated_delta_rule_short_layers_kernel<DK, T>, grid,
             kDeltaThreads, smem, g, rows, layers, layer_rows);
    else
      launch("gated_delta_rule_rows", kernel, grid, kDeltaThreads, smem, g, rows);
    return true;
  };
  using Four = std::integral_constant<int, 4>;
  using Two = std::integral_constant<int, 2>;
  using One = std::integral_constant<int, 1>;
  // Four tiles a block is only taken when asked for: at 32 rows it measured 1% slower than two
  // (one block then runs four serial tile passes, BENCHMARKS.md).
  int tiles = forced != 0 && col_tiles % forced == 0 ? forced : 0;
  if (tiles == 0) tiles = with_tiles(Two{}, false) ? 2 : 1;
  if (tiles == 4)
    with_tiles(Four{}, true);
  else if (tiles == 2)
    with_tiles(Two{}, true);
  else
    with_tiles(One{}, true);
}

// Rows are a grid dimension (y for the conv, z for the delta rule): at most 65535.
void check_rows(const ops::RecurrentRow* rows, int64_t n_rows, int64_t max_n, const char* op) {
  if (n_rows < 0 || max_n < 0) fail(op, ": negative row count ", n_rows, " or max_n ", max_n);
  if (n_rows > 65535) fail(op, ": ", n_rows, " rows exceed the grid's 65535");
  if (n_rows > 0 && rows == nullptr) fail(op, ": ", n_rows, " rows but no descriptors");
}

}  // namespace

void set_short_delta_tiles(int tiles) {
  if (tiles != 0 && tiles != 1 && tiles != 2 && tiles != 4)
    fail("set_short_delta_tiles: ", tiles, " tiles per block (0, 1, 2 or 4)");
  short_delta_tiles() = tiles;
}

void causal_conv_silu(const float* x, int64_t n, int64_t channels, int64_t kernel,
                      const ops::WeightRef& w, float* state, float* out, float* state_after) {
  if (n < 0 || channels < 0 || kernel < 1)
    fail("causal_conv_silu: bad shape n ", n, ", channels ", channels, ", kernel ", kernel);
  check_conv_weight(w, channels, kernel, "causal_conv_silu");
  if (n == 0 || channels == 0) return;
  const auto* wd = static_cast<const float*>(w.data);
  const unsigned blocks = grid_blocks(ceil_div(channels, kConvThreads), "causal_conv_silu");
  with_conv_taps(kernel, "causal_conv_silu", [&](auto taps) {
    launch("causal_conv_silu", causal_conv_silu_kernel<decltype(taps)::value>, blocks, kConvThreads,
           0, x, n, channels, wd, state, out, state_after);
  });
}

// The grid does not depend on max_n (each block walks its own row's n); max_n == 0 only lets an
// all-idle call skip the launch.
void causal_conv_silu_rows(const float* x, int64_t channels, int64_t kernel,
                           const ops::WeightRef& w, const ops::RecurrentRow* rows, int64_t n_rows,
                           int64_t max_n, float* out) {
  if (channels < 0 || kernel < 1)
    fail("causal_conv_silu_rows: bad shape channels ", channels, ", kernel ", kernel);
  check_conv_weight(w, channels, kernel, "causal_conv_silu_rows");
  check_rows(rows, n_rows, max_n, "causal_conv_silu_rows");
  if (n_rows == 0 || max_n == 0 || channels == 0) return;
  const auto* wd = static_cast<const float*>(w.data);
  // Rows of at most kConvChunk tokens (decode steps, verify windows) run whole in one block,
  // whatever max_n is below that, so a captured graph's grid holds for any rows up to its bound.
  const int64_t chunk = max_n > kConvChunk ? kConvChunk : 0;
  const int64_t chunks = chunk == 0 ? 1 : ceil_div(max_n, chunk);
  if (chunks > 1 && out == x)
    fail("causal_conv_silu_rows: out aliases x, but rows of ", max_n, " tokens run in chunks");
  if (chunks > 65535) fail("causal_conv_silu_rows: ", max_n, " tokens per row exceed the grid");
  const dim3 grid(grid_blocks(ceil_div(channels, kConvThreads), "causal_conv_silu_rows"),
                  static_cast<unsigned>(n_rows), static_cast<unsigned>(chunks));
  with_conv_taps(kernel, "causal_conv_silu_rows", [&](auto taps) {
    launch("causal_conv_silu_rows", causal_conv_silu_rows_kernel<decltype(taps)::value>, grid,
           kConvThreads, 0, x, channels, wd, rows, chunk, out, nullptr, int64_t{1});
  });
}

void gated_delta_rule(const float* q, const float* k, const float* v, const float* a,
                      const float* b, const ops::WeightRef& A_log, const ops::WeightRef& dt_bias,
                      int64_t n, const ops::DeltaHeads& h, float* state, float* out,
                      float* state_after) {
  if (n < 0) fail("gated_delta_rule: negative token count ", n);
  check_delta_shape(h, A_log, dt_bias, "gated_delta_rule");
  if (n == 0) return;
  const DeltaArgs g = delta_args(q, k, v, a, b, A_log, dt_bias, h, out);

  // The layout (with_delta_layout) and the state_after flag depend on the shape, the mode and
  // the call's outputs, never on n.
  const bool after = state_after != nullptr;
  with_delta_layout(h.dk, [&](auto DK, auto L) {
    constexpr int dk_padded = decltype(DK)::value, lanes = decltype(L)::value;
    const auto kernel = after ? gated_delta_rule_kernel<dk_padded, lanes, true>
                              : gated_delta_rule_kernel<dk_padded, lanes, false>;
    launch("gated_delta_rule", kernel, delta_grid(h, lanes, 1, "gated_delta_rule"), kDeltaThreads,
           0, g, n, state, state_after);
  });
}

// As causal_conv_silu_rows, the grid does not depend on max_n. The layout follows dk and the mode
// exactly as in gated_delta_rule, so every row runs the per-token code the single-row op would
// run for it.
void gated_delta_rule_rows(const float* q, const float* k, const float* v, const float* a,
                           const float* b, const ops::WeightRef& A_log,
                           const ops::WeightRef& dt_bias, const ops::RecurrentRow* rows,
                           int64_t n_rows, int64_t max_n, const ops::DeltaHeads& h, float* out) {
  check_delta_shape(h, A_log, dt_bias, "gated_delta_rule_rows");
  check_rows(rows, n_rows, max_n, "gated_delta_rule_rows");
  if (n_rows == 0 || max_n == 0) return;
  const DeltaArgs g = delta_args(q, k, v, a, b, A_log, dt_bias, h, out);
  // Short rows (decode steps, verify windows, commit replays) of the shapes it takes: the
  // short-row kernel. Its bits, and the single-token kernel's, are the chunked kernel's.
  if (short_rows_take(g, max_n)) {
    if (g.dk == 64)
      launch_short_rows<64>(g, rows, n_rows);
    else
      launch_short_rows<128>(g, rows, n_rows);
    return;
  }
  // One token per row (decode steps) of other shapes: the single-token kernel (it reads q and k
  // as float4s, hence only where those are 16-byte aligned).
  const bool single_tokens = max_n == 1 && g.copy16;
  with_delta_layout(h.dk, [&](auto DK, auto L) {
    constexpr int dk_padded = decltype(DK)::value, lanes = decltype(L)::value;
    const auto kernel = single_tokens ? gated_delta_rule_decode_kernel<dk_padded, lanes>
                                      : gated_delta_rule_rows_kernel<dk_padded, lanes>;
    launch("gated_delta_rule_rows", kernel,
           delta_grid(h, lanes, static_cast<unsigned>(n_rows), "gated_delta_rule_rows"),
           kDeltaThreads, 0, g, rows);
  });
}

// Layers of short rows go in one conv launch and one short-row delta launch (grid axis y, resp. z:
// layer-major rows, at most 65535 in all); anything else runs layer by layer through the per-layer
// ops, from the host table. Either way each layer runs the kernels' per-row code on its rows, so
// the bits are the per-layer calls'.
void recurrent_layers_rows(const ops::RecurrentLayers& layers, int64_t channels, int64_t kernel,
                           const ops::RecurrentRow* rows, int64_t n_rows, int64_t max_n,
                           const ops::DeltaHeads& h) {
  const char* op = "recurrent_layers_rows";
  if (channels < 0 || kernel < 1) fail(op, ": bad shape channels ", channels, ", kernel ", kernel);
  for (int64_t l = 0; l < layers.count; ++l) {
    check_conv_weight(layers.host[l].conv_weight, channels, kernel, op);
    check_delta_shape(h, layers.host[l].A_log, layers.host[l].dt_bias, op);
  }
  if (n_rows < 0) fail(op, ": negative row count ", n_rows);
  check_rows(rows, n_rows * layers.count, max_n, op);
  if (layers.count == 0 || n_rows == 0 || max_n == 0 || channels == 0) return;
  const int64_t kd = h.n_k_heads * h.dk;
  auto layer_args = [&](const ops::RecurrentLayer& L) {
    return delta_args(L.conv_out, L.conv_out + kd, L.conv_out + 2 * kd, L.a, L.b, L.A_log,
                      L.dt_bias, h, L.out);
  };
  bool at_once = max_n <= kConvChunk;  // the conv's rows run whole; short_rows_take checks dk
  for (int64_t l = 0; l < layers.count && at_once; ++l)
    at_once = short_rows_take(layer_args(layers.host[l]), max_n);
  if (!at_once) {
    for (int64_t l = 0; l < layers.count; ++l) {
      const ops::RecurrentLayer& L = layers.host[l];
      const ops::RecurrentRow* lr = rows + l * n_rows;
      cuda::causal_conv_silu_rows(L.conv_input, channels, kernel, L.conv_weight, lr, n_rows, max_n,
                                  L.conv_out);
      cuda::gated_delta_rule_rows(L.conv_out, L.conv_out + kd, L.conv_out + 2 * kd, L.a, L.b,
                                  L.A_log, L.dt_bias, lr, n_rows, max_n, h, L.out);
    }
    return;
  }
  const int64_t all_rows = n_rows * layers.count;
  const dim3 grid(grid_blocks(ceil_div(channels, kConvThreads), op),
                  static_cast<unsigned>(all_rows), 1);
  with_conv_taps(kernel, op, [&](auto taps) {
    launch(op, causal_conv_silu_rows_kernel<decltype(taps)::value, true>, grid, kConvThreads, 0,
           nullptr, channels, nullptr, rows, int64_t{0}, nullptr, layers.device, n_rows);
  });
  const DeltaArgs g = layer_args(layers.host[0]);
  if (h.dk == 64)
    launch_short_rows<64>(g, rows, all_rows, layers.device, n_rows);
  else
    launch_short_rows<128>(g, rows, all_rows, layers.device, n_rows);
}

TANDEM_CUDA_TRACE_UNIT(recurrent)

}  // namespace tandem::cuda
