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

// Per token of a GLM-5 forward of n tokens: whether its choices are the fixture's: every sparse
// layer's experts (routing [sparse, n, k]) and every layer's DSA choice (index [layers, n, topk]),
// compared as sets, with transformers' padding of a short prefix (later positions, masked) left
// out. A token's logits depend on the choices made at it and at every earlier token, so a
// backend that rounds more than the reference (the GPU's bf16 product inputs) can be held to a
// rounding tolerance exactly up to the first token where a discrete choice went the other way.
inline std::vector<bool> glm5_choices_agree(const std::vector<int32_t>& routing,
                                            const std::vector<int64_t>& want_routing,
                                            const std::vector<int32_t>& index,
                                            const std::vector<int64_t>& want_index, int64_t sparse,
                                            int64_t layers, int64_t n, int64_t k, int64_t topk) {
  std::vector<bool> agree(static_cast<size_t>(n), false);
  if (routing.size() != static_cast<size_t>(sparse * n * k) ||
      want_routing.size() != routing.size() ||
      index.size() != static_cast<size_t>(layers * n * topk) || want_index.size() != index.size())
    return agree;
  auto same_set = [](std::vector<int64_t> a, std::vector<int64_t> b) {
    std::sort(a.begin(), a.end());
    std::sort(b.begin(), b.end());
    return a == b;
  };
  for (int64_t t = 0; t < n; ++t) {
    bool ok = true;
    for (int64_t l = 0; l < sparse && ok; ++l) {
      const auto at = static_cast<size_t>((l * n + t) * k);
      ok = same_set({routing.begin() + at, routing.begin() + at + k},
                    {want_routing.begin() + at, want_routing.begin() + at + k});
    }
    for (int64_t l = 0; l < layers && ok; ++l) {
      std::vector<int64_t> got, exp;
      for (int64_t j = 0; j < topk; ++j) {
        const auto at = static_cast<size_t>((l * n + t) * topk + j);
        if (index[at] >= 0) got.push_back(index[at]);
        if (want_index[at] >= 0 && want_index[at] <= t) exp.push_back(want_index[at]);
      }
      ok = same_set(got, exp);
    }
    agree[static_cast<size_t>(t)] = ok;
  }
  return agree;
}

}  // namespace tandem::testing
