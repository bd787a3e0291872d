// The acceptance walk (DESIGN.md §5.1 step 3): which of a row's proposals the target keeps, and
// the token it emits after them. One walk serves every drafter.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "tandem/core/sampler.h"

namespace tandem::spec {

enum class VerifyMode {
  // The target samples every window position with its own key (seed, index); a proposal is
  // accepted only if equal. Output is byte-identical to non-speculative decoding at any
  // temperature (given batch-invariant logits).
  Match,
  // Leviathan / Chen: accept proposal x with probability min(1, p(x)/q(x)), else draw from
  // norm(max(0, p − q)). Same distribution as the target, not the same bytes as a plain run.
  Rejection,
};

VerifyMode parse_verify_mode(std::string_view s);  // "match" | "rejection"; Error otherwise
const char* verify_mode_name(VerifyMode m);

struct AcceptOutcome {
  int accepted = 0;              // proposals kept (0..k)
  std::vector<int32_t> emitted;  // the accepted proposals, then the correction or bonus token
};

// logits: [k+1, vocab] for window positions 0..k (position j predicts the token after window
// token j, the slot of proposal j). first_index: the output index proposal 0 stands for; window
// position j uses key (sampling.seed, first_index + j). q: the drafter's distributions, one per
// proposal (required in Rejection mode, ignored in Match mode).
AcceptOutcome accept_walk(std::span<const float> logits, int64_t vocab,
                          std::span<const int32_t> proposals,
                          std::span<const std::vector<TokenProb>> q, const SamplingParams& sampling,
                          uint64_t first_index, VerifyMode mode);

// Match verification from the target's tokens alone (no logits on the host): target[j] is the
// token the target chose at window position j (k+1 entries): its argmax, or its draw with the key
// (seed, first_index + j) (ops::sample_rows, the same token sample_token gives). Same outcome as
// accept_walk in Match mode.
AcceptOutcome accept_walk_match(std::span<const int32_t> target,
                                std::span<const int32_t> proposals);

}  // namespace tandem::spec
