#include "tandem/io/random_tensors.h"

#include <cmath>
#include <cstring>

namespace tandem {

std::vector<float> RandomTensors::uniform(int64_t n, float lo, float hi) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = u(rng);
  return v;
}

void RandomTensors::put(const std::string& name, DType t, std::vector<int64_t> shape,
                        std::vector<std::byte> bytes) {
  storage.push_back(std::move(bytes));
  tensors.push_back({name, t, std::move(shape), storage.back()});
}

void RandomTensors::add(const std::string& name, std::vector<int64_t> shape, float lo, float hi,
                        bool force_f32) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  const DType t = force_f32 ? DType::F32 : dtype;
  const std::vector<float> v = uniform(n, lo, hi);
  std::vector<std::byte> bytes(static_cast<size_t>(n) * dtype_size(t));
  for (int64_t i = 0; i < n; ++i) {
    const float x = v[static_cast<size_t>(i)];
    if (t == DType::F32) {
      std::memcpy(bytes.data() + i * 4, &x, 4);
    } else {
      const uint16_t h = t == DType::BF16 ? f32_to_bf16(x) : f32_to_f16(x);
      std::memcpy(bytes.data() + i * 2, &h, 2);
    }
  }
  put(name, t, std::move(shape), std::move(bytes));
}

void RandomTensors::linear(const std::string& name, int64_t out, int64_t in) {
  const float a = 1.0f / std::sqrt(static_cast<float>(in));
  add(name, {out, in}, -a, a);
}

}  // namespace tandem
