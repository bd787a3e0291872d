#include "tandem/io/random_tensors.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace tandem {

namespace {

// splitmix64's output function: a bijective 64-bit mixer.
uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

std::vector<float> RandomTensors::uniform(int64_t n, float lo, float hi) {
  // One draw of the stream keys the tensor; element i is then a function of (key, i), so large
  // tensors fill in parallel and the values do not depend on the thread count.
  const uint64_t key = rng();
  std::vector<float> v(static_cast<size_t>(n));
  const float span = hi - lo, top = std::nextafter(hi, lo);
  parallel_range(n, int64_t{1} << 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const uint64_t h = mix64(key + (static_cast<uint64_t>(i) + 1) * 0x9E3779B97F4A7C15ull);
      const float u = static_cast<float>(h >> 40) * (1.0f / 16777216.0f);  // [0, 1), 24 bits
      v[static_cast<size_t>(i)] = std::min(lo + span * u, top);
    }
  });
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
  parallel_range(n, int64_t{1} << 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float x = v[static_cast<size_t>(i)];
      if (t == DType::F32) {
        std::memcpy(bytes.data() + i * 4, &x, 4);
      } else {
        const uint16_t h = t == DType::BF16 ? f32_to_bf16(x) : f32_to_f16(x);
        std::memcpy(bytes.data() + i * 2, &h, 2);
      }
    }
  });
  put(name, t, std::move(shape), std::move(bytes));
}

void RandomTensors::linear(const std::string& name, int64_t out, int64_t in) {
  const float a = 1.0f / std::sqrt(static_cast<float>(in));
  add(name, {out, in}, -a, a);
}

}  // namespace tandem
