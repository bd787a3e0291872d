// The requests the GLM-5 lossless tests (CPU and CUDA) run on a small random GLM-5: three rows of
// different prompt lengths (one spanning several prefill chunks of 8), greedy or sampled with a
// seed per request, generating past their prompts.
#pragma once

#include <cstdint>
#include <vector>

#include "tandem/engine/generator.h"

namespace tandem::test {

inline std::vector<GenerateRequest> glm5_lossless_requests(float temperature) {
  const std::vector<std::vector<int32_t>> prompts = {
      {3, 17, 22, 8, 8, 31, 29, 5, 37, 12, 30, 14},
      {9, 9, 14},
      {2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32, 34, 5, 7}};
  std::vector<GenerateRequest> reqs;
  for (size_t i = 0; i < prompts.size(); ++i) {
    GenerateRequest r;
    r.prompt = prompts[i];
    r.max_tokens = 20 + 4 * static_cast<int64_t>(i);
    r.ignore_eos = true;
    r.sampling.temperature = temperature;
    r.sampling.seed = 100 + i;
    reqs.push_back(r);
  }
  return reqs;
}

}  // namespace tandem::test
