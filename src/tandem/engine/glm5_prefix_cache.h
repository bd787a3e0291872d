// The prefix cache of a GLM-5 target (PrefixStore): saved prompt prefixes with a copy of the
// row's latent caches and index keys at the boundary (Glm5State::RowSnapshot) and the drafter's
// checkpoint for it. GLM-5's caches grow by one entry per position and are never rewritten, so a
// snapshot is exactly the state a cold prefill of its tokens reaches, and restoring it is a copy.
// Entries are evicted least recently used under a byte budget. With a disk tier (PrefixDisk),
// evicted entries are written there, one file per boundary (each layer's latent cache as its
// "keys", its index keys as its "values"), and a longer prefix found there is read back.
//
// Not thread-safe: the engine loop owns it, like the state it restores rows of.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <unordered_map>
#include <vector>

#include "tandem/engine/prefix_disk.h"
#include "tandem/engine/prefix_store.h"
#include "tandem/model/glm5_state.h"

namespace tandem {

class Glm5PrefixCache final : public PrefixStore {
 public:
  // `state` must outlive the cache.
  Glm5PrefixCache(Glm5State& state, size_t max_bytes);

  PrefixHit lookup(std::span<const int32_t> prompt, const std::string& draft_ns,
                   bool adopt_other) override;
  void restore(const PrefixHit& hit, int slot) override;
  bool insert(std::span<const int32_t> tokens, int slot, spec::CheckpointPtr draft) override;
  PrefixCacheStats stats() const override;
  std::vector<int64_t> boundaries() const override;
  std::optional<PrefixDiskLayout> disk_layout() const override;
  void attach_disk(PrefixDisk* disk) override { disk_ = disk; }
  void persist_all() override;

 private:
  struct Entry {
    std::vector<int32_t> tokens;
    Glm5State::RowSnapshot row;
    spec::CheckpointPtr draft;
    size_t bytes = 0;  // row + draft
    uint64_t last_use = 0;
  };

  Glm5State& state_;
  size_t max_bytes_;
  size_t bytes_ = 0;
  uint64_t next_id_ = 1, clock_ = 0;
  int64_t evictions_ = 0;
  PrefixDisk* disk_ = nullptr;
  int64_t disk_writes_ = 0, disk_loads_ = 0;
  std::unordered_map<uint64_t, Entry> entries_;
  std::unordered_multimap<uint64_t, uint64_t> by_hash_;  // hash of the tokens -> entry id
  std::map<int64_t, int64_t> lengths_;                   // entry length -> how many entries

  uint64_t find(std::span<const int32_t> tokens) const;
  void evict(uint64_t id);
  PrefixHit lookup_memory(std::span<const int32_t> prompt, const std::string& draft_ns,
                          bool adopt_other);
  // Adds an entry (evicting others to make room); false when it cannot fit the budget.
  bool add(Entry e);
  static PrefixRecord record(const Entry& e);
  // A record read from disk as an entry; false (nothing added) when its sections do not fit
  // this state's layout or the budget.
  bool load(PrefixRecord r);
};

}  // namespace tandem
