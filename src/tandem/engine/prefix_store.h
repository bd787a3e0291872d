// What the batch engine asks of a prefix cache (DESIGN.md §7): saved prompt prefixes, each with
// the target's row state at its boundary and the drafter's checkpoint for it, restored into a
// joining row. PrefixCache serves Qwen3.5's paged hybrid state; Glm5PrefixCache serves GLM-5's
// per-row latent caches. The engine decides which boundaries are saved.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "tandem/core/dtype.h"
#include "tandem/spec/checkpoint.h"

namespace tandem {

class PrefixDisk;

// How a store's files on a disk tier are laid out: part of the key they are written under, so a
// file is only ever read back into a state of the same shape.
struct PrefixDiskLayout {
  std::string kv_scheme;        // the state's layout, in words
  DType kv_dtype = DType::F32;  // how the per-layer sections store their elements
};

struct PrefixCacheStats {
  int64_t entries = 0;
  int64_t evictions = 0;
  int64_t disk_files = 0, disk_writes = 0, disk_loads = 0, disk_removed = 0;
  int64_t disk_bytes = 0;
  int64_t kv_blocks = 0;  // distinct KV blocks the entries hold (paged states)
  size_t bytes = 0;       // what the entries hold, counted against the budget
  size_t max_bytes = 0;
};

// What a request can reuse. tokens == 0: a miss.
struct PrefixHit {
  int64_t tokens = 0;
  uint64_t entry = 0;
  // The drafter's state at the boundary; null when the entry's attachment is of another drafter
  // namespace (or none): the caller's drafter adopts the prefix from its tokens
  // (DraftRows::adopt_prefix).
  spec::CheckpointPtr draft;
  bool from_disk = false;  // the entry was read back from a disk tier for this lookup
};

class PrefixStore {
 public:
  virtual ~PrefixStore() = default;
  // The longest saved prefix of `prompt` that leaves at least one token to prefill (the first
  // sampled token needs the last prompt token's logits). draft_ns: the caller's drafter namespace
  // ("" for none, which uses any entry). An entry without an attachment of that namespace is used
  // for the target alone when `adopt_other` (the drafter adopts the prefix without changing the
  // output), and skipped otherwise. Marks the entry used (LRU).
  virtual PrefixHit lookup(std::span<const int32_t> prompt, const std::string& draft_ns,
                           bool adopt_other) = 0;
  // Starts the empty open row `slot` at the hit's boundary. Throws Error, changing nothing, when
  // the state cannot hold it.
  virtual void restore(const PrefixHit& hit, int slot) = 0;
  // Saves row `slot`'s state at its current length, which must equal tokens.size(), with the
  // drafter's checkpoint for it (null without a drafter). An existing entry of the same tokens is
  // marked used, and takes the checkpoint when it has none of that namespace. Evicts
  // least-recently-used entries to stay within the budget. Returns whether an entry is there.
  virtual bool insert(std::span<const int32_t> tokens, int slot, spec::CheckpointPtr draft) = 0;
  // Evicts entries (never `keep`) until a fixed KV pool has `blocks` free blocks; returns
  // whether it has. A state without a fixed pool has nothing to make room in.
  virtual bool make_room(int64_t /*blocks*/, uint64_t /*keep*/ = 0) { return false; }
  // The layout of this store's disk files; nullopt when it has no disk tier.
  virtual std::optional<PrefixDiskLayout> disk_layout() const { return std::nullopt; }
  // Spills evicted entries to `disk` (opened under disk_layout(); must outlive the store) and
  // reads longer prefixes back from it. Only called when disk_layout() has a value.
  virtual void attach_disk(PrefixDisk* /*disk*/) {}
  // Writes every entry to a disk tier, where there is one (a server shutting down).
  virtual void persist_all() {}
  virtual PrefixCacheStats stats() const = 0;
  // The saved boundaries' lengths, ascending (tests, reports).
  virtual std::vector<int64_t> boundaries() const = 0;
};

// The byte size of a drafter checkpoint, as prefix caches count it against their budget.
size_t checkpoint_bytes(const spec::Checkpoint* c);

}  // namespace tandem
