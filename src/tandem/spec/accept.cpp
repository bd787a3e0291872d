#include "tandem/spec/accept.h"

#include <algorithm>

#include "tandem/core/error.h"
#include "tandem/core/rng.h"

namespace tandem::spec {

namespace {

double prob_of(std::span<const TokenProb> dist, int32_t id) {
  for (const TokenProb& t : dist)
    if (t.id == id) return t.prob;
  return 0.0;
}

// norm(max(0, p − q)) in p's canonical order; falls back to p when p ≤ q everywhere (then a
// rejection has probability zero and this is never drawn from).
void residual(std::span<const TokenProb> p, std::span<const TokenProb> q,
              std::vector<TokenProb>* out) {
  out->clear();
  double total = 0;
  for (const TokenProb& t : p) {
    const double r = std::max(0.0, t.prob - prob_of(q, t.id));
    if (r > 0) {
      out->push_back({t.id, r});
      total += r;
    }
  }
  if (total <= 0) {
    out->assign(p.begin(), p.end());
    return;
  }
  for (TokenProb& t : *out) t.prob /= total;
}

// Inverse CDF over `dist` with the residual stream's uniform at `index`.
int32_t draw_residual(std::span<const TokenProb> dist, uint64_t seed, uint64_t index) {
  const double u = uniform_open01(seed, index, kRngStreamResidual);
  double cum = 0.0;
  for (const TokenProb& e : dist) {
    cum += e.prob;
    if (u < cum) return e.id;
  }
  return dist.back().id;
}

}  // namespace

VerifyMode parse_verify_mode(std::string_view s) {
  if (s == "match") return VerifyMode::Match;
  if (s == "rejection") return VerifyMode::Rejection;
  fail("--verify must be 'match' or 'rejection', got '", s, "'");
}

const char* verify_mode_name(VerifyMode m) {
  return m == VerifyMode::Match ? "match" : "rejection";
}

AcceptOutcome accept_walk(std::span<const float> logits, int64_t vocab,
                          std::span<const int32_t> proposals,
                          std::span<const std::vector<TokenProb>> q, const SamplingParams& sampling,
                          uint64_t first_index, VerifyMode mode) {
  const size_t k = proposals.size();
  TANDEM_CHECK(logits.size() == (k + 1) * static_cast<size_t>(vocab), "accept_walk logits size");
  if (mode == VerifyMode::Rejection && q.size() != k)
    fail("rejection verification needs the drafter's distribution for each proposal (got ",
         q.size(), " for ", k, " proposals)");
  AcceptOutcome out;
  std::vector<TokenProb> p, r;
  for (size_t j = 0; j <= k; ++j) {
    const auto row = logits.subspan(j * static_cast<size_t>(vocab), static_cast<size_t>(vocab));
    const uint64_t index = first_index + j;
    if (j == k) {  // bonus: every proposal was accepted
      out.emitted.push_back(sample_token(row, sampling, index));
      break;
    }
    if (mode == VerifyMode::Match) {
      const int32_t t = sample_token(row, sampling, index);
      out.emitted.push_back(t);
      if (t != proposals[j]) break;
      ++out.accepted;
      continue;
    }
    filtered_distribution(row, sampling, &p);
    const double pp = prob_of(p, proposals[j]);
    const double qq = prob_of(q[j], proposals[j]);
    const double u = uniform_open01(sampling.seed, index, kRngStreamAccept);
    const bool accept = pp > 0 && (qq <= 0 || u < std::min(1.0, pp / qq));
    if (accept) {
      out.emitted.push_back(proposals[j]);
      ++out.accepted;
      continue;
    }
    residual(p, q[j], &r);
    out.emitted.push_back(draw_residual(r, sampling.seed, index));
    break;
  }
  return out;
}

AcceptOutcome accept_walk_match(std::span<const int32_t> target,
                                std::span<const int32_t> proposals) {
  TANDEM_CHECK(target.size() == proposals.size() + 1, "accept_walk_match: ", target.size(),
               " target tokens for ", proposals.size(), " proposals");
  AcceptOutcome out;
  for (size_t j = 0; j < target.size(); ++j) {
    out.emitted.push_back(target[j]);
    if (j == proposals.size() || target[j] != proposals[j]) break;
    ++out.accepted;
  }
  return out;
}

}  // namespace tandem::spec
