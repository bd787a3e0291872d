// The arithmetic of a row's RMSNorm on the GPU (internal: included by .cu files only). One
// definition, so the norm kernels (elementwise.cu) and a projection that normalises its own input
// rows (linear.cu's prologue) compute bit for bit the same values.
//
// The reduction order of a row of d floats is fixed by d alone (norm_order): VT virtual threads,
// virtual thread v summing, in double, the squares of the elements of its CW-wide chunks
// c = v, v + VT, v + 2·VT, ... (chunk by chunk, element by element); then block_sum's tree over the
// VT partials. Any block size that divides VT (or is larger, leaving threads idle) can compute it,
// so the order never depends on the kernel that happens to normalise the row.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace tandem::cuda {

constexpr int kNormThreads = 128;      // rows below kWideNormMinDim
constexpr int kWideNormThreads = 512;  // rows of kWideNormMinDim or more (hidden-size norms)
constexpr int64_t kWideNormMinDim = 2048;
constexpr int kRowVec = 4;  // 4-float chunks a virtual thread of a hidden-size row sums
constexpr int64_t kRowNormMaxDim = int64_t(kWideNormThreads) * 4 * kRowVec;  // 8192

// The order of a row of d floats: VT virtual threads summing CW-wide chunks.
enum class NormOrder {
  Narrow,   // VT = kNormThreads, CW = 1: d < kWideNormMinDim
  Chunked,  // VT = kWideNormThreads, CW = 4 (at most kRowVec chunks each): hidden-size rows
  Wide,     // VT = kWideNormThreads, CW = 1: d > kRowNormMaxDim
};

__host__ __device__ inline NormOrder norm_order(int64_t d) {
  if (d < kWideNormMinDim) return NormOrder::Narrow;
  return d <= kRowNormMaxDim ? NormOrder::Chunked : NormOrder::Wide;
}

// A butterfly over the lanes of a warp: every lane ends with the same bits (a + b == b + a).
__device__ inline double warp_sum(double v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sum over a block of Threads threads, returned to every thread: warp_sum inside each warp, then
// the warp totals added in warp order. s_warp must not be in use.
template <int Threads>
__device__ inline double block_sum(double v, double* s_warp) {
  v = warp_sum(v);
  if (threadIdx.x % 32 == 0) s_warp[threadIdx.x / 32] = v;
  __syncthreads();
  double total = 0.0;
  for (int w = 0; w < Threads / 32; ++w) total += s_warp[w];
  return total;
}

// 1 / sqrt(mean(x²) + eps) of a row of d elements from its sum of squares ss (cpu::inv_rms's
// expression).
__device__ inline float inv_rms_from_sum(double ss, int64_t d, float eps) {
  return static_cast<float>(1.0 / sqrt(ss / static_cast<double>(d) + static_cast<double>(eps)));
}

// One normalised element: (x · s) · scale, scale = 1 + w (zero-centred) or w, as cpu::rms_norm.
__device__ inline float normed(float x, float s, float w, bool zero_centred) {
  return (x * s) * (zero_centred ? 1.0f + w : w);
}

// The virtual-warp totals of row x[d] in norm order (VT, CW), computed by the Threads threads of
// a block: thread t plays virtual threads t, t + Threads, ... (threads past VT idle). Writes
// s_warp[0 .. VT/32); the row's sum of squares is their sum in index order (row_square_total),
// readable after a barrier. CW == 4 needs x 16-byte aligned and d a multiple of 4, and covers
// at most kRowVec chunks per virtual thread (d <= VT · 4 · kRowVec); its loads are all issued
// before any is used, as a latency-bound single row wants.
template <int Threads, int VT, int CW>
__device__ inline void row_square_partials(const float* x, int64_t d, double* s_warp) {
  static_assert(Threads % 32 == 0 && VT % 32 == 0, "whole warps");
  constexpr int kPer = VT >= Threads ? VT / Threads : 1;
#pragma unroll
  for (int q = 0; q < kPer; ++q) {
    const int v = static_cast<int>(threadIdx.x) + q * Threads;
    if (v >= VT) break;  // uniform per warp: VT and Threads are whole warps
    double ss = 0.0;
    if constexpr (CW == 4) {
      float4 f[kRowVec];
#pragma unroll
      for (int j = 0; j < kRowVec; ++j) {
        const int64_t i = 4 * (v + int64_t(j) * VT);
        f[j] = i < d ? *reinterpret_cast<const float4*>(x + i) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int j = 0; j < kRowVec; ++j) {
        ss += static_cast<double>(f[j].x) * f[j].x;
        ss += static_cast<double>(f[j].y) * f[j].y;
        ss += static_cast<double>(f[j].z) * f[j].z;
        ss += static_cast<double>(f[j].w) * f[j].w;
      }
    } else {
      for (int64_t i = v; i < d; i += VT) ss += static_cast<double>(x[i]) * x[i];
    }
    ss = warp_sum(ss);
    if (threadIdx.x % 32 == 0) s_warp[v / 32] = ss;
  }
}

// The Chunked order held in registers by a group of kNormGroup threads (a latency-bound row):
// group thread t holds the row's 4-float chunks t + kNormGroup·k (k < NC), zeros past the row.
// Those are exactly the chunks of virtual threads t + kNormGroup·q (q < 4): chunk
// t + kNormGroup·(q + 4j) is virtual thread t + kNormGroup·q's j-th. So the four partial sums
// below, each over its j in order, then warp_sum, are the very terms block_sum<kWideNormThreads>
// adds. Writes the kWideNormThreads / 32 virtual-warp totals to s_warp (the group's warps each
// write their four); the row's sum is row_square_total<kWideNormThreads> after a barrier.
constexpr int kNormGroup = 128;

template <int NC>
__device__ inline void chunked_square_partials(const float4 (&xv)[NC], int t, double* s_warp) {
  constexpr int kVirtual = kWideNormThreads / kNormGroup;  // virtual threads per group thread
  static_assert(NC % kVirtual == 0, "whole chunk rounds");
  double ss[kVirtual];
#pragma unroll
  for (int q = 0; q < kVirtual; ++q) {
    ss[q] = 0.0;
#pragma unroll
    for (int j = 0; j < NC / kVirtual; ++j) {
      const float4 f = xv[q + kVirtual * j];
      ss[q] += static_cast<double>(f.x) * f.x;
      ss[q] += static_cast<double>(f.y) * f.y;
      ss[q] += static_cast<double>(f.z) * f.z;
      ss[q] += static_cast<double>(f.w) * f.w;
    }
  }
#pragma unroll
  for (int q = 0; q < kVirtual; ++q) ss[q] = warp_sum(ss[q]);
  if (t % 32 == 0) {
#pragma unroll
    for (int q = 0; q < kVirtual; ++q) s_warp[(t + kNormGroup * q) / 32] = ss[q];
  }
}

template <int VT>
__device__ inline double row_square_total(const double* s_warp) {
  double total = 0.0;
  for (int w = 0; w < VT / 32; ++w) total += s_warp[w];
  return total;
}

// One row normalised from registers by the block's first kNormGroup threads (the only ones that
// may call it): each loads its NC chunks of x (t + kNormGroup·k, chunked_square_partials' order),
// the group meets at named barrier `Barrier` for the row's sum, and emit(c, normed chunk c) takes
// each of the thread's chunks inside the row, rms_norm's values. wv: the thread's chunks of the
// norm weight, loaded before the kernel waits (zeros past the row).
template <int NC, int Barrier, class Emit>
__device__ __forceinline__ void normalise_chunked_row(const float* x, int K, const float4* wv,
                                                      float eps, bool zero_centred, double* s_warp,
                                                      Emit&& emit) {
  const int t = threadIdx.x, per_row = K / 4;
  const float4* x4 = reinterpret_cast<const float4*>(x);
  const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
  float4 xv[NC];
#pragma unroll
  for (int k = 0; k < NC; ++k) {
    const int c = t + kNormGroup * k;
    xv[k] = c < per_row ? x4[c] : zero;
  }
  chunked_square_partials<NC>(xv, t, s_warp);
  static_assert(kNormGroup == 128, "the barrier's thread count below");
  asm volatile("bar.sync %0, 128;" ::"n"(Barrier) : "memory");
  const float s = inv_rms_from_sum(row_square_total<kWideNormThreads>(s_warp), K, eps);
#pragma unroll
  for (int k = 0; k < NC; ++k) {
    const int c = t + kNormGroup * k;
    if (c >= per_row) break;
    const float4 v = xv[k], w = wv[k];
    emit(c, make_float4(normed(v.x, s, w.x, zero_centred), normed(v.y, s, w.y, zero_centred),
                        normed(v.z, s, w.z, zero_centred), normed(v.w, s, w.w, zero_centred)));
  }
}

}  // namespace tandem::cuda
