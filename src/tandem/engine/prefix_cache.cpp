#include "tandem/engine/prefix_cache.h"

#include <xxhash.h>

#include <algorithm>
#include <memory>

#include "tandem/backend/ops.h"
#include "tandem/core/error.h"

namespace tandem {

namespace {

uint64_t hash_tokens(std::span<const int32_t> tokens) {
  return XXH3_64bits(tokens.data(), tokens.size_bytes());
}

// fn(block, first position, positions) for each block of a length-token prefix's KV, in order:
// a block's keys (and its values) are contiguous, so each is one copy.
template <class Fn>
void for_each_block_run(std::span<const int32_t> blocks, int64_t length, Fn fn) {
  for (int64_t p = 0; p < length; p += Qwen35State::kBlockSize)
    fn(blocks[static_cast<size_t>(p / Qwen35State::kBlockSize)], p,
       std::min(Qwen35State::kBlockSize, length - p));
}

struct HashState {
  XXH3_state_t* s = XXH3_createState();
  HashState() {
    if (!s) fail("prefix cache: out of memory for a hash state");
    XXH3_64bits_reset(s);
  }
  ~HashState() { XXH3_freeState(s); }
};

}  // namespace

PrefixCache::PrefixCache(Qwen35State& state, size_t max_bytes, size_t kv_block_bytes)
    : state_(state), max_bytes_(max_bytes), block_bytes_(kv_block_bytes) {}

PrefixCache::~PrefixCache() {
  for (auto& [id, e] : entries_) state_.release_blocks(e.blocks);
}

uint64_t PrefixCache::find(std::span<const int32_t> tokens, uint64_t hash) const {
  const auto [lo, hi] = by_hash_.equal_range(hash);
  for (auto it = lo; it != hi; ++it) {
    const Entry& e = entries_.at(it->second);
    if (std::equal(e.tokens.begin(), e.tokens.end(), tokens.begin(), tokens.end()))
      return it->second;
  }
  return 0;
}

std::vector<std::pair<int64_t, uint64_t>> PrefixCache::prefix_hashes(
    std::span<const int32_t> tokens, int64_t limit) const {
  // One streaming pass over the tokens, a digest at each saved length.
  std::vector<std::pair<int64_t, uint64_t>> out;
  HashState h;
  int64_t hashed = 0;
  for (const auto& [len, count] : lengths_) {
    if (len > limit) break;
    XXH3_64bits_update(h.s, tokens.data() + hashed,
                       static_cast<size_t>(len - hashed) * sizeof(int32_t));
    hashed = len;
    out.emplace_back(len, XXH3_64bits_digest(h.s));
  }
  return out;
}

template <class Fn>
void PrefixCache::for_each_ancestor(std::span<const int32_t> tokens, Fn fn) {
  for (const auto& [len, hash] : prefix_hashes(tokens, static_cast<int64_t>(tokens.size()) - 1))
    if (const uint64_t id = find(tokens.first(static_cast<size_t>(len)), hash)) fn(entries_.at(id));
}

PrefixCache::Hit PrefixCache::lookup(std::span<const int32_t> prompt, const std::string& draft_ns,
                                     bool adopt_other) {
  return lookup_through_disk(
      disk_, prompt, [&] { return lookup_memory(prompt, draft_ns, adopt_other); },
      [&](PrefixRecord&& r) { return load(std::move(r)); }, &disk_loads_);
}

PrefixCache::Hit PrefixCache::lookup_memory(std::span<const int32_t> prompt,
                                            const std::string& draft_ns, bool adopt_other) {
  const auto candidates = prefix_hashes(prompt, static_cast<int64_t>(prompt.size()) - 1);
  for (auto c = candidates.rbegin(); c != candidates.rend(); ++c) {
    const auto [lo, hi] = by_hash_.equal_range(c->second);
    for (auto it = lo; it != hi; ++it) {
      Entry& e = entries_.at(it->second);
      if (static_cast<int64_t>(e.tokens.size()) != c->first ||
          !std::equal(e.tokens.begin(), e.tokens.end(), prompt.begin()))
        continue;
      Hit hit;
      if (!draft_ns.empty()) {
        if (e.draft && e.draft->ns == draft_ns) {
          hit.draft = e.draft;
        } else if (!adopt_other) {
          continue;
        }
      }
      hit.tokens = c->first;
      hit.entry = it->second;
      e.last_use = ++clock_;
      return hit;
    }
  }
  return {};
}

void PrefixCache::restore(const Hit& hit, int slot) {
  Entry& e = entries_.at(hit.entry);
  TANDEM_CHECK(static_cast<int64_t>(e.tokens.size()) == hit.tokens, "prefix cache: hit of ",
               hit.tokens, " tokens on an entry of ", e.tokens.size());
  state_.attach_prefix(slot, e.blocks, hit.tokens, e.linear.data());
  ++e.hits;
}

bool PrefixCache::insert(std::span<const int32_t> tokens, int slot, spec::CheckpointPtr draft) {
  const int64_t length = static_cast<int64_t>(tokens.size());
  TANDEM_CHECK(length >= 1 && state_.length(slot) == length, "prefix cache: row slot ", slot,
               " covers ", state_.length(slot), " tokens, not the ", length, " given");
  TANDEM_CHECK(!draft || draft->processed_tokens == length, "prefix cache: the drafter's ",
               "checkpoint covers ", draft ? draft->processed_tokens : 0, " tokens, not ", length);
  const uint64_t hash = hash_tokens(tokens);
  if (const uint64_t id = find(tokens, hash)) {
    Entry& e = entries_.at(id);
    e.last_use = ++clock_;
    if (draft && !(e.draft && e.draft->ns == draft->ns)) {
      const size_t before = checkpoint_bytes(e.draft.get());
      e.draft = std::move(draft);
      const size_t after = checkpoint_bytes(e.draft.get());
      e.own_bytes = e.own_bytes - before + after;
      own_bytes_ = own_bytes_ - before + after;
    }
    return true;
  }
  const size_t own = sizeof(float) * static_cast<size_t>(state_.linear_state_floats()) +
                     checkpoint_bytes(draft.get());
  const int64_t full = length / Qwen35State::kBlockSize;
  const bool tail = length % Qwen35State::kBlockSize != 0;
  const bool has_kv = state_.attention_layers() > 0;
  // What the entry would add to the budget: its own bytes and the blocks no entry holds yet
  // (fewer are held after each eviction, so it is counted again each time).
  auto added = [&] {
    size_t n = own;
    if (!has_kv) return n;
    const auto& table = state_.block_table(slot);
    for (int64_t b = 0; b < full; ++b)
      n += block_uses_.count(table[static_cast<size_t>(b)]) ? 0 : block_bytes_;
    return n + (tail ? block_bytes_ : 0);
  };
  if (own + static_cast<size_t>(full + tail) * (has_kv ? block_bytes_ : 0) > max_bytes_)
    return false;
  while (bytes() + added() > max_bytes_ && !entries_.empty()) evict(oldest(0));

  Entry e;
  e.tokens.assign(tokens.begin(), tokens.end());
  if (has_kv) {
    const auto& table = state_.block_table(slot);
    try {
      e.blocks.assign(table.begin(), table.begin() + full);
      if (tail) e.blocks.push_back(state_.copy_block(table[static_cast<size_t>(full)]));
    } catch (const Error&) {
      return false;  // a fixed pool with no block to spare: the boundary is not saved
    }
    state_.retain_blocks(std::span(e.blocks).first(static_cast<size_t>(full)));
  }
  e.linear.grow_to(state_.linear_state_floats());
  ops::copy(e.linear.data(), state_.linear_state(slot),
            sizeof(float) * static_cast<size_t>(state_.linear_state_floats()));
  e.draft = std::move(draft);
  return add_entry(std::move(e), own);
}

bool PrefixCache::add_entry(Entry&& e, size_t own) {
  e.own_bytes = own;
  e.last_use = ++clock_;
  for_each_ancestor(e.tokens, [](Entry& a) { ++a.descendants; });
  e.descendants = 0;
  for (const auto& [id, other] : entries_)
    e.descendants += other.tokens.size() > e.tokens.size() &&
                     std::equal(e.tokens.begin(), e.tokens.end(), other.tokens.begin());
  for (int32_t b : e.blocks) ++block_uses_[b];
  own_bytes_ += own;
  ++lengths_[static_cast<int64_t>(e.tokens.size())];
  const uint64_t id = next_id_++;
  by_hash_.emplace(hash_tokens(e.tokens), id);
  entries_.emplace(id, std::move(e));
  return true;
}

PrefixRecord PrefixCache::record(const Entry& e) const {
  PrefixRecord r;
  r.tokens = e.tokens;
  const int64_t length = static_cast<int64_t>(e.tokens.size());
  const int64_t layers = state_.attention_layers();
  const size_t row = state_.kv_token_bytes();
  r.kv_dtype = state_.kv_dtype();
  r.keys.resize(static_cast<size_t>(layers));
  r.values.resize(static_cast<size_t>(layers));
  for (int64_t l = 0; l < layers; ++l) {
    const ops::KVLayerView kv = state_.kv_layer(static_cast<int>(l));
    auto& k = r.keys[static_cast<size_t>(l)];
    auto& v = r.values[static_cast<size_t>(l)];
    k.resize(static_cast<size_t>(length) * row);
    v.resize(static_cast<size_t>(length) * row);
    for_each_block_run(e.blocks, length, [&](int32_t b, int64_t p, int64_t n) {
      ops::copy_to_host(k.data() + p * row, kv.key(b, 0), row * static_cast<size_t>(n));
      ops::copy_to_host(v.data() + p * row, kv.value(b, 0), row * static_cast<size_t>(n));
    });
  }
  r.linear.resize(static_cast<size_t>(state_.linear_state_floats()));
  ops::copy_to_host(r.linear.data(), e.linear.data(), sizeof(float) * r.linear.size());
  r.draft = e.draft;
  return r;
}

bool PrefixCache::load(PrefixRecord&& r) {
  const int64_t length = static_cast<int64_t>(r.tokens.size());
  const int64_t layers = state_.attention_layers();
  if (length < 1 || static_cast<int64_t>(r.keys.size()) != layers ||
      static_cast<int64_t>(r.values.size()) != layers ||
      static_cast<int64_t>(r.linear.size()) != state_.linear_state_floats() ||
      (r.draft && r.draft->processed_tokens != length) || r.kv_dtype != state_.kv_dtype())
    return false;
  const size_t kv_bytes = static_cast<size_t>(length) * state_.kv_token_bytes();  // per layer
  for (int64_t l = 0; l < layers; ++l)
    if (r.keys[static_cast<size_t>(l)].size() != kv_bytes ||
        r.values[static_cast<size_t>(l)].size() != kv_bytes)
      return false;
  const int64_t nblocks = layers > 0 ? Qwen35State::blocks_for(length) : 0;
  const size_t own = sizeof(float) * r.linear.size() + checkpoint_bytes(r.draft.get());
  if (own + static_cast<size_t>(nblocks) * block_bytes_ > max_bytes_) return false;
  while (bytes() + own + static_cast<size_t>(nblocks) * block_bytes_ > max_bytes_ &&
         !entries_.empty())
    evict(oldest(0));
  if (state_.fixed() && state_.free_block_count() < nblocks && !make_room(nblocks)) return false;
  Entry e;
  try {
    state_.take_blocks(nblocks, &e.blocks);
  } catch (const Error&) {
    return false;
  }
  if (layers > 0) {
    // Each layer's keys and values go up in one copy each and kv_write_stored scatters them into
    // the entry's blocks: two large copies per layer, not two per block (on a GPU a small copy
    // costs more in latency than in bytes).
    std::vector<int64_t> pos(static_cast<size_t>(length));
    for (int64_t p = 0; p < length; ++p) pos[static_cast<size_t>(p)] = p;
    load_pos_.grow_to(length);
    load_table_.grow_to(nblocks);
    load_k_.grow_to(static_cast<int64_t>(kv_bytes));
    load_v_.grow_to(static_cast<int64_t>(kv_bytes));
    ops::copy_from_host(load_pos_.data(), pos.data(), sizeof(int64_t) * pos.size());
    ops::copy_from_host(load_table_.data(), e.blocks.data(), sizeof(int32_t) * e.blocks.size());
    for (int64_t l = 0; l < layers; ++l) {
      ops::copy_from_host(load_k_.data(), r.keys[static_cast<size_t>(l)].data(), kv_bytes);
      ops::copy_from_host(load_v_.data(), r.values[static_cast<size_t>(l)].data(), kv_bytes);
      ops::kv_write_stored(state_.kv_layer(static_cast<int>(l)), load_table_.data(),
                           load_pos_.data(), length, load_k_.data(), load_v_.data());
    }
  }
  e.linear.grow_to(state_.linear_state_floats());
  ops::copy_from_host(e.linear.data(), r.linear.data(), sizeof(float) * r.linear.size());
  e.tokens = std::move(r.tokens);
  e.draft = std::move(r.draft);
  return add_entry(std::move(e), own);
}

std::optional<PrefixDiskLayout> PrefixCache::disk_layout() const {
  return PrefixDiskLayout{state_.kv_scheme(), state_.kv_dtype()};
}

void PrefixCache::persist_all() {
  if (!disk_) return;
  for (const auto& [id, e] : entries_) disk_writes_ += disk_->write(record(e));
}

void PrefixCache::evict(uint64_t id) {
  auto it = entries_.find(id);
  TANDEM_CHECK(it != entries_.end(), "prefix cache: evicting unknown entry ", id);
  Entry& e = it->second;
  // The disk tier keeps what memory lets go (a failed write only loses the entry, as without it).
  if (disk_) disk_writes_ += disk_->write(record(e));
  state_.release_blocks(e.blocks);
  for (int32_t b : e.blocks)
    if (--block_uses_.at(b) == 0) block_uses_.erase(b);
  own_bytes_ -= e.own_bytes;
  for_each_ancestor(e.tokens, [](Entry& a) { --a.descendants; });
  const int64_t length = static_cast<int64_t>(e.tokens.size());
  if (--lengths_.at(length) == 0) lengths_.erase(length);
  const auto [lo, hi] = by_hash_.equal_range(hash_tokens(e.tokens));
  for (auto h = lo; h != hi; ++h)
    if (h->second == id) {
      by_hash_.erase(h);
      break;
    }
  entries_.erase(it);
  ++evictions_;
}

uint64_t PrefixCache::oldest(uint64_t keep) const {
  auto rank = [](const Entry& e) { return e.hits > 0 ? 2 : e.descendants > 0 ? 0 : 1; };
  uint64_t best = 0;
  const Entry* b = nullptr;
  for (const auto& [id, e] : entries_) {
    if (id == keep) continue;
    if (!b || rank(e) < rank(*b) || (rank(e) == rank(*b) && e.last_use < b->last_use)) {
      best = id;
      b = &e;
    }
  }
  return best;
}

bool PrefixCache::make_room(int64_t blocks, uint64_t keep) {
  while (state_.free_block_count() < blocks) {
    const uint64_t id = oldest(keep);
    if (id == 0) return false;
    evict(id);
  }
  return true;
}

PrefixCacheStats PrefixCache::stats() const {
  PrefixCacheStats s;
  s.entries = static_cast<int64_t>(entries_.size());
  s.evictions = evictions_;
  s.kv_blocks = static_cast<int64_t>(block_uses_.size());
  s.bytes = bytes();
  s.max_bytes = max_bytes_;
  add_disk_stats(disk_, disk_writes_, disk_loads_, &s);
  return s;
}

std::vector<int64_t> PrefixCache::boundaries() const {
  std::vector<int64_t> out;
  for (const auto& [len, count] : lengths_) out.insert(out.end(), static_cast<size_t>(count), len);
  return out;
}

size_t checkpoint_bytes(const spec::Checkpoint* c) {
  if (!c) return 0;
  size_t n = c->tokens.size() * sizeof(int32_t);
  for (const auto& [name, t] : c->tensors) n += t.data.size() * sizeof(float);
  return n;
}

}  // namespace tandem
