#include "tandem/spec/ngram.h"

#include <xxhash.h>

#include <algorithm>
#include <unordered_set>

#include "tandem/core/error.h"

namespace tandem::spec {
namespace {

constexpr const char* kWho = "ngram drafter";
constexpr int kMaxN = 16;

// An index entry is the start of an n-gram inside the row's history; hashing and equality read
// the n tokens there. The set keeps the first entry of each distinct n-gram, and starts are
// inserted in increasing order, so the entry found for any n-gram is its earliest occurrence.
struct GramHash {
  const std::vector<int32_t>* history;
  int n;
  size_t operator()(int32_t start) const {
    return static_cast<size_t>(
        XXH3_64bits(history->data() + start, static_cast<size_t>(n) * sizeof(int32_t)));
  }
};

struct GramEq {
  const std::vector<int32_t>* history;
  int n;
  bool operator()(int32_t a, int32_t b) const {
    if (a == b) return true;
    const int32_t* h = history->data();
    return std::equal(h + a, h + a + n, h + b);
  }
};

using GramIndex = std::unordered_set<int32_t, GramHash, GramEq>;

// One row's state. Its indexes point at its own history, so a Row never moves (rows are held by
// unique_ptr).
class Row {
 public:
  explicit Row(const NgramOptions& o) : min_n_(o.min_n) {
    for (int n = o.min_n; n <= o.max_n; ++n)
      index_.emplace_back(16, GramHash{&history_, n}, GramEq{&history_, n});
  }
  Row(const Row&) = delete;
  Row& operator=(const Row&) = delete;

  const std::vector<int32_t>& history() const { return history_; }
  int64_t processed() const { return processed_; }
  bool pending_known() const { return static_cast<int64_t>(history_.size()) == processed_ + 1; }

  // Appends a token and indexes every n-gram that now ends at it.
  void push(int32_t token) {
    history_.push_back(token);
    const int64_t len = static_cast<int64_t>(history_.size());
    for (size_t i = 0; i < index_.size(); ++i) {
      const int n = min_n_ + static_cast<int>(i);
      if (len >= n) index_[i].insert(static_cast<int32_t>(len - n));
    }
  }
  void add_processed(int64_t n) { processed_ += n; }

  std::vector<int32_t> lookup(int depth) const {
    std::vector<int32_t> out;
    if (depth <= 0) return out;
    const int64_t len = static_cast<int64_t>(history_.size());
    for (int i = static_cast<int>(index_.size()) - 1; i >= 0; --i) {
      const int n = min_n_ + i;
      if (n >= len) continue;  // the trailing n-gram is the whole history: nothing earlier
      const int32_t tail = static_cast<int32_t>(len - n);
      const auto it = index_[i].find(tail);
      TANDEM_CHECK(it != index_[i].end(), "trailing n-gram not indexed");
      if (*it == tail) continue;  // its first occurrence is itself
      const int64_t from = *it + n;
      const int64_t to = std::min<int64_t>(from + depth, len);
      out.assign(history_.begin() + from, history_.begin() + to);
      return out;
    }
    return out;
  }

 private:
  int min_n_;
  std::vector<int32_t> history_;
  int64_t processed_ = 0;
  std::vector<GramIndex> index_;  // index_[n - min_n]
};

class AppendChange : public PreparedChange {
 public:
  AppendChange(std::vector<std::unique_ptr<Row>>* target, std::vector<std::unique_ptr<Row>> rows)
      : target_(target), rows_(std::move(rows)) {}
  void commit() noexcept override {
    for (auto& r : rows_) target_->push_back(std::move(r));
    rows_.clear();
  }
  void dispose() noexcept override { rows_.clear(); }

 private:
  std::vector<std::unique_ptr<Row>>* target_;
  std::vector<std::unique_ptr<Row>> rows_;
};

class NgramRows : public DraftRows {
 public:
  NgramRows(const NgramOptions& o, const std::string& ns) : options_(o), ns_(ns) {}

  const std::string& ns() const override { return ns_; }
  PrefillMode prefill_mode() const override { return PrefillMode::Full; }
  HiddenTaps taps() const override { return {}; }
  int row_count() const override { return static_cast<int>(rows_.size()); }

  std::unique_ptr<PreparedChange> prepare_append(std::span<const CheckpointPtr> from) override {
    std::vector<std::unique_ptr<Row>> built;
    built.reserve(from.size());
    for (const CheckpointPtr& c : from) {
      auto row = std::make_unique<Row>(options_);
      if (c) {
        check_checkpoint(*c, kWho, kNgramSchema, ns_, c->processed_tokens);
        if (static_cast<int64_t>(c->tokens.size()) != c->processed_tokens)
          fail(kWho, ": checkpoint holds ", c->tokens.size(), " history tokens but covers ",
               c->processed_tokens, " processed tokens (token alignment mismatch)");
        for (int32_t t : c->tokens) row->push(t);
        row->add_processed(c->processed_tokens);
      }
      built.push_back(std::move(row));
    }
    // Reserved now so that commit, which must not throw, never allocates.
    rows_.reserve(rows_.size() + built.size());
    return std::make_unique<AppendChange>(&rows_, std::move(built));
  }

  void filter_rows(std::span<const int> keep) override {
    std::vector<bool> seen(rows_.size(), false);
    for (int k : keep) {
      TANDEM_CHECK(k >= 0 && k < row_count(), "row ", k, " of ", row_count());
      TANDEM_CHECK(!seen[k], "row ", k, " kept twice");
      seen[k] = true;
    }
    std::vector<std::unique_ptr<Row>> kept;
    kept.reserve(keep.size());
    for (int k : keep) kept.push_back(std::move(rows_[k]));
    rows_ = std::move(kept);
  }

  void prefill(std::span<const RowPrefill> rows) override {
    // Checked first, so a bad call changes nothing.
    for (const RowPrefill& p : rows) {
      TANDEM_CHECK(p.row >= 0 && p.row < row_count(), "row ", p.row, " of ", row_count());
      const Row& r = *rows_[p.row];
      if (p.processed_before != r.processed())
        fail(kWho, ": row ", p.row, " prefill starts at token ", p.processed_before,
             " but the row covers ", r.processed(), " (token alignment mismatch)");
      TANDEM_CHECK(!r.pending_known(), "prefill of row ", p.row, " after its pending token");
    }
    for (const RowPrefill& p : rows) {
      Row& r = *rows_[p.row];
      for (int32_t t : p.tokens) r.push(t);
      r.add_processed(static_cast<int64_t>(p.tokens.size()));
    }
  }

  void adopt_prefix(int row, std::span<const int32_t> tokens) override {
    const RowPrefill p{row, tokens, nullptr, 0};
    prefill({&p, 1});
  }
  bool adopts_exactly() const override { return true; }

  void draft(std::span<const RowDraft> rows, std::vector<DraftProposal>* out) override {
    TANDEM_CHECK(static_cast<int>(rows.size()) == row_count());
    for (size_t b = 0; b < rows.size(); ++b) {
      const Row& r = *rows_[b];
      TANDEM_CHECK(rows[b].depth >= 0);
      TANDEM_CHECK(!r.pending_known() || r.history().back() == rows[b].pending, "row ", b,
                   ": pending token differs from the one already seen");
    }
    out->resize(rows.size());
    for (size_t b = 0; b < rows.size(); ++b) {
      Row& r = *rows_[b];
      if (!r.pending_known()) r.push(rows[b].pending);
      DraftProposal& p = (*out)[b];
      p.tokens = r.lookup(rows[b].depth);
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
      Row& r = *rows_[b];
      const VerifyRow& v = rows[b];
      for (int j = 1; j <= v.accepted; ++j) r.push(v.window[j]);
      r.push(v.next_pending);
      r.add_processed(1 + v.accepted);
    }
  }

  CheckpointPtr capture(int row) const override {
    TANDEM_CHECK(row >= 0 && row < row_count(), "row ", row, " of ", row_count());
    const Row& r = *rows_[row];
    auto c = std::make_shared<Checkpoint>();
    c->processed_tokens = r.processed();
    c->schema = kNgramSchema;
    c->ns = ns_;
    c->metadata = nlohmann::json::object();
    c->tokens.assign(r.history().begin(), r.history().begin() + r.processed());
    return c;
  }

 private:
  NgramOptions options_;
  std::string ns_;
  std::vector<std::unique_ptr<Row>> rows_;
};

}  // namespace

void validate_ngram_options(const NgramOptions& o) {
  if (o.min_n < 1 || o.min_n > kMaxN)
    fail("--ngram-min must be between 1 and ", kMaxN, ", got ", o.min_n);
  if (o.max_n < 1 || o.max_n > kMaxN)
    fail("--ngram-max must be between 1 and ", kMaxN, ", got ", o.max_n);
  if (o.min_n > o.max_n)
    fail("--ngram-min (", o.min_n, ") must not exceed --ngram-max (", o.max_n, ")");
}

NgramProvider::NgramProvider(const NgramOptions& options) : options_(options) {
  validate_ngram_options(options_);
  ns_ = std::string(kNgramSchema) + ":n=" + std::to_string(options_.min_n) + "-" +
        std::to_string(options_.max_n);
}

std::unique_ptr<DraftRows> NgramProvider::open_rows(const TargetView& /*target*/) const {
  // Model-free: any target serves, since proposals are only ever its own earlier tokens.
  return std::make_unique<NgramRows>(options_, ns_);
}

}  // namespace tandem::spec
