// How the CUDA kernels store and load the paged KV's elements (ops::KVLayerView): fp32 as is,
// bf16 rounded to nearest even on the way in (the CPU's f32_to_bf16) and widened exactly on
// the way out, so every kernel that writes a row stores the bits the others read back.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace tandem::cuda {

// Element i of a pool of fp32 (bf16 false) or bf16 (bf16 true) values.
__device__ __forceinline__ void store_kv(void* pool, int64_t i, float v, bool bf16) {
  if (bf16)
    static_cast<__nv_bfloat16*>(pool)[i] = __float2bfloat16_rn(v);
  else
    static_cast<float*>(pool)[i] = v;
}

// Four consecutive elements as fp32, read through the read-only cache: one 16-byte load for
// fp32 (p 16-byte aligned), one 8-byte load for bf16 (p 8-byte aligned).
__device__ __forceinline__ float4 load_kv4(const float* p) {
  return __ldg(reinterpret_cast<const float4*>(p));
}
__device__ __forceinline__ float4 load_kv4(const uint16_t* p) {
  const uint2 u = __ldg(reinterpret_cast<const uint2*>(p));
  // Element 0 is the low half of u.x (little-endian).
  return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u),
                     __uint_as_float(u.y << 16), __uint_as_float(u.y & 0xffff0000u));
}

}  // namespace tandem::cuda
