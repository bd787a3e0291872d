// Norms, activations, gates, rotary embedding and the embedding gather: memory-bound kernels, one
// block per row where a row needs a reduction, grid-stride loops elsewhere. Formulas follow
// cpu/elementwise.cpp term by term (same products, same association) so the two backends differ
// only by fp32 rounding.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "tandem/backend/cuda/activation.cuh"
#include "tandem/backend/cuda/check.cuh"
#include "tandem/backend/cuda/cuda_ops.h"
#include "tandem/backend/cuda/kv_element.cuh"
#include "tandem/backend/cuda/row_norm.cuh"
#include "tandem/core/error.h"

namespace tandem::cuda {

namespace {

constexpr int kThreads = 256;  // grid-stride kernels
constexpr int kEmbedThreads = 1024;

// 1 / sqrt(mean(x²) + eps) of row x[d], as cpu::inv_rms: squares summed in double (each
// product exact), thread t taking i = t, t + Threads, ... in order, then block_sum. The block
// size is a function of d alone (rms_norm's dispatch), so the order never depends on m.
// A row as the norms read it: fp32 values, or (EmbeddedRow) a bf16 table row widened exactly to
// fp32 as embed_rows widens it, NaN throughout where its id was out of range (what embed_rows
// writes then). The same values either way, so a norm of an embedded row has embed_rows +
// rms_norm's bits.
struct EmbeddedRow {
  const uint16_t* p;
  bool valid;
};
__device__ __forceinline__ float element(const float* x, int64_t i) {
  return x[i];
}
__device__ __forceinline__ float element(const EmbeddedRow& x, int64_t i) {
  return x.valid ? __uint_as_float(static_cast<uint32_t>(x.p[i]) << 16)
                 : __int_as_float(0x7fc00000);
}

template <int Threads, class X>
__device__ inline float row_inv_rms(const X& x, int64_t d, float eps, double* s_warp) {
  double ss = 0.0;
  for (int64_t i = threadIdx.x; i < d; i += Threads) {
    const float v = element(x, i);
    ss += static_cast<double>(v) * v;
  }
  return inv_rms_from_sum(block_sum<Threads>(ss, s_warp), d, eps);
}

// One row of rms_norm in the Narrow or Wide order (Threads threads): xr[d] into yr[d]. yr may
// alias xr: every xr[i] a thread rewrites was read by the reduction before its barrier, and after
// it each thread touches only its own i.
template <int Threads, class Out, class X>
__device__ inline void norm_row(const X& xr, int64_t d, const float* w, bool zero_centred,
                                float eps, Out* yr, double* s_warp) {
  const float s = row_inv_rms<Threads>(xr, d, eps, s_warp);
  for (int64_t i = threadIdx.x; i < d; i += Threads) {
    const float wi = w[i];
    yr[i] = Out(normed(element(xr, i), s, wi, zero_centred));
  }
}

// Grid: one block per row of x[m, d]; y may alias x (norm_row).
// Out: float, or __nv_bfloat16 for rms_norm_bf16 (each value rounded to nearest even).
template <int Threads, class Out = float>
__global__ void __launch_bounds__(Threads)
    rms_norm_kernel(const float* x, int64_t d, const float* w, bool zero_centred, float eps,
                    Out* y) {
  pdl_wait();
  pdl_release();
  __shared__ double s_warp[Threads / 32];
  norm_row<Threads>(x + blockIdx.x * d, d, w, zero_centred, eps, y + blockIdx.x * d, s_warp);
}

// Hidden-size rows (kWideNormMinDim <= d <= kRowNormMaxDim), the norm at the start of every
// sublayer. Thread t holds the 4-float chunks c = t, t + Threads, ... of its row in registers
// (loaded all at once: a decode step's single row is latency-bound, so every load is in flight
// before any is used), and sums their squares in double, chunk by chunk, element by element;
// then block_sum. The order depends on d alone. `vec` (rows 16-byte aligned) only picks 16-byte
// loads over scalar ones for the same elements, so it changes no bit.
// Add (add_rms_norm): x_sum = x + r is written back and normalised; y may alias r. Otherwise
// x_sum is unused and y may alias x.
__device__ __forceinline__ void load_chunk(const float* p, int64_t i, int64_t d, bool vec,
                                           float (&v)[4]) {
  if (vec && i + 4 <= d) {
    const float4 f = *reinterpret_cast<const float4*>(p + i);
    v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] = i + e < d ? p[i + e] : 0.0f;
  }
}

// An embedded row's chunk: 4 bf16 values at once where vec (8-byte aligned), else one by one.
__device__ __forceinline__ void load_chunk(const EmbeddedRow& x, int64_t i, int64_t d, bool vec,
                                           float (&v)[4]) {
  if (x.valid && vec && i + 4 <= d) {
    const uint2 u = *reinterpret_cast<const uint2*>(x.p + i);
    v[0] = __uint_as_float(u.x << 16), v[1] = __uint_as_float(u.x & 0xffff0000u);
    v[2] = __uint_as_float(u.y << 16), v[3] = __uint_as_float(u.y & 0xffff0000u);
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] = i + e < d ? element(x, i + e) : 0.0f;
  }
}

// bf16: 4 values rounded to nearest even (8-byte aligned when vec).
__device__ __forceinline__ void store_chunk(__nv_bfloat16* p, int64_t i, int64_t d, bool vec,
                                            const float (&v)[4]) {
  if (vec && i + 4 <= d) {
    const __nv_bfloat162 lo = __floats2bfloat162_rn(v[0], v[1]),
                         hi = __floats2bfloat162_rn(v[2], v[3]);
    *reinterpret_cast<uint2*>(p + i) = make_uint2(*reinterpret_cast<const uint32_t*>(&lo),
                                                  *reinterpret_cast<const uint32_t*>(&hi));
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (i + e < d) p[i + e] = __float2bfloat16_rn(v[e]);
  }
}

__device__ __forceinline__ void store_chunk(float* p, int64_t i, int64_t d, bool vec,
                                            const float (&v)[4]) {
  if (vec && i + 4 <= d) {
    *reinterpret_cast<float4*>(p + i) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (i + e < d) p[i + e] = v[e];
  }
}

// The weight elements chunked_norm_row scales thread threadIdx.x's chunks by (0 past d). A norm
// weight is a model parameter no kernel writes, so a kernel loads it before its pdl_wait: the
// weight's round trip overlaps the previous kernel instead of lengthening the norm's chain.
using NormWeightChunks = float[kRowVec][4];

__device__ __forceinline__ void load_weight_chunks(const float* w, int64_t d,
                                                   NormWeightChunks& wv) {
#pragma unroll
  for (int j = 0; j < kRowVec; ++j)
    load_chunk(w, 4 * (threadIdx.x + j * kWideNormThreads), d, false, wv[j]);
}

template <bool Add, class Out, class X>
__device__ inline void chunked_norm_row(const X& x, const float* r, float* x_sum, int64_t d,
                                        const NormWeightChunks& wv, bool zero_centred, float eps,
                                        bool vec, Out* y, double* s_warp) {
  constexpr int Threads = kWideNormThreads;
  float v[kRowVec][4];
#pragma unroll
  for (int j = 0; j < kRowVec; ++j) load_chunk(x, 4 * (threadIdx.x + j * Threads), d, vec, v[j]);
  if constexpr (Add) {
    float a[kRowVec][4];
#pragma unroll
    for (int j = 0; j < kRowVec; ++j) load_chunk(r, 4 * (threadIdx.x + j * Threads), d, vec, a[j]);
#pragma unroll
    for (int j = 0; j < kRowVec; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) v[j][e] += a[j][e];
      store_chunk(x_sum, 4 * (threadIdx.x + j * Threads), d, vec, v[j]);
    }
  }
  double ss = 0.0;
#pragma unroll
  for (int j = 0; j < kRowVec; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) ss += static_cast<double>(v[j][e]) * v[j][e];  // 0 past d
  const float s = inv_rms_from_sum(block_sum<Threads>(ss, s_warp), d, eps);
#pragma unroll
  for (int j = 0; j < kRowVec; ++j) {
    const int64_t i = 4 * (threadIdx.x + j * Threads);
    if (i >= d) break;
    float o[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) o[e] = normed(v[j][e], s, wv[j][e], zero_centred);
    store_chunk(y, i, d, vec, o);
  }
}

// Grid: one block per row (chunked_norm_row).
template <bool Add, class Out = float>
__global__ void __launch_bounds__(kWideNormThreads)
    row_norm_kernel(const float* x, const float* r, float* x_sum, int64_t d, const float* w,
                    bool zero_centred, float eps, bool vec, Out* y) {
  NormWeightChunks wv;
  load_weight_chunks(w, d, wv);
  pdl_wait();
  pdl_release();
  __shared__ double s_warp[kWideNormThreads / 32];
  const int64_t off = blockIdx.x * d;
  chunked_norm_row<Add>(x + off, Add ? r + off : nullptr, Add ? x_sum + off : nullptr, d, wv,
                        zero_centred, eps, vec, y + off, s_warp);
}

// rms_norm_pair. Grid (rows, 2): block (t, 0) normalises a[t] into y[t, :d], block (t, 1) b[t]
// into y[t, d:], each with rms_norm's kernel body for d (Chunked: chunked_norm_row, else
// norm_row<Threads>), so both halves carry rms_norm's bits.
template <int Threads, bool Chunked>
__global__ void __launch_bounds__(Threads)
    rms_norm_pair_kernel(const float* a, const float* b, int64_t d, const float* wa,
                         const float* wb, bool zero_centred, float eps, bool vec, float* y) {
  const bool second = blockIdx.y == 1;
  const float* w = second ? wb : wa;
  NormWeightChunks wv;
  if constexpr (Chunked) load_weight_chunks(w, d, wv);
  pdl_wait();
  pdl_release();
  __shared__ double s_warp[Threads / 32];
  const float* x = (second ? b : a) + blockIdx.x * d;
  float* yr = y + blockIdx.x * 2 * d + (second ? d : 0);
  if constexpr (Chunked)
    chunked_norm_row<false>(x, nullptr, nullptr, d, wv, zero_centred, eps, vec, yr, s_warp);
  else
    norm_row<Threads>(x, d, w, zero_centred, eps, yr, s_warp);
}

// rms_norm_pair_embedded: rms_norm_pair_kernel with block (t, 0) reading the embedding row of
// ids[t] where it lies in the bf16 table (EmbeddedRow: embed_rows' values), so a draft step's
// embedding needs no launch of its own. vec: 16-byte loads of b and 8-byte loads of the table.
template <int Threads, bool Chunked>
__global__ void __launch_bounds__(Threads)
    rms_norm_pair_embedded_kernel(const uint16_t* table, int64_t vocab, const int32_t* ids,
                                  const float* b, int64_t d, const float* wa, const float* wb,
                                  bool zero_centred, float eps, bool vec, float* y) {
  NormWeightChunks wv;
  if constexpr (Chunked) load_weight_chunks(blockIdx.y == 1 ? wb : wa, d, wv);
  pdl_wait();
  pdl_release();
  __shared__ double s_warp[Threads / 32];
  float* yr = y + blockIdx.x * 2 * d;
  if (blockIdx.y == 1) {
    const float* x = b + blockIdx.x * d;
    if constexpr (Chunked)
      chunked_norm_row<false>(x, nullptr, nullptr, d, wv, zero_centred, eps, vec, yr + d, s_warp);
    else
      norm_row<Threads>(x, d, wb, zero_centred, eps, yr + d, s_warp);
    return;
  }
  const int32_t id = ids[blockIdx.x];
  const bool valid = id >= 0 && id < vocab;
  const EmbeddedRow x{table + (valid ? static_cast<int64_t>(id) * d : 0), valid};
  if constexpr (Chunked)
    chunked_norm_row<false>(x, nullptr, nullptr, d, wv, zero_centred, eps, vec, yr, s_warp);
  else
    norm_row<Threads>(x, d, wa, zero_centred, eps, yr, s_warp);
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// Grid: one block per row of x[m, d]: x += r, then rms_norm_kernel's arithmetic on the sum. Each
// thread adds the elements i = t, t + Threads, ... that row_inv_rms then reads back, so the
// reduction sees the block's own writes without a barrier. y may alias r: r[i] is read before
// the reduction's barrier, y[i] written after it, by the same thread.
template <int Threads>
__global__ void __launch_bounds__(Threads)
    add_rms_norm_kernel(float* x, const float* r, int64_t d, const float* w, bool zero_centred,
                        float eps, float* y) {
  pdl_wait();
  pdl_release();
  __shared__ double s_warp[Threads / 32];
  float* xr = x + blockIdx.x * d;
  const float* rr = r + blockIdx.x * d;
  float* yr = y + blockIdx.x * d;
  for (int64_t i = threadIdx.x; i < d; i += Threads) xr[i] += rr[i];
  const float s = row_inv_rms<Threads>(xr, d, eps, s_warp);
  for (int64_t i = threadIdx.x; i < d; i += Threads) {
    const float wi = w[i];
    yr[i] = normed(xr[i], s, wi, zero_centred);
  }
}

// Grid: one block per row of x, z [m, d]; y may alias x or z (same argument as rms_norm).
// The kernel releases its dependent before it waits (check.cuh): that dependent is the DeltaNet's
// output projection, whose blocks then become resident while the delta rule runs, a kernel that
// leaves the memory bus idle, and issue their first weight loads there.
// The first kGatedHeld elements of a thread (i = t, t + kNormThreads, ...) keep their weight and
// gate in registers: the weight is loaded before the wait (it never changes), the gate right
// after it, together with the reduction's loads, instead of two round trips after the sum.
constexpr int kGatedHeld = 4;
template <class Out = float>
__global__ void __launch_bounds__(kNormThreads)
    gated_rms_norm_kernel(const float* x, const float* z, int64_t d, const float* w, float eps,
                          Out* y) {
  __shared__ double s_warp[kNormThreads / 32];
  const int64_t row = blockIdx.x;
  const float* xr = x + row * d;
  const float* zr = z + row * d;
  Out* yr = y + row * d;
  float wv[kGatedHeld], zv[kGatedHeld];
#pragma unroll
  for (int j = 0; j < kGatedHeld; ++j) {
    const int64_t i = threadIdx.x + j * int64_t(kNormThreads);
    wv[j] = i < d ? w[i] : 0.0f;
  }
  pdl_release();
  pdl_wait();
#pragma unroll
  for (int j = 0; j < kGatedHeld; ++j) {
    const int64_t i = threadIdx.x + j * int64_t(kNormThreads);
    zv[j] = i < d ? zr[i] : 0.0f;
  }
  const float s = row_inv_rms<kNormThreads>(xr, d, eps, s_warp);
#pragma unroll
  for (int j = 0; j < kGatedHeld; ++j) {
    const int64_t i = threadIdx.x + j * int64_t(kNormThreads);
    if (i < d) yr[i] = Out(wv[j] * (xr[i] * s) * silu(zv[j]));
  }
  for (int64_t i = threadIdx.x + kGatedHeld * int64_t(kNormThreads); i < d; i += kNormThreads)
    yr[i] = Out(w[i] * (xr[i] * s) * silu(zr[i]));
}

// Grid: one block per token. table is BF16 [vocab, d]; bf16 → fp32 is exact (a 16-bit shift).
// ids are checked by the caller; an out-of-range id still never reads outside the table: its
// row becomes NaN, which the caller's output checks will surface.
// `from` (may be null): where from[row] >= 0 the id is source[from[row]] (embed_rows_selected).
__global__ void embed_rows_kernel(const uint16_t* __restrict__ table, int64_t vocab, int64_t d,
                                  const int32_t* __restrict__ ids, const int32_t* source,
                                  const int32_t* from, float* __restrict__ out) {
  pdl_wait();
  pdl_release();
  const int64_t row = blockIdx.x;
  const int32_t id = from && from[row] >= 0 ? source[from[row]] : ids[row];
  float* o = out + row * d;
  if (id < 0 || id >= vocab) {
    for (int64_t i = threadIdx.x; i < d; i += blockDim.x) o[i] = __int_as_float(0x7fc00000);
    return;
  }
  const uint16_t* src = table + static_cast<int64_t>(id) * d;
  for (int64_t i = threadIdx.x; i < d; i += blockDim.x)
    o[i] = __uint_as_float(static_cast<uint32_t>(src[i]) << 16);
}

__global__ void swiglu_kernel(const float* gate, const float* up, int64_t n, float* out) {
  pdl_wait();
  pdl_release();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    out[i] = silu(gate[i]) * up[i];
}

__global__ void sigmoid_gate_kernel(float* x, const float* gate, int64_t n) {
  pdl_wait();
  pdl_release();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    x[i] *= sigmoid(gate[i]);
}

__global__ void add_inplace_kernel(float* x, const float* y, int64_t n) {
  pdl_wait();
  pdl_release();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    x[i] += y[i];
}

// The rotation of one rope pair: (a, b) by the angle whose cosine and sine are c, s. Rounded
// products and difference spelled out, so rope_kernel and qk_norm_rope_kernel cannot be
// contracted into different fused multiply-adds.
__device__ __forceinline__ void rotate_pair(float& a, float& b, float c, float s) {
  const float ra = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
  const float rb = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
  a = ra;
  b = rb;
}

// One thread per (token, head, i < half) rotates pair i of the `2 · half` values at `offset` in
// each head of head_stride values: (i, i + half), or (2i, 2i + 1) when interleaved. The pairs are
// disjoint, so the in-place update has one writer per element. The angle is fp32
// float(position) · inv_freq[i], as the CPU (and the reference) compute it.
__global__ void rope_kernel(float* x, int64_t n_tokens, int64_t n_heads, int64_t head_stride,
                            int64_t offset, int64_t half, bool interleaved,
                            const int64_t* positions, const float* inv_freq) {
  pdl_wait();
  pdl_release();
  const int64_t total = n_tokens * n_heads * half;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = idx % half;
    const int64_t token_head = idx / half;  // t * n_heads + h
    const int64_t t = token_head / n_heads;
    const float angle = static_cast<float>(positions[t]) * inv_freq[i];
    const float c = cosf(angle);
    const float s = sinf(angle);
    float* v = x + token_head * head_stride + offset;
    const int64_t ia = interleaved ? 2 * i : i;
    const int64_t ib = interleaved ? 2 * i + 1 : i + half;
    float a = v[ia], b = v[ib];
    rotate_pair(a, b, c, s);
    v[ia] = a;
    v[ib] = b;
  }
}

// Grid: one block per row of x[m, d]. The mean, then the population variance, each summed in
// double over thread-strided elements and block_sum's tree: an order fixed by d alone, so a
// row's values never depend on m. y may alias x (each thread rewrites only what it read, after
// both reductions' barriers).
__global__ void __launch_bounds__(kNormThreads)
    layer_norm_kernel(const float* x, int64_t d, const float* w, const float* b, float eps,
                      float* y) {
  pdl_wait();
  pdl_release();
  __shared__ double s_warp[kNormThreads / 32];
  const float* xr = x + blockIdx.x * d;
  float* yr = y + blockIdx.x * d;
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < d; i += kNormThreads) sum += xr[i];
  const float mean = static_cast<float>(block_sum<kNormThreads>(sum, s_warp) / d);
  __syncthreads();  // s_warp is reused
  double sq = 0.0;
  for (int64_t i = threadIdx.x; i < d; i += kNormThreads) {
    const double c = static_cast<double>(xr[i] - mean);
    sq += c * c;
  }
  const double var = block_sum<kNormThreads>(sq, s_warp) / d;
  const float inv = static_cast<float>(1.0 / sqrt(var + static_cast<double>(eps)));
  for (int64_t i = threadIdx.x; i < d; i += kNormThreads)
    yr[i] = __fadd_rn(__fmul_rn(__fmul_rn(xr[i] - mean, inv), w[i]), b[i]);
}

__global__ void scale_kernel(float* x, int64_t n, float s) {
  pdl_wait();
  pdl_release();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    x[i] *= s;
}

// Grid: one block per (token, head) over T × (n_heads + n_kv_heads): the query heads of a token,
// then its key heads. A block normalises one head vector with rms_norm_kernel<kNormThreads>'s
// arithmetic (row_inv_rms, then (x · s) · scale), stages it in shared memory, and rotates its
// rope pairs with rope_kernel's arithmetic; query blocks also copy the head's gate. k is
// rewritten in place (each block owns its head). Requires head_dim <= kMaxQkHeadDim.
// With a KV target (kv.pool set), a key block also writes its head's key and value rows to the
// token's slot in the paged KV, the values kv_write would store.
constexpr int64_t kMaxQkHeadDim = 512;

// Where qk_norm_rope writes keys and values as well (pool == nullptr: nowhere).
struct KvTarget {
  void* pool;
  bool bf16;  // the pool's storage (else fp32)
  int64_t block_size;
  const int64_t* slots;  // physical slot per token: block · block_size + offset
  const float* v;        // [T, n_kv_heads, head_dim]
};

__global__ void __launch_bounds__(kNormThreads)
    qk_norm_rope_kernel(const float* __restrict__ qg, float* __restrict__ q,
                        float* __restrict__ gate, float* k, int64_t n_heads, int64_t n_kv_heads,
                        int64_t hd, int64_t half, const float* __restrict__ q_norm,
                        const float* __restrict__ k_norm, bool zero_centred, float eps,
                        const int64_t* __restrict__ positions, const float* __restrict__ inv_freq,
                        const KvTarget kv) {
  constexpr int kHeld = kMaxQkHeadDim / kNormThreads;  // elements per thread: i = t + 128·j
  __shared__ double s_warp[kNormThreads / 32];
  __shared__ float y[kMaxQkHeadDim];
  const int64_t per_token = n_heads + n_kv_heads;
  const int64_t t = blockIdx.x / per_token, h = blockIdx.x % per_token;
  const bool is_q = h < n_heads;
  const float* x = is_q ? qg + (t * n_heads + h) * 2 * hd : k + (t * n_kv_heads + h - n_heads) * hd;
  float* out = is_q ? q + (t * n_heads + h) * hd : k + (t * n_kv_heads + h - n_heads) * hd;
  const float* w = is_q ? q_norm : k_norm;
  // Before the wait: the norm weights, the rotation of each pair and the key's KV slot. The
  // weights and inv_freq never change, and positions and slots are uploaded before the
  // forward's first kernel (check.cuh), so after the wait only the projection is read.
  float wv[kHeld], cs[kHeld], sn[kHeld];
  const float pos = static_cast<float>(positions[t]);
#pragma unroll
  for (int j = 0; j < kHeld; ++j) {
    const int64_t i = threadIdx.x + j * int64_t(kNormThreads);
    wv[j] = i < hd ? w[i] : 0.0f;
    const float angle = i < half ? pos * inv_freq[i] : 0.0f;
    cs[j] = cosf(angle);
    sn[j] = sinf(angle);
  }
  // A key block's rows in the paged KV (null: none).
  // kd, vd: element offsets of the key and value head rows in kv.pool (-1: none).
  int64_t kd = -1, vd = -1;
  const float* vs = nullptr;
  if (!is_q && kv.pool) {
    const int64_t slot = kv.slots[t];
    if (slot >= 0) {
      const int64_t j = h - n_heads, row = n_kv_heads * hd;
      kd = ((slot / kv.block_size) * 2 * kv.block_size + slot % kv.block_size) * row + j * hd;
      vd = kd + kv.block_size * row;
      vs = kv.v + (t * n_kv_heads + j) * hd;
    }
  }
  pdl_wait();
  pdl_release();
  const float s = row_inv_rms<kNormThreads>(x, hd, eps, s_warp);
#pragma unroll
  for (int j = 0; j < kHeld; ++j) {
    const int64_t i = threadIdx.x + j * int64_t(kNormThreads);
    if (i < hd) y[i] = normed(x[i], s, wv[j], zero_centred);
  }
  if (is_q) {
    float* g = gate + (t * n_heads + h) * hd;
    for (int64_t i = threadIdx.x; i < hd; i += kNormThreads) g[i] = x[hd + i];
  }
  __syncthreads();  // y complete; every read of x (which may be k itself) is done
#pragma unroll
  for (int j = 0; j < kHeld; ++j) {
    const int64_t i = threadIdx.x + j * int64_t(kNormThreads);
    if (i >= hd) break;
    if (i < half) {
      float a = y[i], b = y[i + half];
      rotate_pair(a, b, cs[j], sn[j]);
      out[i] = a;
      out[i + half] = b;
      if (kd >= 0) {
        store_kv(kv.pool, kd + i, a, kv.bf16);
        store_kv(kv.pool, kd + i + half, b, kv.bf16);
      }
    } else if (i >= 2 * half) {
      out[i] = y[i];
      if (kd >= 0) store_kv(kv.pool, kd + i, y[i], kv.bf16);
    }
    if (vd >= 0) store_kv(kv.pool, vd + i, vs[i], kv.bf16);
  }
}

}  // namespace

void embed_rows_selected(const ops::WeightRef& table, const int32_t* ids, const int32_t* source,
                         const int32_t* from, int64_t n, float* out) {
  if (table.dtype != DType::BF16)
    fail("embed_rows: the table must be BF16 on the CUDA backend, got ", dtype_name(table.dtype));
  if (n < 0) fail("embed_rows: negative token count ", n);
  if (n == 0 || table.cols == 0) return;
  if (reinterpret_cast<uintptr_t>(table.data) % alignof(uint16_t) != 0)
    fail("embed_rows: the table is not 2-byte aligned");
  launch("embed_rows", embed_rows_kernel, grid_blocks(n, "embed_rows"), kEmbedThreads, 0,
         static_cast<const uint16_t*>(table.data), table.rows, table.cols, ids, source, from, out);
}

void embed_rows(const ops::WeightRef& table, const int32_t* ids, int64_t n, float* out) {
  cuda::embed_rows_selected(table, ids, nullptr, nullptr, n, out);
}

namespace {

// rms_norm into Out (float, or __nv_bfloat16 for rms_norm_bf16): one kernel per norm_order
// (row_norm.cuh), each with that order's virtual threads, so both outputs carry the same values.
template <class Out>
void launch_rms_norm(const char* op, const float* x, int64_t m, int64_t d, const ops::WeightRef& w,
                     bool zero_centred, float eps, Out* y) {
  check_f32_vector(w, d, op, "weight");
  if (m < 0 || d < 0) fail(op, ": negative shape ", m, " x ", d);
  if (m == 0 || d == 0) return;
  const auto* wp = static_cast<const float*>(w.data);
  const NormOrder order = norm_order(d);
  // 16-byte loads of x, and stores of 4 outputs at once (16 bytes of float, 8 of bf16).
  const bool vec =
      d % 4 == 0 && aligned16(x) && reinterpret_cast<uintptr_t>(y) % (4 * sizeof(Out)) == 0;
  if (order == NormOrder::Chunked)
    launch(op, row_norm_kernel<false, Out>, grid_blocks(m, op), kWideNormThreads, 0, x, nullptr,
           nullptr, d, wp, zero_centred, eps, vec, y);
  else if (order == NormOrder::Wide)
    launch(op, rms_norm_kernel<kWideNormThreads, Out>, grid_blocks(m, op), kWideNormThreads, 0, x,
           d, wp, zero_centred, eps, y);
  else
    launch(op, rms_norm_kernel<kNormThreads, Out>, grid_blocks(m, op), kNormThreads, 0, x, d, wp,
           zero_centred, eps, y);
}

}  // namespace

void rms_norm(const float* x, int64_t m, int64_t d, const ops::WeightRef& w, bool zero_centred,
              float eps, float* y) {
  launch_rms_norm("rms_norm", x, m, d, w, zero_centred, eps, y);
}

void rms_norm_bf16(const float* x, int64_t m, int64_t d, const ops::WeightRef& w, bool zero_centred,
                   float eps, uint16_t* y) {
  launch_rms_norm("rms_norm_bf16", x, m, d, w, zero_centred, eps,
                  reinterpret_cast<__nv_bfloat16*>(y));
}

void rms_norm_pair(const float* a, const float* b, int64_t m, int64_t d, const ops::WeightRef& wa,
                   const ops::WeightRef& wb, bool zero_centred, float eps, float* y) {
  check_f32_vector(wa, d, "rms_norm_pair", "first weight");
  check_f32_vector(wb, d, "rms_norm_pair", "second weight");
  if (m < 0 || d < 0) fail("rms_norm_pair: negative shape ", m, " x ", d);
  if (m == 0 || d == 0) return;
  const auto *pa = static_cast<const float*>(wa.data), *pb = static_cast<const float*>(wb.data);
  const dim3 grid(grid_blocks(m, "rms_norm_pair"), 2);
  const NormOrder order = norm_order(d);
  if (order == NormOrder::Chunked)
    launch("rms_norm_pair", rms_norm_pair_kernel<kWideNormThreads, true>, grid, kWideNormThreads, 0,
           a, b, d, pa, pb, zero_centred, eps,
           d % 4 == 0 && aligned16(a) && aligned16(b) && aligned16(y), y);
  else if (order == NormOrder::Wide)
    launch("rms_norm_pair", rms_norm_pair_kernel<kWideNormThreads, false>, grid, kWideNormThreads,
           0, a, b, d, pa, pb, zero_centred, eps, false, y);
  else
    launch("rms_norm_pair", rms_norm_pair_kernel<kNormThreads, false>, grid, kNormThreads, 0, a, b,
           d, pa, pb, zero_centred, eps, false, y);
}

void rms_norm_pair_embedded(const ops::WeightRef& table, const int32_t* ids, const float* b,
                            int64_t m, const ops::WeightRef& wa, const ops::WeightRef& wb,
                            bool zero_centred, float eps, float* y) {
  if (table.dtype != DType::BF16)
    fail("rms_norm_pair_embedded: the table must be BF16 on the CUDA backend, got ",
         dtype_name(table.dtype));
  const int64_t d = table.cols;
  check_f32_vector(wa, d, "rms_norm_pair_embedded", "first weight");
  check_f32_vector(wb, d, "rms_norm_pair_embedded", "second weight");
  if (m < 0) fail("rms_norm_pair_embedded: negative row count ", m);
  if (m == 0 || d == 0) return;
  const auto *pa = static_cast<const float*>(wa.data), *pb = static_cast<const float*>(wb.data);
  const auto* tp = static_cast<const uint16_t*>(table.data);
  const dim3 grid(grid_blocks(m, "rms_norm_pair_embedded"), 2);
  const NormOrder order = norm_order(d);
  if (order == NormOrder::Chunked)
    launch("rms_norm_pair_embedded", rms_norm_pair_embedded_kernel<kWideNormThreads, true>, grid,
           kWideNormThreads, 0, tp, table.rows, ids, b, d, pa, pb, zero_centred, eps,
           d % 4 == 0 && aligned16(b) && aligned16(y) && reinterpret_cast<uintptr_t>(tp) % 8 == 0,
           y);
  else if (order == NormOrder::Wide)
    launch("rms_norm_pair_embedded", rms_norm_pair_embedded_kernel<kWideNormThreads, false>, grid,
           kWideNormThreads, 0, tp, table.rows, ids, b, d, pa, pb, zero_centred, eps, false, y);
  else
    launch("rms_norm_pair_embedded", rms_norm_pair_embedded_kernel<kNormThreads, false>, grid,
           kNormThreads, 0, tp, table.rows, ids, b, d, pa, pb, zero_centred, eps, false, y);
}

void add_rms_norm(float* x, const float* r, int64_t m, int64_t d, const ops::WeightRef& w,
                  bool zero_centred, float eps, float* y) {
  check_f32_vector(w, d, "add_rms_norm", "weight");
  if (m < 0 || d < 0) fail("add_rms_norm: negative shape ", m, " x ", d);
  if (y == x) fail("add_rms_norm: the output must not alias the residual stream x");
  if (m == 0 || d == 0) return;
  const auto* wp = static_cast<const float*>(w.data);
  // The same kernels as rms_norm for this d, hence the same reduction order.
  const NormOrder order = norm_order(d);
  if (order == NormOrder::Chunked)
    launch("add_rms_norm", row_norm_kernel<true>, grid_blocks(m, "add_rms_norm"), kWideNormThreads,
           0, x, r, x, d, wp, zero_centred, eps,
           d % 4 == 0 && aligned16(x) && aligned16(r) && aligned16(y), y);
  else if (order == NormOrder::Wide)
    launch("add_rms_norm", add_rms_norm_kernel<kWideNormThreads>, grid_blocks(m, "add_rms_norm"),
           kWideNormThreads, 0, x, r, d, wp, zero_centred, eps, y);
  else
    launch("add_rms_norm", add_rms_norm_kernel<kNormThreads>, grid_blocks(m, "add_rms_norm"),
           kNormThreads, 0, x, r, d, wp, zero_centred, eps, y);
}

void gated_rms_norm(const float* x, const float* z, int64_t m, int64_t d, const ops::WeightRef& w,
                    float eps, float* y) {
  check_f32_vector(w, d, "gated_rms_norm", "weight");
  if (m < 0 || d < 0) fail("gated_rms_norm: negative shape ", m, " x ", d);
  if (m == 0 || d == 0) return;
  launch("gated_rms_norm", gated_rms_norm_kernel<float>, grid_blocks(m, "gated_rms_norm"),
         kNormThreads, 0, x, z, d, static_cast<const float*>(w.data), eps, y);
}

void gated_rms_norm_bf16(const float* x, const float* z, int64_t m, int64_t d,
                         const ops::WeightRef& w, float eps, uint16_t* y) {
  check_f32_vector(w, d, "gated_rms_norm_bf16", "weight");
  if (m < 0 || d < 0) fail("gated_rms_norm_bf16: negative shape ", m, " x ", d);
  if (m == 0 || d == 0) return;
  launch("gated_rms_norm_bf16", gated_rms_norm_kernel<__nv_bfloat16>,
         grid_blocks(m, "gated_rms_norm_bf16"), kNormThreads, 0, x, z, d,
         static_cast<const float*>(w.data), eps, reinterpret_cast<__nv_bfloat16*>(y));
}

void swiglu(const float* gate, const float* up, int64_t n, float* out) {
  if (n <= 0) return;
  launch("swiglu", swiglu_kernel, grid_stride_blocks(n, kThreads), kThreads, 0, gate, up, n, out);
}

void sigmoid_gate(float* x, const float* gate, int64_t n) {
  if (n <= 0) return;
  launch("sigmoid_gate", sigmoid_gate_kernel, grid_stride_blocks(n, kThreads), kThreads, 0, x, gate,
         n);
}

void add_inplace(float* x, const float* y, int64_t n) {
  if (n <= 0) return;
  launch("add_inplace", add_inplace_kernel, grid_stride_blocks(n, kThreads), kThreads, 0, x, y, n);
}

void qk_norm_rope(const ops::QkNormRope& s, const float* qg, const ops::WeightRef& q_norm,
                  const ops::WeightRef& k_norm, const int64_t* positions, const float* inv_freq,
                  float* q, float* gate, float* k) {
  check_f32_vector(q_norm, s.head_dim, "qk_norm_rope", "q_norm");
  check_f32_vector(k_norm, s.head_dim, "qk_norm_rope", "k_norm");
  if (s.head_dim > kMaxQkHeadDim || s.head_dim >= kWideNormMinDim)
    fail("qk_norm_rope: head_dim ", s.head_dim, " exceeds the CUDA kernel's ", kMaxQkHeadDim);
  const int64_t blocks = s.n_tokens * (s.n_heads + s.n_kv_heads);
  if (blocks == 0) return;
  const KvTarget kv =
      s.kv ? KvTarget{s.kv->pool, s.kv->dtype == DType::BF16, s.kv->block_size, s.kv_slots, s.v}
           : KvTarget{nullptr, false, 0, nullptr, nullptr};
  launch("qk_norm_rope", qk_norm_rope_kernel, grid_blocks(blocks, "qk_norm_rope"), kNormThreads, 0,
         qg, q, gate, k, s.n_heads, s.n_kv_heads, s.head_dim, s.rotary_dim / 2,
         static_cast<const float*>(q_norm.data), static_cast<const float*>(k_norm.data),
         s.zero_centred, s.eps, positions, inv_freq, kv);
}

void rope_slice(float* x, int64_t n_tokens, int64_t n_heads, int64_t head_stride, int64_t offset,
                int64_t dim, const int64_t* positions, const float* inv_freq, bool interleaved) {
  if (dim < 0 || dim % 2 != 0 || offset < 0 || offset + dim > head_stride)
    fail("rope_slice: ", dim, " values at ", offset, " must be even and within heads of ",
         head_stride);
  if (n_tokens < 0 || n_heads < 0) fail("rope_slice: negative shape ", n_tokens, " x ", n_heads);
  const int64_t half = dim / 2;
  const int64_t total = n_tokens * n_heads * half;
  if (total == 0) return;
  launch("rope_slice", rope_kernel, grid_stride_blocks(total, kThreads), kThreads, 0, x, n_tokens,
         n_heads, head_stride, offset, half, interleaved, positions, inv_freq);
}

void rope(float* x, int64_t n_tokens, int64_t n_heads, int64_t head_dim, int64_t rotary_dim,
          const int64_t* positions, const float* inv_freq) {
  if (rotary_dim < 0 || rotary_dim % 2 != 0 || rotary_dim > head_dim)
    fail("rope: rotary_dim ", rotary_dim, " must be even and within head_dim ", head_dim);
  rope_slice(x, n_tokens, n_heads, head_dim, 0, rotary_dim, positions, inv_freq, false);
}

void layer_norm(const float* x, int64_t m, int64_t d, const ops::WeightRef& w,
                const ops::WeightRef& b, float eps, float* y) {
  check_f32_vector(w, d, "layer_norm", "weight");
  check_f32_vector(b, d, "layer_norm", "bias");
  if (m < 0 || d < 0) fail("layer_norm: negative shape ", m, " x ", d);
  if (m == 0 || d == 0) return;
  launch("layer_norm", layer_norm_kernel, grid_blocks(m, "layer_norm"), kNormThreads, 0, x, d,
         static_cast<const float*>(w.data), static_cast<const float*>(b.data), eps, y);
}

void scale(float* x, int64_t n, float s) {
  if (n < 0) fail("scale: negative size ", n);
  if (n == 0) return;
  launch("scale", scale_kernel, grid_stride_blocks(n, kThreads), kThreads, 0, x, n, s);
}

TANDEM_CUDA_TRACE_UNIT(elementwise)

}  // namespace tandem::cuda
