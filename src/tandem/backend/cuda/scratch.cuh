// Grow-only device scratch for the ops' intermediates (internal: included by .cu files only).
#pragma once

#include <cstddef>
#include <cstdint>

#include "tandem/backend/cuda/cuda_ops.h"

namespace tandem::cuda {

// Owned by one context (a member of an op file's Context::unit<T>()), freed with it.
// get<T>(n): room for n (at least one) T. Reallocates only to grow, and then bumps the context's
// scratch generation, which graph keys include, so no graph replays a freed address. Calls are
// ordered on the context's stream, so the next user may reuse what the last one wrote.
// get_zeroed<T>(n): the same, zero-filled (on the stream) whenever it is (re)allocated: counters
// that the kernels return to zero themselves.
struct DeviceScratch {
  void* p = nullptr;
  size_t bytes = 0;

  DeviceScratch() = default;
  ~DeviceScratch() { cuda::free(p); }
  DeviceScratch(const DeviceScratch&) = delete;
  DeviceScratch& operator=(const DeviceScratch&) = delete;

  template <class T>
  T* get(int64_t n) {
    grow(sizeof(T) * static_cast<size_t>(n > 0 ? n : 1), false);
    return static_cast<T*>(p);
  }
  template <class T>
  T* get_zeroed(int64_t n) {
    grow(sizeof(T) * static_cast<size_t>(n > 0 ? n : 1), true);
    return static_cast<T*>(p);
  }

 private:
  void grow(size_t want, bool zero) {
    if (want <= bytes) return;
    cuda::free(p);  // cudaFree waits for queued work: no earlier kernel sees the freed buffer
    p = nullptr;
    bytes = 0;
    p = cuda::alloc(want);
    bytes = want;
    if (zero) fill_zero(p, want);
    bump_scratch_generation();
  }
};

}  // namespace tandem::cuda
