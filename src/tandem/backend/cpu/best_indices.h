// The indices of the `keep` largest of n values, largest first, the lower index on equal values:
// a total order, so the choice never depends on a sort's stability or scan direction. Expert
// routing (both rules) and the DSA indexer choose with it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

namespace tandem::cpu {

inline std::vector<int32_t> best_indices(const float* v, int64_t n, int64_t keep) {
  std::vector<int32_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + keep, order.end(),
                    [&](int32_t a, int32_t b) { return v[a] > v[b] || (v[a] == v[b] && a < b); });
  order.resize(static_cast<size_t>(keep));
  return order;
}

}  // namespace tandem::cpu
