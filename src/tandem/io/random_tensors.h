// Tensors of random values for the random-weight writers (model/qwen3_5_random, model/glm5_random,
// spec/eagle3_random): each tensor keyed by one draw from a seeded stream, in the order tensors
// are added, its elements a counter-based function of (key, index) (filled on all threads),
// stored in the writer's dtype and handed to write_safetensors as they are.
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "tandem/core/dtype.h"
#include "tandem/io/safetensors.h"

namespace tandem {

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
