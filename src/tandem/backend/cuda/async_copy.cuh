// cp.async group bookkeeping (sm_80+) shared by the kernels that stage global memory in shared
// memory through groups of asynchronous copies (linear_tiles.cu, recurrent.cu).
#pragma once

namespace tandem::cuda {

// Closes this thread's cp.async copies issued since the last commit into one group.
__device__ __forceinline__ void copy_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// Waits until at most Pending of this thread's committed groups are still in flight (groups
// complete in commit order). A barrier after it publishes every thread's copies.
template <int Pending>
__device__ __forceinline__ void copy_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(Pending) : "memory");
}

}  // namespace tandem::cuda
