// Grow-only device scratch for the ops' intermediates (internal: included by .cu files only).
#pragma once

#include <cstddef>
#include <cstdint>

#include "tandem/backend/cuda/cuda_ops.h"

namespace tandem::cuda {

// get<T>(n): room for n (at least one) T. Reallocates only to grow, and then bumps the scratch
// generation, which graph keys include, so no graph replays a freed address. Calls are ordered on
// the stream, so the next user may reuse what the last one wrote.
struct DeviceScratch {
  void* p = nullptr;
  size_t bytes = 0;
  template <class T>
  T* get(int64_t n) {
    const size_t want = sizeof(T) * static_cast<size_t>(n > 0 ? n : 1);
    if (want > bytes) {
      cuda::free(p);
      p = cuda::alloc(want);
      bytes = want;
      bump_scratch_generation();
    }
    return static_cast<T*>(p);
  }
};

}  // namespace tandem::cuda
