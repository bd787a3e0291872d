#include "tandem/backend/staged_upload.h"

#include <cstring>

#include "tandem/core/error.h"

#ifdef TANDEM_HAVE_CUDA
#include "tandem/backend/cuda/cuda_ops.h"
#endif

namespace tandem {

uint8_t* StagedUpload::host(size_t bytes) {
  return slots_[next_].reserve(bytes);
}

void StagedUpload::start(void* dst, size_t bytes) {
  PinnedBuffer& s = slots_[next_];
  if (s.data() == nullptr || bytes > s.capacity())
    fail("StagedUpload: ", bytes, " bytes exceed the ", s.capacity(), " staged");
  next_ ^= 1;
#ifdef TANDEM_HAVE_CUDA
  if (s.where() == ops::Backend::Cuda) {
    cuda::copy_from_pinned_async(dst, s.data(), bytes);
    s.queued();
    return;
  }
#endif
  std::memcpy(dst, s.data(), bytes);
}

}  // namespace tandem
