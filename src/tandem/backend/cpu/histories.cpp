// The token-history ops on the CPU: backend/history_rows.h's steps, one row after another. The
// lookup scans each row's starts in increasing order and stops at the first match, the earliest
// occurrence spec/ngram.h's index finds.
#include "tandem/backend/cpu/cpu_ops.h"
#include "tandem/backend/history_rows.h"

namespace tandem::cpu {

void ngram_lookup(const ops::TokenHistories& h, int min_n, int max_n, int depth, int32_t* ids,
                  int32_t* counts) {
  for (int64_t r = 0; r < h.rows; ++r) {
    const int32_t* t = history_rows::row_tokens(h, r);
    const int64_t len = h.lengths[r];
    int64_t start = -1;
    int found_n = 0;
    for (int n = max_n; n >= min_n && start < 0; --n) {
      if (n >= len) continue;  // the trailing n-gram is the whole history: nothing earlier
      const int64_t tail = len - n;
      for (int64_t s = 0; s < tail; ++s)
        if (history_rows::gram_equal(t, s, tail, n)) {
          start = s;
          found_n = n;
          break;
        }
    }
    history_rows::write_window(h, r, start, found_n, depth, ids, counts);
  }
}

void history_append(const ops::TokenHistories& h, const int32_t* ids, int depth,
                    const int32_t* accepted, const int32_t* next) {
  for (int64_t r = 0; r < h.rows; ++r) history_rows::append_row(h, r, ids, depth, accepted, next);
}

}  // namespace tandem::cpu
