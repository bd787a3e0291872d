// Non-owning views of stored tensors (weights, fixtures) and owning fp32 activation buffers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "tandem/core/dtype.h"

namespace tandem {

// A read-only view of a tensor whose bytes live elsewhere (usually a memory-mapped safetensors
// file that outlives the view). Shape is row-major, outermost first, as safetensors stores it:
// a Linear weight is [out_features, in_features].
struct TensorView {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  size_t nbytes = 0;

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  int64_t dim(size_t i) const { return shape.at(i); }
  bool valid() const { return data != nullptr; }
};

std::string shape_str(const std::vector<int64_t>& shape);

// Grows a scratch buffer to at least n floats; never shrinks (workspaces are sized once per
// shape and reused, so the hot path does not allocate).
inline void grow_to(std::vector<float>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
}

// Copies any float tensor (F32/F16/BF16) to fp32. Throws on other dtypes.
std::vector<float> to_f32(const TensorView& t);

}  // namespace tandem
