// The sampler chain (DESIGN.md section 4): temperature -> top-k -> top-p -> min-p -> draw, with
// mlx-lm / OpenAI semantics. Logit bias and penalties are applied by the caller before this.
//
// Invariants the engine and speculative decoding (section 5.1) rely on:
// - filtered_distribution is a pure function of (logits, params): bitwise identical output for
//   identical input, on one build. All probability arithmetic is in double.
// - A draw is a pure function of (filtered distribution, seed, index): one uniform from
//   kRngStreamToken at the token's absolute output index, walked as an inverse CDF over the
//   canonical order (descending probability, ascending id). A drafter that walks its own
//   distribution with the same key produces coupled proposals; the accept walk samples the target
//   with the key of each window position.
#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

namespace tandem {

struct SamplingParams {
  float temperature = 0.0f;  // 0 = greedy argmax (lowest id wins ties)
  int32_t top_k = 0;         // 0 = off; else keep the k highest logits (ties: lowest ids)
  float top_p = 1.0f;        // 1 = off; else smallest prefix with cumulative probability >= top_p
  float min_p = 0.0f;        // 0 = off; else drop tokens with prob < min_p * max prob
  uint64_t seed = 0;         // request seed: keys every random number of the request

  // Throws Error for temperature < 0 or non-finite, top_k < 0, top_p outside (0, 1],
  // min_p outside [0, 1] (NaN is outside every range).
  void validate() const;
  bool greedy() const { return temperature == 0.0f; }
};

// One entry of a filtered distribution. `prob` is renormalized over the kept set.
struct TokenProb {
  int32_t id;
  double prob;
};

// The filtered distribution the draw uses, as (id, probability) pairs in canonical order
// (descending probability, ties by ascending id), probabilities summing to 1 (up to rounding).
// - Greedy params give the one-point distribution {argmax, 1}.
// - -inf logits are excluded; tokens whose probability underflows to 0 in double (very low
//   temperature) are excluded too: they can never be drawn. top-k counts before that exclusion.
// - min-p compares against the maximum probability, which every earlier filter keeps, so the
//   test is exp((l - l_max) / T) >= min_p.
// - Errors: invalid params, empty logits, any NaN or +inf logit, all logits -inf.
// `out` is cleared and reused: with a warm vector this allocates nothing.
void filtered_distribution(std::span<const float> logits, const SamplingParams& p,
                           std::vector<TokenProb>* out);

// Inverse CDF over `dist` (canonical order) with u = uniform_open01(seed, index, kRngStreamToken):
// the first entry whose cumulative probability exceeds u; the last entry if rounding leaves the
// total below u. `dist` must be non-empty.
int32_t draw_from(std::span<const TokenProb> dist, uint64_t seed, uint64_t index);

// filtered_distribution + draw_from with the request seed. Greedy ignores the key. `index` is the
// token's absolute output index. `scratch` holds the distribution (reuse it to avoid allocation);
// the overload without it uses a thread-local scratch vector.
int32_t sample_token(std::span<const float> logits, const SamplingParams& p, uint64_t index,
                     std::vector<TokenProb>* scratch);
int32_t sample_token(std::span<const float> logits, const SamplingParams& p, uint64_t index);

// Index of the largest logit, lowest id on ties. Errors: empty logits, any NaN, all -inf.
int32_t argmax(std::span<const float> logits);

// log softmax(logits)[id] with the logsumexp in double (used by `tandem score`).
// -inf logits contribute nothing (and give -inf at their id). Errors: id out of range, NaN or
// +inf logits, all -inf.
double log_softmax_at(std::span<const float> logits, int32_t id);

// The min(k, size) largest raw logits as (id, logit), descending, ties by ascending id.
// Errors: k < 0, NaN logits.
std::vector<std::pair<int32_t, float>> top_logits(std::span<const float> logits, int k);

}  // namespace tandem
