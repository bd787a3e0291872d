#include "tandem/core/tensor.h"

#include "tandem/core/error.h"

namespace tandem {

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

std::vector<float> to_f32(const TensorView& t) {
  const int64_t n = t.numel();
  std::vector<float> out(static_cast<size_t>(n));
  switch (t.dtype) {
    case DType::F32:
      std::memcpy(out.data(), t.data, static_cast<size_t>(n) * 4);
      break;
    case DType::BF16: {
      const auto* p = static_cast<const uint16_t*>(t.data);
      for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_f32(p[i]);
      break;
    }
    case DType::F16: {
      const auto* p = static_cast<const uint16_t*>(t.data);
      for (int64_t i = 0; i < n; ++i) out[i] = f16_to_f32(p[i]);
      break;
    }
    case DType::F8_E4M3: {
      const auto* p = static_cast<const uint8_t*>(t.data);
      for (int64_t i = 0; i < n; ++i) out[i] = fp8_e4m3_to_f32(p[i]);
      break;
    }
    default:
      fail("tensor ", t.name, ": dtype ", dtype_name(t.dtype), " is not a float type");
  }
  return out;
}

}  // namespace tandem
