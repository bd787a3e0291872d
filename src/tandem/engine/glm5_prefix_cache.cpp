#include "tandem/engine/glm5_prefix_cache.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>

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
  return lookup_through_disk(
      disk_, prompt, [&] { return lookup_memory(prompt, draft_ns, adopt_other); },
      [&](PrefixRecord&& r) { return load(std::move(r)); }, &disk_loads_);
}

PrefixHit Glm5PrefixCache::lookup_memory(std::span<const int32_t> prompt,
                                         const std::string& draft_ns, bool adopt_other) {
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
  e.tokens.assign(tokens.begin(), tokens.end());
  e.draft = std::move(draft);
  return add(std::move(e));
}

bool Glm5PrefixCache::add(Entry e) {
  e.bytes = e.row.bytes() + checkpoint_bytes(e.draft.get());
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
  e.last_use = ++clock_;
  const uint64_t id = next_id_++;
  bytes_ += e.bytes;
  ++lengths_[static_cast<int64_t>(e.tokens.size())];
  by_hash_.emplace(hash_tokens(e.tokens), id);
  entries_.emplace(id, std::move(e));
  return true;
}

std::optional<PrefixDiskLayout> Glm5PrefixCache::disk_layout() const {
  return PrefixDiskLayout{state_.layout(), DType::F32};
}

PrefixRecord Glm5PrefixCache::record(const Entry& e) {
  PrefixRecord r;
  r.tokens = e.tokens;
  r.kv_dtype = DType::F32;
  auto bytes_of = [](const std::vector<float>& v) {
    const auto* p = reinterpret_cast<const std::byte*>(v.data());
    return std::vector<std::byte>(p, p + v.size() * sizeof(float));
  };
  for (size_t l = 0; l < e.row.latent.size(); ++l) {
    r.keys.push_back(bytes_of(e.row.latent[l]));
    r.values.push_back(bytes_of(e.row.index_keys[l]));
  }
  r.draft = e.draft;
  return r;
}

bool Glm5PrefixCache::load(PrefixRecord r) {
  if (find(r.tokens) || r.tokens.empty() || r.keys.size() != r.values.size() || !r.linear.empty() ||
      r.kv_dtype != DType::F32)
    return false;
  if (r.draft && r.draft->processed_tokens != static_cast<int64_t>(r.tokens.size())) return false;
  Entry e;
  e.row.length = static_cast<int64_t>(r.tokens.size());
  auto floats_of = [](const std::vector<std::byte>& b, std::vector<float>* out) {
    if (b.size() % sizeof(float) != 0) return false;
    out->resize(b.size() / sizeof(float));
    if (!b.empty()) std::memcpy(out->data(), b.data(), b.size());
    return true;
  };
  e.row.latent.resize(r.keys.size());
  e.row.index_keys.resize(r.values.size());
  for (size_t l = 0; l < r.keys.size(); ++l)
    if (!floats_of(r.keys[l], &e.row.latent[l]) || !floats_of(r.values[l], &e.row.index_keys[l]))
      return false;
  // Shapes against this state's layout (the file's key already names it): restore checks the
  // same before it changes a row, so a file that passes here restores.
  if (!state_.fits(e.row)) return false;
  e.tokens = std::move(r.tokens);
  e.draft = std::move(r.draft);
  return add(std::move(e));
}

void Glm5PrefixCache::persist_all() {
  if (!disk_) return;
  for (const auto& [id, e] : entries_) disk_writes_ += disk_->write(record(e));
}

void Glm5PrefixCache::evict(uint64_t id) {
  auto it = entries_.find(id);
  TANDEM_CHECK(it != entries_.end(), "prefix cache: no entry ", id);
  const Entry& e = it->second;
  // The disk tier keeps what memory lets go (a failed write only loses the entry, as without it).
  if (disk_) disk_writes_ += disk_->write(record(e));
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
  add_disk_stats(disk_, disk_writes_, disk_loads_, &s);
  return s;
}

std::vector<int64_t> Glm5PrefixCache::boundaries() const {
  std::vector<int64_t> out;
  for (const auto& [len, n] : lengths_)
    for (int64_t i = 0; i < n; ++i) out.push_back(len);
  return out;
}

}  // namespace tandem
