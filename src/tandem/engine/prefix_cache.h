// The live prefix cache of a hybrid target (DESIGN.md §7): prompt prefixes whose state was saved
// at a boundary, reusable by a later request that starts with the same tokens.
//
// A Qwen3.5 row's state at a boundary is its KV up to the boundary plus its Gated DeltaNet conv +
// recurrent state there, which summarises the whole prefix and cannot be cut back: a prefix is
// reusable only up to a boundary where that state was saved. An entry holds
//  - the KV blocks below the boundary, shared by reference with the rows that wrote them and with
//    the rows restored from it (Qwen35State::retain_blocks; no copy), and a copy of the block
//    holding the boundary's tail when the boundary is not block-aligned;
//  - a copy of the row's linear state at the boundary (backend memory);
//  - the drafter's checkpoint for exactly that boundary (spec::Checkpoint), under its namespace,
//    so a hit restores target and drafter together and the first round drafts at full strength.
// Which boundaries are saved is the engine's rule (BatchEngine): the cache stores what it is given.
//
// Restoring copies what the row will change (linear state, tail block) and shares the rest, so an
// entry can be evicted at any time without touching a running row: "in use" never pins an entry.
// Eviction is least-recently-used under a byte budget that counts snapshots, checkpoints and each
// KV block the entries hold once (a block shared by nested prefixes of one prompt costs once);
// entries some request reused go after those none did (oldest()).
//
// Not thread-safe: the engine loop owns it, like the state whose blocks it holds.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "tandem/backend/buffer.h"
#include "tandem/engine/prefix_disk.h"
#include "tandem/engine/prefix_store.h"
#include "tandem/model/qwen3_5_state.h"
#include "tandem/spec/checkpoint.h"

namespace tandem {

class PrefixCache final : public PrefixStore {
 public:
  using Hit = PrefixHit;
  // `state` must outlive the cache; its block and slot layout is the one the entries refer to.
  PrefixCache(Qwen35State& state, size_t max_bytes, size_t kv_block_bytes);
  ~PrefixCache();  // releases every block the entries hold
  PrefixCache(const PrefixCache&) = delete;
  PrefixCache& operator=(const PrefixCache&) = delete;

  // The longest saved prefix of `prompt` that leaves at least one token to prefill (the first
  // sampled token needs the last prompt token's logits). draft_ns: the caller's drafter namespace
  // ("" for none, which uses any entry). An entry without an attachment of that namespace is used
  // for the target alone when `adopt_other` (the drafter adopts the prefix without changing the
  // output: it needs only tokens, or verification does not depend on proposals), and skipped
  // otherwise. Marks the entry used (LRU). With a disk tier, a longer prefix found there is read
  // back into memory first (an unusable file is a miss, removed).
  Hit lookup(std::span<const int32_t> prompt, const std::string& draft_ns,
             bool adopt_other) override;

  // Starts the empty open row `slot` at the hit's boundary (Qwen35State::attach_prefix). Throws
  // Error, changing nothing, when a fixed pool lacks the block a non-aligned tail copies into.
  void restore(const Hit& hit, int slot) override;

  // Saves row `slot`'s state at its current length, which must equal tokens.size(), with the
  // drafter's checkpoint for it (null without a drafter; otherwise its processed_tokens must be
  // tokens.size()). An existing entry of the same tokens is marked used, and takes the
  // checkpoint when it has none of that namespace. Evicts
  // least-recently-used entries to stay within the budget; an entry larger than the whole budget,
  // or one whose tail copy finds no free block, is not saved. Returns whether an entry is there.
  bool insert(std::span<const int32_t> tokens, int slot, spec::CheckpointPtr draft) override;

  // Evicts least-recently-used entries (never `keep`) until the state has `blocks` free blocks;
  // returns whether it has. Blocks still listed by rows or by kept entries are not freed by this.
  bool make_room(int64_t blocks, uint64_t keep = 0) override;

  // The disk tier (may be null; must outlive the cache): evicted entries are written to it, and
  // lookups read longer prefixes back from it.
  std::optional<PrefixDiskLayout> disk_layout() const override;
  void attach_disk(PrefixDisk* disk) override { disk_ = disk; }
  // Writes every entry to the disk tier (a server shutting down with --prefix-cache-persist).
  void persist_all() override;

  PrefixCacheStats stats() const override;
  // The saved boundaries' lengths, ascending (tests, reports).
  std::vector<int64_t> boundaries() const override;

 private:
  struct Entry {
    std::vector<int32_t> tokens;
    std::vector<int32_t> blocks;  // ceil(length / 16), each held once by the entry
    Buffer<float> linear;         // [linear_layers][conv | recurrent] at the boundary
    spec::CheckpointPtr draft;
    size_t own_bytes = 0;  // linear + draft
    uint64_t last_use = 0;
    int64_t hits = 0;         // requests restored from it
    int64_t descendants = 0;  // other entries whose tokens extend this entry's
  };

  Qwen35State& state_;
  size_t max_bytes_, block_bytes_;
  uint64_t next_id_ = 1, clock_ = 0;
  std::unordered_map<uint64_t, Entry> entries_;
  std::unordered_multimap<uint64_t, uint64_t> by_hash_;  // hash of the tokens -> entry id
  std::map<int64_t, int64_t> lengths_;                   // entry length -> how many entries
  std::unordered_map<int32_t, int64_t> block_uses_;      // block -> entries holding it
  size_t own_bytes_ = 0;
  int64_t evictions_ = 0;
  PrefixDisk* disk_ = nullptr;
  // Backend staging of load(): positions 0..n-1, the entry's block table, one layer's keys and
  // values (grown, reused).
  Buffer<int64_t> load_pos_;
  Buffer<int32_t> load_table_;
  Buffer<std::byte> load_k_, load_v_;
  int64_t disk_writes_ = 0, disk_loads_ = 0;

  size_t bytes() const { return own_bytes_ + block_uses_.size() * block_bytes_; }
  uint64_t find(std::span<const int32_t> tokens, uint64_t hash) const;
  // (length, hash of tokens' first `length`) for each saved length up to `limit`, ascending.
  std::vector<std::pair<int64_t, uint64_t>> prefix_hashes(std::span<const int32_t> tokens,
                                                          int64_t limit) const;
  // fn(entry) for each entry whose tokens are a proper prefix of `tokens`.
  template <class Fn>
  void for_each_ancestor(std::span<const int32_t> tokens, Fn fn);
  Hit lookup_memory(std::span<const int32_t> prompt, const std::string& draft_ns, bool adopt_other);
  // An entry's state on the host, for the disk tier.
  PrefixRecord record(const Entry& e) const;
  // Adds a record read from disk as an entry holding fresh blocks; false (nothing added) when it
  // does not fit this state's layout or budget, or the pool has no blocks for it.
  bool load(PrefixRecord&& r);
  bool add_entry(Entry&& e, size_t own);
  void evict(uint64_t id);
  // The entry to evict next, other than `keep` (0 when there is none), least recently used
  // within the first non-empty class of:
  //  1. superseded ancestors never reused: a longer entry extends them, so every prompt that
  //     runs through it takes the longer one, and only a prompt diverging in between loses;
  //  2. other entries never reused;
  //  3. entries reused at least once.
  // A prompt's end or a finished turn that nobody continues is saved as often as a shared system
  // prompt is reused; plain LRU would let a stream of such one-off entries push out the prefix
  // everyone shares, and the grid boundaries a long prompt leaves behind its end crowd out
  // other prompts' ends.
  uint64_t oldest(uint64_t keep) const;
};

}  // namespace tandem
