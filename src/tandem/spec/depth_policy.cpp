#include "tandem/spec/depth_policy.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "tandem/core/error.h"

namespace tandem::spec {

namespace {

// Each position's estimate leans on a prior worth `kPriorProposals` proposals: position j's
// prior is kPriorDecay times position j-1's estimate (0.6 for position 0), so positions a round
// rarely reaches are judged by the ones it does, a little pessimistically. One row drafts only a
// few proposals a round, so the prior's weight decides how soon a single row gives up on a
// drafter that is never right (where windows cost little more than a step, batch 1 of a large
// model) and how easily early rejections talk it out of deep windows that pay: worth 8, auto ran
// at 0.89x of plain decoding with a hopeless drafter at batch 1 on the H200; worth 1, it stayed
// at shallow depths where depth 3 paid (2.16x against 2.72x at p = 0.8). Two balances them in
// simulation (tests/test_depth_policy.cpp).
constexpr double kPriorProposals = 2.0;
constexpr double kPriorFirst = 0.6;
constexpr double kPriorDecay = 0.85;
// An unmeasured depth costs this share of a round more per extra token than its measured
// neighbour (verify windows and draft steps both grow with the depth).
constexpr double kPriorSlope = 0.10;
// Rounds between explorations while the best depth has a neighbour never measured.
constexpr int64_t kFirstExplore = 4;
// The depth a bucket runs changes only for one whose rate beats it by this share: estimates
// wobble by a few percent from round to round, and each change of depth runs CUDA graphs of new
// shapes (an eager run and a capture each, for every row count the bucket passes through), which
// costs far more than running within 3% of the best rate.
constexpr double kSwitchMargin = 0.03;

}  // namespace

DepthPolicy::DepthPolicy(DepthPolicyOptions options) : options_(options) {
  if (options_.max_depth < 1 || options_.max_depth > 16)
    fail("depth policy: max depth must be in 1..16, got ", options_.max_depth);
  if (!(options_.cost_smoothing > 0.0 && options_.cost_smoothing <= 1.0))
    fail("depth policy: cost smoothing must be in (0, 1]");
  if (options_.acceptance_window < 1 || options_.explore_every < 2 || options_.explore_backoff < 1)
    fail(
        "depth policy: acceptance window >= 1, explore_every >= 2 and explore_backoff >= 1 "
        "required");
  positions_.resize(static_cast<size_t>(options_.max_depth));
}

int DepthPolicy::bucket_of(int64_t rows) {
  int b = 0;
  while ((int64_t{1} << b) < rows) ++b;
  return b;
}

double DepthPolicy::acceptance(int position) const {
  TANDEM_CHECK(position >= 0 && position < options_.max_depth, "position ", position);
  double prior = kPriorFirst;
  double a = 0.0;
  for (int j = 0; j <= position; ++j) {
    const Position& p = positions_[static_cast<size_t>(j)];
    a = (p.accepted + kPriorProposals * prior) / (p.drafted + kPriorProposals);
    prior = kPriorDecay * a;
  }
  return a;
}

double DepthPolicy::expected_tokens(int depth) const {
  double e = 1.0;
  for (int j = 0; j < depth; ++j) e += acceptance(j);
  return e;
}

std::optional<double> DepthPolicy::estimate(const Bucket& b, int depth) const {
  if (b.cost[static_cast<size_t>(depth)]) return b.cost[static_cast<size_t>(depth)];
  // Measured depths of the bucket: with two or more, the least-squares line through them (a
  // round's cost grows about linearly with its proposals: window tokens and draft steps);
  // with one, that cost and the prior slope.
  double n = 0, sx = 0, sy = 0, sxx = 0, sxy = 0, lowest = 0;
  int nearest = -1;
  for (int k = 0; k <= options_.max_depth; ++k) {
    const std::optional<double>& c = b.cost[static_cast<size_t>(k)];
    if (!c) continue;
    n += 1, sx += k, sy += *c, sxx += double(k) * k, sxy += k * *c;
    lowest = nearest < 0 ? *c : std::min(lowest, *c);
    if (nearest < 0 || std::abs(k - depth) < std::abs(nearest - depth)) nearest = k;
  }
  if (nearest < 0) return std::nullopt;
  const double scale = 1.0 + kPriorSlope * static_cast<double>(depth - nearest);
  const double from_nearest = *b.cost[static_cast<size_t>(nearest)] * std::max(0.5, scale);
  if (n >= 2) {
    // The lower of the line and the prior slope: measured depths of equal cost (a flat line)
    // must not hide that a shallower, unmeasured depth is cheaper, or it is never tried.
    const double slope = (n * sxy - sx * sy) / (n * sxx - sx * sx);
    const double at = (sy - slope * sx) / n + slope * depth;
    return std::max(0.5 * lowest, std::min(at, from_nearest));
  }
  return from_nearest;
}

std::optional<double> DepthPolicy::cost(int64_t rows, int depth) const {
  TANDEM_CHECK(depth >= 0 && depth <= options_.max_depth, "depth ", depth);
  const auto it = buckets_.find(bucket_of(rows));
  if (it == buckets_.end()) return std::nullopt;
  return estimate(it->second, depth);
}

int DepthPolicy::best(int64_t rows) const {
  const auto it = buckets_.find(bucket_of(rows));
  // Nothing timed for this many rows yet (no round, or only untimed ones): start in the middle,
  // where both neighbours get measured soon.
  const int start = (options_.max_depth + 1) / 2;
  if (it == buckets_.end()) return start;
  int best = -1;
  double best_rate = 0.0;
  for (int k = 0; k <= options_.max_depth; ++k) {
    const std::optional<double> c = estimate(it->second, k);
    if (!c || *c <= 0.0) continue;
    const double rate = expected_tokens(k) / *c;
    if (best < 0 || rate > best_rate * (1.0 + 1e-9)) {  // ties keep the shallower depth
      best = k;
      best_rate = rate;
    }
  }
  if (best < 0) return start;
  const int in_use = it->second.in_use;
  if (in_use >= 0 && in_use != best) {
    const std::optional<double> c = estimate(it->second, in_use);
    if (c && *c > 0.0 && best_rate <= expected_tokens(in_use) / *c * (1.0 + kSwitchMargin))
      return in_use;
  }
  return best;
}

DepthPolicy::Bucket& DepthPolicy::bucket(int64_t rows) {
  Bucket& b = buckets_[bucket_of(rows)];
  if (b.cost.empty()) {
    b.cost.resize(static_cast<size_t>(options_.max_depth + 1));
    b.interval = options_.explore_every;
    b.next_explore = options_.explore_every;
  }
  return b;
}

bool DepthPolicy::measured(int64_t rows, int depth) const {
  TANDEM_CHECK(depth >= 0 && depth <= options_.max_depth, "depth ", depth);
  const auto it = buckets_.find(bucket_of(rows));
  return it != buckets_.end() && it->second.cost[static_cast<size_t>(depth)].has_value();
}

int DepthPolicy::choose(int64_t rows, bool timed) {
  TANDEM_CHECK(rows >= 1, "depth policy: a round of ", rows, " rows");
  if (warmup_) {
    // Depths 0, 0, 1, 1, ... per exact row count (each row count runs CUDA graphs of its own);
    // the exploration schedule and the most rows seen are left as they were (the warm-up's row
    // counts are not the traffic's).
    const int64_t n = warmup_rounds_[rows]++;
    return static_cast<int>((n / 2) % (options_.max_depth + 1));
  }
  const int k = best(rows);
  Bucket& b = bucket(rows);
  b.in_use = k;
  b.most_rows = std::max(b.most_rows, rows);
  auto unmeasured = [&](int d) {
    return d >= 0 && d <= options_.max_depth && !b.cost[static_cast<size_t>(d)];
  };
  // While the best depth has a neighbour never measured, explore every kFirstExplore rounds: a
  // fresh bucket otherwise runs its starting guess for explore_every rounds.
  if (unmeasured(k - 1) || unmeasured(k + 1))
    b.next_explore = std::min(b.next_explore, b.last_explore + kFirstExplore);
  if (++b.rounds < b.next_explore || !timed) return k;
  // An exploration due waits for a round of the most rows the bucket has seen (a full batch, as
  // rows that finish one after another leave fewer), up to explore_every · explore_backoff
  // rounds: each row count runs CUDA graphs of its own, so explorations at whatever row count
  // comes capture a graph for each (a millisecond of host time apiece, while the device idles:
  // more than a short run's explorations gain), where one row count's graphs are captured once
  // and replayed by its later explorations.
  const int64_t most_deferred = int64_t{options_.explore_every} * options_.explore_backoff;
  if (rows < b.most_rows && b.rounds < b.next_explore + most_deferred) return k;
  b.last_explore = b.rounds;
  // Explore a neighbour: alternately the deeper and the shallower one. The interval doubles while
  // the best depth stays where the last exploration found it.
  const int64_t most = int64_t{options_.explore_every} * options_.explore_backoff;
  b.interval = k == b.last_best ? std::min(2 * b.interval, most) : options_.explore_every;
  b.last_best = k;
  b.next_explore = b.rounds + b.interval;
  ++b.explorations;
  // A neighbour never measured first, the shallower one before the deeper: costs grow concavely
  // with the depth (a first proposal brings the draft, the window and the commit; later ones
  // little more), so a line through drafted depths overprices plain rounds, which then only their
  // own measurement can clear.
  if (unmeasured(k - 1)) return k - 1;
  if (unmeasured(k + 1)) return k + 1;
  const bool deeper = b.explorations % 2 == 1;
  if (deeper && k < options_.max_depth) return k + 1;
  if (k > 0) return k - 1;
  return k + 1;
}

void DepthPolicy::record(int64_t rows, int depth, double seconds, std::span<const int64_t> drafted,
                         std::span<const int64_t> accepted) {
  TANDEM_CHECK(depth >= 0 && depth <= options_.max_depth, "depth policy: depth ", depth);
  TANDEM_CHECK(drafted.size() == accepted.size(), "depth policy: counts of different lengths");
  Bucket& b = bucket(rows);
  ++(seconds > 0.0 ? timed_rounds_ : untimed_rounds_);
  if (seconds > 0.0) {
    std::optional<double>& c = b.cost[static_cast<size_t>(depth)];
    c = c ? (1.0 - options_.cost_smoothing) * *c + options_.cost_smoothing * seconds : seconds;
  }
  if (warmup_) return;
  const double window = static_cast<double>(options_.acceptance_window);
  for (size_t j = 0; j < drafted.size() && j < positions_.size(); ++j) {
    if (drafted[j] <= 0) continue;
    Position& p = positions_[j];
    p.drafted += static_cast<double>(drafted[j]);
    p.accepted += static_cast<double>(accepted[j]);
    if (p.drafted > window) {  // fade older rounds so the estimate follows the recent ones
      const double scale = window / p.drafted;
      p.drafted *= scale;
      p.accepted *= scale;
    }
  }
}

}  // namespace tandem::spec
