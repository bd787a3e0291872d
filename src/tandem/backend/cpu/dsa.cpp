// GLM-5's DSA indexer choice on the CPU (ops::dsa_select): which earlier positions each query
// attends to. A query's scores are computed from its own q, w and the keys alone (each head's dot
// product in k order, the heads summed in order), so its choice never depends on the other
// queries of the call: batch invariant like every op of the forward.
#include <algorithm>
#include <cmath>
#include <vector>

#include "tandem/backend/cpu/best_indices.h"
#include "tandem/backend/cpu/cpu_ops.h"
#include "tandem/backend/cpu/thread_pool.h"
#include "tandem/core/error.h"

namespace tandem::cpu {

void dsa_select(const float* q, const float* w, int64_t n, int64_t heads, int64_t D,
                const float* keys, int64_t ctx, const int64_t* pos, int64_t topk, int32_t* out) {
  if (heads < 1 || D < 1 || topk < 1)
    fail("dsa_select: ", heads, " heads of ", D, " values, top ", topk);
  for (int64_t i = 0; i < n; ++i)
    if (pos[i] < 0 || pos[i] >= ctx)
      fail("dsa_select: query ", i, " at position ", pos[i], " outside the ", ctx, " keys");
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  parallel_for(n, [&](int64_t i0, int64_t i1) {
    std::vector<float> score;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t len = pos[i] + 1;
      score.assign(static_cast<size_t>(len), 0.0f);
      for (int64_t p = 0; p < len; ++p) {
        const float* k = keys + p * D;
        float s = 0.0f;
        for (int64_t h = 0; h < heads; ++h) {
          const float* qh = q + (i * heads + h) * D;
          float d = 0.0f;
          for (int64_t c = 0; c < D; ++c) d += qh[c] * k[c];
          s += w[i * heads + h] * std::max(0.0f, d * scale);
        }
        score[static_cast<size_t>(p)] = s;
      }
      const int64_t keep = std::min(topk, len);
      const std::vector<int32_t> order = best_indices(score.data(), len, keep);
      int32_t* o = out + i * topk;
      for (int64_t j = 0; j < topk; ++j) o[j] = j < keep ? order[static_cast<size_t>(j)] : -1;
    }
  });
}

}  // namespace tandem::cpu
