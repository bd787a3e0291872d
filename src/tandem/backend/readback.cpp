#include "tandem/backend/readback.h"

#include <cstdlib>
#include <cstring>

#include "tandem/core/error.h"

#ifdef TANDEM_HAVE_CUDA
#include "tandem/backend/cuda/cuda_ops.h"
#endif

namespace tandem {

namespace {
void release_host(ops::Backend where, void* p) {
#ifdef TANDEM_HAVE_CUDA
  if (where == ops::Backend::Cuda) return cuda::free_pinned(p);
#endif
  (void)where;
  std::free(p);
}
}  // namespace

Readback::~Readback() {
#ifdef TANDEM_HAVE_CUDA
  if (event_) cuda::destroy_event(event_);
#endif
  if (host_) release_host(where_, host_);
}

void Readback::start(const void* src, size_t bytes) {
  if (pending_) fail("Readback: a copy is still pending; wait() for it first");
  const ops::Backend b = ops::backend();
  if (bytes > capacity_ || b != where_) {
    if (host_) release_host(where_, host_);
    host_ = nullptr;
    capacity_ = 0;
    where_ = b;
#ifdef TANDEM_HAVE_CUDA
    if (b == ops::Backend::Cuda) host_ = cuda::alloc_pinned(bytes);
#endif
    if (!host_) {
      host_ = std::malloc(bytes);
      if (!host_) fail("Readback: out of host memory for ", bytes, " bytes");
    }
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
