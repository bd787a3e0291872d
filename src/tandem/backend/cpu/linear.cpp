// y = x · wᵀ with weights streamed from their storage dtype and fp32 accumulation.
//
// The kernel works on tiles of MR activation rows × NR weight rows. Every dot product owns one
// 16-lane accumulator that walks k in the same order, then reduces with a fixed tree, whatever
// the tile shape: so y[i, j] is bitwise the same for m = 1 (decode), m = k+1 (verify) or m = 512
// (prefill). Weight conversion (bf16/f16 → f32) happens in registers; nothing is unpacked to
// memory, so decode reads each weight byte once (the memory roofline).
#include <algorithm>

#include "tandem/backend/cpu/cpu_ops.h"
#include "tandem/backend/cpu/simd.h"
#include "tandem/backend/cpu/thread_pool.h"
#include "tandem/core/error.h"

namespace tandem::cpu {

using namespace tandem::ops;

namespace {

constexpr int kMaxMR = 4;
// Decode-shaped calls (m <= 2) stream 8 weight rows at once: more loads in flight per core.
// Larger m uses 4x4 tiles so that the accumulators fit in the 32 vector registers.
constexpr int kMaxNR = 8;
constexpr int kWideNR = 8;
constexpr int kSquareNR = 4;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)

template <DType WT>
inline __m512 load_w16(const void* row, int64_t c) {
  if constexpr (WT == DType::F32) {
    return _mm512_loadu_ps(static_cast<const float*>(row) + c);
  } else if constexpr (WT == DType::BF16) {
    const __m256i h =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(row) + c));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    const __m256i h =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(row) + c));
    return _mm512_cvtph_ps(h);
  }
}

template <DType WT>
inline __m512 load_w16_masked(const void* row, int64_t c, __mmask16 mask) {
  if constexpr (WT == DType::F32) {
    return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(row) + c);
  } else if constexpr (WT == DType::BF16) {
    const __m256i h = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(row) + c);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(row) + c);
    return _mm512_cvtph_ps(h);
  }
}

template <DType WT, int MR, int NR>
void tile(const float* x, int64_t k, const void* const* wrows, float* y, int64_t ldy) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 16 <= k; c += 16) {
    __m512 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = load_w16<WT>(wrows[j], c);
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_loadu_ps(x + i * k + c);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  if (c < k) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (k - c)) - 1u);
    __m512 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = load_w16_masked<WT>(wrows[j], c, mask);
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + i * k + c);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * ldy + j] = _mm512_reduce_add_ps(acc[i][j]);
}

#else  // portable fallback with the same per-dot-product structure (16 lanes, fixed reduce)

template <DType WT>
inline float load_w(const void* row, int64_t c) {
  if constexpr (WT == DType::F32) {
    return static_cast<const float*>(row)[c];
  } else if constexpr (WT == DType::BF16) {
    return bf16_to_f32(static_cast<const uint16_t*>(row)[c]);
  } else {
    return f16_to_f32(static_cast<const uint16_t*>(row)[c]);
  }
}

template <DType WT, int MR, int NR>
void tile(const float* x, int64_t k, const void* const* wrows, float* y, int64_t ldy) {
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      float lanes[16] = {};
      for (int64_t c = 0; c < k; ++c) lanes[c % 16] += x[i * k + c] * load_w<WT>(wrows[j], c);
      for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
      y[i * ldy + j] = lanes[0];
    }
  }
}

#endif

template <DType WT, int MR>
void tile_nr(int nr, const float* x, int64_t k, const void* const* wrows, float* y, int64_t ldy) {
  switch (nr) {
    case 8:
      if constexpr (MR <= 2) tile<WT, MR, 8>(x, k, wrows, y, ldy);
      break;
    case 7:
      if constexpr (MR <= 2) tile<WT, MR, 7>(x, k, wrows, y, ldy);
      break;
    case 6:
      if constexpr (MR <= 2) tile<WT, MR, 6>(x, k, wrows, y, ldy);
      break;
    case 5:
      if constexpr (MR <= 2) tile<WT, MR, 5>(x, k, wrows, y, ldy);
      break;
    case 4:
      tile<WT, MR, 4>(x, k, wrows, y, ldy);
      break;
    case 3:
      tile<WT, MR, 3>(x, k, wrows, y, ldy);
      break;
    case 2:
      tile<WT, MR, 2>(x, k, wrows, y, ldy);
      break;
    default:
      tile<WT, MR, 1>(x, k, wrows, y, ldy);
      break;
  }
}

template <DType WT>
void tile_any(int mr, int nr, const float* x, int64_t k, const void* const* wrows, float* y,
              int64_t ldy) {
  switch (mr) {
    case 4:
      tile_nr<WT, 4>(nr, x, k, wrows, y, ldy);
      break;
    case 3:
      tile_nr<WT, 3>(nr, x, k, wrows, y, ldy);
      break;
    case 2:
      tile_nr<WT, 2>(nr, x, k, wrows, y, ldy);
      break;
    default:
      tile_nr<WT, 1>(nr, x, k, wrows, y, ldy);
      break;
  }
}

template <DType WT>
void linear_typed(const float* x, int64_t m, const WeightRef& w, float* y) {
  const int64_t n = w.rows;
  const int64_t k = w.cols;
  const size_t row_bytes = static_cast<size_t>(k) * dtype_size(WT);
  const auto* base = static_cast<const uint8_t*>(w.data);
  const int64_t tile_n = m <= 2 ? kWideNR : kSquareNR;
  const int64_t tile_m = m <= 2 ? 2 : kMaxMR;
  const int64_t n_tiles = (n + tile_n - 1) / tile_n;
  // Small products (norm-sized projections, the DeltaNet gate projections) run on the calling
  // thread: a parallel region costs more than their arithmetic. Results do not depend on it.
  const bool parallel = static_cast<int64_t>(row_bytes) * n * std::max<int64_t>(m, 1) >= (64 << 10);
  // Tiles are fixed by n and m alone; a chunk of tiles is any contiguous run of them.
  parallel_for(
      n_tiles,
      [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t r0 = t * tile_n;
          const int nr = static_cast<int>(std::min<int64_t>(tile_n, n - r0));
          const void* wrows[kMaxNR];
          for (int j = 0; j < nr; ++j) wrows[j] = base + static_cast<size_t>(r0 + j) * row_bytes;
          for (int64_t i0 = 0; i0 < m; i0 += tile_m) {
            const int mr = static_cast<int>(std::min<int64_t>(tile_m, m - i0));
            tile_any<WT>(mr, nr, x + i0 * k, k, wrows, y + i0 * n + r0, n);
          }
        }
      },
      parallel);
}

}  // namespace

void linear(const float* x, int64_t m, const WeightRef& w, float* y) {
  if (m <= 0 || w.rows == 0) return;
  switch (w.dtype) {
    case DType::F32:
      linear_typed<DType::F32>(x, m, w, y);
      break;
    case DType::BF16:
      linear_typed<DType::BF16>(x, m, w, y);
      break;
    case DType::F16:
      linear_typed<DType::F16>(x, m, w, y);
      break;
    case DType::F8_E4M3:
      linear_fp8(x, m, w, y);
      break;
    default:
      fail("linear: unsupported weight dtype ", dtype_name(w.dtype));
  }
}

}  // namespace tandem::cpu
