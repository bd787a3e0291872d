#include "tandem/backend/stream_mark.h"

#ifdef TANDEM_HAVE_CUDA
#include "tandem/backend/cuda/cuda_ops.h"
#endif

namespace tandem {

StreamMark::~StreamMark() {
#ifdef TANDEM_HAVE_CUDA
  if (event_) cuda::destroy_event(event_);
#endif
}

void StreamMark::record() {
#ifdef TANDEM_HAVE_CUDA
  if (!event_) event_ = cuda::create_event();
  const cuda::StreamPoint at = cuda::record_event(event_);
  context_ = at.context;
  seq_ = at.seq;
  recorded_ = true;
#endif
}

void StreamMark::wait() {
  if (!recorded_) return;
  recorded_ = false;
#ifdef TANDEM_HAVE_CUDA
  cuda::wait_event(event_, {context_, seq_});
#endif
}

bool StreamMark::reached() {
  if (!recorded_) return true;
#ifdef TANDEM_HAVE_CUDA
  return cuda::event_completed(event_, {context_, seq_});
#else
  return true;
#endif
}

}  // namespace tandem
