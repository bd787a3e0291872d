#include "tandem/backend/pinned.h"

#include <cstdlib>

#include "tandem/core/error.h"

#ifdef TANDEM_HAVE_CUDA
#include "tandem/backend/cuda/cuda_ops.h"
#endif

namespace tandem {

namespace {
void release(ops::Backend where, uint8_t* p) {
  if (p == nullptr) return;
#ifdef TANDEM_HAVE_CUDA
  if (where == ops::Backend::Cuda) return cuda::free_pinned(p);
#endif
  (void)where;
  std::free(p);
}
}  // namespace

PinnedBuffer::~PinnedBuffer() {
  try {
    wait();        // a queued copy may still read or write the memory freed below
  } catch (...) {  // a device error; nothing to report from a destructor
  }
  release(where_, data_);
}

uint8_t* PinnedBuffer::reserve(size_t bytes) {
  wait();
  const ops::Backend b = ops::backend();
  if (data_ != nullptr && bytes <= capacity_ && b == where_) return data_;
  release(where_, data_);
  data_ = nullptr;
  capacity_ = 0;
  where_ = b;
  const size_t n = bytes > 0 ? bytes : 1;
#ifdef TANDEM_HAVE_CUDA
  if (b == ops::Backend::Cuda) data_ = static_cast<uint8_t*>(cuda::alloc_pinned(n));
#endif
  if (data_ == nullptr) data_ = static_cast<uint8_t*>(std::malloc(n));
  if (data_ == nullptr) fail("out of host memory for ", n, " bytes of copy staging");
  capacity_ = n;
  return data_;
}

void PinnedBuffer::queued() {
  if (where_ == ops::Backend::Cuda) last_copy_.record();
}

void PinnedBuffer::wait() {
  last_copy_.wait();
}

}  // namespace tandem
