// Bookkeeping shared by the drafters whose rows are built from the target's hidden states (MTP
// layers, EAGLE-3 heads): each row tracks `base` (target tokens before its history, from
// adopt_prefix), `length` (committed rows), `has_hidden` (the hidden of the pending position is
// kept) and `drafted` (a round is in flight). The checks here are the DraftRows contract's
// (draft.h); `who` names the drafter in messages ("qwen-mtp", "eagle3").
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tandem/core/error.h"
#include "tandem/spec/draft.h"

namespace tandem::spec {

// Keeps rows `keep` in that order and hands every other row to release(row). reserve_extra: room
// kept for rows of prepared appends, whose commit must not allocate.
template <class Row, class Release>
void keep_hidden_rows(std::vector<Row>& rows, std::span<const int> keep, int64_t reserve_extra,
                      std::string_view who, Release&& release) {
  std::vector<bool> kept(rows.size(), false);
  for (int k : keep) {
    if (k < 0 || k >= static_cast<int>(rows.size()))
      fail(who, " filter_rows: row ", k, " does not exist");
    if (kept[static_cast<size_t>(k)]) fail(who, " filter_rows: row ", k, " listed twice");
    kept[static_cast<size_t>(k)] = true;
  }
  std::vector<Row> next;
  next.reserve(keep.size() + static_cast<size_t>(reserve_extra));
  for (size_t i = 0; i < rows.size(); ++i)
    if (!kept[i]) release(rows[i]);
  for (int k : keep) next.push_back(std::move(rows[static_cast<size_t>(k)]));
  rows = std::move(next);
}

// A cold row's history starts after the adopted prefix.
template <class Row>
void adopt_hidden_row_prefix(std::vector<Row>& rows, int row, std::span<const int32_t> tokens,
                             std::string_view who) {
  if (row < 0 || row >= static_cast<int>(rows.size()))
    fail(who, " adopt_prefix: row ", row, " does not exist");
  Row& r = rows[static_cast<size_t>(row)];
  if (r.has_hidden || r.length != 0 || r.base != 0)
    fail(who, " adopt_prefix: row ", row, " is not a cold row");
  r.base = static_cast<int64_t>(tokens.size());
}

// The checks of a prefill call before anything changes: rows exist and are listed once, carry no
// round in flight, bring tokens in [0, vocab) and the target's hiddens (missing_hidden says what
// is needed: "the target's ... hiddens"; with device_hidden, RowPrefill::hidden_device does),
// and continue exactly where each row stands.
template <class Row>
void check_hidden_row_prefills(const std::vector<Row>& rows, std::span<const RowPrefill> prefills,
                               int64_t vocab, std::string_view who, std::string_view missing_hidden,
                               bool device_hidden = false) {
  std::vector<bool> seen(rows.size(), false);
  for (const RowPrefill& p : prefills) {
    if (p.row < 0 || p.row >= static_cast<int>(rows.size()))
      fail(who, " prefill: row ", p.row, " does not exist");
    if (seen[static_cast<size_t>(p.row)]) fail(who, " prefill: row ", p.row, " listed twice");
    seen[static_cast<size_t>(p.row)] = true;
    const Row& r = rows[static_cast<size_t>(p.row)];
    if (r.drafted) fail(who, " prefill: row ", p.row, " has an uncommitted draft");
    if (p.tokens.empty()) fail(who, " prefill: row ", p.row, " has no tokens");
    if (p.hidden == nullptr && !(device_hidden && p.hidden_device != nullptr))
      fail(who, " prefill: row ", p.row, " needs ", missing_hidden);
    for (int32_t id : p.tokens)
      if (id < 0 || id >= vocab)
        fail(who, " prefill: token id ", id, " is out of range [0, ", vocab, ")");
    const int64_t covered = r.base + (r.has_hidden ? r.length + 1 : 0);
    if (covered != p.processed_before)
      fail(who, " prefill: row ", p.row, " covers ", covered, " tokens but the prefill ",
           p.processed_before == 0 ? "starts at token 0"
                                   : "continues after " + std::to_string(p.processed_before));
  }
}

}  // namespace tandem::spec
