// A host buffer that asynchronous copies on the op stream read from or land in (Readback,
// StagedUpload): pinned on CUDA (a pageable buffer would make the copy block the host), plain
// malloc on the CPU backend, where copies complete at once. After a copy that touches it is
// queued (queued()), wait() blocks until it has completed; reserve() and the destructor wait for
// it before they reuse or free the memory.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tandem/backend/ops.h"
#include "tandem/backend/stream_mark.h"

namespace tandem {

class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  ~PinnedBuffer();
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;

  // At least `bytes` of host memory of the active backend's kind (contents unspecified), once
  // the last queued copy has completed. Throws Error when out of memory.
  uint8_t* reserve(size_t bytes);
  uint8_t* data() const { return data_; }
  size_t capacity() const { return capacity_; }
  ops::Backend where() const { return where_; }
  // A copy from or into data() was just queued on the op stream (CUDA: marks the stream there).
  void queued();
  void wait();  // until the last queued copy has completed; throws with a device error

 private:
  uint8_t* data_ = nullptr;
  size_t capacity_ = 0;
  StreamMark last_copy_;  // CUDA: after the last queued copy
  ops::Backend where_ = ops::Backend::Cpu;
};

}  // namespace tandem
