// A plain double-precision mixture-of-experts reference for the op tests (Qwen3.5-MoE's and
// GLM-5's): random fp32 values, host WeightRefs over them, and one SwiGLU MLP of a token.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "tandem/backend/ops.h"

namespace tandem::test {

// n values ~ N(0, 0.5²) from rng.
inline std::vector<float> normal_values(int64_t n, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, 0.5f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = nd(rng);
  return v;
}

// An F32 [rows, cols] view of host values (v must outlive it).
inline ops::WeightRef f32_ref(const std::vector<float>& v, int64_t rows, int64_t cols) {
  return ops::WeightRef{DType::F32, v.data(), rows, cols, {}};
}

inline double dot(const float* a, const float* b, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

// down · (silu(gate · x) ⊙ (up · x)) for one token x [H]; gate/up [inner, H], down [H, inner].
inline std::vector<double> swiglu_mlp(const float* x, const std::vector<float>& gate,
                                      const std::vector<float>& up, const std::vector<float>& down,
                                      int64_t H, int64_t inner) {
  std::vector<double> act(static_cast<size_t>(inner)), out(static_cast<size_t>(H), 0.0);
  for (int64_t i = 0; i < inner; ++i) {
    const double g = dot(x, gate.data() + i * H, H), u = dot(x, up.data() + i * H, H);
    act[static_cast<size_t>(i)] = g / (1 + std::exp(-g)) * u;
  }
  for (int64_t o = 0; o < H; ++o)
    for (int64_t i = 0; i < inner; ++i)
      out[static_cast<size_t>(o)] +=
          act[static_cast<size_t>(i)] * down[static_cast<size_t>(o * inner + i)];
  return out;
}

}  // namespace tandem::test
