// Paged fp32 KV of a drafter's own attention layer, shared by the rows of one DraftRows: blocks
// of kBlockSize positions handed to rows and given back, a pool that grows geometrically (block
// ids never move), checkpoint copies, and the attention segments of a block forward.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "tandem/backend/buffer.h"
#include "tandem/backend/ops.h"
#include "tandem/backend/staged_upload.h"
#include "tandem/model/gated_attention.h"
#include "tandem/spec/checkpoint.h"

namespace tandem::spec {

class DraftKvPool {
 public:
  static constexpr int64_t kBlockSize = 16;

  DraftKvPool(int64_t kv_heads, int64_t head_dim) : kv_heads_(kv_heads), head_dim_(head_dim) {}

  // fp32 whatever the target's KV: a drafter's checkpoints are fp32 tensors, and one layer's KV
  // is a small part of the target's.
  ops::KVLayerView view() const;
  // Grows `blocks` (a row's table) to hold `length` positions.
  void reserve(std::vector<int32_t>& blocks, int64_t length);
  // Returns a row's blocks to the pool (blocks is left empty). Never allocates.
  void release(std::vector<int32_t>& blocks);

  // The attention segments of one block forward: row i (table tables[i]) appends counts[i] rows
  // after its lengths[i]. Tables are uploaded into scratch the segments point into, valid until
  // the next call.
  std::vector<AttentionSegment> segments(std::span<const std::vector<int32_t>* const> tables,
                                         std::span<const int64_t> lengths,
                                         std::span<const int64_t> counts);

  // The same rows for the attention of all rows at once (AttentionBatch): positions, KV slots,
  // query rows and tables go up in one copy into scratch the result points into, valid until
  // the next call. Tables sit at a stride of the largest position bound (in blocks), so a row's
  // table address changes only when a bound does: a graph captured around the forward stays
  // valid while the rows grow below their bounds. Every table must hold lengths[i] + counts[i]
  // positions (reserve).
  AttentionBatch batch(std::span<const std::vector<int32_t>* const> tables,
                       std::span<const int64_t> lengths, std::span<const int64_t> counts);

  // The batches of a draft chain, uploaded in one copy: step j appends one row at
  // lengths[i] + j to every row i with depths[i] > j. Tables are shared by all steps (each must
  // hold lengths[i] + depths[i] positions), so segment i of a step points at row i's table
  // wherever the rows that stopped drafting left it. Valid until the next batch or chain call.
  // completion (optional, one position per row): step 0 first appends one row at completion[i]
  // to every row i (an MTP commit's completion rows, DraftRows::settle), then the chain's.
  // hold (optional): the copy is not started but described there, for the caller to start with
  // the chain's other inputs (StagedUpload::start_together) before anything reads the batches.
  std::vector<AttentionBatch> chain(std::span<const std::vector<int32_t>* const> tables,
                                    std::span<const int64_t> lengths, std::span<const int> depths,
                                    std::span<const int64_t> completion = {},
                                    StagedUpload::Part* hold = nullptr);

  // The rows a checkpoint's KV tensors kv_keys and kv_values [rows, kv_heads, head_dim] hold;
  // throws tandem::Error naming `who` unless both are there in this pool's shape.
  int64_t checkpoint_rows(const Checkpoint& c, const std::string& who) const;
  // Writes the first `length` positions of a table into a checkpoint's KV tensors.
  void save(const std::vector<int32_t>& blocks, int64_t length, Checkpoint& c) const;
  // A fresh table holding the first `length` rows of a checkpoint's KV tensors (checked by
  // checkpoint_rows).
  std::vector<int32_t> restore(const Checkpoint& c, int64_t length);

  // Fresh tables holding copies of the first lengths[i] positions of tables[i] of `src` (a pool
  // of this shape in the same backend memory), in order: one launch for all rows, no host copy.
  // On a throw nothing was taken from this pool.
  std::vector<std::vector<int32_t>> copy_from(const DraftKvPool& src,
                                              std::span<const std::vector<int32_t>* const> tables,
                                              std::span<const int64_t> lengths);

  int64_t kv_heads() const { return kv_heads_; }
  int64_t head_dim() const { return head_dim_; }

 private:
  int64_t kv_heads_ = 0, head_dim_ = 0;
  Buffer<float> pool_;  // [n_blocks, 2, kBlockSize, kv_heads, head_dim], backend memory
  int64_t n_blocks_ = 0;
  std::vector<int32_t> free_;
  Buffer<int32_t> tables_dev_;
  std::vector<int32_t> tables_host_;
  // save(), restore() and copy_from(): the block moves [2 · blocks] (ops::copy_blocks), then the
  // row's blocks as the pool lays them out, in backend memory (staging_) and in its pinned upload.
  // Only restore uploads the blocks; save reads them back into saved_blocks_; copy_from stages
  // only the moves.
  mutable Buffer<uint8_t> staging_;
  mutable StagedUpload staging_upload_;
  mutable std::vector<float> saved_blocks_;
  struct Staging {  // the pinned side, filled by the caller before start_staging
    int32_t* moves = nullptr;
    float* blocks = nullptr;  // upload_blocks only
    size_t moves_bytes = 0, upload_bytes = 0;
  };
  struct Staged {  // the backend side
    const int32_t* moves;
    float* blocks;
  };
  // What the staging holds past the moves: no blocks (copy_from), the blocks in backend memory
  // only (save), or also in the pinned upload (restore).
  enum class StagedBlocks { None, Device, Uploaded };
  Staging stage(int64_t blocks, StagedBlocks staged) const;
  Staged start_staging(const Staging& st) const;
  // batch() and chain(): the rows' tables at one stride, then per batch positions, KV slots and
  // query rows [tokens] each.
  Buffer<uint8_t> batch_dev_;
  StagedUpload batch_upload_;

  // One batch of batch() or chain(): which tables' rows append how many positions from where.
  struct StepRows {
    std::vector<int> rows;        // indices into the tables, in order
    std::vector<int64_t> starts;  // each row's first new position
    std::vector<int64_t> counts;  // new positions per row
  };
  // Checks every table holds its rows' new positions, then uploads the tables at one stride and
  // each step's arrays in one copy (or describes it in *hold, as chain()).
  std::vector<AttentionBatch> upload(std::span<const std::vector<int32_t>* const> tables,
                                     std::span<const StepRows> steps,
                                     StagedUpload::Part* hold = nullptr);

  int64_t floats_per_block() const { return 2 * kBlockSize * kv_heads_ * head_dim_; }
  std::vector<int32_t> take(int64_t n);
};

}  // namespace tandem::spec
