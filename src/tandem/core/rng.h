// Counter-based random keys (DESIGN.md section 4). Every random number tandem draws for a request
// is a pure function of (request seed, absolute output index, stream): no generator state, so a
// token's randomness does not depend on batch position, speculation, or how many tokens were
// drafted, and a drafter can reproduce the target's noise exactly (coupled draws, section 5.1).
//
// Generator: Philox4x32-10 (Random123, Salmon et al. SC'11). Mapping onto the cipher:
//   key     = { seed & 0xffffffff, seed >> 32 }
//   counter = { index & 0xffffffff, index >> 32, stream, 0 }
// Counter word 3 is reserved (0) so a later consumer that needs several blocks per (index, stream)
// can number them without colliding with existing streams.
//
// Stream assignments (never reuse a number for a different purpose; that would correlate draws):
//   0  kRngStreamToken   the token draw (inverse-CDF uniform in sample_token); drafters that couple
//                        with the target use this same stream at the same index.
//   1  kRngStreamAccept  the rejection-sampling accept test of speculative decoding
//                        (accept p_j with probability min(1, p/q)).
//   2  kRngStreamResidual the draw from norm(max(0, p - q)) after a rejection. It must not reuse
//                        stream 0: the proposal was drawn from stream 0 at the same index, and a
//                        residual draw correlated with it would bias the emitted distribution.
//   3  kRngStreamDraftCorruption  the benchmark continuation drafter's choice to corrupt a
//                        proposal and the token it puts instead (spec/continuation.h); keyed by
//                        its own seed, never a request's.
#pragma once

#include <array>
#include <cstdint>

namespace tandem {

inline constexpr uint32_t kRngStreamToken = 0;
inline constexpr uint32_t kRngStreamAccept = 1;
inline constexpr uint32_t kRngStreamResidual = 2;
inline constexpr uint32_t kRngStreamDraftCorruption = 3;

// Raw Philox4x32-10 block: exposed so tests can check the cipher against Random123's published
// known-answer vectors independently of the (seed, index, stream) mapping.
std::array<uint32_t, 4> philox4x32_10(std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key);

// The 128 random bits for (seed, index, stream), with the mapping documented above.
std::array<uint32_t, 4> philox_bits(uint64_t seed, uint64_t index,
                                    uint32_t stream = kRngStreamToken);

// A uniform double strictly inside (0, 1): (k + 0.5) / 2^52 for the top 52 bits k of words 0-1,
// i.e. the odd multiples of 2^-53. Every value is exact, the smallest is 2^-53 and the largest
// 1 - 2^-53, so neither 0 nor 1 can occur (log(u) and inverse-CDF walks are always safe).
double uniform_open01(uint64_t seed, uint64_t index, uint32_t stream = kRngStreamToken);

}  // namespace tandem
