// The continuation drafter, for benchmarks only: it proposes the target's own continuation,
// recorded beforehand by plain decoding, with each proposal corrupted with probability 1 - p.
// Under match verification a proposal that follows accepted ones is then accepted with
// probability p exactly, so speed-up can be measured against acceptance on any target, also on
// random weights where no real drafter accepts anything (issue 19: at p = 0.8 and depth 3 the
// mean accepted length is 1 + p + p² + p³ = 2.95 tokens per round, the bonus token included).
//
// References are whole token sequences, prompt + continuation. A row drafts from the first
// reference its history (token_rows.h) is a prefix of, found at its first draft and kept while
// the history stays on it; once the history leaves every reference, the row proposes nothing.
// The proposal for position i of reference r is r[i], replaced when the key (seed, r, i) draws a
// uniform u >= p by r[i] + 1 + (another draw mod V - 1), mod V: always another token. The key
// depends on nothing else, so proposals do not depend on depth, batch or round boundaries.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tandem/spec/draft.h"

namespace tandem::spec {

inline constexpr const char* kContinuationSchema = "continuation-history-v1";

class ContinuationProvider : public DraftProvider {
 public:
  // Throws tandem::Error unless p is in [0, 1] and every reference is non-empty.
  ContinuationProvider(std::vector<std::vector<int32_t>> references, double accept_p,
                       uint64_t seed);
  const std::string& id() const override { return id_; }
  uint64_t weights_bytes() const override { return 0; }
  // "continuation-history-v1:p=<p>:seed=<seed>:<hash of the references>".
  const std::string& checkpoint_namespace() const override { return ns_; }
  // Refuses a target whose vocabulary has fewer than 2 tokens or does not hold every reference
  // token.
  std::unique_ptr<DraftRows> open_rows(const TargetView& target) const override;
  double accept_p() const { return accept_p_; }

 private:
  std::vector<std::vector<int32_t>> references_;
  double accept_p_;
  uint64_t seed_;
  std::string id_ = "continuation";
  std::string ns_;
};

}  // namespace tandem::spec
