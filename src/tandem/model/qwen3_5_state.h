// Per-row decoding state of a Qwen3.5 target: paged KV for the full-attention layers and
// per-slot conv + recurrent state for the Gated DeltaNet layers.
#pragma once

#include <cstdint>
#include <deque>
#include <span>
#include <string>
#include <vector>

#include "tandem/backend/buffer.h"
#include "tandem/backend/ops.h"
#include "tandem/model/forward.h"
#include "tandem/model/qwen3_5_config.h"

namespace tandem {

// How a speculative (verify) window keeps what it needs to cut a row's Gated DeltaNet state back
// to any prefix of the window (DESIGN.md §5.3). Both give bit-identical results; they trade
// verify-time work against commit-time work and memory:
//  - PerPositionStates: the forward records the conv + recurrent state after every window token;
//    a commit copies the state of the last kept token (free when it keeps the whole window).
//    Per layer and row, a verify writes n + 1 states and a commit copies one; memory: n states
//    per row.
//  - Replay: the forward leaves each window row's states as they stand after the window's first
//    token, which every commit keeps (ops::RecurrentRow::settled), and its projections write the
//    window's recurrence inputs (conv input rows, a, b) into the state's recording; a commit
//    replays the kept tokens after the first from that state through the same per-token kernels,
//    every committed row of every layer in one batched call per op (none when every row keeps
//    one token). Per layer and row, a verify reads and writes the state once, as a decode step
//    does, and a commit that keeps more than one token reads and writes it once more; memory: the
//    inputs only (~1/250 of a 9B state per token).
//    The recording holds one forward's windows, so a speculative forward needs every earlier
//    window committed (or its row closed) first.
enum class RecurrentRollback { PerPositionStates, Replay };

// Fixed-size KV blocks shared by all rows; a row owns a list of blocks (its block table).
// Blocks are never moved, so a block id stays valid while the pool grows. KV, conv/recurrent
// states and window buffers live in the active backend's memory (device memory on CUDA); block
// tables and lengths stay on the host (the model uploads the tables it needs per forward).
class Qwen35State {
 public:
  static constexpr int64_t kBlockSize = 16;

  // kDefaultRollback (Replay): the least state traffic per round (bench/rollback_bench.cpp and
  // `bench --rollback`, BENCHMARKS.md) and the least memory.
  // kv_dtype: how the KV stores keys and values (ops::KVLayerView): BF16 (the default, half the
  // memory and bandwidth) or F32. Conv and recurrent states are fp32 either way.
  static constexpr RecurrentRollback kDefaultRollback = RecurrentRollback::Replay;
  explicit Qwen35State(const Qwen35Config& cfg, RecurrentRollback rollback = kDefaultRollback,
                       DType kv_dtype = kDefaultKvDType);
  static constexpr DType kDefaultKvDType = DType::BF16;
  RecurrentRollback rollback() const { return rollback_; }
  DType kv_dtype() const { return kv_dtype_; }

  // A pool sized once (a server's memory budget, DESIGN.md §7). After set_capacity nothing the
  // state holds grows or moves: open_row throws when every slot is taken, reserve throws (before
  // changing anything) when the free blocks do not cover the request, begin_window throws above
  // window_tokens. Without it (the command line), the pool and the slots grow on demand.
  struct Capacity {
    int rows = 0;               // row slots, each with its conv + recurrent state
    int64_t blocks = 0;         // KV blocks shared by all rows
    int64_t window_tokens = 1;  // the largest speculative window a row may open
  };
  // Must be called before the first open_row.
  void set_capacity(const Capacity& cap);
  bool fixed() const { return fixed_; }
  // Bytes one KV block and one row slot (state + its largest window buffer) hold: what a memory
  // budget divides into.
  static size_t block_bytes(const Qwen35Config& cfg, DType kv_dtype = kDefaultKvDType);
  static size_t row_bytes(const Qwen35Config& cfg, int64_t window_tokens,
                          RecurrentRollback rollback = kDefaultRollback);
  static int64_t blocks_for(int64_t tokens) { return (tokens + kBlockSize - 1) / kBlockSize; }
  int64_t total_blocks() const { return n_blocks_; }
  int64_t free_block_count() const { return static_cast<int64_t>(free_blocks_.size()); }
  int open_row_count() const;

  // Rows are slots; a freed slot is reused. A new row covers no tokens.
  int open_row();
  void close_row(int slot);
  bool row_open(int slot) const;
  int64_t length(int slot) const { return rows_.at(slot).length; }
  int row_capacity() const { return static_cast<int>(rows_.size()); }

  // Makes room for `new_length` tokens in the row's KV (takes free blocks; grows the pool unless
  // its capacity is fixed, in which case a shortfall throws Error and changes nothing).
  void reserve(int slot, int64_t new_length);

  // --- Shared prefixes (the prefix cache) ---
  // A KV block is held by reference: by the rows whose tables list it and by whoever retained it
  // (a prefix-cache entry). It returns to the free list when the last holder lets go. A row only
  // ever writes positions at or past its length, and a shared prefix covers whole blocks below
  // the length of every row that lists them, so a shared block is never written again.
  //
  // Starts an empty open row (length 0, no blocks) at `length` tokens: the first length / 16
  // blocks of `blocks` are shared with their holders; when length is not a multiple of 16 the
  // block holding its tail is copied into a block of the row's own (the row will write the rest
  // of it). `linear` ([linear_layers][conv | recurrent], backend memory) becomes the row's state.
  // Throws Error, changing nothing, if the copy needs a block a fixed pool does not have.
  void attach_prefix(int slot, std::span<const int32_t> blocks, int64_t length,
                     const float* linear);
  void retain_blocks(std::span<const int32_t> blocks);
  void release_blocks(std::span<const int32_t> blocks);
  // A new block, held once by the caller, with block `src`'s keys and values in every layer.
  // Throws Error when a fixed pool has no free block.
  int32_t copy_block(int32_t src);
  // Appends n free blocks to *out, each held once by the caller (contents unspecified); grows
  // the pool unless it is fixed. Throws Error, taking none, when a fixed pool has fewer free.
  void take_blocks(int64_t n, std::vector<int32_t>* out);
  // The layout a saved state must have to be restored here: dtype, block size, layer and head
  // shapes (the prefix cache's disk files are keyed by it).
  std::string kv_scheme() const;
  int32_t block_holders(int32_t block) const { return holders_.at(static_cast<size_t>(block)); }
  // Floats of one row's linear state ([linear_layers][conv | recurrent]) and the state itself.
  int64_t linear_state_floats() const { return n_linear_ * (conv_floats_ + rec_floats_); }
  const float* linear_state(int slot) const { return linear_state_.at(slot).data(); }
  // Marks tokens as processed; called by the model after a forward wrote them.
  void set_length(int slot, int64_t n) { rows_.at(slot).length = n; }
  const std::vector<int32_t>& block_table(int slot) const { return rows_.at(slot).blocks; }

  ops::KVLayerView kv_layer(int attn_layer);
  float* conv_state(int slot, int linear_layer);
  float* recurrent_state(int slot, int linear_layer);
  const float* conv_state(int slot, int linear_layer) const;
  const float* recurrent_state(int slot, int linear_layer) const;
  int64_t conv_state_floats() const { return conv_floats_; }
  int64_t recurrent_state_floats() const { return rec_floats_; }
  int64_t attention_layers() const { return n_attn_; }
  // One position's keys (or values) of one layer: elements, and bytes as stored.
  int64_t kv_token_elements() const { return kv_heads_ * head_dim_; }
  size_t kv_token_bytes() const {
    return static_cast<size_t>(kv_token_elements()) * dtype_size(kv_dtype_);
  }
  int64_t linear_layers() const { return n_linear_; }

  // --- Speculative windows (driven by Qwen35Model::forward / commit_windows) ---
  // A row has at most one open window: the n tokens appended at `window_start` by a speculative
  // forward, not yet committed. While it is open the row takes no other forward. Window buffers
  // (per slot under PerPositionStates, the state's recording under Replay) are grown to the
  // largest window or forward seen and reused (no allocation in steady state).
  //
  // Replay: makes the recording ready for a speculative forward of `tokens` tokens (all its rows,
  // speculative or not, at their places in the forward). Throws Error, changing nothing, while
  // any row's window is uncommitted (its inputs are in the recording) or when a fixed pool's
  // recording (rows x window_tokens tokens) is smaller.
  void begin_recording(int64_t tokens);
  // Opens a window of n tokens starting at the row's current length; `first_token` is its place
  // in the forward (Replay: where its inputs are recorded). Throws if one is already open.
  void begin_window(int slot, int64_t n, int64_t first_token = 0);
  // Closes the window: the row now covers window_start + kept tokens. KV blocks past the new
  // length stay allocated to the row (the next window overwrites them; close_row frees them);
  // attention only ever reads positions below the length its own forward just wrote.
  void end_window(int slot, int64_t kept);
  bool window_open(int slot) const { return rows_.at(slot).window_n > 0; }
  int64_t window_start(int slot) const { return rows_.at(slot).window_start; }
  int64_t window_size(int slot) const { return rows_.at(slot).window_n; }
  // PerPositionStates: [n, conv_state_floats] and [n, recurrent_state_floats], the state after
  // each window token. Null under Replay.
  float* window_conv_after(int slot, int linear_layer);
  float* window_recurrent_after(int slot, int linear_layer);
  // Replay: the recorded forward's inputs of a DeltaNet layer, token-major over all its tokens
  // (a row's window starts at window_first): conv input rows [T, conv_dim], b [T, n_v_heads],
  // a [T, n_v_heads]. Null under PerPositionStates or before the first recording.
  float* recorded_conv_input(int linear_layer);
  float* recorded_b(int linear_layer);
  float* recorded_a(int linear_layer);
  int64_t recorded_tokens() const { return recorded_tokens_; }
  int64_t window_first(int slot) const { return rows_.at(slot).window_first; }

  // --- Commits settled on the device (Qwen35Model::settle_windows) ---
  // A commit may be queued with its kept counts in backend memory, before the host reads them:
  // the next round's forwards are queued behind it. Until resolve_settled tells the host what such
  // a commit kept, length() counts the first token of its window only; the rest is in
  // settled_shift()[slot] (backend memory): Σ over the row's settled commits of the tokens kept
  // past their first, of which the host has counted known_shift(slot). A forward moves the row's
  // positions on by the difference where the tokens are (ops::shift_positions). Commits resolve
  // oldest first; a row holds at most unresolved_tokens() tokens past length().
  //
  // Closes the open window as a settled commit (kept: 1..n, on the device).
  void settle_window(int slot);
  // The row's oldest unresolved settled commit kept `kept` tokens. Throws Error, changing
  // nothing, if the row has none or kept is outside 1..its window.
  void resolve_settled(int slot, int64_t kept);
  // The same for several rows, all checked before any changes (a row listed twice resolves its
  // two oldest commits).
  void resolve_settled(std::span<const RowKeep> rows);
  int unresolved_commits(int slot) const {
    return static_cast<int>(rows_.at(slot).settling.size());
  }
  int64_t unresolved_tokens(int slot) const;
  int64_t known_shift(int slot) const { return rows_.at(slot).known_shift; }
  // [row_capacity()] per slot; zeroed (on the stream) when a row opens in the slot.
  int64_t* settled_shift() { return settled_shift_.data(); }

  // Bytes held for KV + recurrent state (for reports).
  size_t bytes() const;

 private:
  struct Row {
    bool open = false;
    int64_t length = 0;
    std::vector<int32_t> blocks;
    int64_t window_start = 0, window_n = 0;  // window_n == 0: no open window
    int64_t window_first = 0;                // Replay: the window's first token in the recording
    Buffer<float> window;                    // PerPositionStates: the states after each token
    std::deque<int64_t> settling;  // window sizes of settled commits not resolved, oldest first
    int64_t known_shift = 0;       // the part of settled_shift_[slot] that length counts
  };
  Buffer<int64_t> settled_shift_;  // per slot, backend memory (see settle_window)
  RecurrentRollback rollback_;
  DType kv_dtype_;
  bool fixed_ = false;
  int64_t max_window_ = 0;  // fixed pool: the window buffers' size in tokens
  int64_t n_attn_ = 0, n_linear_ = 0, kv_heads_ = 0, head_dim_ = 0;
  int64_t conv_floats_ = 0, rec_floats_ = 0, conv_dim_ = 0, n_v_heads_ = 0;
  std::vector<Row> rows_;
  std::vector<Buffer<std::byte>> kv_pools_;  // per attention layer, elements of kv_dtype_
  int64_t n_blocks_ = 0;
  std::vector<int32_t> free_blocks_;
  std::vector<int32_t> holders_;             // per block: rows listing it + retains; 0 = free
  std::vector<Buffer<float>> linear_state_;  // per slot: [n_linear][conv | recurrent]

  void grow_pool(int64_t min_free);
  // Floats one linear layer uses in a row's window buffer for an n-token window.
  int64_t window_layer_floats(int64_t n) const;
  // Floats one linear layer's recorded inputs take per token (Replay).
  int64_t recorded_token_floats() const { return conv_dim_ + 2 * n_v_heads_; }
  // Replay: per linear layer, conv input [T, conv_dim], b [T, n_v_heads], a [T, n_v_heads] of the
  // recorded forward's T = recorded_tokens_ tokens.
  Buffer<float> recording_;
  int64_t recorded_tokens_ = 0;     // tokens of the last begin_recording
  int64_t recording_capacity_ = 0;  // fixed pool: tokens the recording was sized for
  float* window_layer(int slot, int linear_layer);
};

}  // namespace tandem
