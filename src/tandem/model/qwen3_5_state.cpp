#include "tandem/model/qwen3_5_state.h"

#include <algorithm>

#include "tandem/core/error.h"

namespace tandem {

Qwen35State::Qwen35State(const Qwen35Config& cfg, RecurrentRollback rollback, DType kv_dtype)
    : rollback_(rollback), kv_dtype_(kv_dtype) {
  ops::check_kv_dtype(kv_dtype, "Qwen35State");
  for (LayerKind k : cfg.layer_types) (k == LayerKind::FullAttention ? n_attn_ : n_linear_)++;
  kv_heads_ = cfg.num_key_value_heads;
  head_dim_ = cfg.head_dim;
  conv_floats_ = cfg.linear_conv_dim() * (cfg.linear_conv_kernel_dim - 1);
  rec_floats_ = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim;
  conv_dim_ = cfg.linear_conv_dim();
  n_v_heads_ = cfg.linear_num_value_heads;
  kv_pools_.resize(static_cast<size_t>(n_attn_));
}

void Qwen35State::set_capacity(const Capacity& cap) {
  TANDEM_CHECK(rows_.empty() && n_blocks_ == 0, "set_capacity on a state already in use");
  if (cap.rows < 1 || cap.blocks < 0 || cap.window_tokens < 1)
    fail("state capacity: ", cap.rows, " rows, ", cap.blocks, " blocks, windows of ",
         cap.window_tokens, " tokens");
  if (n_attn_ > 0) grow_pool(cap.blocks);
  // grow_pool rounds small requests up; a fixed pool holds exactly what was asked for.
  if (n_attn_ > 0 && n_blocks_ > cap.blocks) {
    free_blocks_.clear();
    for (int64_t b = cap.blocks - 1; b >= 0; --b) free_blocks_.push_back(static_cast<int32_t>(b));
    n_blocks_ = cap.blocks;
    holders_.resize(static_cast<size_t>(n_blocks_));
  }
  rows_.resize(static_cast<size_t>(cap.rows));
  linear_state_.resize(static_cast<size_t>(cap.rows));
  const int64_t blocks_per_row = n_attn_ > 0 ? cap.blocks : 0;
  for (size_t i = 0; i < rows_.size(); ++i) {
    linear_state_[i].grow_to(n_linear_ * (conv_floats_ + rec_floats_));
    rows_[i].window.grow_to(n_linear_ * window_layer_floats(cap.window_tokens));
    rows_[i].blocks.reserve(static_cast<size_t>(blocks_per_row));
  }
  if (rollback_ == RecurrentRollback::Replay) {
    recording_capacity_ = cap.rows * cap.window_tokens;
    recording_.grow_to(n_linear_ * recording_capacity_ * recorded_token_floats());
  }
  settled_shift_.grow_to(cap.rows);
  max_window_ = cap.window_tokens;
  fixed_ = true;
}

size_t Qwen35State::block_bytes(const Qwen35Config& cfg, DType kv_dtype) {
  ops::check_kv_dtype(kv_dtype, "Qwen35State::block_bytes");
  int64_t n_attn = 0;
  for (LayerKind k : cfg.layer_types) n_attn += k == LayerKind::FullAttention;
  return static_cast<size_t>(n_attn * 2 * kBlockSize * cfg.num_key_value_heads * cfg.head_dim) *
         dtype_size(kv_dtype);
}

size_t Qwen35State::row_bytes(const Qwen35Config& cfg, int64_t window_tokens,
                              RecurrentRollback rollback) {
  Qwen35State probe(cfg, rollback);
  const int64_t layer = probe.conv_floats_ + probe.rec_floats_;
  // Replay: the row's share of the recording (set_capacity sizes it at rows x window_tokens).
  const int64_t window = rollback == RecurrentRollback::Replay
                             ? window_tokens * probe.recorded_token_floats()
                             : probe.window_layer_floats(window_tokens);
  return static_cast<size_t>(probe.n_linear_ * (layer + window)) * sizeof(float);
}

int Qwen35State::open_row_count() const {
  int n = 0;
  for (const Row& r : rows_) n += r.open;
  return n;
}

int Qwen35State::open_row() {
  int slot = -1;
  for (size_t i = 0; i < rows_.size(); ++i)
    if (!rows_[i].open) {
      slot = static_cast<int>(i);
      break;
    }
  if (slot < 0 && fixed_)
    fail("no free row slot: all ", rows_.size(), " slots of the state's fixed pool are in use");
  if (slot < 0) {
    slot = static_cast<int>(rows_.size());
    rows_.emplace_back();
    linear_state_.emplace_back();
  }
  Row& r = rows_[slot];
  r.open = true;
  r.length = 0;
  r.blocks.clear();
  r.window_start = r.window_n = 0;
  r.settling.clear();
  r.known_shift = 0;
  linear_state_[slot].grow_to(n_linear_ * (conv_floats_ + rec_floats_));
  linear_state_[slot].zero();
  settled_shift_.grow_to(static_cast<int64_t>(rows_.size()));
  ops::fill_zero(settled_shift_.data() + slot, sizeof(int64_t));
  return slot;
}

void Qwen35State::close_row(int slot) {
  Row& r = rows_.at(slot);
  TANDEM_CHECK(r.open, "close_row on a closed slot");
  release_blocks(r.blocks);
  r.blocks.clear();
  r.open = false;
  r.length = 0;
  r.window_start = r.window_n = 0;  // an uncommitted window dies with its row
  r.settling.clear();
  r.known_shift = 0;
}

bool Qwen35State::row_open(int slot) const {
  return slot >= 0 && slot < static_cast<int>(rows_.size()) && rows_[slot].open;
}

void Qwen35State::grow_pool(int64_t min_free) {
  const int64_t add = std::max<int64_t>({min_free, n_blocks_, 16});
  const int64_t per_block = 2 * kBlockSize * static_cast<int64_t>(kv_token_bytes());
  for (auto& pool : kv_pools_) pool.grow_to((n_blocks_ + add) * per_block);
  for (int64_t b = n_blocks_ + add - 1; b >= n_blocks_; --b)
    free_blocks_.push_back(static_cast<int32_t>(b));
  n_blocks_ += add;
  holders_.resize(static_cast<size_t>(n_blocks_), 0);
}

void Qwen35State::retain_blocks(std::span<const int32_t> blocks) {
  for (int32_t b : blocks) {
    TANDEM_CHECK(b >= 0 && b < n_blocks_ && holders_[static_cast<size_t>(b)] > 0,
                 "retain of block ", b, ", which nobody holds");
    ++holders_[static_cast<size_t>(b)];
  }
}

void Qwen35State::release_blocks(std::span<const int32_t> blocks) {
  for (int32_t b : blocks) {
    int32_t& h = holders_.at(static_cast<size_t>(b));
    TANDEM_CHECK(h > 0, "release of free block ", b);
    if (--h == 0) free_blocks_.push_back(b);
  }
}

int32_t Qwen35State::copy_block(int32_t src) {
  TANDEM_CHECK(src >= 0 && src < n_blocks_ && holders_[static_cast<size_t>(src)] > 0,
               "copy of block ", src, ", which nobody holds");
  std::vector<int32_t> taken;
  take_blocks(1, &taken);
  const int32_t dst = taken[0];
  const int64_t per_block = 2 * kBlockSize * static_cast<int64_t>(kv_token_bytes());
  for (auto& pool : kv_pools_)
    ops::copy(pool.data() + dst * per_block, pool.data() + src * per_block,
              static_cast<size_t>(per_block));
  return dst;
}

void Qwen35State::take_blocks(int64_t n, std::vector<int32_t>* out) {
  if (static_cast<int64_t>(free_blocks_.size()) < n) {
    if (fixed_)
      fail("out of KV blocks: ", n, " needed, ", free_blocks_.size(), " of ", n_blocks_,
           " are free");
    grow_pool(n - static_cast<int64_t>(free_blocks_.size()));
  }
  for (int64_t i = 0; i < n; ++i) {
    out->push_back(free_blocks_.back());
    holders_[static_cast<size_t>(free_blocks_.back())] = 1;
    free_blocks_.pop_back();
  }
}

std::string Qwen35State::kv_scheme() const {
  return std::string(kv_dtype_ == DType::BF16 ? "kv=bf16" : "kv=f32") +
         " state=f32 block=" + std::to_string(kBlockSize) +
         " attention=" + std::to_string(n_attn_) + "x" + std::to_string(kv_heads_) + "x" +
         std::to_string(head_dim_) + " linear=" + std::to_string(n_linear_) + "x" +
         std::to_string(conv_floats_) + "+" + std::to_string(rec_floats_);
}

void Qwen35State::attach_prefix(int slot, std::span<const int32_t> blocks, int64_t length,
                                const float* linear) {
  Row& r = rows_.at(slot);
  TANDEM_CHECK(r.open && r.length == 0 && r.blocks.empty() && r.window_n == 0,
               "attach_prefix needs an empty open row");
  const int64_t full = length / kBlockSize;
  const bool tail = length % kBlockSize != 0;
  TANDEM_CHECK(n_attn_ == 0 || static_cast<int64_t>(blocks.size()) == full + tail,
               "attach_prefix: ", blocks.size(), " blocks for ", length, " tokens");
  if (n_attn_ > 0) {
    // The copy first: it is the only step that can fail.
    const int32_t own = tail ? copy_block(blocks[static_cast<size_t>(full)]) : -1;
    retain_blocks(blocks.first(static_cast<size_t>(full)));
    r.blocks.assign(blocks.begin(), blocks.begin() + full);
    if (tail) r.blocks.push_back(own);
  }
  ops::copy(linear_state_[slot].data(), linear,
            sizeof(float) * static_cast<size_t>(linear_state_floats()));
  r.length = length;
}

void Qwen35State::reserve(int slot, int64_t new_length) {
  Row& r = rows_.at(slot);
  TANDEM_CHECK(r.open, "reserve on a closed slot");
  const int64_t need = (new_length + kBlockSize - 1) / kBlockSize;
  const int64_t missing = need - static_cast<int64_t>(r.blocks.size());
  if (missing <= 0 || n_attn_ == 0) return;
  if (fixed_ && static_cast<int64_t>(free_blocks_.size()) < missing)
    fail("out of KV blocks: row slot ", slot, " needs ", missing, " more for ", new_length,
         " tokens, ", free_blocks_.size(), " of ", n_blocks_, " are free");
  take_blocks(missing, &r.blocks);
}

ops::KVLayerView Qwen35State::kv_layer(int attn_layer) {
  ops::KVLayerView v;
  v.pool = kv_pools_.at(attn_layer).data();
  v.dtype = kv_dtype_;
  v.block_size = kBlockSize;
  v.n_kv_heads = kv_heads_;
  v.head_dim = head_dim_;
  return v;
}

float* Qwen35State::conv_state(int slot, int linear_layer) {
  return linear_state_.at(slot).data() + linear_layer * (conv_floats_ + rec_floats_);
}

float* Qwen35State::recurrent_state(int slot, int linear_layer) {
  return conv_state(slot, linear_layer) + conv_floats_;
}

const float* Qwen35State::conv_state(int slot, int linear_layer) const {
  return linear_state_.at(slot).data() + linear_layer * (conv_floats_ + rec_floats_);
}

const float* Qwen35State::recurrent_state(int slot, int linear_layer) const {
  return conv_state(slot, linear_layer) + conv_floats_;
}

int64_t Qwen35State::window_layer_floats(int64_t n) const {
  return rollback_ == RecurrentRollback::PerPositionStates ? n * (conv_floats_ + rec_floats_) : 0;
}

void Qwen35State::begin_recording(int64_t tokens) {
  TANDEM_CHECK(rollback_ == RecurrentRollback::Replay, "begin_recording without Replay rollback");
  for (size_t i = 0; i < rows_.size(); ++i)
    if (rows_[i].window_n > 0)
      fail("forward: row slot ", i, "'s speculative window (", rows_[i].window_n,
           " tokens) is not committed yet; its inputs are in the state's recording, which holds "
           "one forward's windows (Replay rollback): commit_windows first");
  if (fixed_ && tokens > recording_capacity_)
    fail("forward: a speculative forward of ", tokens, " tokens exceeds the fixed pool's ",
         recording_capacity_, " (rows x window tokens); send prompts in their own forward");
  recording_.grow_to(n_linear_ * tokens * recorded_token_floats());
  recorded_tokens_ = tokens;
}

void Qwen35State::begin_window(int slot, int64_t n, int64_t first_token) {
  Row& r = rows_.at(slot);
  TANDEM_CHECK(r.open, "begin_window on a closed slot");
  if (r.window_n > 0)
    fail("row slot ", slot, " already has an uncommitted speculative window (", r.window_n,
         " tokens from position ", r.window_start, "); commit_windows must close it first");
  if (n <= 0) fail("begin_window: row slot ", slot, " window of ", n, " tokens");
  if (fixed_ && n > max_window_)
    fail("row slot ", slot, ": a window of ", n, " tokens exceeds the pool's ", max_window_);
  // Grown, never shrunk: after the largest window a slot sees, verify rounds allocate nothing.
  r.window.grow_to(n_linear_ * window_layer_floats(n));
  if (rollback_ == RecurrentRollback::Replay)
    TANDEM_CHECK(first_token >= 0 && first_token + n <= recorded_tokens_, "begin_window: tokens ",
                 first_token, "..", first_token + n, " outside the recording of ",
                 recorded_tokens_);
  r.window_start = r.length;
  r.window_n = n;
  r.window_first = first_token;
}

void Qwen35State::end_window(int slot, int64_t kept) {
  Row& r = rows_.at(slot);
  TANDEM_CHECK(r.window_n > 0 && kept >= 1 && kept <= r.window_n, "end_window: bad window/kept");
  r.length = r.window_start + kept;
  r.window_start = r.window_n = 0;
}

void Qwen35State::settle_window(int slot) {
  Row& r = rows_.at(slot);
  TANDEM_CHECK(r.window_n > 0, "settle_window: row slot ", slot, " has no open window");
  r.settling.push_back(r.window_n);
  r.length = r.window_start + 1;
  r.window_start = r.window_n = 0;
}

void Qwen35State::resolve_settled(int slot, int64_t kept) {
  if (!row_open(slot)) fail("resolve_settled: row slot ", slot, " is not open");
  Row& r = rows_[slot];
  if (r.settling.empty())
    fail("resolve_settled: row slot ", slot, " has no commit settled on the device to resolve");
  const int64_t n = r.settling.front();
  if (kept < 1 || kept > n)
    fail("resolve_settled: row slot ", slot, " keeps ", kept, " tokens of a ", n,
         "-token window (must be 1..", n, ")");
  r.settling.pop_front();
  r.length += kept - 1;
  r.known_shift += kept - 1;
}

void Qwen35State::resolve_settled(std::span<const RowKeep> rows) {
  // Dry run on copies of the rows' queues, then the real one (which cannot fail any more).
  std::vector<std::pair<int, std::deque<int64_t>>> queues;
  for (const RowKeep& k : rows) {
    if (!row_open(k.slot)) fail("resolve_settled: row slot ", k.slot, " is not open");
    auto it = std::find_if(queues.begin(), queues.end(),
                           [&](const auto& q) { return q.first == k.slot; });
    if (it == queues.end()) {
      queues.emplace_back(k.slot, rows_[k.slot].settling);
      it = queues.end() - 1;
    }
    if (it->second.empty())
      fail("resolve_settled: row slot ", k.slot, " has no commit settled on the device to resolve");
    const int64_t n = it->second.front();
    if (k.kept < 1 || k.kept > n)
      fail("resolve_settled: row slot ", k.slot, " keeps ", k.kept, " tokens of a ", n,
           "-token window (must be 1..", n, ")");
    it->second.pop_front();
  }
  for (const RowKeep& k : rows) resolve_settled(k.slot, k.kept);
}

int64_t Qwen35State::unresolved_tokens(int slot) const {
  int64_t n = 0;
  for (int64_t w : rows_.at(slot).settling) n += w - 1;
  return n;
}

float* Qwen35State::window_layer(int slot, int linear_layer) {
  Row& r = rows_.at(slot);
  TANDEM_CHECK(r.window_n > 0, "window buffer of a row without an open window");
  return r.window.data() + linear_layer * window_layer_floats(r.window_n);
}

float* Qwen35State::window_conv_after(int slot, int linear_layer) {
  if (rollback_ != RecurrentRollback::PerPositionStates) return nullptr;
  return window_layer(slot, linear_layer);
}

float* Qwen35State::window_recurrent_after(int slot, int linear_layer) {
  if (rollback_ != RecurrentRollback::PerPositionStates) return nullptr;
  return window_layer(slot, linear_layer) + window_size(slot) * conv_floats_;
}

float* Qwen35State::recorded_conv_input(int linear_layer) {
  if (rollback_ != RecurrentRollback::Replay || recorded_tokens_ == 0) return nullptr;
  TANDEM_CHECK(linear_layer >= 0 && linear_layer < n_linear_, "recorded layer ", linear_layer);
  return recording_.data() + linear_layer * recorded_tokens_ * recorded_token_floats();
}

float* Qwen35State::recorded_b(int linear_layer) {
  float* x = recorded_conv_input(linear_layer);
  return x ? x + recorded_tokens_ * conv_dim_ : nullptr;
}

float* Qwen35State::recorded_a(int linear_layer) {
  float* b = recorded_b(linear_layer);
  return b ? b + recorded_tokens_ * n_v_heads_ : nullptr;
}

size_t Qwen35State::bytes() const {
  size_t n = 0;
  for (const auto& p : kv_pools_) n += static_cast<size_t>(p.size());
  for (const auto& s : linear_state_) n += static_cast<size_t>(s.size()) * sizeof(float);
  for (const Row& r : rows_) n += static_cast<size_t>(r.window.size()) * sizeof(float);
  return n + static_cast<size_t>(recording_.size()) * sizeof(float);
}

}  // namespace tandem
