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

}  // namespace tandem
