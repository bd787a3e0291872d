// SamplingParams in one expression, for the sampler's tests on either backend.
#pragma once

#include <cstdint>

#include "tandem/core/sampler.h"

namespace tandem::testing {

inline SamplingParams sampling(float temperature, int32_t top_k = 0, float top_p = 1.0f,
                               float min_p = 0.0f, uint64_t seed = 0) {
  SamplingParams p;
  p.temperature = temperature;
  p.top_k = top_k;
  p.top_p = top_p;
  p.min_p = min_p;
  p.seed = seed;
  return p;
}

}  // namespace tandem::testing
