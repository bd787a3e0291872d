#include "tandem/backend/staged_upload.h"

#include <cstring>

#include "tandem/backend/pinned.h"
#include "tandem/core/error.h"

#ifdef TANDEM_HAVE_CUDA
#include "tandem/backend/cuda/cuda_ops.h"
#endif

namespace tandem {

StagedUpload::~StagedUpload() {
  for (Slot& s : slots_) {
#ifdef TANDEM_HAVE_CUDA
    if (s.event) {
      if (s.in_flight) {
        try {
          cuda::wait_event(s.event);  // the copy still reads the buffer freed below
        } catch (...) {               // a device error; nothing to report from a destructor
        }
      }
      cuda::destroy_event(s.event);
    }
#endif
    pinned_free(where_, s.data);
  }
}

uint8_t* StagedUpload::host(size_t bytes) {
  Slot& s = slots_[next_];
#ifdef TANDEM_HAVE_CUDA
  if (s.in_flight) cuda::wait_event(s.event);
#endif
  s.in_flight = false;
  const ops::Backend b = ops::backend();
  if (b != where_) {  // the backend changed (tests): staging of the new kind from here on
    for (Slot& o : slots_) {
#ifdef TANDEM_HAVE_CUDA
      if (o.in_flight) cuda::wait_event(o.event);
#endif
      o.in_flight = false;
      pinned_free(where_, o.data);
      o.data = nullptr;
      o.capacity = 0;
    }
    where_ = b;
  }
  if (bytes > s.capacity || s.data == nullptr) {
    pinned_free(where_, s.data);
    s.data = nullptr;
    s.capacity = 0;
    s.data = static_cast<uint8_t*>(pinned_alloc(where_, bytes));
    s.capacity = bytes > 0 ? bytes : 1;
  }
  return s.data;
}

void StagedUpload::start(void* dst, size_t bytes) {
  Slot& s = slots_[next_];
  if (bytes > s.capacity)
    fail("StagedUpload: ", bytes, " bytes exceed the ", s.capacity, " staged");
  next_ ^= 1;
#ifdef TANDEM_HAVE_CUDA
  if (where_ == ops::Backend::Cuda) {
    if (!s.event) s.event = cuda::create_event();
    cuda::copy_to_device(dst, s.data, bytes);
    cuda::record_event(s.event);
    s.in_flight = true;
    return;
  }
#endif
  std::memcpy(dst, s.data, bytes);
}

}  // namespace tandem
