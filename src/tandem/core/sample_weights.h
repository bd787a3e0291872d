// The integer weights every sampler of tandem draws from, one definition for the host and the
// CUDA kernels (DESIGN.md section 4). A logit l becomes the weight
//
//   W(l) = round(exp((l - max) / T) * 2^40)        (0 when the product is below one half)
//
// computed with sample_exp below: only correctly rounded IEEE operations (+, -, *, /, floor and
// fma, each written out, never left to the compiler to contract), so a weight has the same bits
// on every CPU and GPU. Sums of weights are integers: exact in any order, which lets a GPU add a
// 248k-token vocabulary in parallel and still agree with the host walk bit for bit. The top token
// weighs exactly 2^40; a token 28 nats below it at T = 1 still weighs 1, one 29 nats below is
// never drawn (as underflow in double excluded tokens before).
//
// Vocabularies are limited to kMaxSampleVocab ids, so that Σ W < 2^63 for any filter.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define TANDEM_HD __host__ __device__
#else
#define TANDEM_HD
#endif

namespace tandem {

inline constexpr int kSampleWeightBits = 40;
inline constexpr uint64_t kSampleWeightOne = uint64_t{1} << kSampleWeightBits;  // W(max)
inline constexpr int64_t kMaxSampleVocab = int64_t{1} << 23;

namespace sample_detail {

TANDEM_HD inline double fma_rn(double a, double b, double c) {
#if defined(__CUDA_ARCH__)
  return __fma_rn(a, b, c);
#else
  return __builtin_fma(a, b, c);
#endif
}

TANDEM_HD inline double floor_d(double x) {
#if defined(__CUDA_ARCH__)
  return ::floor(x);
#else
  return __builtin_floor(x);
#endif
}

// 2^n for -1022 <= n <= 1023, built from its exponent bits (exact).
TANDEM_HD inline double pow2(int n) {
  const uint64_t bits = static_cast<uint64_t>(1023 + n) << 52;
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(static_cast<long long>(bits));
#else
  double d;
  std::memcpy(&d, &bits, sizeof d);
  return d;
#endif
}

}  // namespace sample_detail

// exp(x) for x <= 0, to within a few units in the last place, and 0 below -32 (where no weight
// survives the rounding). Cody-Waite reduction x = n ln2 + r, |r| <= ln2 / 2, then the Taylor
// polynomial of degree 12 (its first omitted term is below 2e-16 relative). sample_exp(0) == 1.
TANDEM_HD inline double sample_exp(double x) {
  using namespace sample_detail;
  if (!(x >= -32.0)) return 0.0;
  constexpr double kInvLn2 = 1.4426950408889634;
  constexpr double kLn2Hi = 6.93147180369123816490e-01;  // ln 2, high 32 bits
  constexpr double kLn2Lo = 1.90821492927058770002e-10;  // ln 2 - kLn2Hi
  const double n = floor_d(fma_rn(x, kInvLn2, 0.5));
  double r = fma_rn(-n, kLn2Hi, x);
  r = fma_rn(-n, kLn2Lo, r);
  // 1/k! for k = 12 .. 0, Horner from the highest term.
  constexpr double c[13] = {2.08767569878680989792e-09,
                            2.50521083854417187751e-08,
                            2.75573192239858906526e-07,
                            2.75573192239858906526e-06,
                            2.48015873015873015873e-05,
                            1.98412698412698412698e-04,
                            1.38888888888888888889e-03,
                            8.33333333333333333333e-03,
                            4.16666666666666666667e-02,
                            1.66666666666666666667e-01,
                            5.00000000000000000000e-01,
                            1.0,
                            1.0};
  double p = c[0];
  for (int k = 1; k < 13; ++k) p = fma_rn(p, r, c[k]);
  return p * pow2(static_cast<int>(n));
}

// W(l) for a live logit l (not -inf) given the row's maximum and 1 / temperature (in double).
TANDEM_HD inline uint64_t sample_weight(float logit, float max, double inv_temperature) {
  const double x = (static_cast<double>(logit) - static_cast<double>(max)) * inv_temperature;
  const double w = sample_detail::fma_rn(sample_exp(x), static_cast<double>(kSampleWeightOne), 0.5);
  return static_cast<uint64_t>(w);  // w >= 0.5: truncation of w rounds the weight to nearest
}

// Weights below this fail min-p (prob < min_p * max prob; the maximum weighs 2^40).
TANDEM_HD inline uint64_t min_p_weight(float min_p) {
  const double t = static_cast<double>(min_p) * static_cast<double>(kSampleWeightOne);
  const double c = sample_detail::floor_d(t);
  return static_cast<uint64_t>(c == t ? c : c + 1.0);  // ceil
}

// The cumulative weight top-p's prefix must reach: ceil(top_p * total).
TANDEM_HD inline uint64_t top_p_weight(float top_p, uint64_t total) {
  const double t = static_cast<double>(top_p) * static_cast<double>(total);
  const double c = sample_detail::floor_d(t);
  const uint64_t w = static_cast<uint64_t>(c == t ? c : c + 1.0);
  return w < 1 ? 1 : (w > total ? total : w);
}

// The cumulative weight the draw's prefix must reach for the uniform u in (0, 1): the drawn token
// is the one whose interval [cum before it, cum through it) holds floor(u * kept_total), i.e. the
// first of the canonical order whose cumulative weight reaches that + 1.
TANDEM_HD inline uint64_t draw_weight(double u, uint64_t kept_total) {
  uint64_t r = static_cast<uint64_t>(u * static_cast<double>(kept_total));
  if (r >= kept_total) r = kept_total - 1;
  return r + 1;
}

// The uniform of uniform_open01 (core/rng.h) from Philox words 0 and 1.
TANDEM_HD inline double uniform_from_words(uint32_t w0, uint32_t w1) {
  const uint64_t word = (static_cast<uint64_t>(w1) << 32) | w0;
  return (static_cast<double>(word >> 12) + 0.5) * 0x1p-52;
}

// A float's bits mapped so that unsigned order is numeric order (-inf lowest); NaN excluded.
TANDEM_HD inline uint32_t logit_order_key(float l) {
  uint32_t b;
#if defined(__CUDA_ARCH__)
  b = __float_as_uint(l);
#else
  std::memcpy(&b, &l, sizeof b);
#endif
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

}  // namespace tandem
