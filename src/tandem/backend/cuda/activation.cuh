// Activation functions shared by the CUDA kernels (internal: included by .cu files only). One
// definition, so a fused kernel (gate_up_swiglu's epilogue) computes bit for bit what the
// standalone ops (swiglu, the recurrent conv, sigmoid_gate) compute.
#pragma once

#include <cuda_runtime.h>

namespace tandem::cuda {

// 1 / (1 + e^-x), as cpu::sigmoid_gate computes the gate.
__device__ __forceinline__ float sigmoid(float x) {
  return 1.0f / (1.0f + expf(-x));
}

// x · sigmoid(x), as cpu::silu: x / (1 + e^-x).
__device__ __forceinline__ float silu(float x) {
  return x / (1.0f + expf(-x));
}

}  // namespace tandem::cuda
