// Launch-overhead removal for repeated forwards (DESIGN.md §2: fixed buffers make CUDA graph
// capture possible). A forward's device work — a fixed sequence of op calls for a given shape —
// is captured once into a CUDA graph and replayed; on the CPU the body simply runs.
//
// The caller names the work by a key that must change whenever anything baked into the launches
// changes: shapes, every buffer address the ops touch, and host scalars passed to ops. Values that
// live in device memory (token ids, positions, block tables) may change between replays; the
// caller refreshes them with copies queued before run(). A key is captured the second time it is
// seen, so that the first run sizes every buffer and internal scratch (capture must not allocate).
#pragma once

#include <cstdint>
#include <functional>
#include <unordered_map>

namespace tandem {

class GraphCache {
 public:
  GraphCache() = default;
  ~GraphCache();
  GraphCache(const GraphCache&) = delete;
  GraphCache& operator=(const GraphCache&) = delete;

  // Queues `body`'s work on the active backend's stream: directly, by capturing it, or by
  // replaying the graph captured for `key`. `body` must only queue ops (no host synchronization,
  // no allocation once warmed up, same calls for the same key).
  void run(uint64_t key, const std::function<void()>& body);
  void clear();
  size_t size() const { return graphs_.size(); }

  static constexpr size_t kMaxGraphs = 64;  // more distinct shapes: start over

 private:
  struct Entry {
    int seen = 0;
    void* exec = nullptr;  // cudaGraphExec_t once captured
  };
  std::unordered_map<uint64_t, Entry> graphs_;
};

// Incremental key building: FNV-1a style mixing of 64-bit words.
class KeyHasher {
 public:
  KeyHasher& add(uint64_t v) {
    h_ = (h_ ^ v) * 0x100000001b3ull;
    h_ ^= h_ >> 29;
    return *this;
  }
  KeyHasher& add(const void* p) { return add(reinterpret_cast<uintptr_t>(p)); }
  uint64_t value() const { return h_; }

 private:
  uint64_t h_ = 0xcbf29ce484222325ull;
};

}  // namespace tandem
