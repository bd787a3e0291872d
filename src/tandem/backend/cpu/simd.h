// x86 SIMD intrinsics for the CPU kernels.
#pragma once

#include <immintrin.h>

// GCC 12 reports its own AVX-512 intrinsics (the _mm512_undefined_* placeholders inside
// _mm512_cvtepu16_epi32, _mm512_reduce_add_ps, ...) as uninitialized reads once they are
// inlined: a compiler false positive, silenced for the files that include this header.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <cstdint>

namespace tandem::ops {

// Dot product with a fixed reduction order that depends only on n: 16 lanes strided over the
// vectors, then a fixed tree. Callers rely on that for batch invariance.
inline float dot_fixed(const float* a, const float* b, int64_t n) {
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1u);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
#else
  float lanes[16] = {};
  for (int64_t i = 0; i < n; ++i) lanes[i % 16] += a[i] * b[i];
  for (int w = 8; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
  return lanes[0];
#endif
}

}  // namespace tandem::ops
