// Adaptive speculation depth (issue 19, `--depth auto`): each round proposes the number of
// tokens k (0..max) that maximises the expected tokens emitted per second,
//
//   rate(k) = E_k / cost(rows, k),   E_k = 1 + Σ_{j<k} a_j,
//
// where a_j is the running share of proposals at window position j that were accepted (accepting
// position j needs every earlier one, so a_j already is the chance of reaching it) and cost is
// the measured time of a round of that many rows at that depth. k = 0 when no depth beats plain
// rounds. The policy only decides how many tokens a round proposes: output never depends on it.
//
// Costs are learnt online, per (rows rounded up to a power of two, depth), as exponential moving
// averages of measured round times. An unmeasured depth is estimated along the least-squares
// line through the bucket's measured depths (a round's cost grows about linearly with its
// proposals); with only one measured, from it, a tenth of a round dearer per extra token
// (optimistic, so it gets tried). Acceptance follows a window of recent proposals, each position
// leaning on a prior drawn from the position before it (so depths rarely run are judged by the ones
// that are). Every `explore_every` rounds a bucket runs a neighbour of its best depth once, so both
// estimates stay current as contexts grow and acceptance drifts; while explorations change
// nothing, they come less and less often (explore_backoff); one that is due waits (for a while) for
// a round of the most rows the bucket has seen, whose CUDA graphs later explorations replay, and
// for a round whose time is recorded (not the first after a prefill, which waits for it too). A
// neighbour never measured goes first (the shallower before the deeper), every few rounds until
// both are: round costs are concave in the depth (the first proposal brings the draft, the window
// and the commit), so the line through drafted depths overprices plain rounds, which only their
// own measurement clears. The depth in use changes only for one whose rate is 3% better (every new
// depth runs CUDA graphs of new shapes).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <vector>

namespace tandem::spec {

struct DepthPolicyOptions {
  int max_depth = 4;
  double cost_smoothing = 0.25;  // weight of a new measurement in a cost's moving average
  // Proposals per position the acceptance estimate follows (older rounds fade out).
  int64_t acceptance_window = 256;
  int explore_every = 16;  // rounds between exploration rounds of one row bucket
  // While explorations leave the best depth as it was, each one doubles the rounds to the next,
  // up to explore_every · explore_backoff; a new best depth resets them. An exploration costs a
  // round at a worse depth, which a drafter that never pays would pay every explore_every rounds.
  int explore_backoff = 8;
};

class DepthPolicy {
 public:
  explicit DepthPolicy(DepthPolicyOptions options = {});

  // The depth for the next round of `rows` rows (0..max_depth). `timed`: the round's time will
  // be recorded (false where it will not be typical, e.g. it also waits for a prefill): an
  // exploration due then waits for the next round, since what it explores is the depth's time.
  int choose(int64_t rows, bool timed = true);
  // What a round of `rows` rows at `depth` did: its wall time (0: not timed, where the time is
  // not typical of the depth; only the counts are taken) and, per window position j < depth, how
  // many proposals were drafted and accepted.
  void record(int64_t rows, int depth, double seconds, std::span<const int64_t> drafted,
              std::span<const int64_t> accepted);

  double acceptance(int position) const;    // a_j: the estimate in use (prior included)
  double expected_tokens(int depth) const;  // E_k per row and round
  // The estimated round time at (rows, depth); nullopt before any round of that row bucket.
  std::optional<double> cost(int64_t rows, int depth) const;
  // The depth choose() would pick now, without exploring: the best rate, except that the depth
  // in use stays until another beats its rate by 3% (a change of depth costs new CUDA graphs).
  int best(int64_t rows) const;
  int max_depth() const { return options_.max_depth; }
  // Rounds recorded with a time, and without one (not typical of their depth).
  int64_t timed_rounds() const { return timed_rounds_; }
  int64_t untimed_rounds() const { return untimed_rounds_; }
  // Whether a round of (rows, depth) has been timed: cost() is then a measurement, not an
  // estimate from the bucket's other depths.
  bool measured(int64_t rows, int depth) const;

  // Start-up warm-up (engine/warmup.h): while on, choose() walks each row count through every
  // depth, two rounds apiece (a shape's first round runs its CUDA graphs cold and goes untimed,
  // the second measures it), and record() learns round costs only: warm-up prompts say nothing
  // of the acceptance real traffic will see, so the estimates keep their priors.
  void set_warmup(bool on) { warmup_ = on; }
  bool warming_up() const { return warmup_; }

 private:
  DepthPolicyOptions options_;
  struct Position {
    double drafted = 0, accepted = 0;  // decayed counts
  };
  std::vector<Position> positions_;
  struct Bucket {
    std::vector<std::optional<double>> cost;  // [depth]
    int64_t rounds = 0;
    int64_t next_explore = 0;  // the round that explores next
    int64_t last_explore = 0;  // the round that explored last
    int64_t interval = 0;      // rounds from one exploration to the next
    int last_best = -1;        // the best depth when the bucket last explored
    int64_t explorations = 0;
    int64_t most_rows = 0;  // the most rows a round of this bucket had
    int in_use = -1;        // the depth its rounds run when not exploring (best's hysteresis)
  };
  std::map<int, Bucket> buckets_;
  int64_t timed_rounds_ = 0, untimed_rounds_ = 0;
  bool warmup_ = false;
  std::map<int64_t, int64_t> warmup_rounds_;  // rows -> warm-up rounds chosen for that many
  static int bucket_of(int64_t rows);
  Bucket& bucket(int64_t rows);  // the bucket of `rows`, made on first use
  std::optional<double> estimate(const Bucket& b, int depth) const;
};

}  // namespace tandem::spec
