#include "tandem/backend/cpu/memory_bandwidth.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "tandem/backend/cpu/simd.h"
#include "tandem/backend/cpu/thread_pool.h"
#include "tandem/backend/ops.h"

namespace tandem::cpu {

namespace {
// Sums the buffer with wide loads; the sum is returned so the reads cannot be optimised away.
float read_sum(const float* p, size_t n) {
#if defined(__AVX512F__)
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(),
         a3 = _mm512_setzero_ps();
  size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    a0 = _mm512_add_ps(a0, _mm512_load_ps(p + i));
    a1 = _mm512_add_ps(a1, _mm512_load_ps(p + i + 16));
    a2 = _mm512_add_ps(a2, _mm512_load_ps(p + i + 32));
    a3 = _mm512_add_ps(a3, _mm512_load_ps(p + i + 48));
  }
  float s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  for (; i < n; ++i) s += p[i];
  return s;
#else
  float s = 0;
  for (size_t i = 0; i < n; ++i) s += p[i];
  return s;
#endif
}
}  // namespace

double measure_read_bandwidth(size_t bytes, int repeats, int threads) {
  // The op pool, or one of the asked-for size.
  std::shared_ptr<ThreadPool> pool = process_pool();
  if (threads > 0 && threads != pool->threads()) pool = std::make_shared<ThreadPool>(threads);
  const int nt = pool->threads();
  const size_t n = bytes / sizeof(float);
  std::unique_ptr<float, decltype(&std::free)> buf(
      static_cast<float*>(std::aligned_alloc(64, n * sizeof(float))), &std::free);
  float* p = buf.get();
  // First touch from the threads that will read, so pages land near them.
  pool->parallel_for(static_cast<int64_t>(n), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) p[i] = 1.0f;
  });
  // One slice per thread, 64-float aligned; each slice's sum has its own slot.
  const size_t per = (n / static_cast<size_t>(nt) + 63) & ~size_t{63};
  std::vector<float> partial(static_cast<size_t>(nt));
  std::vector<double> rates;
  volatile float sink = 0;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    pool->parallel_for(nt, [&](int64_t s0, int64_t s1) {
      for (int64_t sl = s0; sl < s1; ++sl) {
        const size_t begin = per * static_cast<size_t>(sl);
        partial[sl] = begin < n ? read_sum(p + begin, std::min(per, n - begin)) : 0.0f;
      }
    });
    float total = 0;
    for (float v : partial) total += v;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    sink = sink + total;
    rates.push_back(static_cast<double>(n * sizeof(float)) / s);
  }
  (void)sink;
  // The median, not the best run: on a shared machine single runs swing by 2x, and decode
  // sustains the typical rate, not the luckiest one.
  std::sort(rates.begin(), rates.end());
  return rates[rates.size() / 2];
}

}  // namespace tandem::cpu
