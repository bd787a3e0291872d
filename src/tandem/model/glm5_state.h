// The per-row caches of a GLM-5 model (Glm5Model), in backend memory (PositionCache):
//  - per decoder layer, the latent KV cache multi-head latent attention reads: per position the
//    normed compressed key/value latent (kv_lora_rank values) then the rotated rotary key all
//    heads share (qk_rope_head_dim values) — not per-head keys and values;
//  - per layer that runs the DSA indexer, the index keys: per position index_head_dim values,
//    normed and rotated.
// Both grow by one entry per position and are never rewritten, so cutting a speculative window
// back to a prefix is a truncation, and the state then equals one that never saw the rejected
// tokens.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tandem/model/glm5_config.h"
#include "tandem/model/position_cache.h"

namespace tandem {

class Glm5State {
 public:
  // max_rows = 0: slots are added as rows open (no limit).
  Glm5State(const Glm5Config& cfg, int max_rows);

  int max_rows() const { return static_cast<int>(rows_.size()); }  // slots so far
  // Opens the lowest free slot (length 0); throws Error when all max_rows are open.
  int open_row();
  void close_row(int slot);  // throws Error naming a slot that is not open
  bool row_open(int slot) const;
  // Positions the row holds, its open speculative window included.
  int64_t length(int slot) const;
  // Tokens of the row's uncommitted speculative window (0: none).
  int64_t window(int slot) const;
  // Bytes the caches of all rows hold.
  uint64_t bytes() const;
  // The caches' layout in words (widths, layers, which layers keep index keys): what a saved
  // snapshot must match to be restored into this state.
  const std::string& layout() const { return layout_; }

  // A row's caches, copied out to host memory (a prefix cache's entry).
  struct RowSnapshot {
    int64_t length = 0;
    std::vector<std::vector<float>> latent, index_keys;  // [layer] -> [length, width]
    uint64_t bytes() const;
  };
  // Throws Error for a row that is not open or has an uncommitted window.
  RowSnapshot snapshot(int slot) const;
  // Starts the open, empty row `slot` from a snapshot taken of a state with the same layout;
  // throws Error (changing nothing) otherwise.
  void restore(int slot, const RowSnapshot& s);
  // Whether a snapshot has this state's layout: a latent cache for every layer and index keys
  // for exactly the layers that keep them, each holding s.length positions.
  bool fits(const RowSnapshot& s) const;

 private:
  friend class Glm5Model;
  struct Row {
    bool open = false;
    int64_t length = 0;
    int64_t window = 0;
    std::vector<PositionCache> latent;      // [layer] -> [length, latent_width]
    std::vector<PositionCache> index_keys;  // [layer] -> [length, index_width]; shared: empty
  };
  Row& row(int slot);  // throws Error naming a slot that is out of range or not open
  const Row& row(int slot) const;
  // Drops positions from `length` on (a speculative window's rejected tail, or what a failed
  // forward appended).
  void truncate(Row& r, int64_t length) const;

  int64_t latent_width_ = 0;  // kv_lora_rank + qk_rope_head_dim
  int64_t index_width_ = 0;   // index_head_dim
  int64_t layers_ = 0;
  bool grows_ = false;  // constructed with max_rows = 0
  std::string layout_;
  std::vector<bool> indexed_;  // per layer: it keeps index keys (runs its own indexer)
  std::vector<Row> rows_;
};

}  // namespace tandem
