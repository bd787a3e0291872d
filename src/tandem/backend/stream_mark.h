// A point of the current backend context's stream that the host waits for or asks about: what a
// pinned buffer's last copy (PinnedBuffer) or an upload's last reader (StagedUpload::consumed)
// left queued. On CUDA an event and its cuda::StreamPoint (kept as plain fields, so this header
// needs no CUDA one): a wait for a point the host already waited past costs no device call. On
// the CPU nothing is ever queued, so a mark is never recorded.
#pragma once

#include <cstdint>

namespace tandem {

class StreamMark {
 public:
  StreamMark() = default;
  ~StreamMark();
  StreamMark(const StreamMark&) = delete;
  StreamMark& operator=(const StreamMark&) = delete;

  // CUDA: marks the work queued so far on the current context's stream.
  void record();
  bool recorded() const { return recorded_; }
  // Blocks until the recorded point has completed, then forgets it (nothing recorded: returns at
  // once). Throws with the first kernel error.
  void wait();
  // Whether the recorded point has completed, without waiting (nothing recorded: true).
  bool reached();
  void forget() { recorded_ = false; }

 private:
  void* event_ = nullptr;  // CUDA: created on the first record()
  const void* context_ = nullptr;
  uint64_t seq_ = 0;
  bool recorded_ = false;
};

}  // namespace tandem
