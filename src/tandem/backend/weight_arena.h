// Places model weights where the active backend computes with them. On the CPU the stored
// (memory-mapped) tensors are used in place; on CUDA each tensor is copied once into device
// memory: matrices (Linear weights, embedding tables) as bf16, vectors and small parameters
// (norm weights, A_log, dt_bias, conv kernels) as fp32. The arena owns those copies; WeightRefs
// it returns stay valid while it lives.
#pragma once

#include <cstdint>
#include <vector>

#include "tandem/backend/buffer.h"
#include "tandem/backend/ops.h"

namespace tandem {

// Scales of an fp8 weight's block grid: ceil(rows / block_rows) x ceil(cols / block_cols).
int64_t fp8_scale_count(const ops::WeightRef& w);

class WeightArena {
 public:
  ops::WeightRef matrix(const ops::WeightRef& stored);
  ops::WeightRef vector(const ops::WeightRef& stored);
  // An fp8 e4m3 matrix with its block scales: on CUDA the codes as stored and the scales as fp32
  // (ops::linear streams the codes and applies the scales itself); the CPU uses it in place.
  ops::WeightRef fp8_matrix(const ops::WeightRef& stored);
  // A dense bf16 copy of an MLX-affine quantized matrix (CUDA); the CPU keeps quantized weights
  // quantized and never calls this.
  ops::WeightRef dequantized(const ops::QuantWeightRef& q);
  // Random weights created directly where they live (no file): matrices bf16 uniform in
  // [-scale, scale], vectors fp32 offset + uniform [-scale, scale]. Deterministic per seed.
  ops::WeightRef random_matrix(int64_t rows, int64_t cols, uint64_t seed, float scale);
  ops::WeightRef random_vector(int64_t n, uint64_t seed, float offset, float scale);

  // One matrix holding `parts` (placed by this arena, same cols, same dtype) stacked by rows,
  // in order; the parts' own copies are released. fp8 parts (each a whole number of scale
  // blocks, same block shape) stack their scale grids alike. Lets a backend run several projections
  // of the same input as one wider linear (gate + up). Returns the stacked weight; parts[i] become
  // views of its rows.
  ops::WeightRef stack_rows(std::vector<ops::WeightRef*> parts);

  // One matrix holding a and b (placed by this arena, same shape and dtype) interleaved in
  // blocks of `group` rows: a[0, g), b[0, g), a[g, 2g), b[g, 2g), ... (the pair layout of
  // ops::gate_up_swiglu). rows must be a multiple of group. The parts' copies are released and
  // a, b become empty views (data null): their rows are no longer contiguous.
  ops::WeightRef interleave_rows(ops::WeightRef* a, ops::WeightRef* b, int64_t group);

  uint64_t bytes() const { return bytes_; }  // bytes the arena owns

 private:
  std::vector<Buffer<uint8_t>> blocks_;
  uint64_t bytes_ = 0;
  void* own(size_t bytes);
  void release(const void* data);  // frees the block starting at data (a part merged away)
};

}  // namespace tandem
