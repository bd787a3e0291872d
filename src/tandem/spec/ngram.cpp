#include "tandem/spec/ngram.h"

#include <xxhash.h>

#include <algorithm>
#include <unordered_set>
#include <vector>

#include "tandem/core/error.h"
#include "tandem/spec/token_rows.h"

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
class Row : public TokenHistory {
 public:
  explicit Row(const NgramOptions& o) : min_n_(o.min_n) {
    for (int n = o.min_n; n <= o.max_n; ++n)
      index_.emplace_back(16, GramHash{&history(), n}, GramEq{&history(), n});
  }
  Row(const Row&) = delete;
  Row& operator=(const Row&) = delete;

  // Appends a token and indexes every n-gram that now ends at it.
  void push(int32_t token) {
    TokenHistory::push(token);
    const int64_t len = static_cast<int64_t>(history().size());
    for (size_t i = 0; i < index_.size(); ++i) {
      const int n = min_n_ + static_cast<int>(i);
      if (len >= n) index_[i].insert(static_cast<int32_t>(len - n));
    }
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
      const auto it = index_[i].find(tail);
      TANDEM_CHECK(it != index_[i].end(), "trailing n-gram not indexed");
      if (*it == tail) continue;  // its first occurrence is itself
      const int64_t from = *it + n;
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

class NgramRows final : public TokenRows<Row> {
 public:
  NgramRows(const NgramOptions& o, const std::string& ns)
      : TokenRows(kWho, kNgramSchema, ns), options_(o) {}

 private:
  std::unique_ptr<Row> new_row() const override { return std::make_unique<Row>(options_); }
  std::vector<int32_t> propose(Row& row, int depth) override { return row.lookup(depth); }

  NgramOptions options_;
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
