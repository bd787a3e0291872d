#include "tandem/spec/ngram.h"

#include <algorithm>
#include <deque>
#include <vector>

#include "tandem/backend/buffer.h"
#include "tandem/backend/ops.h"
#include "tandem/backend/readback.h"
#include "tandem/core/error.h"
#include "tandem/spec/gram_index.h"
#include "tandem/spec/token_rows.h"

namespace tandem::spec {
namespace {

constexpr const char* kWho = "ngram drafter";
constexpr int kMaxN = 16;

// One row's state: its history and, for each n, the first occurrence of every n-gram in it.
class Row : public TokenHistory {
 public:
  explicit Row(const NgramOptions& o) : min_n_(o.min_n) {
    for (int n = o.min_n; n <= o.max_n; ++n) index_.emplace_back(n);
  }

  // Appends a token and indexes every n-gram that now ends at it.
  void push(int32_t token) {
    TokenHistory::push(token);
    const int64_t len = static_cast<int64_t>(history().size());
    for (GramIndex& index : index_)
      if (len >= index.n()) index.insert(history(), static_cast<int32_t>(len - index.n()));
  }

  std::vector<int32_t> lookup(int depth) const {
    std::vector<int32_t> out;
    if (depth <= 0) return out;
    const std::vector<int32_t>& h = history();
    const int64_t len = static_cast<int64_t>(h.size());
    for (int i = static_cast<int>(index_.size()) - 1; i >= 0; --i) {
      const int n = min_n_ + i;
      if (n >= len) continue;  // the trailing n-gram is the whole history: nothing earlier
      const int32_t tail = static_cast<int32_t>(len - n);
      const int32_t first = index_[static_cast<size_t>(i)].first(h, tail);
      TANDEM_CHECK(first >= 0, "trailing n-gram not indexed");
      if (first == tail) continue;  // its first occurrence is itself
      const int64_t from = first + n;
      const int64_t to = std::min<int64_t>(from + depth, len);
      out.assign(h.begin() + from, h.begin() + to);
      return out;
    }
    return out;
  }

 private:
  int min_n_;
  std::vector<GramIndex> index_;  // index_[n - min_n]
};

// Rounds settled on the device (DraftRows::can_settle): when a run of settled rounds starts, the
// rows' histories are copied where the tokens are; each round looks up there (ops::ngram_lookup)
// and appends what its verify kept (ops::history_append), so no host read stands between rounds.
// Each round's proposals, counts and next tokens come back in one read, and resolve adds them to
// the host rows, which so stay exact for every resolved round. Any host path (draft, commit,
// prefill, row changes) drops the device copy; the next settled round copies the rows again.
class NgramRows final : public TokenRows<Row> {
 public:
  NgramRows(const NgramOptions& o, const std::string& ns)
      : TokenRows(kWho, kNgramSchema, ns), options_(o) {}

  std::unique_ptr<PreparedChange> prepare_append(std::span<const CheckpointPtr> from) override {
    leave_device("append");
    return TokenRows::prepare_append(from);
  }
  std::unique_ptr<PreparedChange> prepare_copy_rows(const DraftRows& from,
                                                    std::span<const int> rows) override {
    leave_device("append");
    return TokenRows::prepare_copy_rows(from, rows);
  }
  void filter_rows(std::span<const int> keep) override {
    leave_device("filter_rows");
    TokenRows::filter_rows(keep);
  }
  void prefill(std::span<const RowPrefill> rows) override {
    leave_device("prefill");
    TokenRows::prefill(rows);
  }
  void draft(std::span<const RowDraft> rows, std::vector<DraftProposal>* out) override {
    leave_device("draft");
    TokenRows::draft(rows, out);
  }
  void commit(std::span<const VerifyRow> rows) override {
    leave_device("commit");
    TokenRows::commit(rows);
  }
  CheckpointPtr capture(int row) const override {
    check_resolved("capture");
    return TokenRows::capture(row);
  }

  bool can_settle(std::span<const RowDraft> rows) const override;
  bool draft_settled(std::span<const RowDraft> rows, QueuedDraft* queued) override;
  void settle(const SettledVerify& v) override;
  void settled_proposals(std::vector<DraftProposal>* out) override;
  void resolve(std::span<const int> accepted) override;
  int unresolved_rounds() const override { return static_cast<int>(settled_.size()); }
  void drop_settled() override;

 private:
  std::unique_ptr<Row> new_row() const override { return std::make_unique<Row>(options_); }
  std::vector<int32_t> propose(Row& row, int depth) override { return row.lookup(depth); }

  // A round's window buffer: the pending tokens [R], the proposals [R, depth], their counts [R]
  // and, once settled, the tokens now pending [R]; read back whole.
  struct Window {
    Buffer<int32_t> dev;
    Readback read;
  };
  static constexpr int kWindows = 3;  // the queued draft and up to two unresolved rounds
  struct SettledRound {
    int depth = 0;
    int window = 0;
    bool parsed = false;  // proposals and next hold the window's read
    std::vector<std::vector<int32_t>> proposals;
    std::vector<int32_t> next;
  };

  int64_t counts_at(int depth) const { return row_count() + row_count() * depth; }
  void upload(std::span<const RowDraft> rows, int depth);
  void parse(SettledRound& round);
  void check_resolved(const char* what) const {
    if (!settled_.empty() || queued_depth_ >= 0)
      fail(who(), " ", what, ": ", settled_.size(),
           " round(s) settled on the device are unresolved",
           queued_depth_ >= 0 ? " and a settled draft is queued" : "");
  }
  void leave_device(const char* what) {
    check_resolved(what);
    on_device_ = false;
  }

  NgramOptions options_;
  // The device copy of the histories ([rows, stride] and lengths; live while on_device_), and
  // each row's length there once every settled round is resolved.
  bool on_device_ = false;
  Buffer<int32_t> tokens_dev_;
  Buffer<int64_t> lengths_dev_;
  int64_t stride_ = 0;
  std::vector<int64_t> device_length_;
  Window windows_[kWindows];
  int next_window_ = 0;
  int queued_depth_ = -1;  // the depth of the draft_settled awaiting settle (-1: none)
  int queued_window_ = 0;
  std::deque<SettledRound> settled_;

  ops::TokenHistories histories() {
    return {tokens_dev_.data(), lengths_dev_.data(), stride_, row_count()};
  }
};

// Room a device copy keeps past its longest history, in tokens: settled rounds stop for a host
// round (which drops the copy; the next one is sized anew) once a row could outgrow it.
constexpr int64_t kHistoryHeadroom = 1024;

bool NgramRows::can_settle(std::span<const RowDraft> rows) const {
  if (rows.empty() || static_cast<int>(rows.size()) != row_count() || queued_depth_ >= 0)
    return false;
  const int depth = rows[0].depth;
  for (const RowDraft& in : rows)
    if (in.depth <= 0 || in.depth != depth || in.want_distribution) return false;
  if (static_cast<int>(settled_.size()) >= kWindows - 1) return false;
  if (!on_device_) return true;  // the copy made for this round is sized for it
  int64_t ahead = depth + 1;
  for (const SettledRound& r : settled_) ahead += r.depth + 1;
  for (int64_t len : device_length_)
    if (len + ahead > stride_) return false;
  return true;
}

void NgramRows::upload(std::span<const RowDraft> rows, int depth) {
  const int R = row_count();
  see_pending(rows);
  int64_t longest = 0;
  for (int b = 0; b < R; ++b)
    longest = std::max<int64_t>(longest, static_cast<int64_t>(row_at(b).history().size()));
  stride_ = (longest + kHistoryHeadroom + depth + 1 + 63) / 64 * 64;
  std::vector<int32_t> tokens(static_cast<size_t>(R * stride_), 0);
  device_length_.assign(static_cast<size_t>(R), 0);
  for (int b = 0; b < R; ++b) {
    const std::vector<int32_t>& h = row_at(b).history();
    std::copy(h.begin(), h.end(), tokens.begin() + b * stride_);
    device_length_[static_cast<size_t>(b)] = static_cast<int64_t>(h.size());
  }
  tokens_dev_.grow_to(static_cast<int64_t>(tokens.size()));
  lengths_dev_.grow_to(R);
  ops::copy_from_host(tokens_dev_.data(), tokens.data(), sizeof(int32_t) * tokens.size());
  ops::copy_from_host(lengths_dev_.data(), device_length_.data(),
                      sizeof(int64_t) * device_length_.size());
  on_device_ = true;
}

bool NgramRows::draft_settled(std::span<const RowDraft> rows, QueuedDraft* queued) {
  if (!can_settle(rows)) return false;
  const int depth = rows[0].depth;
  const int64_t R = row_count();
  if (!on_device_) upload(rows, depth);
  Window& w = windows_[next_window_];
  if (w.read.pending()) w.read.wait();  // a round resolved without its proposals read
  w.dev.grow_to(counts_at(depth) + 2 * R);
  int32_t* ids = w.dev.data();
  ops::ngram_lookup(histories(), options_.min_n, options_.max_n, depth, ids,
                    ids + counts_at(depth));
  queued->ids = ids;
  queued->counts = ids + counts_at(depth);
  queued->slots.assign(static_cast<size_t>(R), {});
  queued->pending_slots.resize(static_cast<size_t>(R));
  for (int64_t b = 0; b < R; ++b) {
    queued->pending_slots[static_cast<size_t>(b)] = static_cast<int32_t>(b);
    for (int j = 0; j < depth; ++j)
      queued->slots[static_cast<size_t>(b)].push_back(static_cast<int32_t>(R + b * depth + j));
  }
  queued_depth_ = depth;
  queued_window_ = next_window_;
  next_window_ = (next_window_ + 1) % kWindows;
  return true;
}

void NgramRows::settle(const SettledVerify& v) {
  if (queued_depth_ < 0) fail(who(), " settle: no settled draft is queued");
  if (v.depth != queued_depth_)
    fail(who(), " settle: a verify of depth ", v.depth, " for a draft of depth ", queued_depth_);
  if (v.accepted == nullptr || v.next == nullptr)
    fail(who(), " settle: the verify's accepted counts and pending tokens are both needed");
  const int64_t R = row_count();
  Window& w = windows_[queued_window_];
  int32_t* ids = w.dev.data();
  ops::history_append(histories(), ids, v.depth, v.accepted, v.next);
  ops::copy(ids + counts_at(v.depth) + R, v.next, sizeof(int32_t) * static_cast<size_t>(R));
  w.read.start(ids, sizeof(int32_t) * static_cast<size_t>(counts_at(v.depth) + 2 * R));
  settled_.push_back({v.depth, queued_window_, false, {}, {}});
  queued_depth_ = -1;
}

void NgramRows::parse(SettledRound& round) {
  if (round.parsed) return;
  const int64_t R = row_count();
  const auto* ids = static_cast<const int32_t*>(windows_[round.window].read.wait());
  const int32_t* counts = ids + counts_at(round.depth);
  round.proposals.assign(static_cast<size_t>(R), {});
  round.next.assign(counts + R, counts + 2 * R);
  for (int64_t b = 0; b < R; ++b) {
    const int32_t n = counts[b];
    TANDEM_CHECK(n >= 0 && n <= round.depth, "row ", b, ": ", n, " proposals at depth ",
                 round.depth);
    const int32_t* p = ids + R + b * round.depth;
    round.proposals[static_cast<size_t>(b)].assign(p, p + n);
  }
  round.parsed = true;
}

void NgramRows::settled_proposals(std::vector<DraftProposal>* out) {
  if (settled_.empty()) fail(who(), " settled_proposals: no settled round is unresolved");
  SettledRound& round = settled_.front();
  parse(round);
  out->assign(static_cast<size_t>(row_count()), DraftProposal{});
  for (size_t b = 0; b < out->size(); ++b) (*out)[b].tokens = round.proposals[b];
}

void NgramRows::resolve(std::span<const int> accepted) {
  if (settled_.empty()) fail(who(), " resolve: no settled round is unresolved");
  if (static_cast<int>(accepted.size()) != row_count())
    fail(who(), " resolve: ", accepted.size(), " accepted counts for ", row_count(), " rows");
  SettledRound& round = settled_.front();
  parse(round);
  for (size_t b = 0; b < accepted.size(); ++b)
    if (accepted[b] < 0 || accepted[b] > static_cast<int>(round.proposals[b].size()))
      fail(who(), " resolve: row ", b, " accepted ", accepted[b], " of ", round.proposals[b].size(),
           " proposals");
  for (size_t b = 0; b < accepted.size(); ++b) {
    keep(row_at(static_cast<int>(b)),
         std::span(round.proposals[b]).first(static_cast<size_t>(accepted[b])), round.next[b]);
    device_length_[b] += 1 + accepted[b];
  }
  settled_.pop_front();
}

void NgramRows::drop_settled() {
  for (Window& w : windows_)
    if (w.read.pending()) w.read.wait();
  settled_.clear();
  queued_depth_ = -1;
  on_device_ = false;
}

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
