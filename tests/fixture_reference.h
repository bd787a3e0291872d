// A parity fixture's reference tensors (reference.safetensors, written by the tools/ scripts on
// the GPU machine): token ids stored as int64 or int32, values in any float dtype. A missing
// tensor is a test failure naming it.
#pragma once

#include <gtest/gtest.h>

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

}  // namespace tandem::testing
