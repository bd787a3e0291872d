#include "tandem/core/dtype.h"

#include <cmath>
#include <cstring>
#include <limits>

namespace tandem {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F64:
    case DType::I64:
      return 8;
    case DType::F32:
    case DType::I32:
    case DType::U32:
      return 4;
    case DType::F16:
    case DType::BF16:
    case DType::I16:
      return 2;
    case DType::U8:
    case DType::I8:
    case DType::BOOL:
    case DType::F8_E4M3:
      return 1;
  }
  return 0;
}

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::F32:
      return "F32";
    case DType::F16:
      return "F16";
    case DType::BF16:
      return "BF16";
    case DType::I32:
      return "I32";
    case DType::I64:
      return "I64";
    case DType::U32:
      return "U32";
    case DType::U8:
      return "U8";
    case DType::BOOL:
      return "BOOL";
    case DType::F64:
      return "F64";
    case DType::I8:
      return "I8";
    case DType::I16:
      return "I16";
    case DType::F8_E4M3:
      return "F8_E4M3";
  }
  return "?";
}

bool dtype_from_safetensors(std::string_view s, DType* out) {
  static constexpr struct {
    std::string_view name;
    DType t;
  } kTable[] = {{"F32", DType::F32}, {"F16", DType::F16},   {"BF16", DType::BF16},
                {"I32", DType::I32}, {"I64", DType::I64},   {"U32", DType::U32},
                {"U8", DType::U8},   {"BOOL", DType::BOOL}, {"F64", DType::F64},
                {"I8", DType::I8},   {"I16", DType::I16},   {"F8_E4M3", DType::F8_E4M3}};
  for (const auto& e : kTable) {
    if (e.name == s) {
      *out = e.t;
      return true;
    }
  }
  return false;
}

float fp8_e4m3_to_f32(uint8_t v) {
  const float sign = v & 0x80u ? -1.0f : 1.0f;
  const int exp = (v >> 3) & 0xf, mant = v & 0x7;
  if (exp == 0xf && mant == 0x7) return std::numeric_limits<float>::quiet_NaN();
  if (exp == 0) return sign * std::ldexp(static_cast<float>(mant), -9);
  return sign * std::ldexp(static_cast<float>(8 + mant), exp - 10);
}

uint8_t f32_to_fp8_e4m3(float f) {
  // Round to nearest, ties to the even code (the code's parity is its mantissa's), saturating at
  // 448. Codes 0x00..0x7e are the non-negative finite values in increasing order.
  if (std::isnan(f)) return 0x7f;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  const float a = std::fabs(f);
  if (a >= 448.0f) return static_cast<uint8_t>(sign | 0x7e);
  if (a < 0x1p-6f) {  // subnormal: multiples of 2^-9; 8 (2^-6) is the first normal code
    return static_cast<uint8_t>(sign | static_cast<int>(std::nearbyint(a * 512.0f)));
  }
  uint32_t u;
  std::memcpy(&u, &a, 4);
  const uint32_t exp = (u >> 23) - 127 + 7;  // 1..15
  const uint32_t keep = (u >> 20) & 0x7u, rest = u & 0xfffffu;
  const uint32_t up = rest > 0x80000u || (rest == 0x80000u && (keep & 1u));
  // A carry out of the mantissa moves to the next exponent, as the code order does; a < 448
  // rounds to 0x7e at most.
  return static_cast<uint8_t>(sign | ((exp << 3) + keep + up));
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {  // subnormal: renormalize
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ffu;
      u = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (mant << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t f32_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t absu = u & 0x7fffffffu;
  if (absu > 0x7f800000u) return sign | 0x7e00u;
  if (absu >= 0x477ff000u) return sign | 0x7c00u;  // rounds to inf
  if (absu < 0x38800000u) {                        // subnormal or zero in f16
    if (absu < 0x33000000u) return sign;
    const uint32_t exp = absu >> 23;
    const uint32_t mant = (absu & 0x7fffffu) | 0x800000u;
    // value = mant * 2^(exp-150); an f16 subnormal counts units of 2^-24.
    const uint32_t shift = 126 - exp;
    uint32_t m = mant >> shift;
    const uint32_t rem = mant & ((1u << (shift)) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (m & 1u))) ++m;
    return sign | static_cast<uint16_t>(m);
  }
  uint32_t r = absu + 0xfffu + ((absu >> 13) & 1u) - (112u << 23);
  return sign | static_cast<uint16_t>(r >> 13);
}

}  // namespace tandem
