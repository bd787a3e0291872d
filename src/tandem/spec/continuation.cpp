#include "tandem/spec/continuation.h"

#include <xxhash.h>

#include <algorithm>
#include <cstdio>
#include <utility>

#include "tandem/core/error.h"
#include "tandem/core/rng.h"
#include "tandem/spec/token_rows.h"

namespace tandem::spec {
namespace {

constexpr const char* kWho = "continuation drafter";
// Reference index and position share the key's 64-bit counter: 24 bits and 40 bits.
constexpr uint64_t kMaxReferences = uint64_t(1) << 24;
constexpr uint64_t kPositionBits = 40;

using References = std::vector<std::vector<int32_t>>;

// A row's tokens and the reference they follow: `matched` history tokens are known to equal it.
class Row : public TokenHistory {
 public:
  int64_t reference = -1;  // -1: not looked up yet (or lost, below)
  size_t matched = 0;
  bool lost = false;  // the history left every reference: no proposals from here on
};

class ContinuationRows final : public TokenRows<Row> {
 public:
  ContinuationRows(const References& refs, double p, uint64_t seed, int64_t vocab,
                   const std::string& ns)
      : TokenRows(kWho, kContinuationSchema, ns), refs_(refs), p_(p), seed_(seed), vocab_(vocab) {}

 private:
  std::unique_ptr<Row> new_row() const override { return std::make_unique<Row>(); }

  std::vector<int32_t> propose(Row& row, int depth) override {
    const std::vector<int32_t>& h = row.history();
    if (!follow(row)) return {};
    const std::vector<int32_t>& ref = refs_[static_cast<size_t>(row.reference)];
    std::vector<int32_t> out;
    for (size_t i = h.size(); i < ref.size() && out.size() < static_cast<size_t>(depth); ++i)
      out.push_back(proposal(row.reference, i, ref[i]));
    return out;
  }

  // Whether the row's history is a prefix of its reference, looking one up when the history
  // has left the one it followed (a history that left every reference cannot come back).
  bool follow(Row& row) const {
    if (row.lost) return false;
    const std::vector<int32_t>& h = row.history();
    auto on = [&](const std::vector<int32_t>& ref, size_t from) {
      return h.size() <= ref.size() && std::equal(h.begin() + static_cast<int64_t>(from), h.end(),
                                                  ref.begin() + static_cast<int64_t>(from));
    };
    if (row.reference >= 0 && on(refs_[static_cast<size_t>(row.reference)], row.matched)) {
      row.matched = h.size();
      return true;
    }
    for (size_t r = 0; r < refs_.size(); ++r)
      if (on(refs_[r], 0)) {
        row.reference = static_cast<int64_t>(r);
        row.matched = h.size();
        return true;
      }
    row.reference = -1;
    row.lost = true;
    return false;
  }

  int32_t proposal(int64_t reference, size_t position, int32_t token) const {
    const uint64_t index = static_cast<uint64_t>(reference) << kPositionBits | position;
    if (uniform_open01(seed_, index, kRngStreamDraftCorruption) < p_) return token;
    const uint32_t other = philox_bits(seed_, index, kRngStreamDraftCorruption)[2];
    const int64_t shift = 1 + static_cast<int64_t>(other % static_cast<uint64_t>(vocab_ - 1));
    return static_cast<int32_t>((token + shift) % vocab_);
  }

  const References& refs_;  // the provider's, which outlives its rows
  double p_;
  uint64_t seed_;
  int64_t vocab_;
};

}  // namespace

ContinuationProvider::ContinuationProvider(References references, double accept_p, uint64_t seed)
    : references_(std::move(references)), accept_p_(accept_p), seed_(seed) {
  if (!(accept_p_ >= 0.0 && accept_p_ <= 1.0))
    fail(kWho, ": acceptance probability p must be in [0, 1], got ", accept_p_);
  if (references_.size() >= kMaxReferences)
    fail(kWho, ": ", references_.size(), " references; at most ", kMaxReferences - 1);
  for (size_t r = 0; r < references_.size(); ++r) {
    if (references_[r].empty()) fail(kWho, ": reference ", r, " is empty");
    if (references_[r].size() >= (uint64_t(1) << kPositionBits))
      fail(kWho, ": reference ", r, " has ", references_[r].size(), " tokens, too many to key");
  }
  // Validated above: nothing between createState and freeState throws.
  XXH3_state_t* st = XXH3_createState();
  if (!st) fail(kWho, ": out of memory for a hash state");
  XXH3_64bits_reset(st);
  for (const std::vector<int32_t>& ref : references_) {
    const uint64_t n = ref.size();
    XXH3_64bits_update(st, &n, sizeof n);
    XXH3_64bits_update(st, ref.data(), ref.size() * sizeof(int32_t));
  }
  const uint64_t digest = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(digest));
  ns_ = std::string(kContinuationSchema) + ":p=" + std::to_string(accept_p_) +
        ":seed=" + std::to_string(seed_) + ":" + hex;
}

std::unique_ptr<DraftRows> ContinuationProvider::open_rows(const TargetView& target) const {
  const int64_t V = target.vocab_size();
  if (V < 2) fail(kWho, ": the target's vocabulary has ", V, " tokens; corrupting needs two");
  for (size_t r = 0; r < references_.size(); ++r)
    for (int32_t t : references_[r])
      if (t < 0 || t >= V)
        fail(kWho, ": reference ", r, " holds token ", t, ", outside the target's vocabulary of ",
             V);
  return std::make_unique<ContinuationRows>(references_, accept_p_, seed_, V, ns_);
}

}  // namespace tandem::spec
