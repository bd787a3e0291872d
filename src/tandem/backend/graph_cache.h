// Launch-overhead removal for repeated forwards (DESIGN.md §2: fixed buffers make CUDA graph
// capture possible). A forward's device work — a fixed sequence of op calls for a given shape —
// is captured once into a CUDA graph and replayed; on the CPU the body simply runs.
//
// The caller names the work by a key that must change whenever anything baked into the launches
// changes: shapes, every buffer address the ops touch, and host scalars passed to ops. Values that
// live in device memory (token ids, positions, block tables) may change between replays; the
// caller refreshes them with copies queued before run(). A key is captured the second time it is
// seen, so that the first run sizes every buffer and internal scratch (capture must not allocate).
// Keys are compared word for word (GraphKey), never by hash alone.
#pragma once

#include <cstdint>
#include <functional>
#include <unordered_map>
#include <vector>

namespace tandem {

// A graph's name: every word that shapes its launches, compared in full (a hash only picks the
// bucket), so two different forwards can never share a graph.
class GraphKey {
 public:
  GraphKey& add(uint64_t v) {
    words_.push_back(v);
    return *this;
  }
  GraphKey& add(const void* p) { return add(reinterpret_cast<uintptr_t>(p)); }
  bool operator==(const GraphKey& o) const { return words_ == o.words_; }
  const std::vector<uint64_t>& words() const { return words_; }
  size_t hash() const;

 private:
  std::vector<uint64_t> words_;
};

class GraphCache {
 public:
  GraphCache() = default;
  ~GraphCache();
  GraphCache(const GraphCache&) = delete;
  GraphCache& operator=(const GraphCache&) = delete;

  // Queues `body`'s work on the current context's stream (backend/context.h): directly, by
  // capturing it, or by replaying the graph captured for `key` under this context. `body` must
  // only queue ops (no host synchronization, no allocation once warmed up, same calls for the
  // same key).
  void run(const GraphKey& key, const std::function<void()>& body);
  void clear();
  size_t size() const { return graphs_.size(); }
  int64_t captures() const { return captures_; }  // graphs captured since construction
  // Runs on the calling thread, by any cache, that were not replays of a captured graph: a key's
  // first run (eager) and its second (the capture). Both cost far more host time than a replay,
  // so a timing that spans one (a round the depth policy learns its cost from) is not typical.
  static int64_t cold_runs();
  int64_t evictions() const { return evictions_; }  // graphs dropped to make room
  // Graphs dropped to make room by any cache on the calling thread: shapes that are run cold
  // again when they recur (a server's step shapes outnumbering kMaxGraphs churn the table).
  static int64_t evicted_graphs();

  // Distinct forwards kept at once (batch sizes × window shapes × position-bound steps); past it
  // the least recently run graph is dropped, never the whole table, so a server whose ragged
  // windows keep producing new shapes keeps the ones it replays.
  static constexpr size_t kMaxGraphs = 256;

 private:
  struct Hash {
    size_t operator()(const GraphKey& k) const { return k.hash(); }
  };
  struct Entry {
    int seen = 0;
    void* exec = nullptr;  // cudaGraphExec_t once captured
    uint64_t last_run = 0;
  };
  std::unordered_map<GraphKey, Entry, Hash> graphs_;
  uint64_t clock_ = 0;
  int64_t captures_ = 0, evictions_ = 0;

  void evict_least_recent();
};

}  // namespace tandem
