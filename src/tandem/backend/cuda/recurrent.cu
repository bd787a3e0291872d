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

__device__ inline float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
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

constexpr int kDeltaWarps = 4;  // row slices of each state column
constexpr int kDeltaThreads = 32 * kDeltaWarps;
constexpr int kDeltaCols = 32;             // value columns per block: one per lane
constexpr int kMaxDk = 2 * kDeltaThreads;  // 256: each thread stages two q and two k values

// One token's raw inputs as one thread stages them: q, k elements tid and tid + 128 (0 past dk),
// its column's v, and the head's a, b.
struct DeltaToken {
  float q[2], k[2], v, a, b;
};

__device__ inline DeltaToken load_delta_token(const float* q, const float* k, const float* v,
                                              const float* a, const float* b, int64_t t,
                                              int64_t n_k_heads, int64_t n_v_heads, int64_t kh,
                                              int64_t vh, int64_t dk, int64_t dv, int64_t j) {
  DeltaToken in;
  const float* qt = q + (t * n_k_heads + kh) * dk;
  const float* kt = k + (t * n_k_heads + kh) * dk;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t i = threadIdx.x + r * kDeltaThreads;
    in.q[r] = i < dk ? qt[i] : 0.0f;
    in.k[r] = i < dk ? kt[i] : 0.0f;
  }
  in.v = j < dv ? v[(t * n_v_heads + vh) * dv + j] : 0.0f;
  in.a = a[t * n_v_heads + vh];
  in.b = b[t * n_v_heads + vh];
  return in;
}

// Grid: (column tiles of 32, value heads). Block (tile, vh) owns state columns
// j = 32·tile + lane of head vh, all dk rows; columns evolve independently in the delta rule, so
// blocks never share state. Thread (warp r, lane) holds rows r·ROWS .. r·ROWS + ROWS-1 of column
// j in registers (ROWS = dk/4 rounded up to a power of two; rows >= dk stay 0 and add exact zeros).
// Per token, with q, k staged raw in shared memory:
//   q̂ = q · dk^-½ / sqrt(Σq² + 1e-6), k̂ = k / sqrt(Σk² + 1e-6)   (Σ: lane-strided, warp_sum)
//   S *= exp(g);  u = (v - Σ_i S[i]·k̂[i]) · β;  S += k̂ uᵀ;  o = Σ_i S[i]·q̂[i]
// Each Σ_i is four per-warp partial sums (rows in order) added in warp order 0..3, so the order
// depends on dk only. Three barriers per token; see the comments at each for what they order.
template <int ROWS>
__global__ void __launch_bounds__(kDeltaThreads)
    gated_delta_rule_kernel(const float* q, const float* k, const float* v, const float* a,
                            const float* b, const float* A_log, const float* dt_bias, int64_t n,
                            int64_t n_k_heads, int64_t n_v_heads, int64_t dk, int64_t dv,
                            float q_scale, float* state, float* out, float* state_after) {
  __shared__ float s_q[kMaxDk];  // this token's raw q, zero past dk
  __shared__ float s_k[kMaxDk];
  __shared__ float s_u[kDeltaWarps][kDeltaCols];  // per-warp partials of Σ S·k̂
  __shared__ float s_o[kDeltaWarps][kDeltaCols];  // per-warp partials of Σ S·q̂

  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int64_t vh = blockIdx.y;
  const int64_t kh = vh / (n_v_heads / n_k_heads);
  const int64_t j = blockIdx.x * int64_t(kDeltaCols) + lane;
  const bool column = j < dv;
  const int row0 = warp * ROWS;

  float* S = state + vh * dk * dv;  // [dk, dv] of this head
  float Sr[ROWS];
#pragma unroll
  for (int m = 0; m < ROWS; ++m) {
    const int64_t i = row0 + m;
    Sr[m] = column && i < dk ? S[i * dv + j] : 0.0f;
  }
  const float A = -expf(A_log[vh]);
  const float bias = dt_bias[vh];

  DeltaToken next = load_delta_token(q, k, v, a, b, 0, n_k_heads, n_v_heads, kh, vh, dk, dv, j);
#pragma unroll 1
  for (int64_t t = 0; t < n; ++t) {
    const DeltaToken cur = next;
    s_q[threadIdx.x] = cur.q[0];
    s_q[threadIdx.x + kDeltaThreads] = cur.q[1];
    s_k[threadIdx.x] = cur.k[0];
    s_k[threadIdx.x + kDeltaThreads] = cur.k[1];
    // The next token's loads go out now and land while this token computes.
    if (t + 1 < n)
      next = load_delta_token(q, k, v, a, b, t + 1, n_k_heads, n_v_heads, kh, vh, dk, dv, j);
    // (1) s_q, s_k hold token t. (Their previous contents were last read before barrier (3)
    // of token t-1, which every thread has passed.)
    __syncthreads();

    // Every warp reduces the same staged vectors in the same order, so all warps hold the same
    // norms without another barrier.
    float ssq = 0.0f, ssk = 0.0f;
    for (int64_t i = lane; i < dk; i += 32) {
      ssq = fmaf(s_q[i], s_q[i], ssq);
      ssk = fmaf(s_k[i], s_k[i], ssk);
    }
    ssq = warp_sum(ssq);
    ssk = warp_sum(ssk);
    const float inv_q = q_scale / sqrtf(ssq + 1e-6f);
    const float inv_k = 1.0f / sqrtf(ssk + 1e-6f);
    const float decay = expf(A * softplus(cur.a + bias));
    const float beta = 1.0f / (1.0f + expf(-cur.b));

    float part = 0.0f;
#pragma unroll
    for (int m = 0; m < ROWS; ++m) {
      Sr[m] *= decay;
      part = fmaf(Sr[m], s_k[row0 + m] * inv_k, part);
    }
    s_u[warp][lane] = part;
    __syncthreads();  // (2) all partials of Σ S·k̂ for token t
    float kv_mem = s_u[0][lane];
#pragma unroll
    for (int r = 1; r < kDeltaWarps; ++r) kv_mem += s_u[r][lane];
    const float u = (cur.v - kv_mem) * beta;

    part = 0.0f;
#pragma unroll
    for (int m = 0; m < ROWS; ++m) {
      Sr[m] = fmaf(s_k[row0 + m] * inv_k, u, Sr[m]);
      part = fmaf(Sr[m], s_q[row0 + m] * inv_q, part);
    }
    s_o[warp][lane] = part;
    if (state_after != nullptr && column) {
      float* dst = state_after + (t * n_v_heads + vh) * dk * dv;
#pragma unroll
      for (int m = 0; m < ROWS; ++m) {
        const int64_t i = row0 + m;
        if (i < dk) dst[i * dv + j] = Sr[m];
      }
    }
    // (3) all partials of Σ S·q̂ for token t; also every thread is done reading s_q, s_k and
    // s_u of token t, so token t+1 may overwrite them.
    __syncthreads();
    if (warp == 0 && column) {
      float o = s_o[0][lane];
#pragma unroll
      for (int r = 1; r < kDeltaWarps; ++r) o += s_o[r][lane];
      out[(t * n_v_heads + vh) * dv + j] = o;
    }
  }

#pragma unroll
  for (int m = 0; m < ROWS; ++m) {
    const int64_t i = row0 + m;
    if (column && i < dk) S[i * dv + j] = Sr[m];
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

  // The same expression as the CPU's, so the two backends use the same bits.
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(h.dk));
  const int64_t rows = ceil_div(h.dk, kDeltaWarps);
  using DeltaKernel = void (*)(const float*, const float*, const float*, const float*, const float*,
                               const float*, const float*, int64_t, int64_t, int64_t, int64_t,
                               int64_t, float, float*, float*, float*);
  const DeltaKernel kernel = rows <= 4    ? gated_delta_rule_kernel<4>
                             : rows <= 8  ? gated_delta_rule_kernel<8>
                             : rows <= 16 ? gated_delta_rule_kernel<16>
                             : rows <= 32 ? gated_delta_rule_kernel<32>
                                          : gated_delta_rule_kernel<64>;
  const dim3 grid(static_cast<unsigned>(ceil_div(h.dv, kDeltaCols)),
                  static_cast<unsigned>(h.n_v_heads));
  kernel<<<grid, kDeltaThreads, 0, op_stream()>>>(
      q, k, v, a, b, static_cast<const float*>(A_log.data), static_cast<const float*>(dt_bias.data),
      n, h.n_k_heads, h.n_v_heads, h.dk, h.dv, q_scale, state, out, state_after);
  check_launch("gated_delta_rule");
}

}  // namespace tandem::cuda
