// Measures how fast this machine's cores can stream memory they do not have cached: the
// ceiling for batch-1 decode, which must read every weight once per token.
#pragma once

#include <cstddef>

namespace tandem::cpu {

// Median-of-`repeats` read bandwidth in bytes/second over a `bytes`-sized buffer (much larger than
// the last-level cache), using `threads` threads (0 = the op thread count).
double measure_read_bandwidth(size_t bytes = size_t{1} << 30, int repeats = 7, int threads = 0);

}  // namespace tandem::cpu
