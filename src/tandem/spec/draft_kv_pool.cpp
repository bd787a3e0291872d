#include "tandem/spec/draft_kv_pool.h"

#include <algorithm>

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
  StepRows step;
  for (size_t i = 0; i < tables.size(); ++i) {
    step.rows.push_back(static_cast<int>(i));
    step.starts.push_back(lengths[i]);
    step.counts.push_back(counts[i]);
  }
  return std::move(upload(tables, {&step, 1}).front());
}

std::vector<AttentionBatch> DraftKvPool::chain(std::span<const std::vector<int32_t>* const> tables,
                                               std::span<const int64_t> lengths,
                                               std::span<const int> depths,
                                               std::span<const int64_t> completion,
                                               StagedUpload::Part* hold) {
  int steps = 0;
  for (int d : depths) steps = std::max(steps, d);
  std::vector<StepRows> rows(static_cast<size_t>(steps));
  if (steps > 0)
    for (size_t i = 0; i < completion.size(); ++i) {
      rows[0].rows.push_back(static_cast<int>(i));
      rows[0].starts.push_back(completion[i]);
      rows[0].counts.push_back(1);
    }
  for (int j = 0; j < steps; ++j)
    for (size_t i = 0; i < tables.size(); ++i)
      if (depths[i] > j) {
        rows[static_cast<size_t>(j)].rows.push_back(static_cast<int>(i));
        rows[static_cast<size_t>(j)].starts.push_back(lengths[i] + j);
        rows[static_cast<size_t>(j)].counts.push_back(1);
      }
  return upload(tables, rows, hold);
}

std::vector<AttentionBatch> DraftKvPool::upload(std::span<const std::vector<int32_t>* const> tables,
                                                std::span<const StepRows> steps,
                                                StagedUpload::Part* hold) {
  // Every table's bound: it sizes the attention's grid, and the largest sets the stride.
  std::vector<int64_t> bounds;
  int64_t stride = 1;
  for (const std::vector<int32_t>* t : tables) {
    bounds.push_back(attention_position_bound(static_cast<int64_t>(t->size()) * kBlockSize));
    stride = std::max(stride, bounds.back() / kBlockSize);
  }
  const int64_t R = static_cast<int64_t>(tables.size());
  size_t bytes =
      upload_part_bytes(sizeof(int32_t) * static_cast<size_t>(std::max<int64_t>(1, R * stride)));
  std::vector<size_t> at;  // each step's arrays
  for (const StepRows& s : steps) {
    int64_t T = 0;
    for (size_t k = 0; k < s.rows.size(); ++k) {
      const size_t i = static_cast<size_t>(s.rows[k]);
      const int64_t capacity = static_cast<int64_t>(tables[i]->size()) * kBlockSize;
      TANDEM_CHECK(capacity >= s.starts[k] + s.counts[k], "draft KV row ", i, " holds ", capacity,
                   " positions, needs ", s.starts[k] + s.counts[k]);
      T += s.counts[k];
    }
    at.push_back(bytes);
    bytes += upload_part_bytes(3 * sizeof(int64_t) * static_cast<size_t>(T));
  }
  uint8_t* host = batch_upload_.host(bytes);
  auto* table_rows = reinterpret_cast<int32_t*>(host);
  std::fill(table_rows, table_rows + R * stride, 0);
  for (int64_t i = 0; i < R; ++i) {
    const std::vector<int32_t>& t = *tables[static_cast<size_t>(i)];
    std::copy(t.begin(), t.end(), table_rows + i * stride);
  }
  batch_dev_.grow_to(static_cast<int64_t>(bytes));
  uint8_t* dev = batch_dev_.data();
  const auto* dev_tables = reinterpret_cast<const int32_t*>(dev);
  std::vector<AttentionBatch> out(steps.size());
  for (size_t j = 0; j < steps.size(); ++j) {
    const StepRows& s = steps[j];
    AttentionBatch& b = out[j];
    for (int64_t n : s.counts) b.tokens += n;
    const int64_t T = b.tokens;
    auto* pos = reinterpret_cast<int64_t*>(host + at[j]);
    int64_t t = 0;
    for (size_t k = 0; k < s.rows.size(); ++k) {
      const int i = s.rows[k];
      const std::vector<int32_t>& table = *tables[static_cast<size_t>(i)];
      b.segments.push_back(
          {dev_tables + i * stride, s.starts[k], s.counts[k], bounds[static_cast<size_t>(i)]});
      for (int64_t n = 0; n < s.counts[k]; ++n, ++t) {
        const int64_t p = s.starts[k] + n;
        pos[t] = p;
        pos[T + t] = ops::kv_slot_of(table.data(), kBlockSize, p);
        pos[2 * T + t] = i;
      }
    }
    b.positions = reinterpret_cast<const int64_t*>(dev + at[j]);
    b.kv_slots = b.positions + T;
    b.rows = AttentionRows{dev_tables, stride, b.positions + 2 * T};
  }
  if (hold)
    *hold = {&batch_upload_, dev, bytes};
  else
    batch_upload_.start(dev, bytes);
  return out;
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
  if (length == 0) return;
  // The row's blocks gathered into staging by one launch and read back once: a row's move
  // between engine groups costs one wait, not a copy-engine transfer per block.
  const int64_t nb = (length + kBlockSize - 1) / kBlockSize;
  const Staging st = stage(nb, StagedBlocks::Device);
  for (int64_t i = 0; i < nb; ++i) {
    st.moves[i] = blocks[static_cast<size_t>(i)];
    st.moves[nb + i] = static_cast<int32_t>(i);
  }
  const Staged dev = start_staging(st);
  ops::copy_blocks(dev.blocks, pool_.data(), dev.moves, nb, floats_per_block());
  std::vector<float>& host = saved_blocks_;
  host.resize(static_cast<size_t>(nb * floats_per_block()));
  ops::copy_to_host(host.data(), dev.blocks, sizeof(float) * host.size());
  // A staged block: kBlockSize keys, then kBlockSize values (the pool's layout).
  for (int64_t p = 0; p < length; p += kBlockSize) {
    const float* block = host.data() + (p / kBlockSize) * floats_per_block();
    const size_t n = static_cast<size_t>(kvf * std::min(kBlockSize, length - p));
    std::copy_n(block, n, keys.data.data() + p * kvf);
    std::copy_n(block + kBlockSize * kvf, n, values.data.data() + p * kvf);
  }
}

std::vector<int32_t> DraftKvPool::restore(const Checkpoint& c, int64_t length) {
  const CheckpointTensor& keys = c.tensors.at("kv_keys");
  const CheckpointTensor& values = c.tensors.at("kv_values");
  const int64_t kvf = kv_heads_ * head_dim_;
  std::vector<int32_t> blocks = take((length + kBlockSize - 1) / kBlockSize);
  if (length == 0) return blocks;
  // The blocks laid out in the pinned upload as the pool holds them, uploaded with their moves
  // in one copy and placed by one launch (stream-ordered before any later use of the staging).
  const int64_t nb = static_cast<int64_t>(blocks.size());
  const Staging st = stage(nb, StagedBlocks::Uploaded);
  for (int64_t i = 0; i < nb; ++i) {
    st.moves[i] = static_cast<int32_t>(i);
    st.moves[nb + i] = blocks[static_cast<size_t>(i)];
  }
  for (int64_t p = 0; p < length; p += kBlockSize) {
    float* block = st.blocks + (p / kBlockSize) * floats_per_block();
    const size_t n = static_cast<size_t>(kvf * std::min(kBlockSize, length - p));
    std::copy_n(keys.data.data() + p * kvf, n, block);
    std::copy_n(values.data.data() + p * kvf, n, block + kBlockSize * kvf);
  }
  const Staged dev = start_staging(st);
  ops::copy_blocks(pool_.data(), dev.blocks, dev.moves, nb, floats_per_block());
  return blocks;
}

std::vector<std::vector<int32_t>> DraftKvPool::copy_from(
    const DraftKvPool& src, std::span<const std::vector<int32_t>* const> tables,
    std::span<const int64_t> lengths) {
  TANDEM_CHECK(tables.size() == lengths.size(), tables.size(), " tables, ", lengths.size(),
               " lengths");
  if (src.kv_heads_ != kv_heads_ || src.head_dim_ != head_dim_)
    fail("draft KV copy: the source pool holds [", src.kv_heads_, ", ", src.head_dim_,
         "] per position, this one [", kv_heads_, ", ", head_dim_, "]");
  int64_t total = 0;
  for (size_t i = 0; i < tables.size(); ++i) {
    const int64_t nb = (lengths[i] + kBlockSize - 1) / kBlockSize;
    if (lengths[i] < 0 || nb > static_cast<int64_t>(tables[i]->size()))
      fail("draft KV copy: row ", i, " has ", tables[i]->size() * kBlockSize,
           " positions, asked to copy ", lengths[i]);
    total += nb;
  }
  // Every block is taken at once, then the tables split them in row order; a throw after that
  // gives them back, so a refusal leaves the pool as it was.
  std::vector<int32_t> taken = take(total);
  std::vector<std::vector<int32_t>> out(tables.size());
  if (total == 0) return out;
  try {
    const Staging st = stage(total, StagedBlocks::None);
    int64_t k = 0;
    for (size_t i = 0; i < tables.size(); ++i) {
      const int64_t nb = (lengths[i] + kBlockSize - 1) / kBlockSize;
      for (int64_t b = 0; b < nb; ++b, ++k) {
        st.moves[k] = (*tables[i])[static_cast<size_t>(b)];
        st.moves[total + k] = taken[static_cast<size_t>(k)];
      }
      out[i].assign(taken.begin() + (k - nb), taken.begin() + k);
    }
    const Staged dev = start_staging(st);
    ops::copy_blocks(pool_.data(), src.pool_.data(), dev.moves, total, floats_per_block());
  } catch (...) {
    release(taken);
    throw;
  }
  return out;
}

DraftKvPool::Staging DraftKvPool::stage(int64_t blocks, StagedBlocks staged) const {
  Staging st;
  st.moves_bytes = upload_part_bytes(sizeof(int32_t) * static_cast<size_t>(2 * blocks));
  const size_t block_bytes = staged == StagedBlocks::None
                                 ? 0
                                 : sizeof(float) * static_cast<size_t>(blocks * floats_per_block());
  const bool upload_blocks = staged == StagedBlocks::Uploaded;
  st.upload_bytes = st.moves_bytes + (upload_blocks ? block_bytes : 0);
  staging_.grow_to(static_cast<int64_t>(st.moves_bytes + block_bytes));
  uint8_t* host = staging_upload_.host(st.upload_bytes);
  st.moves = reinterpret_cast<int32_t*>(host);
  st.blocks = upload_blocks ? reinterpret_cast<float*>(host + st.moves_bytes) : nullptr;
  return st;
}

DraftKvPool::Staged DraftKvPool::start_staging(const Staging& st) const {
  staging_upload_.start(staging_.data(), st.upload_bytes);
  return {reinterpret_cast<const int32_t*>(staging_.data()),
          reinterpret_cast<float*>(staging_.data() + st.moves_bytes)};
}

}  // namespace tandem::spec
