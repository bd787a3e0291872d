// The per-row steps of the token-history ops (ops::ngram_lookup, history_append), written once:
// the CPU runs them row by row and the CUDA kernels use them inside one block per row, so both
// backends write the same proposals (constexpr, so device code may call them).
#pragma once

#include <cstdint>

#include "tandem/backend/ops.h"

namespace tandem::history_rows {

constexpr const int32_t* row_tokens(const ops::TokenHistories& h, int64_t r) {
  return h.tokens + r * h.stride;
}

// Whether the n tokens at `start` equal the n at `tail` (the row's trailing n-gram).
constexpr bool gram_equal(const int32_t* tokens, int64_t start, int64_t tail, int n) {
  for (int i = 0; i < n; ++i)
    if (tokens[start + i] != tokens[tail + i]) return false;
  return true;
}

// Row r's window of ngram_lookup: its pending token, then the proposals that follow the match at
// `start` of an n-gram of length n (start < 0: none), padded with the pending token to depth.
constexpr void write_window(const ops::TokenHistories& h, int64_t r, int64_t start, int n,
                            int depth, int32_t* ids, int32_t* counts) {
  const int32_t* t = row_tokens(h, r);
  const int64_t len = h.lengths[r];
  const int32_t pending = len > 0 ? t[len - 1] : -1;  // (callers keep every history non-empty)
  int64_t found = 0;
  if (start >= 0) {
    const int64_t from = start + n;
    found = len - from < depth ? len - from : depth;
    for (int64_t j = 0; j < found; ++j) ids[h.rows + r * depth + j] = t[from + j];
  }
  for (int64_t j = found; j < depth; ++j) ids[h.rows + r * depth + j] = pending;
  ids[r] = pending;
  counts[r] = static_cast<int32_t>(found);
}

// Row r of history_append.
constexpr void append_row(const ops::TokenHistories& h, int64_t r, const int32_t* ids, int depth,
                          const int32_t* accepted, const int32_t* next) {
  const int64_t len = h.lengths[r];
  const int32_t a = accepted[r];
  if (a < 0 || a > depth || len + depth + 1 > h.stride) return;
  int32_t* t = h.tokens + r * h.stride;
  for (int32_t j = 0; j < a; ++j) t[len + j] = ids[h.rows + r * depth + j];
  t[len + a] = next[r];
  h.lengths[r] = len + a + 1;
}

}  // namespace tandem::history_rows
