// The Gated DeltaNet's recurrent ops: the depthwise causal conv (+ SiLU) and the gated delta rule.
// Both walk a row's tokens in order inside one kernel, carrying the state in registers, and run
// exactly the same per-token step whatever n is: n tokens in one call leave the same bits as n
// calls of one token (the state round-trips through fp32 memory exactly).
#include <cuda_runtime.h>

#include <cmath>

#include "tandem/backend/cuda/check.cuh"
#include "tandem/backend/cuda/cuda_ops.h"
#include "tandem/core/error.h"

namespace tandem::cuda {

namespace {

__device__ inline float silu(float x) {
  return x / (1.0f + expf(-x));
}

__device__ inline float softplus(float x) {
  return x > 20.0f ? x : log1pf(expf(x));
}

// --- causal_conv_silu ----------------------------------------------------------------------------

constexpr int kConvThreads = 128;
constexpr int kMaxConvKernel = 16;

// One thread per channel (grid over channels); it walks the n tokens in order with the last
// K-1 inputs in registers (win, oldest first), like cpu::causal_conv_silu's state. A thread
// reads x[t, c] before writing out[t, c] and touches only channel c, so out may alias x.
//   acc = Σ_{j<K-1} w[c, j] · win[j] + w[c, K-1] · x[t, c],  out = silu(acc)
template <int K>
__global__ void __launch_bounds__(kConvThreads)
    causal_conv_silu_kernel(const float* x, int64_t n, int64_t channels, const float* w,
                            float* state, float* out, float* state_after) {
  constexpr int H = K - 1;  // history length
  const int64_t c = blockIdx.x * int64_t(kConvThreads) + threadIdx.x;
  if (c >= channels) return;
  float wc[K];
#pragma unroll
  for (int j = 0; j < K; ++j) wc[j] = w[c * K + j];
  float win[H > 0 ? H : 1];
#pragma unroll
  for (int j = 0; j < H; ++j) win[j] = state[c * H + j];

    // Unrolled so later tokens' x loads issue early; every copy runs the same fmaf sequence.
#pragma unroll 4
  for (int64_t t = 0; t < n; ++t) {
    const float xt = x[t * channels + c];
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < H; ++j) acc = fmaf(wc[j], win[j], acc);
    acc = fmaf(wc[H], xt, acc);
    if constexpr (H > 0) {
#pragma unroll
      for (int j = 0; j + 1 < H; ++j) win[j] = win[j + 1];
      win[H - 1] = xt;
    }
    out[t * channels + c] = silu(acc);
    if (state_after != nullptr) {
      float* dst = state_after + (t * channels + c) * H;
#pragma unroll
      for (int j = 0; j < H; ++j) dst[j] = win[j];
    }
  }
#pragma unroll
  for (int j = 0; j < H; ++j) state[c * H + j] = win[j];
}

// Launches causal_conv_silu_kernel<kernel>: the tap count is a template argument so the window
// stays in registers.
template <int K = 1>
void launch_causal_conv_silu(int64_t kernel, const float* x, int64_t n, int64_t channels,
                             const float* w, float* state, float* out, float* state_after) {
  if constexpr (K > kMaxConvKernel) {
    fail("causal_conv_silu: kernel size ", kernel, " exceeds the CUDA maximum ", kMaxConvKernel);
  } else if (kernel != K) {
    launch_causal_conv_silu<K + 1>(kernel, x, n, channels, w, state, out, state_after);
  } else {
    const unsigned blocks = grid_blocks(ceil_div(channels, kConvThreads), "causal_conv_silu");
    causal_conv_silu_kernel<K>
        <<<blocks, kConvThreads, 0, op_stream()>>>(x, n, channels, w, state, out, state_after);
    check_launch("causal_conv_silu");
  }
}

// --- gated_delta_rule ----------------------------------------------------------------------------
//
// Work split. Grid (column tiles of 32, value heads); block (tile, vh) owns value columns
// j = 32·tile + 0..31 of head vh, all dk rows of each: columns evolve independently in the delta
// rule, so blocks never share state. Four lanes share a column (lane = 4·c + s: column c of the
// warp's 8, row quarter s) and each keeps ROWS of the column's rows in registers: rows
// i = 16m + 4s + e (m < ROWS/4, e < 4), i.e. float4 number 4m + s of a row vector. ROWS·4 is dk
// padded up (16, 32 or 64 rows per lane); padded rows hold 0 and their k̂, q̂ are 0, so they add
// exact zeros. At dk = dv = 128 a warp holds 8 columns × 128 rows: with 32 value heads that is
// 512 warps, one per H200 warp scheduler.
//
// Time split. Tokens go in chunks of TOKENS (16; 8 at ROWS 64), double-buffered in shared memory.
// For chunk c the block (A) waits for its cp.async copies (raw q, k of key head vh / group, the
// tile's v columns, a, b; issued during chunk c-1), issues chunk c+1's copies into the other
// buffer, normalises chunk c's q and k in place and turns a, b into decay and beta, all tokens at
// once, then (B) runs the recurrence over chunk c's tokens with no barrier: per token a column's
// two dk-long sums are four per-lane partials combined by two xor shuffles inside the quad.
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
//        (s0+s1)+(s2+s3); the quad then adds xor-1 then xor-2 partners. Float addition is
//        commutative, so all four lanes end with the same bits.
// The output reduction of token t is done at the start of token t+1 (or after the last token),
// so its shuffle latency overlaps the next token's dot product.

constexpr int kDeltaThreads = 128;
constexpr int kDeltaLanesPerCol = 4;
constexpr int kDeltaCols = kDeltaThreads / kDeltaLanesPerCol;  // 32 value columns per block
constexpr int kDeltaColsPerWarp = 32 / kDeltaLanesPerCol;      // 8
constexpr int kMaxDk = 256;
constexpr unsigned kFullMask = 0xffffffffu;

constexpr int delta_chunk_tokens(int rows) {
  return rows <= 32 ? 16 : 8;  // keeps two chunks within 48 KiB of static shared memory
}

// One chunk of tokens in shared memory. Row vectors are padded by 4 floats so that the
// normalisation pass, where neighbouring lanes read different vectors, spreads its float4 reads
// over all banks (the recurrence reads one vector per token, as broadcasts).
template <int ROWS, int TOKENS>
struct alignas(16) DeltaChunk {
  static constexpr int kDkPadded = 4 * ROWS;
  static constexpr int kStride = kDkPadded + 4;
  float qk[2][TOKENS][kStride];  // [0]: q, [1]: k; raw as copied, then normalised in place
  float v[TOKENS][kDeltaCols];   // the tile's value columns
  float decay[TOKENS];           // raw a as copied, then the decay factor
  float beta[TOKENS];            // raw b as copied, then beta
};

// Kernel arguments (layouts as ops::gated_delta_rule).
struct DeltaArgs {
  const float *q, *k, *v, *a, *b, *A_log, *dt_bias;
  int64_t n, n_k_heads, n_v_heads, dv;
  int dk;
  float q_scale;
  bool copy16;  // q, k, v 16-byte aligned and dk, dv multiples of 4: stage with 16-byte copies
  float *state, *out, *state_after;
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

// Returns x unchanged, hidden from the optimiser: row addresses built from it are recomputed
// where used instead of being kept live (ROWS 64-bit addresses, 2·ROWS registers) through the
// token loop.
__device__ inline int64_t opaque(int64_t x) {
  asm volatile("" : "+l"(x));
  return x;
}

// Sum over the four lanes of a column (a quad): xor 1, then xor 2. Every lane of the quad gets
// the same bits.
__device__ inline float quad_sum(float x) {
  x += __shfl_xor_sync(kFullMask, x, 1);
  return x + __shfl_xor_sync(kFullMask, x, 2);
}

// Issues the copies of tokens t0 .. t0+count-1 into `ch`: q and k of key head kh, v columns
// col0 .. col0+ncols-1 of head vh, a and b of head vh. Words it does not write keep their
// zeros (padding rows, columns past dv).
template <int ROWS, int TOKENS>
__device__ void delta_stage(DeltaChunk<ROWS, TOKENS>& ch, const DeltaArgs& g, int64_t kh,
                            int64_t vh, int64_t col0, int ncols, int64_t t0, int count) {
  const int tid = threadIdx.x;
  if (g.copy16) {
    const int f4 = g.dk / 4;
    for (int e = tid; e < count * f4; e += kDeltaThreads) {
      const int p = e / f4, f = e - p * f4;
      const int64_t src = ((t0 + p) * g.n_k_heads + kh) * g.dk + 4 * f;
      copy_async16(&ch.qk[0][p][4 * f], g.q + src);
      copy_async16(&ch.qk[1][p][4 * f], g.k + src);
    }
    const int c4 = ncols / 4;
    for (int e = tid; e < count * c4; e += kDeltaThreads) {
      const int p = e / c4, f = e - p * c4;
      copy_async16(&ch.v[p][4 * f], g.v + ((t0 + p) * g.n_v_heads + vh) * g.dv + col0 + 4 * f);
    }
  } else {
    for (int e = tid; e < count * g.dk; e += kDeltaThreads) {
      const int p = e / g.dk, i = e - p * g.dk;
      const int64_t src = ((t0 + p) * g.n_k_heads + kh) * g.dk + i;
      copy_async4(&ch.qk[0][p][i], g.q + src);
      copy_async4(&ch.qk[1][p][i], g.k + src);
    }
    for (int e = tid; e < count * ncols; e += kDeltaThreads) {
      const int p = e / ncols, c = e - p * ncols;
      copy_async4(&ch.v[p][c], g.v + ((t0 + p) * g.n_v_heads + vh) * g.dv + col0 + c);
    }
  }
  if (tid < count) {
    copy_async4(&ch.decay[tid], g.a + (t0 + tid) * g.n_v_heads + vh);
    copy_async4(&ch.beta[tid], g.b + (t0 + tid) * g.n_v_heads + vh);
  }
}

// L2-normalises the first `count` tokens' q and k in place (G lanes per vector, see the order
// above) and replaces raw a, b with decay and beta. Every lane runs the shuffles.
template <int ROWS, int TOKENS>
__device__ void delta_normalise(DeltaChunk<ROWS, TOKENS>& ch, int count, float q_scale, float A,
                                float bias) {
  constexpr int G = kDeltaThreads / (2 * TOKENS);  // lanes per vector
  constexpr int F = ROWS / G;                      // float4s per lane
  static_assert(32 % G == 0 && F >= 1 && F * G == ROWS, "vector split must tile a warp and dk");
  const int tid = threadIdx.x;
  const int s = tid % G, vec = tid / G;
  const int which = vec / TOKENS, p = vec % TOKENS;
  const bool live = p < count;
  float4* x = reinterpret_cast<float4*>(ch.qk[which][p]);
  float4 r[F];
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int m = 0; m < F; ++m) {
    r[m] = live ? x[G * m + s] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    acc[0] = fmaf(r[m].x, r[m].x, acc[0]);
    acc[1] = fmaf(r[m].y, r[m].y, acc[1]);
    acc[2] = fmaf(r[m].z, r[m].z, acc[2]);
    acc[3] = fmaf(r[m].w, r[m].w, acc[3]);
  }
  float ss = (acc[0] + acc[1]) + (acc[2] + acc[3]);
#pragma unroll
  for (int offset = 1; offset < G; offset *= 2) ss += __shfl_xor_sync(kFullMask, ss, offset);
  const float inv = (which == 0 ? q_scale : 1.0f) / sqrtf(ss + 1e-6f);
  if (live) {
#pragma unroll
    for (int m = 0; m < F; ++m)
      x[G * m + s] = make_float4(r[m].x * inv, r[m].y * inv, r[m].z * inv, r[m].w * inv);
  }
  if (tid < count) {
    ch.decay[tid] = expf(A * softplus(ch.decay[tid] + bias));
    ch.beta[tid] = 1.0f / (1.0f + expf(-ch.beta[tid]));
  }
}

template <int ROWS, bool AFTER>
__global__ void __launch_bounds__(kDeltaThreads, 1) gated_delta_rule_kernel(const DeltaArgs g) {
  constexpr int TOKENS = delta_chunk_tokens(ROWS);
  using Chunk = DeltaChunk<ROWS, TOKENS>;
  static_assert(sizeof(Chunk) % sizeof(float4) == 0, "chunks must stay 16-byte aligned");
  __shared__ Chunk ch[2];

  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int s = lane % kDeltaLanesPerCol;
  const int col = (tid / 32) * kDeltaColsPerWarp + lane / kDeltaLanesPerCol;
  const int64_t vh = blockIdx.y;
  const int64_t kh = vh / (g.n_v_heads / g.n_k_heads);
  const int64_t col0 = int64_t(blockIdx.x) * kDeltaCols;
  const int ncols = static_cast<int>(min64(kDeltaCols, g.dv - col0));
  const bool column = col < ncols;
  const int64_t j = col0 + col;
  const float A = -expf(g.A_log[vh]);
  const float bias = g.dt_bias[vh];
  // The state loads go out first: they overlap the shared-memory set-up below.
  float* S = g.state + vh * g.dk * g.dv;  // [dk, dv] of this head
  float Sr[ROWS];
#pragma unroll
  for (int m = 0; m < ROWS / 4; ++m)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = 16 * m + 4 * s + e;
      Sr[4 * m + e] = column && i < g.dk ? S[i * g.dv + j] : 0.0f;
    }

  {
    float4* z = reinterpret_cast<float4*>(ch);
    for (int i = tid; i < int(sizeof(ch) / sizeof(float4)); i += kDeltaThreads)
      z[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  __syncthreads();  // the zeros land before any copy into the same words
  delta_stage(ch[0], g, kh, vh, col0, ncols, 0, static_cast<int>(min64(TOKENS, g.n)));

  float o_part = 0.0f;   // this lane's share of token o_token's output, not yet reduced
  int64_t o_token = -1;  // none yet
  int buf = 0;
  for (int64_t t0 = 0; t0 < g.n; t0 += TOKENS, buf ^= 1) {
    const int count = static_cast<int>(min64(TOKENS, g.n - t0));
    copy_async_wait_all();
    // (A) Chunk t0's copies are visible to all; every thread has finished the previous chunk's
    // recurrence, so its buffer (ch[buf ^ 1]) may be refilled.
    __syncthreads();
    if (t0 + TOKENS < g.n)
      delta_stage(ch[buf ^ 1], g, kh, vh, col0, ncols, t0 + TOKENS,
                  static_cast<int>(min64(TOKENS, g.n - t0 - TOKENS)));
    delta_normalise(ch[buf], count, g.q_scale, A, bias);
    __syncthreads();  // (B) chunk t0's q̂, k̂, decay, beta are ready
    const Chunk& c = ch[buf];

#pragma unroll 1
    for (int p = 0; p < count; ++p) {
      const float4* kp = reinterpret_cast<const float4*>(c.qk[1][p]);
      const float4* qp = reinterpret_cast<const float4*>(c.qk[0][p]);
      float kk[ROWS], qq[ROWS];
#pragma unroll
      for (int m = 0; m < ROWS / 4; ++m) {
        const float4 k4 = kp[4 * m + s], q4 = qp[4 * m + s];
        kk[4 * m] = k4.x, kk[4 * m + 1] = k4.y, kk[4 * m + 2] = k4.z, kk[4 * m + 3] = k4.w;
        qq[4 * m] = q4.x, qq[4 * m + 1] = q4.y, qq[4 * m + 2] = q4.z, qq[4 * m + 3] = q4.w;
      }
      const float decay = c.decay[p], beta = c.beta[p], vj = c.v[p][col];

      const float o_prev = quad_sum(o_part);
      if (o_token >= 0 && s == 0 && column) g.out[(o_token * g.n_v_heads + vh) * g.dv + j] = o_prev;

      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        Sr[r] *= decay;
        acc[r % 4] = fmaf(Sr[r], kk[r], acc[r % 4]);
      }
      const float kv = quad_sum((acc[0] + acc[1]) + (acc[2] + acc[3]));
      const float u = (vj - kv) * beta;
      float oacc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        Sr[r] = fmaf(kk[r], u, Sr[r]);
        oacc[r % 4] = fmaf(Sr[r], qq[r], oacc[r % 4]);
      }
      o_part = (oacc[0] + oacc[1]) + (oacc[2] + oacc[3]);
      o_token = t0 + p;
      if constexpr (AFTER) {
        if (column) {
          const int64_t dv = opaque(g.dv);
          float* dst = g.state_after + (o_token * g.n_v_heads + vh) * g.dk * dv + j;
#pragma unroll
          for (int m = 0; m < ROWS / 4; ++m)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int i = 16 * m + 4 * s + e;
              if (i < g.dk) dst[i * dv] = Sr[4 * m + e];
            }
        }
      }
    }
  }
  const float o_last = quad_sum(o_part);
  if (s == 0 && column) g.out[(o_token * g.n_v_heads + vh) * g.dv + j] = o_last;

  const int64_t dv = opaque(g.dv);
#pragma unroll
  for (int m = 0; m < ROWS / 4; ++m)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = 16 * m + 4 * s + e;
      if (column && i < g.dk) S[i * dv + j] = Sr[4 * m + e];
    }
}

}  // namespace

void causal_conv_silu(const float* x, int64_t n, int64_t channels, int64_t kernel,
                      const ops::WeightRef& w, float* state, float* out, float* state_after) {
  if (n < 0 || channels < 0 || kernel < 1)
    fail("causal_conv_silu: bad shape n ", n, ", channels ", channels, ", kernel ", kernel);
  check_f32_vector(w, channels * kernel, "causal_conv_silu", "weight");
  if (w.rows != channels || w.cols != kernel)
    fail("causal_conv_silu: weight is [", w.rows, ", ", w.cols, "], expected [", channels, ", ",
         kernel, "]");
  if (n == 0 || channels == 0) return;
  launch_causal_conv_silu(kernel, x, n, channels, static_cast<const float*>(w.data), state, out,
                          state_after);
}

void gated_delta_rule(const float* q, const float* k, const float* v, const float* a,
                      const float* b, const ops::WeightRef& A_log, const ops::WeightRef& dt_bias,
                      int64_t n, const ops::DeltaHeads& h, float* state, float* out,
                      float* state_after) {
  if (n < 0) fail("gated_delta_rule: negative token count ", n);
  if (h.n_k_heads < 1 || h.n_v_heads < 1 || h.n_v_heads % h.n_k_heads != 0)
    fail("gated_delta_rule: ", h.n_v_heads, " value heads is not a multiple of ", h.n_k_heads,
         " key heads");
  if (h.dk < 1 || h.dk > kMaxDk || h.dv < 1)
    fail("gated_delta_rule: dk ", h.dk, " (max ", kMaxDk, "), dv ", h.dv, " unsupported");
  if (h.n_v_heads > 65535)
    fail("gated_delta_rule: ", h.n_v_heads, " value heads exceed the grid's 65535");
  check_f32_vector(A_log, h.n_v_heads, "gated_delta_rule", "A_log");
  check_f32_vector(dt_bias, h.n_v_heads, "gated_delta_rule", "dt_bias");
  if (n == 0) return;

  const auto aligned16 = [](const float* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  DeltaArgs g{};
  g.q = q, g.k = k, g.v = v, g.a = a, g.b = b;
  g.A_log = static_cast<const float*>(A_log.data);
  g.dt_bias = static_cast<const float*>(dt_bias.data);
  g.n = n, g.n_k_heads = h.n_k_heads, g.n_v_heads = h.n_v_heads, g.dv = h.dv;
  g.dk = static_cast<int>(h.dk);
  // The same expression as the CPU's, so the two backends use the same bits.
  g.q_scale = 1.0f / std::sqrt(static_cast<float>(h.dk));
  // Either copy width stages the same words, so the choice never changes a result.
  g.copy16 = h.dk % 4 == 0 && h.dv % 4 == 0 && aligned16(q) && aligned16(k) && aligned16(v);
  g.state = state, g.out = out, g.state_after = state_after;

  // Rows per lane from dk; state_after is a template flag so the usual token loop carries no
  // store branch. Both choices depend on the shape and the call's outputs, never on n.
  using DeltaKernel = void (*)(DeltaArgs);
  const bool after = state_after != nullptr;
  const DeltaKernel kernel =
      h.dk <= 64 ? (after ? gated_delta_rule_kernel<16, true> : gated_delta_rule_kernel<16, false>)
      : h.dk <= 128
          ? (after ? gated_delta_rule_kernel<32, true> : gated_delta_rule_kernel<32, false>)
          : (after ? gated_delta_rule_kernel<64, true> : gated_delta_rule_kernel<64, false>);
  const dim3 grid(grid_blocks(ceil_div(h.dv, kDeltaCols), "gated_delta_rule"),
                  static_cast<unsigned>(h.n_v_heads));
  kernel<<<grid, kDeltaThreads, 0, op_stream()>>>(g);
  check_launch("gated_delta_rule");
}

}  // namespace tandem::cuda
