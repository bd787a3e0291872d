#include "tandem/core/sampler.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <numeric>

#include "tandem/core/error.h"
#include "tandem/core/rng.h"

namespace tandem {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kPosInf = std::numeric_limits<float>::infinity();

// The canonical order of a filtered distribution: descending probability, ascending id on ties.
// A strict total order (ids are distinct), so every sort/selection below yields one unique result
// regardless of algorithm or chunking. Also used with logits stored in `prob` for top-k selection.
bool canonical_before(const TokenProb& a, const TokenProb& b) {
  return a.prob > b.prob || (a.prob == b.prob && a.id < b.id);
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
void sort_more(std::vector<TokenProb>& d, size_t* sorted, size_t chunk) {
  const size_t end = std::min(d.size(), *sorted + chunk);
  if (end < d.size()) {
    std::nth_element(d.begin() + *sorted, d.begin() + end, d.end(), canonical_before);
  }
  std::sort(d.begin() + *sorted, d.begin() + end, canonical_before);
  *sorted = end;
}

constexpr size_t kFirstChunk = 64;

// The filtered distribution with unnormalized weights, in canonical order on d[0, sorted) and
// unordered after it, plus the sum of the kept weights (the normalizer). filtered_distribution
// sorts the rest; sample_token sorts only as far as its walk goes. Both see the same normalizer
// and the same prefix, so a lazy walk draws exactly the token draw_from would.
struct Filtered {
  size_t sorted = 0;
  double kept_total = 0.0;
};

Filtered filter(std::span<const float> logits, const SamplingParams& p,
                std::vector<TokenProb>* out) {
  TANDEM_CHECK(out != nullptr);
  p.validate();
  out->clear();
  const LogitScan scan = scan_logits(logits, "sampler", /*allow_pos_inf=*/false);
  if (p.greedy()) {
    out->push_back({scan.argmax, 1.0});
    return {1, 1.0};
  }

  // weight(l) = exp((l - max) / T): the unnormalized temperature-scaled probability, exactly 1 at
  // the maximum. Because the maximum survives top-k and top-p, min-p ("prob < min_p * max prob")
  // is weight < min_p, and renormalization never changes that ratio.
  const double inv_t = 1.0 / static_cast<double>(p.temperature);
  const double max = scan.max;
  const double min_p = p.min_p;
  const auto weight = [&](double l) { return std::exp((l - max) * inv_t); };
  // Sum of weights over the top-k set (all live tokens when top-k is off), before min-p:
  // the denominator of top-p's cumulative probability.
  double total = 0.0;
  double kept_total = 0.0;
  // Keep tokens that pass min-p and can be drawn at all (weight 0 = underflow in double). Both
  // tests drop a suffix of the canonical order, so filtering before top-p's prefix walk gives the
  // intersection of the prefixes, exactly what applying min-p after top-p would.
  const auto keep = [&](double w) { return w > 0.0 && w >= min_p; };

  auto& d = *out;
  const bool top_k_active = p.top_k > 0 && static_cast<size_t>(p.top_k) < scan.live;
  if (top_k_active) {
    // Select the k highest logits (ties: lowest ids) without sorting the vocabulary; `prob`
    // temporarily holds the logit, whose canonical order is the probability order.
    for (size_t i = 0; i < logits.size(); ++i) {
      if (logits[i] != kNegInf) d.push_back({static_cast<int32_t>(i), logits[i]});
    }
    const auto kth = d.begin() + p.top_k;
    std::nth_element(d.begin(), kth, d.end(), canonical_before);
    d.erase(kth, d.end());
    std::sort(d.begin(), d.end(), canonical_before);  // fixes the summation order
    size_t kept = 0;
    for (const TokenProb& e : d) {
      const double w = weight(e.prob);
      total += w;
      if (keep(w)) {
        d[kept++] = {e.id, w};
        kept_total += w;
      }
    }
    d.resize(kept);
  } else {
    for (size_t i = 0; i < logits.size(); ++i) {
      if (logits[i] == kNegInf) continue;
      const double w = weight(logits[i]);
      total += w;  // id order: fixed, so deterministic
      if (keep(w)) {
        d.push_back({static_cast<int32_t>(i), w});
        kept_total += w;
      }
    }
  }
  TANDEM_CHECK(!d.empty(), "the maximum always survives the filters");
  if (p.top_p >= 1.0f) return {0, kept_total};

  // Smallest canonical prefix with cumulative weight >= top_p * total, sorting lazily in growing
  // chunks (the mass is usually in a few tokens). The kept set is then that prefix, and its
  // normalizer the cumulative weight walked (summed in canonical order).
  const double target = static_cast<double>(p.top_p) * total;
  double cum = 0.0;
  size_t sorted = 0;
  for (size_t chunk = kFirstChunk; sorted < d.size(); chunk *= 2) {
    const size_t begin = sorted;
    sort_more(d, &sorted, chunk);
    for (size_t j = begin; j < sorted; ++j) {
      cum += d[j].prob;
      if (cum >= target) {
        d.resize(j + 1);
        return {j + 1, cum};
      }
    }
  }
  return {sorted, cum};  // rounding kept the cumulative below target: keep everything walked
}

}  // namespace

void filtered_distribution(std::span<const float> logits, const SamplingParams& p,
                           std::vector<TokenProb>* out) {
  const Filtered f = filter(logits, p, out);
  auto& d = *out;
  if (f.sorted < d.size()) std::sort(d.begin() + f.sorted, d.end(), canonical_before);
  for (TokenProb& e : d) e.prob /= f.kept_total;
}

int32_t draw_from(std::span<const TokenProb> dist, uint64_t seed, uint64_t index) {
  TANDEM_CHECK(!dist.empty());
  const double u = uniform_open01(seed, index, kRngStreamToken);
  double cum = 0.0;
  for (const TokenProb& e : dist) {
    cum += e.prob;
    if (u < cum) return e.id;
  }
  return dist.back().id;  // the renormalized total rounded below u
}

int32_t sample_token(std::span<const float> logits, const SamplingParams& p, uint64_t index,
                     std::vector<TokenProb>* scratch) {
  Filtered f = filter(logits, p, scratch);
  auto& d = *scratch;
  if (p.greedy()) return d.front().id;
  // draw_from over the normalized distribution, sorting only the prefix the walk reaches. Each
  // term is the same w / kept_total filtered_distribution stores, summed in the same order.
  const double u = uniform_open01(p.seed, index, kRngStreamToken);
  double cum = 0.0;
  size_t chunk = kFirstChunk;
  for (size_t j = 0; j < d.size(); ++j) {
    if (j == f.sorted) {
      sort_more(d, &f.sorted, chunk);
      chunk *= 2;
    }
    cum += d[j].prob / f.kept_total;
    if (u < cum) return d[j].id;
  }
  return d.back().id;  // fully sorted by now: the last entry of the canonical order
}

int32_t sample_token(std::span<const float> logits, const SamplingParams& p, uint64_t index) {
  thread_local std::vector<TokenProb> scratch;
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
