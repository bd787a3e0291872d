// Rows of a drafter that drafts from token histories alone (n-gram lookup, the benchmark's
// continuation drafter): no weights, no hiddens, nothing on the device.
//
// A row's history is every token the row knows, in order: the tokens the target processed, then
// the pending token once the engine has handed it over. So between rounds
//   history = processed tokens                after prefill or restore (pending not yet seen)
//   history = processed tokens + [pending]    after a draft or commit
// draft() appends `pending` when it is not there yet (and checks it when it is) before asking
// the drafter for proposals; commit() appends the accepted proposals and the next pending token
// (the window's pending is already the last history token). prefill() after a commit continues
// the row with tokens the target processed without drafting (plain rounds at depth 0), the first
// of them the pending token the row already holds.
//
// A checkpoint holds exactly the processed tokens, never the pending one: it is the drafter state
// after `processed_tokens` target tokens, whatever token comes next, so one capture can be
// restored for any continuation (a prefix cache entry, a resumed request); the restored row
// learns its pending token from the next draft() like a freshly prefilled row.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tandem/core/error.h"
#include "tandem/spec/draft.h"
#include "tandem/spec/prepared_change.h"

namespace tandem::spec {

// One row's tokens. A drafter's row type derives from it; a derived push() that also indexes the
// token hides this one (TokenRows calls Row::push).
class TokenHistory {
 public:
  const std::vector<int32_t>& history() const { return history_; }
  int64_t processed() const { return processed_; }
  bool pending_known() const { return static_cast<int64_t>(history_.size()) == processed_ + 1; }
  void push(int32_t token) { history_.push_back(token); }
  void add_processed(int64_t n) { processed_ += n; }

 private:
  std::vector<int32_t> history_;
  int64_t processed_ = 0;
};

// The DraftRows contract for rows of type Row (a TokenHistory); the drafter supplies new_row()
// and propose(). `who` names the drafter in messages, `schema` its checkpoints.
template <class Row>
class TokenRows : public DraftRows {
 public:
  TokenRows(std::string who, std::string schema, std::string ns)
      : who_(std::move(who)), schema_(std::move(schema)), ns_(std::move(ns)) {}

  const std::string& ns() const override { return ns_; }
  PrefillMode prefill_mode() const override { return PrefillMode::Full; }
  HiddenTaps taps() const override { return {}; }
  int row_count() const override { return static_cast<int>(rows_.size()); }

  std::unique_ptr<PreparedChange> prepare_append(std::span<const CheckpointPtr> from) override {
    auto built = std::make_shared<std::vector<std::unique_ptr<Row>>>();
    built->reserve(from.size());
    for (const CheckpointPtr& c : from) {
      std::unique_ptr<Row> row = new_row();
      if (c) {
        check_checkpoint(*c, who_, schema_, ns_, c->processed_tokens);
        if (static_cast<int64_t>(c->tokens.size()) != c->processed_tokens)
          fail(who_, ": checkpoint holds ", c->tokens.size(), " history tokens but covers ",
               c->processed_tokens, " processed tokens (token alignment mismatch)");
        for (int32_t t : c->tokens) row->push(t);
        row->add_processed(c->processed_tokens);
      }
      built->push_back(std::move(row));
    }
    return stage_appended(std::move(built));
  }

  // Rows of another TokenRows of this row type and namespace that have not seen their pending
  // token (a prefill group's): the rows themselves copied, history and index, instead of rebuilt
  // token by token from a checkpoint. Others go through checkpoints (DraftRows' default).
  std::unique_ptr<PreparedChange> prepare_copy_rows(const DraftRows& from,
                                                    std::span<const int> rows) override {
    const auto* source = dynamic_cast<const TokenRows*>(&from);
    bool in_place = source != nullptr && source != this && source->ns_ == ns_ &&
                    source->unresolved_rounds() == 0;
    for (int b : rows) {
      if (b < 0 || b >= from.row_count())
        fail(who_, " copy_rows: row ", b, " does not exist (", from.row_count(), " rows)");
      in_place = in_place && !source->rows_[static_cast<size_t>(b)]->pending_known();
    }
    if (!in_place) return DraftRows::prepare_copy_rows(from, rows);
    auto built = std::make_shared<std::vector<std::unique_ptr<Row>>>();
    built->reserve(rows.size());
    for (int b : rows)
      built->push_back(std::make_unique<Row>(*source->rows_[static_cast<size_t>(b)]));
    return stage_appended(std::move(built));
  }

  void filter_rows(std::span<const int> keep) override {
    std::vector<bool> seen(rows_.size(), false);
    for (int k : keep) {
      TANDEM_CHECK(k >= 0 && k < row_count(), "row ", k, " of ", row_count());
      TANDEM_CHECK(!seen[static_cast<size_t>(k)], "row ", k, " kept twice");
      seen[static_cast<size_t>(k)] = true;
    }
    std::vector<std::unique_ptr<Row>> kept;
    kept.reserve(keep.size());
    for (int k : keep) kept.push_back(std::move(rows_[static_cast<size_t>(k)]));
    rows_ = std::move(kept);
  }

  void prefill(std::span<const RowPrefill> rows) override {
    // Checked first, so a bad call changes nothing.
    for (const RowPrefill& p : rows) {
      TANDEM_CHECK(p.row >= 0 && p.row < row_count(), "row ", p.row, " of ", row_count());
      const Row& r = *rows_[static_cast<size_t>(p.row)];
      if (p.processed_before != r.processed())
        fail(who_, ": row ", p.row, " prefill starts at token ", p.processed_before,
             " but the row covers ", r.processed(), " (token alignment mismatch)");
      if (r.pending_known() && (p.tokens.empty() || p.tokens[0] != r.history().back()))
        fail(who_, ": row ", p.row, " continues with token ", p.tokens.empty() ? -1 : p.tokens[0],
             " but its pending token is ", r.history().back());
    }
    for (const RowPrefill& p : rows) {
      Row& r = *rows_[static_cast<size_t>(p.row)];
      // A row that saw its pending token (a commit) continues after it: the target processed it.
      const size_t from = r.pending_known() ? 1 : 0;
      for (size_t i = from; i < p.tokens.size(); ++i) r.push(p.tokens[i]);
      r.add_processed(static_cast<int64_t>(p.tokens.size()));
    }
  }

  void adopt_prefix(int row, std::span<const int32_t> tokens) override {
    const RowPrefill p{row, tokens, nullptr, 0};
    prefill({&p, 1});
  }
  bool adopts_exactly() const override { return true; }

  // Proposals never depend on sampling; the q asked for in rejection mode is one-hot.
  void draft(std::span<const RowDraft> rows, std::vector<DraftProposal>* out) override {
    for (const RowDraft& in : rows) TANDEM_CHECK(in.depth >= 0);
    see_pending(rows);
    out->resize(rows.size());
    for (size_t b = 0; b < rows.size(); ++b) {
      Row& r = *rows_[b];
      DraftProposal& p = (*out)[b];
      p.tokens = rows[b].depth > 0 ? propose(r, rows[b].depth) : std::vector<int32_t>{};
      TANDEM_CHECK(static_cast<int>(p.tokens.size()) <= rows[b].depth);
      p.q.clear();
      if (rows[b].want_distribution)
        for (int32_t t : p.tokens) p.q.push_back({TokenProb{t, 1.0}});
    }
  }

  void commit(std::span<const VerifyRow> rows) override {
    TANDEM_CHECK(static_cast<int>(rows.size()) == row_count());
    for (size_t b = 0; b < rows.size(); ++b) {
      const Row& r = *rows_[b];
      const VerifyRow& v = rows[b];
      TANDEM_CHECK(r.pending_known(), "row ", b, ": commit without a draft");
      TANDEM_CHECK(!v.window.empty() && v.window[0] == r.history().back(), "row ", b,
                   ": the window does not start with the pending token");
      TANDEM_CHECK(v.accepted >= 0 && v.accepted < static_cast<int>(v.window.size()), "row ", b,
                   ": accepted ", v.accepted, " of a window of ", v.window.size());
    }
    for (size_t b = 0; b < rows.size(); ++b) {
      const VerifyRow& v = rows[b];
      keep(*rows_[b], v.window.subspan(1, static_cast<size_t>(v.accepted)), v.next_pending);
    }
  }

  CheckpointPtr capture(int row) const override {
    TANDEM_CHECK(row >= 0 && row < row_count(), "row ", row, " of ", row_count());
    const Row& r = *rows_[static_cast<size_t>(row)];
    auto c = std::make_shared<Checkpoint>();
    c->processed_tokens = r.processed();
    c->schema = schema_;
    c->ns = ns_;
    c->metadata = nlohmann::json::object();
    c->tokens.assign(r.history().begin(), r.history().begin() + r.processed());
    return c;
  }

 protected:
  virtual std::unique_ptr<Row> new_row() const = 0;
  // Up to `depth` (>= 1) proposals for the token after the row's history, which ends with the
  // pending token.
  virtual std::vector<int32_t> propose(Row& row, int depth) = 0;
  Row& row_at(int b) { return *rows_[static_cast<size_t>(b)]; }
  const std::string& who() const { return who_; }

  // Every row's pending token (rows.size() == row_count()): checked against the one a row already
  // holds, all rows first (a bad call changes nothing), then appended where the row has none.
  void see_pending(std::span<const RowDraft> rows) {
    TANDEM_CHECK(static_cast<int>(rows.size()) == row_count());
    for (size_t b = 0; b < rows.size(); ++b) {
      const Row& r = *rows_[b];
      TANDEM_CHECK(!r.pending_known() || r.history().back() == rows[b].pending, "row ", b,
                   ": pending token differs from the one already seen");
    }
    for (size_t b = 0; b < rows.size(); ++b)
      if (!rows_[b]->pending_known()) rows_[b]->push(rows[b].pending);
  }
  // A verified round into a row that held its pending token: the target processed it and the
  // accepted proposals, and `next` is pending now.
  static void keep(Row& r, std::span<const int32_t> accepted, int32_t next) {
    for (int32_t t : accepted) r.push(t);
    r.push(next);
    r.add_processed(1 + static_cast<int64_t>(accepted.size()));
  }

 private:
  std::string who_, schema_, ns_;
  std::vector<std::unique_ptr<Row>> rows_;

  // The change that appends `built` (fully built rows) on commit; disposing drops them.
  std::unique_ptr<PreparedChange> stage_appended(
      std::shared_ptr<std::vector<std::unique_ptr<Row>>> built) {
    // Reserved now so that commit, which must not throw, never allocates.
    rows_.reserve(rows_.size() + built->size());
    return std::make_unique<CallbackChange>(
        [this, built] {
          for (auto& r : *built) rows_.push_back(std::move(r));
        },
        [built] { built->clear(); });
  }
};

}  // namespace tandem::spec
