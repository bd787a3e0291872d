// The earliest occurrence of every n-gram of a growing token history, for n-gram prompt lookup:
// an open-addressing hash set of start offsets, each keyed by the n tokens at its start.
#pragma once

#include <xxhash.h>

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

namespace tandem::spec {

// Starts are inserted in increasing order (the history only grows at its end) and an n-gram
// already present is not inserted again, so the entry kept for each distinct n-gram is its first
// occurrence. The table is one flat array (linear probing, at most half full): an insert
// allocates only when the array doubles, where a node-based set allocated for every n-gram.
// The history is passed to every call (its storage may move as it grows); entries read it.
class GramIndex {
 public:
  explicit GramIndex(int n) : n_(n) {}

  int n() const { return n_; }
  size_t size() const { return size_; }

  // Adds the n-gram at history[start .. start + n) unless an equal one is indexed.
  void insert(std::span<const int32_t> history, int32_t start) {
    if ((size_ + 1) * 2 > slots_.size()) grow();
    const uint32_t h = hash_of(history.data() + start);
    for (size_t i = h & mask();; i = (i + 1) & mask()) {
      Slot& s = slots_[i];
      if (s.start < 0) {
        s = {h, start};
        ++size_;
        return;
      }
      if (s.hash == h && same(history, s.start, start)) return;
    }
  }

  // The indexed start whose n tokens equal history[start .. start + n): the earliest occurrence
  // of that n-gram, `start` itself if it is the first; -1 if none is indexed.
  int32_t first(std::span<const int32_t> history, int32_t start) const {
    if (slots_.empty()) return -1;
    const uint32_t h = hash_of(history.data() + start);
    for (size_t i = h & mask();; i = (i + 1) & mask()) {
      const Slot& s = slots_[i];
      if (s.start < 0) return -1;
      if (s.hash == h && same(history, s.start, start)) return s.start;
    }
  }

 private:
  struct Slot {
    uint32_t hash = 0;
    int32_t start = -1;  // -1: empty
  };
  int n_;
  size_t size_ = 0;
  std::vector<Slot> slots_;  // a power of two long, or empty

  size_t mask() const { return slots_.size() - 1; }
  uint32_t hash_of(const int32_t* tokens) const {
    const uint64_t h = XXH3_64bits(tokens, sizeof(int32_t) * static_cast<size_t>(n_));
    return static_cast<uint32_t>(h ^ (h >> 32));
  }
  bool same(std::span<const int32_t> history, int32_t a, int32_t b) const {
    return a == b || std::equal(history.data() + a, history.data() + a + n_, history.data() + b);
  }
  void grow() {
    std::vector<Slot> old(std::max<size_t>(32, slots_.size() * 2));
    old.swap(slots_);
    for (const Slot& s : old) {
      if (s.start < 0) continue;
      size_t i = s.hash & mask();
      while (slots_[i].start >= 0) i = (i + 1) & mask();
      slots_[i] = s;
    }
  }
};

}  // namespace tandem::spec
