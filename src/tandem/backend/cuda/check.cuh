// Error checks and launch helpers shared by the CUDA backend's .cu files (internal: included by
// nvcc-compiled files only).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "tandem/backend/cuda/cuda_ops.h"
#include "tandem/core/error.h"

// Evaluates a CUDA runtime call once; on failure throws tandem::Error with file:line, the call
// and CUDA's description of the error.
#define TANDEM_CUDA_CHECK(expr)                                  \
  do {                                                           \
    const cudaError_t tandem_cuda_err_ = (expr);                 \
    if (tandem_cuda_err_ != cudaSuccess)                         \
      ::tandem::fail(__FILE__, ":", __LINE__, ": ", #expr, ": ", \
                     cudaGetErrorString(tandem_cuda_err_));      \
  } while (0)

namespace tandem::cuda {

// Called right after a kernel launch: reports a bad launch configuration at once, and any
// earlier asynchronous kernel fault (sticky) no later than the next op.
inline void check_launch(const char* op) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) fail("CUDA launch failed in ", op, ": ", cudaGetErrorString(err));
}

inline cudaStream_t op_stream() {
  return static_cast<cudaStream_t>(stream());
}

inline int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Blocks for a grid-stride loop over `n` elements: enough to fill an H200 (132 SMs) several
// times over; larger n is covered by the loop, so the count stays far below gridDim.x's limit.
inline unsigned grid_stride_blocks(int64_t n, int threads) {
  constexpr int64_t kMaxBlocks = 132 * 32;
  const int64_t blocks = ceil_div(n, threads);
  return static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

// A one-block-per-item grid dimension; throws rather than launch a truncated grid.
inline unsigned grid_blocks(int64_t blocks, const char* op) {
  if (blocks > 0x7fffffff) fail(op, ": ", blocks, " blocks exceed the CUDA grid limit");
  return static_cast<unsigned>(blocks);
}

// Device fp32 vector weights (norm scales, A_log, dt_bias, conv taps): F32, `count` elements,
// 4-byte aligned so kernels can read them as float.
inline void check_f32_vector(const ops::WeightRef& w, int64_t count, const char* op,
                             const char* what) {
  if (w.dtype != DType::F32)
    fail(op, ": ", what, " must be F32 on the CUDA backend, got ", dtype_name(w.dtype));
  if (w.rows * w.cols != count)
    fail(op, ": ", what, " has ", w.rows * w.cols, " elements, expected ", count);
  if (reinterpret_cast<uintptr_t>(w.data) % alignof(float) != 0)
    fail(op, ": ", what, " is not 4-byte aligned");
}

}  // namespace tandem::cuda
