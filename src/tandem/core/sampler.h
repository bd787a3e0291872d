// The sampler chain (DESIGN.md section 4): temperature -> top-k -> top-p -> min-p -> draw, with
// mlx-lm / OpenAI semantics. Logit bias and penalties are applied by the caller before this.
//
// Invariants the engine and speculative decoding (section 5.1) rely on:
// - Probabilities are integer weights (core/sample_weights.h): W = round(exp((l - max) / T) · 2^40)
//   from a fixed sequence of correctly rounded operations, summed as integers. The filtered set,
//   its weights and every draw are therefore pure functions of (logits, params, seed, index) with
//   the same bits on every build and backend: the CUDA sampler (ops::sample_rows) draws exactly
//   the tokens this file does from the same logits.
// - A draw is one uniform from kRngStreamToken at the token's absolute output index, walked as an
//   inverse CDF in integers over the canonical order (descending weight, ascending id). A drafter
//   that walks its own distribution with the same key produces coupled proposals; the accept walk
//   samples the target with the key of each window position.
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

// One entry of the filtered weights: the token's integer weight W (sample_weights.h).
struct TokenWeight {
  int32_t id;
  uint64_t weight;
};

// The filtered set the draw uses, in canonical order (descending weight, ties by ascending id),
// and the sum of its weights (returned).
// - Greedy params give the one-point set {argmax, 2^40}.
// - -inf logits are excluded; tokens whose weight rounds to 0 (more than ~28 nats below the
//   maximum after temperature) are excluded too: they can never be drawn. top-k counts before
//   that exclusion, and selects by logit (ties: lowest ids).
// - min-p compares against the maximum, which every earlier filter keeps and which weighs
//   2^40: a token stays if W >= ceil(min_p · 2^40).
// - top-p keeps the shortest canonical prefix whose weight reaches ceil(top_p · total), total
//   being the weight of the top-k set before min-p (all of it when nothing reaches that).
// - Errors: invalid params, empty logits, a vocabulary over kMaxSampleVocab, any NaN or +inf
//   logit, all logits -inf.
// `out` is cleared and reused: with a warm vector this allocates nothing.
uint64_t filtered_weights(std::span<const float> logits, const SamplingParams& p,
                          std::vector<TokenWeight>* out);

// filtered_weights as probabilities W / total (the drafter's q of rejection sampling).
void filtered_distribution(std::span<const float> logits, const SamplingParams& p,
                           std::vector<TokenProb>* out);

// The integer inverse CDF over `weights` (canonical order, summing to `total`) with
// u = uniform_open01(seed, index, kRngStreamToken): the first entry whose cumulative weight
// reaches draw_weight(u, total). `weights` must be non-empty.
int32_t draw_weighted(std::span<const TokenWeight> weights, uint64_t total, uint64_t seed,
                      uint64_t index);

// Inverse CDF over a distribution in doubles, u as above: the first entry whose cumulative
// probability exceeds u; the last entry if rounding leaves the total below u. `dist` must be
// non-empty. (For distributions given as probabilities; sampled logits go through the weights.)
int32_t draw_from(std::span<const TokenProb> dist, uint64_t seed, uint64_t index);

// filtered_weights + draw_weighted with the request seed, sorting only as far as the walk goes.
// Greedy ignores the key. `index` is the token's absolute output index. `scratch` holds the
// weights (reuse it to avoid allocation); the overload without it uses a thread-local vector.
int32_t sample_token(std::span<const float> logits, const SamplingParams& p, uint64_t index,
                     std::vector<TokenWeight>* scratch);
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
