#include "tandem/engine/glm5_prefix_cache.h"

#include <xxhash.h>

#include <algorithm>

#include "tandem/core/error.h"

namespace tandem {

namespace {

uint64_t hash_tokens(std::span<const int32_t> tokens) {
  return XXH3_64bits(tokens.data(), tokens.size_bytes());
}

}  // namespace

Glm5PrefixCache::Glm5PrefixCache(Glm5State& state, size_t max_bytes)
    : state_(state), max_bytes_(max_bytes) {}

uint64_t Glm5PrefixCache::find(std::span<const int32_t> tokens) const {
  const auto [lo, hi] = by_hash_.equal_range(hash_tokens(tokens));
  for (auto it = lo; it != hi; ++it) {
    const Entry& e = entries_.at(it->second);
    if (std::equal(e.tokens.begin(), e.tokens.end(), tokens.begin(), tokens.end()))
      return it->second;
  }
  return 0;
}

PrefixHit Glm5PrefixCache::lookup(std::span<const int32_t> prompt, const std::string& draft_ns,
                                  bool adopt_other) {
  // Saved lengths, longest first, that leave at least one prompt token to prefill.
  for (auto l = lengths_.rbegin(); l != lengths_.rend(); ++l) {
    const int64_t len = l->first;
    if (len >= static_cast<int64_t>(prompt.size())) continue;
    const uint64_t id = find(prompt.first(static_cast<size_t>(len)));
    if (!id) continue;
    Entry& e = entries_.at(id);
    PrefixHit hit;
    if (!draft_ns.empty()) {
      if (e.draft && e.draft->ns == draft_ns)
        hit.draft = e.draft;
      else if (!adopt_other)
        continue;
    }
    hit.tokens = len;
    hit.entry = id;
    e.last_use = ++clock_;
    return hit;
  }
  return {};
}

void Glm5PrefixCache::restore(const PrefixHit& hit, int slot) {
  const Entry& e = entries_.at(hit.entry);
  TANDEM_CHECK(e.row.length == hit.tokens, "prefix cache: hit of ", hit.tokens,
               " tokens on an entry of ", e.row.length);
  state_.restore(slot, e.row);
}

bool Glm5PrefixCache::insert(std::span<const int32_t> tokens, int slot, spec::CheckpointPtr draft) {
  const int64_t length = static_cast<int64_t>(tokens.size());
  TANDEM_CHECK(length >= 1 && state_.length(slot) == length, "prefix cache: row slot ", slot,
               " covers ", state_.length(slot), " tokens, not the ", length, " given");
  TANDEM_CHECK(!draft || draft->processed_tokens == length, "prefix cache: the drafter's ",
               "checkpoint covers ", draft ? draft->processed_tokens : 0, " tokens, not ", length);
  if (const uint64_t id = find(tokens)) {
    Entry& e = entries_.at(id);
    e.last_use = ++clock_;
    if (draft && !(e.draft && e.draft->ns == draft->ns)) {
      const size_t before = checkpoint_bytes(e.draft.get()), after = checkpoint_bytes(draft.get());
      e.draft = std::move(draft);
      e.bytes = e.bytes - before + after;
      bytes_ = bytes_ - before + after;
    }
    return true;
  }
  Entry e;
  e.row = state_.snapshot(slot);
  e.bytes = e.row.bytes() + checkpoint_bytes(draft.get());
  if (e.bytes > max_bytes_) return false;
  while (bytes_ + e.bytes > max_bytes_ && !entries_.empty()) {
    uint64_t oldest = 0, when = UINT64_MAX;
    for (const auto& [id, other] : entries_)
      if (other.last_use < when) {
        oldest = id;
        when = other.last_use;
      }
    evict(oldest);
  }
  e.tokens.assign(tokens.begin(), tokens.end());
  e.draft = std::move(draft);
  e.last_use = ++clock_;
  const uint64_t id = next_id_++;
  bytes_ += e.bytes;
  ++lengths_[length];
  by_hash_.emplace(hash_tokens(tokens), id);
  entries_.emplace(id, std::move(e));
  return true;
}

void Glm5PrefixCache::evict(uint64_t id) {
  auto it = entries_.find(id);
  TANDEM_CHECK(it != entries_.end(), "prefix cache: no entry ", id);
  const Entry& e = it->second;
  const auto [lo, hi] = by_hash_.equal_range(hash_tokens(e.tokens));
  for (auto h = lo; h != hi; ++h)
    if (h->second == id) {
      by_hash_.erase(h);
      break;
    }
  const int64_t len = static_cast<int64_t>(e.tokens.size());
  if (--lengths_[len] == 0) lengths_.erase(len);
  bytes_ -= e.bytes;
  entries_.erase(it);
  ++evictions_;
}

PrefixCacheStats Glm5PrefixCache::stats() const {
  PrefixCacheStats s;
  s.entries = static_cast<int64_t>(entries_.size());
  s.evictions = evictions_;
  s.bytes = bytes_;
  s.max_bytes = max_bytes_;
  return s;
}

std::vector<int64_t> Glm5PrefixCache::boundaries() const {
  std::vector<int64_t> out;
  for (const auto& [len, n] : lengths_)
    for (int64_t i = 0; i < n; ++i) out.push_back(len);
  return out;
}

}  // namespace tandem
