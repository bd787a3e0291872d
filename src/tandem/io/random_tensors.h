// Tensors of random values for the random-weight writers (model/qwen3_5_random, model/glm5_random,
// spec/eagle3_random): each tensor keyed by one draw from a seeded stream, in the order tensors
// are added, its elements a counter-based function of (key, index) (filled on all threads),
// stored in the writer's dtype and handed to write_safetensors as they are.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tandem/core/dtype.h"
#include "tandem/io/safetensors.h"

namespace tandem {

// fn(i0, i1) over [0, n) split across the machine's threads (whole-checkpoint writers fill
// gigabytes), in pieces of at least `grain`; callers make each element's value depend on its
// index alone, never on the split, so a checkpoint does not depend on the thread count.
template <class Fn>
void parallel_range(int64_t n, int64_t grain, const Fn& fn) {
  const int64_t threads =
      std::clamp<int64_t>(std::thread::hardware_concurrency(), 1,
                          std::max<int64_t>(n / std::max<int64_t>(grain, 1), 1));
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < threads; ++t)
    pool.emplace_back([&, t] { fn(n * t / threads, n * (t + 1) / threads); });
  fn(0, n / threads);
  for (std::thread& th : pool) th.join();
}

struct RandomTensors {
  DType dtype = DType::F32;  // F32, BF16 or F16
  std::mt19937_64 rng;
  std::vector<std::vector<std::byte>> storage;  // the tensors' bytes (tensors point into them)
  std::vector<TensorToWrite> tensors;

  RandomTensors(DType t, uint64_t seed) : dtype(t), rng(seed) {}

  // n values uniform in [lo, hi), keyed by the stream's next draw.
  std::vector<float> uniform(int64_t n, float lo, float hi);
  // A tensor of the given bytes.
  void put(const std::string& name, DType t, std::vector<int64_t> shape,
           std::vector<std::byte> bytes);
  // A tensor of U(lo, hi) draws in `dtype` (F32 with force_f32).
  void add(const std::string& name, std::vector<int64_t> shape, float lo, float hi,
           bool force_f32 = false);
  // A Linear weight [out, in] of scale 1/sqrt(in).
  void linear(const std::string& name, int64_t out, int64_t in);
};

}  // namespace tandem
