// Scalar access to one element of a stored weight, for the small per-channel vectors (norm
// scales, decay parameters, conv taps) that the scalar kernels read. memcpy keeps unaligned
// tensor data (safetensors does not align) well-defined.
#pragma once

#include <cmath>
#include <cstring>

#include "tandem/backend/cpu/cpu_ops.h"
#include "tandem/backend/ops.h"

namespace tandem::ops {

inline float weight_element(const WeightRef& w, int64_t i) {
  switch (w.dtype) {
    case DType::F32: {
      float v;
      std::memcpy(&v, static_cast<const float*>(w.data) + i, sizeof v);
      return v;
    }
    case DType::BF16:
    case DType::F16: {
      uint16_t h;
      std::memcpy(&h, static_cast<const uint16_t*>(w.data) + i, sizeof h);
      return w.dtype == DType::BF16 ? bf16_to_f32(h) : f16_to_f32(h);
    }
    case DType::F8_E4M3:
      return cpu::fp8_element(w, i);
    default:
      return NAN;
  }
}

}  // namespace tandem::ops
