// Kernel timeline: a diagnostic compiled in only by `cmake -DTANDEM_CUDA_TRACE=ON` (internal:
// included by check.cuh). Default builds contain none of it: the macros below expand to nothing
// and every kernel's code is unchanged.
//
// Each kernel's first block records the global timer (ns) and its launch shape right after
// pdl_wait() returns. Under PDL a kernel's wait returns when the kernel before it has completed,
// so consecutive marks split a decode step's critical path into per-kernel shares, inside CUDA
// graphs too (tools/kernel_timeline.py turns a dump into a table). With PDL off the marks are
// kernel start times. The mark costs block 0 one atomic round trip, so traced steps run a little
// long.
//
// The .cu files are compiled without relocatable device code, so each translation unit has its
// own buffer (internal linkage) and names itself once with TANDEM_CUDA_TRACE_UNIT(name), at the
// end of the file inside namespace tandem::cuda. That defines trace_collect_<name>() and
// trace_clear_<name>(), which device.cu gathers.
#pragma once

#if TANDEM_CUDA_TRACE

#include <cuda_runtime.h>

#include <vector>

#include "tandem/backend/cuda/cuda_ops.h"

namespace tandem::cuda {

namespace {
constexpr unsigned kTraceCapacity = 1u << 18;  // marks per translation unit; later ones are dropped
__device__ unsigned long long g_trace_ns[kTraceCapacity];
__device__ uint4 g_trace_shape[kTraceCapacity];  // grid x, y, z, block x
__device__ unsigned g_trace_count;
}  // namespace

__device__ __forceinline__ void trace_mark() {
  if ((threadIdx.x | threadIdx.y | threadIdx.z | blockIdx.x | blockIdx.y | blockIdx.z) != 0) return;
  unsigned long long ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  const unsigned i = atomicAdd(&g_trace_count, 1u);
  if (i < kTraceCapacity) {
    g_trace_ns[i] = ns;
    g_trace_shape[i] = make_uint4(gridDim.x, gridDim.y, gridDim.z, blockDim.x);
  }
}

// A graph launch's mark (graph.cu): the host's clock (steady_clock ns) when it queued the launch,
// recorded by a one-thread kernel queued just before the graph. Device time minus host time is
// the launch's slack plus a constant; where the slack is least, the device was idle waiting for the
// host (tools/kernel_timeline.py --gaps). The z field tells these marks from kernels' shapes.
constexpr unsigned kLaunchMark = 0xffffffffu;
__device__ __forceinline__ void trace_launch_mark(unsigned long long host_ns) {
  unsigned long long ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  const unsigned i = atomicAdd(&g_trace_count, 1u);
  if (i < kTraceCapacity) {
    g_trace_ns[i] = ns;
    g_trace_shape[i] = make_uint4(static_cast<unsigned>(host_ns),
                                  static_cast<unsigned>(host_ns >> 32), kLaunchMark, 0);
  }
}

// Registers the exit-time dump to $TANDEM_CUDA_TRACE_OUT (device.cu); launch() calls it, so the
// handler is registered after the CUDA runtime's own and runs before the runtime shuts down.
void trace_register_dump();

// Appends this unit's marks to `out` (the count of marks it had to drop goes to `dropped`).
#define TANDEM_CUDA_TRACE_UNIT(name)                                                            \
  void trace_collect_##name(std::vector<KernelMark>& out, uint64_t& dropped) {                  \
    unsigned n = 0;                                                                             \
    TANDEM_CUDA_CHECK(cudaMemcpyFromSymbol(&n, g_trace_count, sizeof n));                       \
    const unsigned kept = n < kTraceCapacity ? n : kTraceCapacity;                              \
    dropped += n - kept;                                                                        \
    std::vector<unsigned long long> ns(kept);                                                   \
    std::vector<uint4> shape(kept);                                                             \
    if (kept > 0) {                                                                             \
      TANDEM_CUDA_CHECK(cudaMemcpyFromSymbol(ns.data(), g_trace_ns, kept * sizeof(ns[0])));     \
      TANDEM_CUDA_CHECK(                                                                        \
          cudaMemcpyFromSymbol(shape.data(), g_trace_shape, kept * sizeof(shape[0])));          \
    }                                                                                           \
    for (unsigned i = 0; i < kept; ++i)                                                         \
      out.push_back(                                                                            \
          shape[i].z == kLaunchMark                                                             \
              ? KernelMark{"launch",                                                            \
                           ns[i],                                                               \
                           {0, 0, 0},                                                           \
                           0,                                                                   \
                           shape[i].x | static_cast<uint64_t>(shape[i].y) << 32}                \
              : KernelMark{#name, ns[i], {shape[i].x, shape[i].y, shape[i].z}, shape[i].w, 0}); \
  }                                                                                             \
  void trace_clear_##name() {                                                                   \
    const unsigned zero = 0;                                                                    \
    TANDEM_CUDA_CHECK(cudaMemcpyToSymbol(g_trace_count, &zero, sizeof zero));                   \
  }

}  // namespace tandem::cuda

#else

#define TANDEM_CUDA_TRACE_UNIT(name)

#endif
