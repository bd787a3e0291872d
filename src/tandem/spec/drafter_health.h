// The drafter health probe (issue 19): speculation only pays while proposals are accepted. A
// drafter whose acceptance has collapsed — an MTP head fed the other hidden tap (--mtp-hidden), a
// damaged quantization, a companion made for another checkpoint — makes every round verify a
// window that yields one token, slower than plain decoding. The probe watches the acceptance of
// first proposals over a sliding window of recent rounds and reports a collapse once, so the
// engine can warn and stop drafting (depth 0). Output never depends on it: a collapse changes
// only how many tokens a round proposes.
#pragma once

#include <cstdint>
#include <deque>
#include <string>

namespace tandem::spec {

struct DrafterHealthOptions {
  // First proposals the window holds before it judges (a few rounds at any batch size: 48 rows
  // of a 48-row round, 48 rounds of one row).
  int64_t window = 48;
  // Below this share of first proposals accepted, the drafter has collapsed. A working drafter
  // sits far above it (the demo model's MTP head: 0.87; n-gram on code: 0.6-0.7); at this share a
  // round of depth 3 yields ~1.1 tokens, less than the verify window costs.
  double floor = 0.10;
};

class DrafterHealth {
 public:
  explicit DrafterHealth(DrafterHealthOptions options = {});

  // One round's first proposals and how many of them were accepted. Returns true on the round
  // that shows a collapse (once: later calls return false).
  bool record(int64_t drafted, int64_t accepted);

  bool collapsed() const { return collapsed_; }
  // Acceptance of first proposals over the current window (at the collapse: the window that
  // showed it); 0 with nothing recorded.
  double acceptance() const;
  int64_t window_proposals() const { return drafted_; }

 private:
  DrafterHealthOptions options_;
  struct Round {
    int64_t drafted, accepted;
  };
  std::deque<Round> rounds_;  // the window, oldest first
  int64_t drafted_ = 0, accepted_ = 0;
  bool collapsed_ = false;
};

// The warning an engine prints on a collapse: the drafter, the observed acceptance and the likely
// causes for its kind.
std::string drafter_collapse_message(const std::string& drafter_id, const DrafterHealth& health);

}  // namespace tandem::spec
