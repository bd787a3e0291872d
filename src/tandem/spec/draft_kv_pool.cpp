#include "tandem/spec/draft_kv_pool.h"

#include <algorithm>
#include <cstring>

#include "tandem/core/error.h"

namespace tandem::spec {

ops::KVLayerView DraftKvPool::view() const {
  ops::KVLayerView v;
  // Written only through the block forwards and restore, which own the blocks they write.
  v.pool = const_cast<float*>(pool_.data());
  v.dtype = DType::F32;
  v.block_size = kBlockSize;
  v.n_kv_heads = kv_heads_;
  v.head_dim = head_dim_;
  return v;
}

std::vector<int32_t> DraftKvPool::take(int64_t n) {
  if (static_cast<int64_t>(free_.size()) < n) {
    const int64_t add = std::max<int64_t>({n, n_blocks_, 16});
    pool_.grow_to((n_blocks_ + add) * floats_per_block());
    // Capacity for every block: giving blocks back never reallocates.
    free_.reserve(static_cast<size_t>(n_blocks_ + add));
    for (int64_t b = n_blocks_ + add - 1; b >= n_blocks_; --b)
      free_.push_back(static_cast<int32_t>(b));
    n_blocks_ += add;
  }
  std::vector<int32_t> out(free_.end() - n, free_.end());
  std::reverse(out.begin(), out.end());
  free_.resize(free_.size() - static_cast<size_t>(n));
  return out;
}

void DraftKvPool::reserve(std::vector<int32_t>& blocks, int64_t length) {
  const int64_t missing =
      (length + kBlockSize - 1) / kBlockSize - static_cast<int64_t>(blocks.size());
  if (missing <= 0) return;
  const std::vector<int32_t> got = take(missing);
  blocks.insert(blocks.end(), got.begin(), got.end());
}

void DraftKvPool::release(std::vector<int32_t>& blocks) {
  free_.insert(free_.end(), blocks.begin(), blocks.end());
  blocks.clear();
}

std::vector<AttentionSegment> DraftKvPool::segments(
    std::span<const std::vector<int32_t>* const> tables, std::span<const int64_t> lengths,
    std::span<const int64_t> counts) {
  tables_host_.clear();
  std::vector<int64_t> offset;
  for (const std::vector<int32_t>* t : tables) {
    offset.push_back(static_cast<int64_t>(tables_host_.size()));
    tables_host_.insert(tables_host_.end(), t->begin(), t->end());
  }
  tables_dev_.grow_to(std::max<int64_t>(1, static_cast<int64_t>(tables_host_.size())));
  ops::copy_from_host(tables_dev_.data(), tables_host_.data(),
                      sizeof(int32_t) * tables_host_.size());
  std::vector<AttentionSegment> segs;
  for (size_t i = 0; i < tables.size(); ++i) {
    const int64_t capacity = static_cast<int64_t>(tables[i]->size()) * kBlockSize;
    segs.push_back({tables_dev_.data() + offset[i], lengths[i], counts[i],
                    attention_position_bound(capacity)});
  }
  return segs;
}

AttentionBatch DraftKvPool::batch(std::span<const std::vector<int32_t>* const> tables,
                                  std::span<const int64_t> lengths,
                                  std::span<const int64_t> counts) {
  AttentionBatch b;
  int64_t stride = 1;
  for (size_t i = 0; i < tables.size(); ++i) {
    const int64_t blocks = static_cast<int64_t>(tables[i]->size());
    TANDEM_CHECK(blocks * kBlockSize >= lengths[i] + counts[i], "draft KV row ", i, " holds ",
                 blocks * kBlockSize, " positions, needs ", lengths[i] + counts[i]);
    const int64_t bound = attention_position_bound(blocks * kBlockSize);
    b.segments.push_back({nullptr, lengths[i], counts[i], bound});
    stride = std::max(stride, bound / kBlockSize);
    b.tokens += counts[i];
  }
  const int64_t T = b.tokens, R = static_cast<int64_t>(tables.size());
  const size_t per_token = sizeof(int64_t) * static_cast<size_t>(T);
  const size_t tables_at = (3 * per_token + 255) / 256 * 256;
  const size_t bytes =
      tables_at + sizeof(int32_t) * static_cast<size_t>(std::max<int64_t>(1, R * stride));
  uint8_t* host = batch_upload_.host(bytes);
  std::memset(host + tables_at, 0, bytes - tables_at);
  auto* pos = reinterpret_cast<int64_t*>(host);
  int32_t* table_rows = reinterpret_cast<int32_t*>(host + tables_at);
  int64_t t = 0;
  for (int64_t i = 0; i < R; ++i) {
    const std::vector<int32_t>& table = *tables[static_cast<size_t>(i)];
    std::copy(table.begin(), table.end(), table_rows + i * stride);
    for (int64_t j = 0; j < counts[static_cast<size_t>(i)]; ++j, ++t) {
      const int64_t p = lengths[static_cast<size_t>(i)] + j;
      pos[t] = p;
      pos[T + t] =
          int64_t{table[static_cast<size_t>(p / kBlockSize)]} * kBlockSize + p % kBlockSize;
      pos[2 * T + t] = i;
    }
  }
  batch_dev_.grow_to(static_cast<int64_t>(bytes));
  uint8_t* dev = batch_dev_.data();
  batch_upload_.start(dev, bytes);
  b.positions = reinterpret_cast<const int64_t*>(dev);
  b.kv_slots = b.positions + T;
  const auto* dev_tables = reinterpret_cast<const int32_t*>(dev + tables_at);
  b.rows = AttentionRows{dev_tables, stride, b.positions + 2 * T};
  for (int64_t i = 0; i < R; ++i)
    b.segments[static_cast<size_t>(i)].block_table = dev_tables + i * stride;
  return b;
}

int64_t DraftKvPool::checkpoint_rows(const Checkpoint& c, const std::string& who) const {
  const auto keys = c.tensors.find("kv_keys");
  const int64_t rows =
      keys == c.tensors.end() || keys->second.shape.empty() ? 0 : keys->second.shape.front();
  checkpoint_tensor(c, who, "kv_keys", {rows, kv_heads_, head_dim_});
  checkpoint_tensor(c, who, "kv_values", {rows, kv_heads_, head_dim_});
  return rows;
}

void DraftKvPool::save(const std::vector<int32_t>& blocks, int64_t length, Checkpoint& c) const {
  CheckpointTensor& keys = c.tensors["kv_keys"];
  CheckpointTensor& values = c.tensors["kv_values"];
  const int64_t kvf = kv_heads_ * head_dim_;
  keys.shape = values.shape = {length, kv_heads_, head_dim_};
  keys.data.resize(static_cast<size_t>(length * kvf));
  values.data.resize(static_cast<size_t>(length * kvf));
  const ops::KVLayerView kv = view();
  for (int64_t p = 0; p < length; p += kBlockSize) {  // a block's keys (values) are contiguous
    const int32_t b = blocks[static_cast<size_t>(p / kBlockSize)];
    const size_t bytes = sizeof(float) * kvf * std::min(kBlockSize, length - p);
    ops::copy_to_host(keys.data.data() + p * kvf, kv.key(b, 0), bytes);
    ops::copy_to_host(values.data.data() + p * kvf, kv.value(b, 0), bytes);
  }
}

std::vector<int32_t> DraftKvPool::restore(const Checkpoint& c, int64_t length) {
  const CheckpointTensor& keys = c.tensors.at("kv_keys");
  const CheckpointTensor& values = c.tensors.at("kv_values");
  const int64_t kvf = kv_heads_ * head_dim_;
  std::vector<int32_t> blocks = take((length + kBlockSize - 1) / kBlockSize);
  const ops::KVLayerView kv = view();
  for (int64_t p = 0; p < length; p += kBlockSize) {
    const int32_t b = blocks[static_cast<size_t>(p / kBlockSize)];
    const size_t bytes = sizeof(float) * kvf * std::min(kBlockSize, length - p);
    ops::copy_from_host(kv.key(b, 0), keys.data.data() + p * kvf, bytes);
    ops::copy_from_host(kv.value(b, 0), values.data.data() + p * kvf, bytes);
  }
  return blocks;
}

}  // namespace tandem::spec
