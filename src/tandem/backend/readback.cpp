#include "tandem/backend/readback.h"

#include <cstring>

#include "tandem/core/error.h"

#ifdef TANDEM_HAVE_CUDA
#include "tandem/backend/cuda/cuda_ops.h"
#endif

namespace tandem {

void Readback::start(const void* src, size_t bytes) {
  if (pending_) fail("Readback: a copy is still pending; wait() for it first");
  uint8_t* host = buffer_.reserve(bytes);
  pending_ = true;
#ifdef TANDEM_HAVE_CUDA
  if (buffer_.where() == ops::Backend::Cuda) {
    cuda::copy_to_pinned_async(host, src, bytes);
    buffer_.queued();
    return;
  }
#endif
  std::memcpy(host, src, bytes);
}

const void* Readback::wait() {
  if (!pending_) fail("Readback: wait() without a started copy");
  pending_ = false;
  buffer_.wait();
  return buffer_.data();
}

}  // namespace tandem
