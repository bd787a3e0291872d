#include "tandem/model/forward.h"

#include "tandem/core/error.h"

namespace tandem {

int64_t check_forward_rows(std::span<const RowInput> rows, const std::function<bool(int)>& is_open,
                           const std::function<std::string(int)>& open_window) {
  int64_t T = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    const RowInput& r = rows[i];
    if (!is_open(r.slot)) fail("forward: row slot ", r.slot, " is not open");
    if (r.n_tokens <= 0) fail("forward: row slot ", r.slot, " has no tokens");
    for (size_t j = 0; j < i; ++j)
      if (rows[j].slot == r.slot) fail("forward: row slot ", r.slot, " is listed twice");
    // The window's rollback records describe the state it started from; another forward would
    // invalidate them, so the round must commit first (DESIGN.md §1.4: a round is a transaction).
    const std::string window = open_window(r.slot);
    if (!window.empty())
      fail("forward: row slot ", r.slot, " has an uncommitted speculative window (", window,
           "); call commit_windows before the next forward");
    T += r.n_tokens;
  }
  return T;
}

void check_tap_layers(std::span<const int> tap_layers, int64_t layers) {
  for (size_t i = 0; i < tap_layers.size(); ++i)
    if (tap_layers[i] < 0 || tap_layers[i] >= layers)
      fail("forward: tap layer ", tap_layers[i], " (entry ", i,
           " of tap_layers) is out of range [0, ", layers,
           "): a tap is the input of one of the model's decoder layers");
}

void check_sample_rows(const ForwardRequest& req, int64_t tokens) {
  if (req.sample_rows.empty()) return;
  if (!req.want_argmax) fail("forward: sample_rows without want_argmax");
  if (req.prompt)
    fail("forward: sample_rows in a prompt forward (its tokens are drawn on the host)");
  const size_t logits_rows = req.all_logits ? static_cast<size_t>(tokens) : req.rows.size();
  if (req.sample_rows.size() != logits_rows)
    fail("forward: ", req.sample_rows.size(), " sample_rows for ", logits_rows, " logits rows");
}

}  // namespace tandem
