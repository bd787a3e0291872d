// N-gram prompt lookup (DESIGN.md §5.4): a model-free drafter that proposes what followed the
// earliest earlier occurrence of the row's trailing n-gram, trying the longest n first.
//
// Rows keep the token histories of token_rows.h: the processed tokens, then the pending one.
//
// draft(depth k): for n = max_n down to min_n (n < history size), take the trailing n-gram of the
// history (it ends with `pending`); the first n for which it occurs earlier — any occurrence that
// starts before the trailing one does, overlaps allowed — proposes the tokens that followed its
// earliest occurrence, at most k of them (fewer when the history ends first). No match → no
// proposals. Proposals never depend on sampling; the q asked for in rejection mode is one-hot.
// An index per n (n-gram → earliest start) grows with the history, so a draft costs O(max_n²)
// hashing, not a scan.
//
// Rounds settled on the device (DraftRows::draft_settled, SpecOptions::settled_rounds) run the
// same lookup there (ops::ngram_lookup) on a copy of the histories, which ops::history_append
// extends with what each verify kept; a row's window is padded past its proposals.
//
// Checkpoints ("ngram-history-v1") hold exactly the processed tokens (token_rows.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "tandem/spec/draft.h"

namespace tandem::spec {

struct NgramOptions {
  int min_n = 1;  // --ngram-min
  int max_n = 3;  // --ngram-max
};

// Throws tandem::Error unless 1 <= min_n <= max_n <= 16.
void validate_ngram_options(const NgramOptions& o);

inline constexpr const char* kNgramSchema = "ngram-history-v1";

class NgramProvider : public DraftProvider {
 public:
  explicit NgramProvider(const NgramOptions& options);
  const std::string& id() const override { return id_; }
  uint64_t weights_bytes() const override { return 0; }
  // "ngram-history-v1:n=<min>-<max>".
  const std::string& checkpoint_namespace() const override { return ns_; }
  std::unique_ptr<DraftRows> open_rows(const TargetView& target) const override;
  const NgramOptions& options() const { return options_; }

 private:
  NgramOptions options_;
  std::string id_ = "ngram";
  std::string ns_;
};

}  // namespace tandem::spec
