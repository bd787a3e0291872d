// The cuBLASLt handle and workspace every prompt-prefill product of a context shares (internal:
// included by .cu files only). Created on first use, kept for the context's life.
#pragma once

#include <cublasLt.h>

#include <cstddef>
#include <cstdint>

namespace tandem::cuda {

constexpr size_t kLtWorkspaceBytes = size_t(32) << 20;

cublasLtHandle_t cublas_lt();  // the current context's
void* lt_workspace();          // kLtWorkspaceBytes of the current context's device memory
// A new matmul description with fp32 compute and scale and W taken transposed (the layouts
// below); the caller owns it.
cublasLtMatmulDesc_t transposed_weight_desc();

// The layouts of yᵀ[N, m] = W[N, K] · xᵀ[K, m] in cuBLASLt's column-major terms: W a K x N matrix
// (taken transposed), x a K x m one (both of type `in`), y an N x m one of type `out` (row-major
// [m, N]). ok: all three were created.
struct LtLayouts {
  cublasLtMatrixLayout_t w = nullptr, x = nullptr, y = nullptr;
  bool ok = false;
  LtLayouts(int64_t N, int64_t K, int64_t m, cudaDataType_t in, cudaDataType_t out) {
    ok = cublasLtMatrixLayoutCreate(&w, in, K, N, K) == CUBLAS_STATUS_SUCCESS &&
         cublasLtMatrixLayoutCreate(&x, in, K, m, K) == CUBLAS_STATUS_SUCCESS &&
         cublasLtMatrixLayoutCreate(&y, out, N, m, N) == CUBLAS_STATUS_SUCCESS;
  }
  ~LtLayouts() {
    cublasLtMatrixLayoutDestroy(w);
    cublasLtMatrixLayoutDestroy(x);
    cublasLtMatrixLayoutDestroy(y);
  }
  LtLayouts(const LtLayouts&) = delete;
  LtLayouts& operator=(const LtLayouts&) = delete;
};

}  // namespace tandem::cuda
