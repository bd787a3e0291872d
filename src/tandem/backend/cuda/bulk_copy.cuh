// The mbarrier and bulk-copy (TMA) primitives of sm_90 that stream weights into shared memory
// with no registers and no per-16-byte instructions (internal: included by linear_ring.cu and
// moe.cu). Addresses are shared::cta addresses (shared_address in linear_mma.cuh).
#pragma once

#include <cstdint>

namespace tandem::cuda {

__device__ __forceinline__ void mbar_init(uint32_t bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

// A block's barriers, by its thread 0, then the whole block synchronised: full[0 .. n) complete on
// one arrival (the producer's, which also expects its copies' bytes) and, where empty is given,
// empty[0 .. n) on `consumers` arrivals (the warps that release a stage).
__device__ __forceinline__ void init_barriers(uint64_t* full, uint64_t* empty, int n,
                                              unsigned consumers) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < n; ++s) {
      mbar_init(static_cast<uint32_t>(__cvta_generic_to_shared(&full[s])), 1);
      if (empty) mbar_init(static_cast<uint32_t>(__cvta_generic_to_shared(&empty[s])), consumers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// One arrival that also expects `bytes` of bulk copies to complete on the barrier.
__device__ __forceinline__ void mbar_arrive_expect(uint32_t bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}

// Returns once the barrier's phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global src to shared dst,
// completing on mbarrier bar; the weights are read once per step, so they are marked to leave
// L2 first (the inputs, read by every block, stay).
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, unsigned bytes,
                                          uint32_t bar, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1], %2, [%3], %4;" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar), "l"(policy)
      : "memory");
}

__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

}  // namespace tandem::cuda
