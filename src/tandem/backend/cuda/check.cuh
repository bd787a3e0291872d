// Error checks and launch helpers shared by the CUDA backend's .cu files (internal: included by
// nvcc-compiled files only).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "tandem/backend/cuda/context.cuh"
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

#include "tandem/backend/cuda/trace.cuh"

namespace tandem::cuda {

// Called right after a kernel launch: reports a bad launch configuration at once, and any
// earlier asynchronous kernel fault (sticky) no later than the next op.
inline void check_launch(const char* op) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) fail("CUDA launch failed in ", op, ": ", cudaGetErrorString(err));
}

inline cudaStream_t op_stream() {
  return current().stream();
}

// --- Programmatic dependent launch (PDL, sm_90) --------------------------------------------------
// Every kernel is launched through launch(), which (when pdl_enabled(), the default outside
// prompt prefill) lets it start while the kernel before it on the stream is still running: its
// blocks fill multiprocessors as the earlier grid drains. The invariant that makes this safe: a
// kernel calls pdl_wait() before it reads anything an earlier kernel wrote or writes anything an
// earlier kernel reads. Only data no kernel of the running forward writes may be touched before
// it: weights, the metadata uploaded before the forward's first kernel (positions, block tables,
// state descriptors; a copy that is not a kernel fully serializes what follows it), state a
// kernel itself last wrote one forward earlier (the delta rule's recurrent state), and what a
// kernel at least two launches back wrote where the kernel just before releases only after its
// own wait (moe_token_down_kernel routes from the router's logits so: see below why that kernel
// has completed).
// pdl_wait() returns once the kernel before it has completed and its writes are visible; that
// kernel waited on its own predecessor before completing, so every earlier kernel has.
// pdl_release() lets the next kernel be scheduled. Kernels call it right after pdl_wait(), so at
// most two grids overlap; the gated norm calls it first (elementwise.cu), so the projection after
// it can start during the delta rule. Only there: a norm kernel that released first between two
// projections let the second one's blocks in beside the first and slowed a 4-token verify window
// from 5.15 to 5.70 ms (BENCHMARKS.md). Without PDL (TANDEM_CUDA_PDL=0, prompt prefill, or an
// earlier op that is not a kernel) both are no-ops and launches serialize as usual.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
#if TANDEM_CUDA_TRACE
  trace_mark();
#endif
}

__device__ __forceinline__ void pdl_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Launches kernel<<<grid, block, smem, op_stream()>>>(args...) with the launch attributes
// attrs[0, n); `op` names the op in a launch error.
template <class... Params, class... Args>
void launch_with(const char* op, const cudaLaunchAttribute* attrs, unsigned n,
                 void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, Args&&... args) {
#if TANDEM_CUDA_TRACE
  trace_register_dump();
#endif
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = op_stream();
  cfg.attrs = const_cast<cudaLaunchAttribute*>(attrs);
  cfg.numAttrs = n;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, static_cast<Params>(args)...);
  if (err != cudaSuccess) fail("CUDA launch failed in ", op, ": ", cudaGetErrorString(err));
  check_launch(op);
}

// Launches kernel<<<grid, block, smem, op_stream()>>>(args...) with PDL allowed when
// pdl_enabled(), except in prompt prefill, whose kernels alternate with cuBLAS GEMMs that do not
// take part, and right after a kernel that asked for the next one to wait
// (Context::serialize_next_launch). cluster > 1: consecutive groups of `cluster` blocks along x
// form a thread block cluster (sm_90; grid.x a multiple of it), whose blocks are co-scheduled and
// read each other's shared memory.
template <class... Params, class... Args>
void launch_clustered(const char* op, unsigned cluster, void (*kernel)(Params...), dim3 grid,
                      dim3 block, size_t smem, Args&&... args) {
  Context& c = current();
  const bool early = pdl_enabled() && !prefill_mode() && !c.serialize_next_launch;
  c.serialize_next_launch = false;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = early ? 1 : 0;
  attr[1].id = cudaLaunchAttributeClusterDimension;
  attr[1].val.clusterDim.x = cluster;
  attr[1].val.clusterDim.y = 1;
  attr[1].val.clusterDim.z = 1;
  launch_with(op, attr, cluster > 1 ? 2 : 1, kernel, grid, block, smem,
              std::forward<Args>(args)...);
}

template <class... Params, class... Args>
void launch(const char* op, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
            Args&&... args) {
  launch_clustered(op, 1, kernel, grid, block, smem, std::forward<Args>(args)...);
}

// Launches kernel<<<grid, block, smem, op_stream()>>>(args...) as a cooperative grid: the runtime
// makes all of its blocks resident at once or refuses the launch, so blocks may wait for each
// other (grid at most resident_blocks()). Without PDL: it starts once the kernel before it has
// completed, whose blocks could otherwise hold the multiprocessors it needs.
template <class... Params, class... Args>
void launch_cooperative(const char* op, void (*kernel)(Params...), dim3 grid, dim3 block,
                        size_t smem, Args&&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  launch_with(op, attr, 1, kernel, grid, block, smem, std::forward<Args>(args)...);
}

// Lets `kernel` take `bytes` of dynamic shared memory (above the default 48 KiB: the staged
// input rows of a decode-sized linear, the stages of the many-row products). The limit is an
// attribute of the kernel on the device, shared by every context and thread, so it is raised
// through raise_dynamic_smem (context.cu), which never lowers it; each context remembers the
// limit it saw, so a launch within it calls nothing. `what` names the memory in the error.
template <class... Params>
void allow_dynamic_smem(void (*kernel)(Params...), size_t bytes, const char* what) {
  Context& c = current();
  const void* key = reinterpret_cast<const void*>(kernel);
  size_t& have = c.smem_allowed[key];
  if (bytes <= have) return;
  have = raise_dynamic_smem(key, c.device(), bytes, what);
}

// Blocks of `kernel` the GPU keeps resident at once (its occupancy per SM at `threads` threads and
// `smem` bytes of dynamic shared memory, times the SMs; at least one per SM), asked once per
// (kernel, smem) and context.
template <class... Params>
int resident_blocks(void (*kernel)(Params...), int threads, size_t smem) {
  Context& c = current();
  const auto key = std::make_pair(reinterpret_cast<const void*>(kernel), smem);
  auto it = c.blocks_per_sm.find(key);
  if (it == c.blocks_per_sm.end()) {
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem) != cudaSuccess ||
        n < 1)
      n = 1;
    it = c.blocks_per_sm.emplace(key, n).first;
  }
  return c.multiprocessors() * it->second;
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
