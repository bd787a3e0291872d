// The per-row and per-token steps of the verify-window ops (ops::accept_windows, settle_windows,
// shift_positions), written once: the CPU loops over them and the CUDA kernels run one per
// thread (constexpr, so device code may call them), so both backends compute the same values.
#pragma once

#include <cstdint>

#include "tandem/backend/ops.h"

namespace tandem::window_rows {

// Token t of a forward whose drafted tokens may still be where the drafter left them.
constexpr int32_t token_at(const int32_t* ids, const int32_t* source, const int32_t* from,
                           int64_t t) {
  return from != nullptr && from[t] >= 0 ? source[from[t]] : ids[t];
}

// Row r's match walk: its accepted proposals and the token now pending.
constexpr void accept_row(const int32_t* verified, const int32_t* ids, const int32_t* source,
                          const int32_t* from, const int32_t* bounds, const int32_t* limits,
                          int64_t r, int32_t* accepted, int32_t* next) {
  const int64_t first = bounds[r];
  int64_t n = bounds[r + 1] - first;
  if (limits != nullptr && limits[r] + 1 < n) n = limits[r] + 1;
  int32_t a = 0;
  while (a + 1 < n && token_at(ids, source, from, first + a + 1) == verified[first + a]) ++a;
  accepted[r] = a;
  next[r] = n > 0 ? verified[first + a] : -1;
}

// Commit row i of settle_windows.
constexpr void settle_row(const int32_t* accepted, const ops::SettledRow* rows, int64_t n_rows,
                          int64_t i, int64_t* shift, ops::RecurrentRow* replay, int64_t layers) {
  const int32_t a = accepted[rows[i].row];
  shift[rows[i].slot] += a;
  if (replay != nullptr)
    for (int64_t l = 0; l < layers; ++l) replay[l * n_rows + i].n = a;
}

// How far row r's tokens move (0 for a token of no row).
constexpr int64_t row_shift(const ops::PositionShift& s, int64_t r) {
  return r < 0 ? 0 : s.shift[s.row_slot[r]] - s.known[r];
}

// Token t of shift_positions: its position, KV slot and (per token) draw index.
constexpr void shift_token(const ops::PositionShift& s, int64_t t, int64_t* positions,
                           int64_t* kv_slots) {
  const int64_t r = s.token_row[t];
  int64_t d = row_shift(s, r);
  if (t < s.park_tokens && r >= 0 && s.park_unless[r] != s.park_full) d += s.park_by;
  if (d == 0) return;
  const int64_t p = positions[t] + d;
  positions[t] = p;
  if (kv_slots != nullptr)
    kv_slots[t] = ops::kv_slot_of(s.tables + r * s.table_stride, s.block_size, p);
  if (s.sample != nullptr && s.sample_per_token) s.sample[t].index += static_cast<uint64_t>(d);
}

// Logits row r's draw index when the forward draws one token per row.
constexpr void shift_row_draw(const ops::PositionShift& s, int64_t r) {
  if (s.sample != nullptr && !s.sample_per_token)
    s.sample[r].index += static_cast<uint64_t>(row_shift(s, r));
}

// Row i of gather_window_rows: where it reads.
constexpr int64_t window_row(int64_t i, int64_t row_stride, int64_t at, const int32_t* offsets) {
  return i * row_stride + at + (offsets != nullptr ? offsets[i] : 0);
}

}  // namespace tandem::window_rows
