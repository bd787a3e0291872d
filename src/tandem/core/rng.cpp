#include "tandem/core/rng.h"

#include <Random123/philox.h>

namespace tandem {

std::array<uint32_t, 4> philox4x32_10(std::array<uint32_t, 4> counter,
                                      std::array<uint32_t, 2> key) {
  r123::Philox4x32_R<10> cipher;
  r123::Philox4x32_R<10>::ctr_type c = {{counter[0], counter[1], counter[2], counter[3]}};
  r123::Philox4x32_R<10>::key_type k = {{key[0], key[1]}};
  const auto r = cipher(c, k);
  return {r.v[0], r.v[1], r.v[2], r.v[3]};
}

std::array<uint32_t, 4> philox_bits(uint64_t seed, uint64_t index, uint32_t stream) {
  return philox4x32_10(
      {static_cast<uint32_t>(index), static_cast<uint32_t>(index >> 32), stream, 0},
      {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)});
}

double uniform_open01(uint64_t seed, uint64_t index, uint32_t stream) {
  const auto bits = philox_bits(seed, index, stream);
  const uint64_t word = (static_cast<uint64_t>(bits[1]) << 32) | bits[0];
  const uint64_t k = word >> 12;  // 52 bits: k + 0.5 needs 53 significant bits, exact in double
  return (static_cast<double>(k) + 0.5) * 0x1p-52;
}

}  // namespace tandem
