#include "tandem/backend/readback.h"

#include <cstring>

#include "tandem/backend/pinned.h"
#include "tandem/core/error.h"

#ifdef TANDEM_HAVE_CUDA
#include "tandem/backend/cuda/cuda_ops.h"
#endif

namespace tandem {

Readback::~Readback() {
#ifdef TANDEM_HAVE_CUDA
  if (event_) {
    if (pending_) {
      try {
        cuda::wait_event(event_);  // the copy still writes the buffer freed below
      } catch (...) {              // a device error; nothing to report from a destructor
      }
    }
    cuda::destroy_event(event_);
  }
#endif
  pinned_free(where_, host_);
}

void Readback::start(const void* src, size_t bytes) {
  if (pending_) fail("Readback: a copy is still pending; wait() for it first");
  const ops::Backend b = ops::backend();
  if (bytes > capacity_ || b != where_) {
    pinned_free(where_, host_);
    host_ = nullptr;
    capacity_ = 0;
    where_ = b;
    host_ = pinned_alloc(b, bytes);
    capacity_ = bytes;
  }
#ifdef TANDEM_HAVE_CUDA
  if (b == ops::Backend::Cuda) {
    if (!event_) event_ = cuda::create_event();
    cuda::copy_to_host_async(host_, src, bytes);
    cuda::record_event(event_);
    pending_ = true;
    return;
  }
#endif
  std::memcpy(host_, src, bytes);
  pending_ = true;
}

const void* Readback::wait() {
  if (!pending_) fail("Readback: wait() without a started copy");
#ifdef TANDEM_HAVE_CUDA
  if (where_ == ops::Backend::Cuda) cuda::wait_event(event_);
#endif
  pending_ = false;
  return host_;
}

}  // namespace tandem
