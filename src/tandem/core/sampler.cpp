#include "tandem/core/sampler.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <numeric>

#include "tandem/core/error.h"
#include "tandem/core/rng.h"
#include "tandem/core/sample_weights.h"

namespace tandem {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kPosInf = std::numeric_limits<float>::infinity();

// The canonical order of filtered weights: descending weight, ascending id on ties. A strict total
// order (ids are distinct), so every sort/selection below yields one unique result regardless of
// algorithm or chunking.
bool canonical_before(const TokenWeight& a, const TokenWeight& b) {
  return a.weight > b.weight || (a.weight == b.weight && a.id < b.id);
}

struct LogitScan {
  float max = kNegInf;
  int32_t argmax = -1;  // lowest id among the maxima
  size_t live = 0;      // logits that are not -inf
};

// One pass over the logits: rejects what no distribution can be built from, finds the maximum.
LogitScan scan_logits(std::span<const float> logits, const char* what, bool allow_pos_inf) {
  if (logits.empty()) fail(what, ": empty logits");
  if (logits.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    fail(what, ": vocabulary of ", logits.size(), " does not fit int32 ids");
  }
  LogitScan s;
  for (size_t i = 0; i < logits.size(); ++i) {
    const float l = logits[i];
    if (std::isnan(l)) fail(what, ": NaN logit at id ", i);
    if (l == kPosInf && !allow_pos_inf) fail(what, ": +inf logit at id ", i);
    if (l == kNegInf) continue;
    ++s.live;
    if (s.argmax < 0 || l > s.max) {
      s.max = l;
      s.argmax = static_cast<int32_t>(i);
    }
  }
  if (s.live == 0) fail(what, ": all ", logits.size(), " logits are -inf");
  return s;
}

}  // namespace

void SamplingParams::validate() const {
  if (!std::isfinite(temperature) || temperature < 0.0f) {
    fail("sampling: temperature must be finite and >= 0, got ", temperature);
  }
  if (top_k < 0) fail("sampling: top_k must be >= 0 (0 = off), got ", top_k);
  if (!(top_p > 0.0f && top_p <= 1.0f)) fail("sampling: top_p must be in (0, 1], got ", top_p);
  if (!(min_p >= 0.0f && min_p <= 1.0f)) fail("sampling: min_p must be in [0, 1], got ", min_p);
}

namespace {

// Extends the sorted prefix d[0, sorted) by the next `chunk` entries of the canonical order.
// Because canonical_before is a strict total order, any sequence of these steps leaves exactly
// the prefix a full sort would produce.
void sort_more(std::vector<TokenWeight>& d, size_t* sorted, size_t chunk) {
  const size_t end = std::min(d.size(), *sorted + chunk);
  if (end < d.size()) {
    std::nth_element(d.begin() + *sorted, d.begin() + end, d.end(), canonical_before);
  }
  std::sort(d.begin() + *sorted, d.begin() + end, canonical_before);
  *sorted = end;
}

constexpr size_t kFirstChunk = 64;

// The filtered weights, in canonical order on d[0, sorted) and unordered after it, and their sum.
// filtered_weights sorts the rest; sample_token sorts only as far as its walk goes. Both see the
// same total and the same prefix, so a lazy walk draws exactly the token draw_weighted would.
struct Filtered {
  size_t sorted = 0;
  uint64_t kept_total = 0;
};

Filtered filter(std::span<const float> logits, const SamplingParams& p,
                std::vector<TokenWeight>* out) {
  TANDEM_CHECK(out != nullptr);
  p.validate();
  out->clear();
  if (logits.size() > static_cast<size_t>(kMaxSampleVocab)) {
    // Integer weights of more tokens could overflow their 64-bit sum.
    fail("sampler: vocabulary of ", logits.size(), " is over the limit of ", kMaxSampleVocab);
  }
  const LogitScan scan = scan_logits(logits, "sampler", /*allow_pos_inf=*/false);
  if (p.greedy()) {
    out->push_back({scan.argmax, kSampleWeightOne});
    return {1, kSampleWeightOne};
  }

  const double inv_t = 1.0 / static_cast<double>(p.temperature);
  const float max = scan.max;
  // Keep tokens that pass min-p and can be drawn at all (weight 0). Both tests drop a suffix of
  // the canonical order, so filtering before top-p's prefix walk gives the intersection of the
  // prefixes, exactly what applying min-p after top-p would.
  const uint64_t min_weight = std::max<uint64_t>(1, min_p_weight(p.min_p));
  // Weight of the top-k set (every live token when top-k is off) before min-p: the total top-p's
  // cumulative weight is measured against. Integer sums: exact in any order.
  uint64_t total = 0, kept_total = 0;

  auto& d = *out;
  const bool top_k_active = p.top_k > 0 && static_cast<size_t>(p.top_k) < scan.live;
  if (top_k_active) {
    // The k highest logits (ties: lowest ids), by their order keys, without sorting the
    // vocabulary; `weight` holds the key until the set is chosen.
    for (size_t i = 0; i < logits.size(); ++i) {
      if (logits[i] != kNegInf) d.push_back({static_cast<int32_t>(i), logit_order_key(logits[i])});
    }
    const auto kth = d.begin() + p.top_k;
    std::nth_element(d.begin(), kth, d.end(), canonical_before);
    d.erase(kth, d.end());
    size_t kept = 0;
    for (const TokenWeight& e : d) {
      const uint64_t w = sample_weight(logits[static_cast<size_t>(e.id)], max, inv_t);
      total += w;
      if (w >= min_weight) {
        d[kept++] = {e.id, w};
        kept_total += w;
      }
    }
    d.resize(kept);
  } else {
    for (size_t i = 0; i < logits.size(); ++i) {
      if (logits[i] == kNegInf) continue;
      const uint64_t w = sample_weight(logits[i], max, inv_t);
      total += w;
      if (w >= min_weight) {
        d.push_back({static_cast<int32_t>(i), w});
        kept_total += w;
      }
    }
  }
  TANDEM_CHECK(!d.empty(), "the maximum always survives the filters");
  if (p.top_p >= 1.0f) return {0, kept_total};

  // Shortest canonical prefix whose weight reaches ceil(top_p · total), sorting lazily in growing
  // chunks (the mass is usually in a few tokens).
  const uint64_t target = top_p_weight(p.top_p, total);
  uint64_t cum = 0;
  size_t sorted = 0;
  for (size_t chunk = kFirstChunk; sorted < d.size(); chunk *= 2) {
    const size_t begin = sorted;
    sort_more(d, &sorted, chunk);
    for (size_t j = begin; j < sorted; ++j) {
      cum += d[j].weight;
      if (cum >= target) {
        d.resize(j + 1);
        return {j + 1, cum};
      }
    }
  }
  return {sorted, cum};  // min-p dropped more than 1 - top_p of the mass: keep all that is left
}

}  // namespace

uint64_t filtered_weights(std::span<const float> logits, const SamplingParams& p,
                          std::vector<TokenWeight>* out) {
  const Filtered f = filter(logits, p, out);
  auto& d = *out;
  if (f.sorted < d.size()) std::sort(d.begin() + f.sorted, d.end(), canonical_before);
  return f.kept_total;
}

void filtered_distribution(std::span<const float> logits, const SamplingParams& p,
                           std::vector<TokenProb>* out) {
  TANDEM_CHECK(out != nullptr);
  thread_local std::vector<TokenWeight> weights;
  const uint64_t total = filtered_weights(logits, p, &weights);
  out->clear();
  out->reserve(weights.size());
  const double inv = 1.0 / static_cast<double>(total);
  for (const TokenWeight& e : weights) out->push_back({e.id, static_cast<double>(e.weight) * inv});
}

int32_t draw_weighted(std::span<const TokenWeight> weights, uint64_t total, uint64_t seed,
                      uint64_t index) {
  TANDEM_CHECK(!weights.empty() && total > 0);
  const uint64_t target = draw_weight(uniform_open01(seed, index, kRngStreamToken), total);
  uint64_t cum = 0;
  for (const TokenWeight& e : weights) {
    cum += e.weight;
    if (cum >= target) return e.id;
  }
  fail("draw_weighted: weights sum to ", cum, ", below their stated total ", total);
}

int32_t draw_from(std::span<const TokenProb> dist, uint64_t seed, uint64_t index) {
  TANDEM_CHECK(!dist.empty());
  const double u = uniform_open01(seed, index, kRngStreamToken);
  double cum = 0.0;
  for (const TokenProb& e : dist) {
    cum += e.prob;
    if (u < cum) return e.id;
  }
  return dist.back().id;  // the total rounded below u
}

int32_t sample_token(std::span<const float> logits, const SamplingParams& p, uint64_t index,
                     std::vector<TokenWeight>* scratch) {
  Filtered f = filter(logits, p, scratch);
  auto& d = *scratch;
  if (p.greedy()) return d.front().id;
  // draw_weighted over the canonical order, sorting only the prefix the walk reaches.
  const uint64_t target = draw_weight(uniform_open01(p.seed, index, kRngStreamToken), f.kept_total);
  uint64_t cum = 0;
  size_t chunk = kFirstChunk;
  for (size_t j = 0; j < d.size(); ++j) {
    if (j == f.sorted) {
      sort_more(d, &f.sorted, chunk);
      chunk *= 2;
    }
    cum += d[j].weight;
    if (cum >= target) return d[j].id;
  }
  TANDEM_CHECK(false, "sample_token: the kept weights sum to their total");
  return d.back().id;
}

int32_t sample_token(std::span<const float> logits, const SamplingParams& p, uint64_t index) {
  thread_local std::vector<TokenWeight> scratch;
  return sample_token(logits, p, index, &scratch);
}

int32_t argmax(std::span<const float> logits) {
  return scan_logits(logits, "argmax", /*allow_pos_inf=*/true).argmax;
}

double log_softmax_at(std::span<const float> logits, int32_t id) {
  const LogitScan scan = scan_logits(logits, "log_softmax", /*allow_pos_inf=*/false);
  if (id < 0 || static_cast<size_t>(id) >= logits.size()) {
    fail("log_softmax: id ", id, " outside vocabulary of ", logits.size());
  }
  if (logits[id] == kNegInf) return -std::numeric_limits<double>::infinity();
  const double max = scan.max;
  double sum = 0.0;
  for (const float l : logits) {
    if (l != kNegInf) sum += std::exp(static_cast<double>(l) - max);
  }
  return (static_cast<double>(logits[id]) - max) - std::log(sum);
}

std::vector<std::pair<int32_t, float>> top_logits(std::span<const float> logits, int k) {
  if (k < 0) fail("top_logits: k must be >= 0, got ", k);
  if (logits.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    fail("top_logits: vocabulary of ", logits.size(), " does not fit int32 ids");
  }
  for (size_t i = 0; i < logits.size(); ++i) {
    if (std::isnan(logits[i])) fail("top_logits: NaN logit at id ", i);
  }
  std::vector<int32_t> ids(logits.size());
  std::iota(ids.begin(), ids.end(), 0);
  const size_t n = std::min(static_cast<size_t>(k), ids.size());
  std::partial_sort(ids.begin(), ids.begin() + n, ids.end(), [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  std::vector<std::pair<int32_t, float>> result;
  result.reserve(n);
  for (size_t i = 0; i < n; ++i) result.emplace_back(ids[i], logits[ids[i]]);
  return result;
}

}  // namespace tandem
