// The cuBLASLt handle and workspace every prompt-prefill product shares (internal: included by
// .cu files only). Created on first use, kept for the process.
#pragma once

#include <cublasLt.h>

#include <cstddef>

namespace tandem::cuda {

constexpr size_t kLtWorkspaceBytes = size_t(32) << 20;

cublasLtHandle_t cublas_lt();
void* lt_workspace();  // kLtWorkspaceBytes of device memory

}  // namespace tandem::cuda
