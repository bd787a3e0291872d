// Per-row decoding state of a Qwen3.5 target: paged KV for the full-attention layers and
// per-slot conv + recurrent state for the Gated DeltaNet layers.
#pragma once

#include <cstdint>
#include <vector>

#include "tandem/backend/ops.h"
#include "tandem/model/qwen3_5_config.h"

namespace tandem {

// Fixed-size KV blocks shared by all rows; a row owns a list of blocks (its block table).
// Blocks are never moved, so a block id stays valid while the pool grows.
class Qwen35State {
 public:
  static constexpr int64_t kBlockSize = 16;

  explicit Qwen35State(const Qwen35Config& cfg);

  // Rows are slots; a freed slot is reused. A new row covers no tokens.
  int open_row();
  void close_row(int slot);
  bool row_open(int slot) const;
  int64_t length(int slot) const { return rows_.at(slot).length; }
  int row_capacity() const { return static_cast<int>(rows_.size()); }

  // Makes room for `new_length` tokens in the row's KV (allocates blocks, grows the pool).
  void reserve(int slot, int64_t new_length);
  // Marks tokens as processed; called by the model after a forward wrote them.
  void set_length(int slot, int64_t n) { rows_.at(slot).length = n; }
  const std::vector<int32_t>& block_table(int slot) const { return rows_.at(slot).blocks; }

  ops::KVLayerView kv_layer(int attn_layer);
  float* conv_state(int slot, int linear_layer);
  float* recurrent_state(int slot, int linear_layer);
  int64_t conv_state_floats() const { return conv_floats_; }
  int64_t recurrent_state_floats() const { return rec_floats_; }

  // Bytes held for KV + recurrent state (for reports).
  size_t bytes() const;

 private:
  struct Row {
    bool open = false;
    int64_t length = 0;
    std::vector<int32_t> blocks;
  };
  int64_t n_attn_ = 0, n_linear_ = 0, kv_heads_ = 0, head_dim_ = 0;
  int64_t conv_floats_ = 0, rec_floats_ = 0;
  std::vector<Row> rows_;
  std::vector<std::vector<float>> kv_pools_;  // per attention layer
  int64_t n_blocks_ = 0;
  std::vector<int32_t> free_blocks_;
  std::vector<std::vector<float>> linear_state_;  // per slot: [n_linear][conv | recurrent]

  void grow_pool(int64_t min_free);
};

}  // namespace tandem
