// The entries a row keeps per position in backend memory: [length, width] floats, appended by
// forwards, cut back to a prefix by commits, never rewritten in place. GLM-5's latent KV cache and
// index keys, and its NextN drafter's latent cache, are of this kind. Since an entry is never
// rewritten, a prefix of the cache is exactly a state the row had.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "tandem/backend/buffer.h"

namespace tandem {

class PositionCache {
 public:
  explicit PositionCache(int64_t width = 0) : width_(width) {}

  int64_t width() const { return width_; }
  int64_t length() const { return length_; }
  // [length, width] in backend memory; valid until the next append (which may move it).
  const float* data() const { return entries_.data(); }
  // Bytes the entries take (not the capacity held).
  uint64_t bytes() const { return static_cast<uint64_t>(length_ * width_) * sizeof(float); }

  // Appends n entries: `n` rows of `width` floats in backend memory, row r at src + r · stride.
  // Capacity at least doubles when it runs out, so a row decoding token by token copies its
  // entries O(log length) times.
  void append(const float* src, int64_t n, int64_t stride);
  void append(const float* src, int64_t n) { append(src, n, width_); }
  // Keeps the first `length` entries (length <= length()); the capacity stays.
  void truncate(int64_t length);
  // Drops every entry and frees the memory.
  void release();

  // The first `length` entries copied to host memory ([length, width]).
  std::vector<float> to_host(int64_t length) const;
  std::vector<float> to_host() const { return to_host(length_); }
  // Replaces the entries with `values` ([values.size() / width, width], host memory).
  void assign_host(std::span<const float> values);

 private:
  int64_t width_ = 0;
  int64_t length_ = 0;
  Buffer<float> entries_;  // capacity entries_.size() / width_
};

}  // namespace tandem
