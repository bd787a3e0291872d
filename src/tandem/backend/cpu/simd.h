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
