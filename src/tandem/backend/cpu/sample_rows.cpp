// sample_rows on the CPU: the host sampler (core/sampler.h) on each row, rows in parallel. Each
// row's token depends on its own logits and parameters only, so the thread count changes nothing.
#include <exception>
#include <vector>

#include "tandem/backend/cpu/cpu_ops.h"
#include "tandem/backend/cpu/thread_pool.h"
#include "tandem/core/error.h"
#include "tandem/core/sample_weights.h"
#include "tandem/core/sampler.h"

namespace tandem::cpu {

void sample_rows(const float* logits, int64_t rows, int64_t V, const ops::SampleRow* params,
                 int32_t* out) {
  if (rows == 0) return;
  if (V <= 0 || V > kMaxSampleVocab)
    fail("sample_rows: vocabulary of ", V, " is outside the sampler's 1..", kMaxSampleVocab);
  parallel_for(rows, [&](int64_t r0, int64_t r1) {
    std::vector<TokenWeight> scratch;
    for (int64_t r = r0; r < r1; ++r) {
      try {
        out[r] = sample_token({logits + r * V, static_cast<size_t>(V)}, ops::sampling_of(params[r]),
                              params[r].index, &scratch);
      } catch (const Error&) {
        out[r] = -1;  // bad logits or parameters: the caller names the row
      }
    }
  });
}

}  // namespace tandem::cpu
