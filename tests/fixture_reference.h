// A parity fixture's reference tensors (reference.safetensors, written by the tools/ scripts on
// the GPU machine): token ids stored as int64 or int32, values in any float dtype. A missing
// tensor is a test failure naming it.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tandem/core/dtype.h"
#include "tandem/core/tensor.h"
#include "tandem/io/safetensors.h"

namespace tandem::testing {

struct FixtureReference {
  std::shared_ptr<const SafetensorsFile> file;

  std::vector<int64_t> ints(const std::string& name) const {
    const TensorView* t = file->find(name);
    EXPECT_NE(t, nullptr) << name;
    std::vector<int64_t> out;
    if (!t) return out;
    for (int64_t i = 0; i < t->numel(); ++i)
      out.push_back(t->dtype == DType::I64 ? static_cast<const int64_t*>(t->data)[i]
                                           : static_cast<const int32_t*>(t->data)[i]);
    return out;
  }
  std::vector<int32_t> ids(const std::string& name) const {
    std::vector<int32_t> out;
    for (int64_t v : ints(name)) out.push_back(static_cast<int32_t>(v));
    return out;
  }
  std::vector<float> floats(const std::string& name) const {
    const TensorView* t = file->find(name);
    EXPECT_NE(t, nullptr) << name;
    return t ? to_f32(*t) : std::vector<float>{};
  }
};

// Recorded routing got [layers, n, k] (expert ids per token) against the fixture's want, as sets
// (the order of a top-k may differ), for the tokens whose fixture margin [layers, n] (how far the
// choice is from a tie) exceeds min_margin. `what` names the case in failures. Returns how many
// tokens were compared.
inline int64_t expect_same_routing(const std::vector<int32_t>& got,
                                   const std::vector<int32_t>& want,
                                   const std::vector<float>& margin, int64_t layers, int64_t n,
                                   int64_t k, float min_margin, const std::string& what) {
  EXPECT_EQ(got.size(), static_cast<size_t>(layers * n * k)) << what;
  EXPECT_EQ(want.size(), got.size()) << what;
  if (got.size() != want.size() || got.size() != static_cast<size_t>(layers * n * k)) return 0;
  int64_t compared = 0;
  for (int64_t l = 0; l < layers; ++l)
    for (int64_t t = 0; t < n; ++t) {
      if (margin[static_cast<size_t>(l * n + t)] <= min_margin) continue;  // a near-tie may flip
      std::vector<int32_t> g(got.begin() + (l * n + t) * k, got.begin() + (l * n + t + 1) * k);
      std::vector<int32_t> w(want.begin() + (l * n + t) * k, want.begin() + (l * n + t + 1) * k);
      std::sort(g.begin(), g.end());
      std::sort(w.begin(), w.end());
      EXPECT_EQ(g, w) << what << " layer " << l << " token " << t;
      ++compared;
    }
  return compared;
}

}  // namespace tandem::testing
