#include "tandem/backend/weight_arena.h"

#include <algorithm>
#include <cstring>

#include "tandem/backend/cpu/cpu_ops.h"
#include "tandem/backend/cpu/weight_element.h"
#include "tandem/core/error.h"
#ifdef TANDEM_HAVE_CUDA
#include "tandem/backend/cuda/cuda_ops.h"
#endif

namespace tandem {

namespace {

bool on_cuda() {
  return ops::backend() == ops::Backend::Cuda;
}

// Uniform in [-1, 1) from (seed, index): splitmix64 of the pair. Host fallback for random weights.
float hash_uniform(uint64_t seed, uint64_t i) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + i + 0x632BE59BD9B4E019ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<float>(z >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

#ifdef TANDEM_HAVE_CUDA
constexpr int64_t kChunkRows = 1024;  // host conversion staging, rows at a time

// Uploads a [rows, cols] matrix as bf16, kChunkRows rows at a time: fill(r0, nr, out) writes
// rows r0..r0+nr-1 as fp32 into out, which upload_bf16 rounds and copies.
template <class Fill>
void upload_rows_bf16(uint16_t* dst, int64_t rows, int64_t cols, Fill fill) {
  std::vector<float> staging(static_cast<size_t>(kChunkRows * cols));
  for (int64_t r0 = 0; r0 < rows; r0 += kChunkRows) {
    const int64_t nr = std::min(kChunkRows, rows - r0);
    fill(r0, nr, staging.data());
    cuda::upload_bf16(dst + r0 * cols, staging.data(), nr * cols);
  }
}
#endif

}  // namespace

int64_t fp8_scale_count(const ops::WeightRef& w) {
  const ops::BlockScales& s = w.scales;
  return ((w.rows + s.block_rows - 1) / s.block_rows) *
         ((w.cols + s.block_cols - 1) / s.block_cols);
}

void* WeightArena::own(size_t bytes) {
  Buffer<uint8_t> b;
  b.grow_to(static_cast<int64_t>(bytes));
  void* p = b.data();
  blocks_.push_back(std::move(b));
  bytes_ += bytes;
  return p;
}

ops::WeightRef WeightArena::matrix(const ops::WeightRef& stored) {
  if (!on_cuda()) return stored;
  ops::WeightRef w = stored;
  w.dtype = DType::BF16;
  const int64_t n = stored.rows * stored.cols;
  auto* dst = static_cast<uint16_t*>(own(sizeof(uint16_t) * static_cast<size_t>(n)));
  w.data = dst;
#ifdef TANDEM_HAVE_CUDA
  if (stored.dtype == DType::BF16) {
    cuda::copy_to_device(dst, stored.data, sizeof(uint16_t) * static_cast<size_t>(n));
  } else {
    upload_rows_bf16(dst, stored.rows, stored.cols, [&](int64_t r0, int64_t nr, float* out) {
      for (int64_t i = 0; i < nr * stored.cols; ++i)
        out[i] = ops::weight_element(stored, r0 * stored.cols + i);
    });
  }
#endif
  return w;
}

ops::WeightRef WeightArena::vector(const ops::WeightRef& stored) {
  if (!on_cuda()) return stored;
  ops::WeightRef w = stored;
  w.dtype = DType::F32;
  const int64_t n = stored.rows * stored.cols;
  std::vector<float> host(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) host[static_cast<size_t>(i)] = ops::weight_element(stored, i);
  void* dst = own(sizeof(float) * static_cast<size_t>(n));
  ops::copy_from_host(dst, host.data(), sizeof(float) * host.size());
  w.data = dst;
  return w;
}

ops::WeightRef WeightArena::fp8_matrix(const ops::WeightRef& stored) {
  TANDEM_CHECK(stored.dtype == DType::F8_E4M3 && stored.scales.data,
               "fp8_matrix: an fp8 e4m3 matrix with block scales, got ", dtype_name(stored.dtype));
  if (!on_cuda()) return stored;
  ops::WeightRef w = stored;
  void* codes = own(stored.bytes());
  ops::copy_from_host(codes, stored.data, stored.bytes());
  w.data = codes;
  // Scales as fp32 whatever they were stored as (bf16 widens exactly): the form cuBLASLt's
  // block-scaled product reads.
  const ops::BlockScales& s = stored.scales;
  const int64_t grid = fp8_scale_count(stored);
  std::vector<float> host(static_cast<size_t>(grid));
  for (int64_t i = 0; i < grid; ++i) {
    if (s.dtype == DType::F32) {
      std::memcpy(&host[static_cast<size_t>(i)], static_cast<const float*>(s.data) + i, 4);
    } else {
      uint16_t b;
      std::memcpy(&b, static_cast<const uint16_t*>(s.data) + i, 2);
      host[static_cast<size_t>(i)] = bf16_to_f32(b);
    }
  }
  void* scales = own(sizeof(float) * host.size());
  ops::copy_from_host(scales, host.data(), sizeof(float) * host.size());
  w.scales.data = scales;
  w.scales.dtype = DType::F32;
  return w;
}

ops::WeightRef WeightArena::dequantized(const ops::QuantWeightRef& q) {
  if (!on_cuda()) fail("WeightArena::dequantized is for the CUDA backend");
  ops::WeightRef w;
  w.dtype = DType::BF16;
  w.rows = q.rows;
  w.cols = q.cols;
  auto* dst = static_cast<uint16_t*>(own(sizeof(uint16_t) * static_cast<size_t>(q.rows * q.cols)));
  w.data = dst;
#ifdef TANDEM_HAVE_CUDA
  upload_rows_bf16(dst, q.rows, q.cols, [&](int64_t r0, int64_t nr, float* out) {
    cpu::dequantize_rows(q, r0, nr, out);
  });
#endif
  return w;
}

ops::WeightRef WeightArena::stack_rows(std::vector<ops::WeightRef*> parts) {
  TANDEM_CHECK(!parts.empty(), "stack_rows: no parts");
  ops::WeightRef w = *parts.front();
  w.rows = 0;
  const bool fp8 = w.dtype == DType::F8_E4M3;
  for (const ops::WeightRef* p : parts) {
    TANDEM_CHECK(p->cols == w.cols && p->dtype == w.dtype, "stack_rows: parts differ in shape");
    if (fp8)
      TANDEM_CHECK(
          p->scales.dtype == w.scales.dtype && p->scales.block_rows == w.scales.block_rows &&
              p->scales.block_cols == w.scales.block_cols && p->rows % w.scales.block_rows == 0,
          "stack_rows: fp8 parts of ", p->rows, " rows do not stack whole scale blocks");
    w.rows += p->rows;
  }
  const size_t row_bytes = static_cast<size_t>(w.cols) * dtype_size(w.dtype);
  auto* dst = static_cast<uint8_t*>(own(row_bytes * static_cast<size_t>(w.rows)));
  w.data = dst;
  // fp8: the scale grids stack the same way (each part a whole number of block rows).
  uint8_t* scale_dst = nullptr;
  if (fp8) {
    scale_dst = static_cast<uint8_t*>(
        own(static_cast<size_t>(fp8_scale_count(w)) * dtype_size(w.scales.dtype)));
    w.scales.data = scale_dst;
  }
  for (ops::WeightRef* p : parts) {
    const size_t n = row_bytes * static_cast<size_t>(p->rows);
    ops::copy(dst, p->data, n);
    // Release the part's own block and make the part a view of the stacked rows.
    release(p->data);
    p->data = dst;
    dst += n;
    if (fp8) {
      const size_t sn = static_cast<size_t>(fp8_scale_count(*p)) * dtype_size(p->scales.dtype);
      ops::copy(scale_dst, p->scales.data, sn);
      release(p->scales.data);
      p->scales.data = scale_dst;
      scale_dst += sn;
    }
  }
  return w;
}

ops::WeightRef WeightArena::interleave_rows(ops::WeightRef* a, ops::WeightRef* b, int64_t group) {
  TANDEM_CHECK(a->rows == b->rows && a->cols == b->cols && a->dtype == b->dtype,
               "interleave_rows: parts differ in shape");
  const size_t block_bytes = static_cast<size_t>(group * a->cols) * dtype_size(a->dtype);
  if (group < 1 || a->rows % group != 0 || block_bytes % sizeof(float) != 0)
    fail("interleave_rows: ", a->rows, " rows of ", a->cols, " do not split into ", group,
         "-row blocks of whole floats");
  ops::WeightRef w = *a;
  w.rows = 2 * a->rows;
  auto* dst = static_cast<uint8_t*>(own(block_bytes * static_cast<size_t>(w.rows / group)));
  w.data = dst;
  // A block of `group` rows is one "row" of block_bytes / 4 floats for the strided copy.
  const int64_t block_floats = static_cast<int64_t>(block_bytes / sizeof(float));
  const int64_t blocks = a->rows / group;
  for (int part = 0; part < 2; ++part) {
    ops::WeightRef* p = part == 0 ? a : b;
    ops::copy_rows(reinterpret_cast<float*>(dst + part * block_bytes), 2 * block_floats,
                   static_cast<const float*>(p->data), block_floats, blocks, block_floats);
    release(p->data);
    p->data = nullptr;
  }
  return w;
}

void WeightArena::release(const void* data) {
  for (auto it = blocks_.begin(); it != blocks_.end(); ++it)
    if (it->data() == data) {
      bytes_ -= static_cast<uint64_t>(it->size());
      blocks_.erase(it);
      return;
    }
}

ops::WeightRef WeightArena::random_matrix(int64_t rows, int64_t cols, uint64_t seed, float scale) {
  ops::WeightRef w;
  w.dtype = DType::BF16;
  w.rows = rows;
  w.cols = cols;
  const int64_t n = rows * cols;
  auto* dst = static_cast<uint16_t*>(own(sizeof(uint16_t) * static_cast<size_t>(n)));
  w.data = dst;
  if (on_cuda()) {
#ifdef TANDEM_HAVE_CUDA
    cuda::fill_random_bf16(dst, n, seed, scale);
#endif
  } else {
    for (int64_t i = 0; i < n; ++i)
      dst[i] = f32_to_bf16(scale * hash_uniform(seed, static_cast<uint64_t>(i)));
  }
  return w;
}

ops::WeightRef WeightArena::random_vector(int64_t n, uint64_t seed, float offset, float scale) {
  ops::WeightRef w;
  w.dtype = DType::F32;
  w.rows = 1;
  w.cols = n;
  auto* dst = static_cast<float*>(own(sizeof(float) * static_cast<size_t>(n)));
  w.data = dst;
  if (on_cuda()) {
#ifdef TANDEM_HAVE_CUDA
    cuda::fill_random_f32(dst, n, seed, offset, scale);
#endif
  } else {
    for (int64_t i = 0; i < n; ++i)
      dst[i] = offset + scale * hash_uniform(seed, static_cast<uint64_t>(i));
  }
  return w;
}

}  // namespace tandem
