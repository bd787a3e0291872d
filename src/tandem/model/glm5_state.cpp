#include "tandem/model/glm5_state.h"

#include "tandem/core/error.h"

namespace tandem {

namespace {

std::vector<PositionCache> empty_caches(int64_t layers, int64_t width) {
  std::vector<PositionCache> c;
  for (int64_t l = 0; l < layers; ++l) c.emplace_back(width);
  return c;
}

}  // namespace

Glm5State::Glm5State(const Glm5Config& cfg, int max_rows)
    : latent_width_(cfg.kv_lora_rank + cfg.qk_rope_head_dim),
      index_width_(cfg.index_head_dim),
      layers_(cfg.num_hidden_layers),
      grows_(max_rows == 0) {
  if (max_rows < 0) fail("Glm5State: max_rows must be >= 0, got ", max_rows);
  layout_ = "glm5 caches=f32 layers=" + std::to_string(layers_) +
            " latent=" + std::to_string(latent_width_) + " index=" + std::to_string(index_width_) +
            " indexed=";
  for (int64_t l = 0; l < layers_; ++l) {
    const auto i = static_cast<size_t>(l);
    indexed_.push_back(i >= cfg.shared_index_layers.size() || !cfg.shared_index_layers[i]);
    layout_ += indexed_.back() ? '1' : '0';
  }
  rows_.resize(static_cast<size_t>(max_rows));
}

int Glm5State::open_row() {
  for (size_t i = 0; i < rows_.size(); ++i) {
    Row& r = rows_[i];
    if (r.open) continue;
    r = Row{};
    r.open = true;
    r.latent = empty_caches(layers_, latent_width_);
    r.index_keys = empty_caches(layers_, index_width_);
    return static_cast<int>(i);
  }
  if (!grows_) fail("Glm5State: all ", rows_.size(), " row slots are open");
  rows_.emplace_back();
  return open_row();
}

Glm5State::Row& Glm5State::row(int slot) {
  return const_cast<Row&>(static_cast<const Glm5State*>(this)->row(slot));
}

const Glm5State::Row& Glm5State::row(int slot) const {
  if (slot < 0 || slot >= max_rows())
    fail("Glm5State: row slot ", slot, " is out of range [0, ", max_rows(), ")");
  const Row& r = rows_[static_cast<size_t>(slot)];
  if (!r.open) fail("Glm5State: row slot ", slot, " is not open");
  return r;
}

void Glm5State::close_row(int slot) {
  row(slot) = Row{};
}

bool Glm5State::row_open(int slot) const {
  return slot >= 0 && slot < max_rows() && rows_[static_cast<size_t>(slot)].open;
}

int64_t Glm5State::length(int slot) const {
  return row(slot).length;
}

int64_t Glm5State::window(int slot) const {
  return row(slot).window;
}

uint64_t Glm5State::bytes() const {
  uint64_t n = 0;
  for (const Row& r : rows_) {
    for (const PositionCache& c : r.latent) n += c.bytes();
    for (const PositionCache& c : r.index_keys) n += c.bytes();
  }
  return n;
}

uint64_t Glm5State::RowSnapshot::bytes() const {
  uint64_t n = 0;
  for (const auto& v : latent) n += v.size() * sizeof(float);
  for (const auto& v : index_keys) n += v.size() * sizeof(float);
  return n;
}

Glm5State::RowSnapshot Glm5State::snapshot(int slot) const {
  const Row& r = row(slot);
  if (r.window > 0)
    fail("Glm5State: row slot ", slot, " has an uncommitted window of ", r.window, " tokens");
  RowSnapshot s;
  s.length = r.length;
  for (const PositionCache& c : r.latent) s.latent.push_back(c.to_host());
  for (const PositionCache& c : r.index_keys) s.index_keys.push_back(c.to_host());
  return s;
}

void Glm5State::restore(int slot, const RowSnapshot& s) {
  Row& r = row(slot);
  if (r.length != 0 || r.window != 0) fail("Glm5State: row slot ", slot, " is not empty");
  if (!fits(s))
    fail("Glm5State: a snapshot of ", s.latent.size(), " layers and ", s.length,
         " positions does not fit this state's layout (", layout_, ")");
  std::vector<PositionCache> latent = empty_caches(layers_, latent_width_),
                             index_keys = empty_caches(layers_, index_width_);
  for (size_t l = 0; l < latent.size(); ++l) {  // may throw (out of memory): r is still empty
    latent[l].assign_host(s.latent[l]);
    index_keys[l].assign_host(s.index_keys[l]);
  }
  r.latent.swap(latent);
  r.index_keys.swap(index_keys);
  r.length = s.length;
}

bool Glm5State::fits(const RowSnapshot& s) const {
  if (s.length < 1 || static_cast<int64_t>(s.latent.size()) != layers_ ||
      static_cast<int64_t>(s.index_keys.size()) != layers_)
    return false;
  for (int64_t l = 0; l < layers_; ++l) {
    const auto i = static_cast<size_t>(l);
    const int64_t index_width = indexed_[i] ? index_width_ : 0;
    if (static_cast<int64_t>(s.latent[i].size()) != s.length * latent_width_ ||
        static_cast<int64_t>(s.index_keys[i].size()) != s.length * index_width)
      return false;
  }
  return true;
}

void Glm5State::truncate(Row& r, int64_t length) const {
  for (PositionCache& c : r.latent)
    if (c.length() > length) c.truncate(length);
  for (PositionCache& c : r.index_keys)
    if (c.length() > length) c.truncate(length);
  r.length = length;
}

}  // namespace tandem
