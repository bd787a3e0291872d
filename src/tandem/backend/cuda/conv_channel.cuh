// One channel of the Gated DeltaNet's depthwise causal conv (+ SiLU), shared by the conv kernels
// (recurrent.cu) and the projection that runs the conv after its product (ConvFold below, in
// linear.cu's register kernel): one definition of the arithmetic, so the fold computes bit for
// bit what the conv kernel computes (internal: included by .cu files only).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "tandem/backend/cuda/activation.cuh"
#include "tandem/backend/ops.h"

namespace tandem::cuda {

// Both launch paths of recurrent.cu run one row's channel through ConvChannel; only where the row's
// pointers and n come from differs (kernel arguments, or a device descriptor in the batched
// kernel), so a row's bits cannot depend on which path ran it or on the other rows of a call.

// One thread per channel (grid over channels); it walks the n tokens in order with the last
// K-1 inputs in registers (win, oldest first), like cpu::causal_conv_silu's state. A thread
// reads x[t, c] before writing out[t, c] and touches only channel c, so out may alias x.
//   acc = Σ_{j<K-1} w[c, j] · win[j] + w[c, K-1] · x[t, c],  out = silu(acc)
// load() takes the channel's taps and state; the kernels call it before they wait on the
// previous kernel (check.cuh's rule: the weight never changes, and only this layer's conv writes
// the state, one forward earlier), so only the inputs x are read after the wait. run() then
// walks the tokens; x and out point at the row's first token, state and state_after are the
// row's own.
template <int K>
struct ConvChannel {
  static constexpr int H = K - 1;  // history length
  float wc[K];
  float win[H > 0 ? H : 1];

  __device__ __forceinline__ void load(const float* w, const float* state, int64_t c) {
#pragma unroll
    for (int j = 0; j < K; ++j) wc[j] = w[c * K + j];
#pragma unroll
    for (int j = 0; j < H; ++j) win[j] = state[c * H + j];
  }

  // Moves the window to the K-1 inputs before token `begin` (begin >= K-1: all of them in x),
  // for a block that starts a row's tokens part way (causal_conv_silu_rows' token chunks).
  __device__ __forceinline__ void seek(const float* x, int64_t begin, int64_t channels, int64_t c) {
#pragma unroll
    for (int j = 0; j < H; ++j) win[j] = x[(begin - H + j) * channels + c];
  }

  // The window as it stands after token `settled` - 1 of run()'s tokens (registers), for a row
  // whose state keeps fewer tokens than it runs; run() copies it without a store in its loop, so
  // the later tokens' loads still issue early.
  float settled_win[H > 0 ? H : 1];

  // One token: silu of the taps over the window and xt, the window then moved on by xt.
  __device__ __forceinline__ float step(float xt) {
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < H; ++j) acc = fmaf(wc[j], win[j], acc);
    acc = fmaf(wc[H], xt, acc);
    if constexpr (H > 0) {
#pragma unroll
      for (int j = 0; j + 1 < H; ++j) win[j] = win[j + 1];
      win[H - 1] = xt;
    }
    return silu(acc);
  }

  // Tokens begin .. end-1 of the row; the window must hold the inputs before `begin`. With
  // settled in (begin, end], settled_win gets the window after token settled - 1.
  __device__ __forceinline__ void run(const float* x, int64_t begin, int64_t end, int64_t channels,
                                      int64_t c, float* out, float* state_after,
                                      int64_t settled = -1) {
    // Unrolled so later tokens' x loads issue early; every copy runs the same fmaf sequence.
#pragma unroll 4
    for (int64_t t = begin; t < end; ++t) {
      out[t * channels + c] = step(x[t * channels + c]);
      if (t + 1 == settled) {
#pragma unroll
        for (int j = 0; j < H; ++j) settled_win[j] = win[j];
      }
      if (state_after != nullptr) {
        float* dst = state_after + (t * channels + c) * H;
#pragma unroll
        for (int j = 0; j < H; ++j) dst[j] = win[j];
      }
    }
  }

  __device__ __forceinline__ void store(float* state, int64_t c) const {
#pragma unroll
    for (int j = 0; j < H; ++j) state[c * H + j] = win[j];
  }
  __device__ __forceinline__ void store_settled(float* state, int64_t c) const {
#pragma unroll
    for (int j = 0; j < H; ++j) state[c * H + j] = settled_win[j];
  }
};

// The conv taps the fold takes (Qwen3.5's linear_conv_kernel_dim); other tap counts run the conv
// kernel after the projection.
constexpr int kFoldedConvTaps = 4;

// A DeltaNet's conv over a projection's first output slice (its q|k|v columns), run by the
// register kernel (linear.cu) on the columns each block stored, after the block's last column
// group: what causal_conv_silu_rows computes on those columns, for calls whose rows hold one
// token each, row r of the descriptors being token r (the host checks as many rows as tokens, at
// most one token a row). Each (token, channel) is one thread's, as in the conv kernel, so it reads
// and writes that channel's window alone. x is the stored slice [m, channels]; out == nullptr:
// no conv.
struct ConvFold {
  const float* w;                 // [channels, kFoldedConvTaps]
  const ops::RecurrentRow* rows;  // [m] device descriptors, as causal_conv_silu_rows reads them
  const float* x;                 // [m, channels] the product's first slice
  float* out;                     // [m, channels] the conv's output
  int channels;

  // Before the kernel waits on its inputs (check.cuh's rule: the descriptors were uploaded before
  // the forward, the taps never change and only this layer's conv writes its state, one forward
  // earlier): L1 fetches of the taps and the windows of columns c0 .. c1-1 of rows 0 .. m-1, so
  // that the pass after the product finds them on the SM. Thread r reads row r's descriptor for
  // its state's address (r < m < the block's threads; thread m fetches the taps).
  __device__ __forceinline__ void prefetch(int m, int c0, int c1) const {
    c1 = c1 < channels ? c1 : channels;
    if (c0 >= c1) return;
    constexpr int K = kFoldedConvTaps, H = K - 1;
    const int t = static_cast<int>(threadIdx.x);
    auto fetch = [](const float* begin, const float* end) {
      for (const char* p = reinterpret_cast<const char*>(begin);
           p < reinterpret_cast<const char*>(end); p += 128)
        asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
      asm volatile("prefetch.global.L1 [%0];" ::"l"(end - 1));
    };
    if (t < m) {
      const float* state = rows[t].conv_state;
      fetch(state + static_cast<int64_t>(c0) * H, state + static_cast<int64_t>(c1) * H);
    } else if (t == m) {
      fetch(w + static_cast<int64_t>(c0) * K, w + static_cast<int64_t>(c1) * K);
    }
  }

  // Token r, channel c: its conv output, its window after the token (conv_after, when the row
  // keeps one) and, when the row settles its token, the state.
  __device__ __forceinline__ void apply(int r, int c) const {
    const ops::RecurrentRow row = rows[r];
    if (row.n != 1 || row.first_token != r) return;  // (never, by the host's check)
    constexpr int H = kFoldedConvTaps - 1;
    ConvChannel<kFoldedConvTaps> ch;
    ch.load(w, row.conv_state, c);
    const int64_t i = static_cast<int64_t>(r) * channels + c;
    out[i] = ch.step(x[i]);
    if (row.conv_after != nullptr) {
#pragma unroll
      for (int j = 0; j < H; ++j) row.conv_after[static_cast<int64_t>(c) * H + j] = ch.win[j];
    }
    if (ops::settled_tokens(row) > 0) ch.store(row.conv_state, c);
  }

  // Columns c0 .. c1-1 of rows 0 .. m-1, over the block's threads. The block's stores of them
  // must be visible to its threads (a barrier first).
  __device__ __forceinline__ void run(int m, int c0, int c1) const {
    c1 = c1 < channels ? c1 : channels;
    const int width = c1 - c0;
    for (int i = static_cast<int>(threadIdx.x); i < m * width; i += static_cast<int>(blockDim.x))
      apply(i / width, c0 + i % width);
  }
};

}  // namespace tandem::cuda
