// Element types of stored tensors and the conversions the CPU kernels use.
// Compute is fp32 everywhere; bf16/f16 are storage formats converted on load into registers.
#pragma once

#include <cstdint>
#include <cstring>
#include <string_view>

namespace tandem {

// F8_E4M3: OCP fp8 e4m3 ("fn": no infinities; S.1111.111 is NaN), GLM-5's published weights.
enum class DType : uint8_t { F32, F16, BF16, I32, I64, U32, U8, BOOL, F64, I8, I16, F8_E4M3 };

size_t dtype_size(DType t);
std::string_view dtype_name(DType t);
// Parses a safetensors dtype string ("BF16", "F32", ...). Returns false if unknown.
bool dtype_from_safetensors(std::string_view s, DType* out);

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round-to-nearest-even, NaN kept quiet (matches torch's bf16 rounding).
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);
// Exact: every e4m3 value is a float (bias 7; exponent 0 is subnormal, m · 2^-9).
float fp8_e4m3_to_f32(uint8_t v);
// The e4m3 code nearest to f (saturating at ±448, ties to the even code; NaN to the NaN code).
uint8_t f32_to_fp8_e4m3(float f);

}  // namespace tandem
