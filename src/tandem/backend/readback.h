// A device→host copy that the host collects later, so the device can go on with work queued
// after it: a decode step's greedy tokens read back while the next step, which takes them from
// device memory, already runs. start() queues the copy behind everything queued so far (into
// pinned host memory on CUDA, the only kind a copy can land in without blocking the host); wait()
// blocks until it has landed. On the CPU the copy happens in start().
#pragma once

#include <cstddef>

#include "tandem/backend/pinned.h"

namespace tandem {

class Readback {
 public:
  // Queues the copy of `bytes` from backend memory `src`. Must not be pending.
  void start(const void* src, size_t bytes);
  // Blocks until the started copy has landed; returns its bytes (valid until the next start).
  const void* wait();
  bool pending() const { return pending_; }

 private:
  PinnedBuffer buffer_;  // destroyed after its copy has landed
  bool pending_ = false;
};

}  // namespace tandem
