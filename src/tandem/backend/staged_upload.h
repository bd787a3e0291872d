// Host data for the device in one asynchronous copy per use: the host fills host(bytes), then
// start() queues the copy to backend memory behind the work queued so far. On CUDA the staging is
// pinned memory, so the copy neither blocks the host nor waits for the device to go idle (a
// pageable copy may do both), and a decode step queued while the previous one runs keeps the
// device busy; an upload of up to cuda::kKernelUploadBytes is a kernel reading the mapped staging,
// which leaves no copy-engine pause between kernels. Two staging buffers alternate: host() hands
// out the one not used last, after waiting for the copy that last read it, so the host can fill the
// next upload while the previous one is still queued. On the CPU start() copies at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "tandem/backend/pinned.h"
#include "tandem/backend/stream_mark.h"

namespace tandem {

// Several arrays often travel in one upload: each part's size rounded up with this keeps the next
// part 256-byte aligned (what the device's wide loads and cudaMalloc give a buffer of its own).
constexpr size_t upload_part_bytes(size_t bytes) {
  return (bytes + 255) / 256 * 256;
}

class StagedUpload {
 public:
  // A staging buffer of at least `bytes` (contents unspecified), valid until start().
  uint8_t* host(size_t bytes);
  // Queues the copy of the first `bytes` of the buffer host() returned to `dst`.
  void start(void* dst, size_t bytes);
  // start() of several uploads (each filled through its own host(), each upload at most once) in
  // one launch: the inputs of one CUDA graph cost one copy kernel on the device, not one each.
  struct Part {
    StagedUpload* upload = nullptr;
    void* dst = nullptr;
    size_t bytes = 0;
  };
  static void start_together(std::span<const Part> parts);
  // Everything that reads the last upload's destination is queued (call it after the last such
  // work, every time). Where that work has completed by the next start(), that copy runs beside
  // the work queued since instead of behind it (CUDA: cuda::copy_from_pinned_ahead): a verify's
  // metadata lands while the draft chain before it runs. Without it, start() copies in order.
  void consumed();

 private:
  PinnedBuffer slots_[2];
  int next_ = 0;             // the slot host() hands out
  StreamMark readers_done_;  // consumed() since the last start() (CUDA)
};

}  // namespace tandem
