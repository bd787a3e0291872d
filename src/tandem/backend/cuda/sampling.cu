// Greedy token choice on the device, so a greedy decode step copies token ids, not logits, to the
// host.
#include <cuda_runtime.h>

#include <cmath>

#include "tandem/backend/cuda/check.cuh"
#include "tandem/backend/cuda/cuda_ops.h"

namespace tandem::cuda {

namespace {

constexpr int kArgmaxThreads = 1024;

// Of two candidates (value, index), the larger value; on equal values the lower index. Index -1
// means "none yet" and loses to any candidate.
__device__ inline void better(float& v, int& i, float v2, int i2) {
  if (i2 < 0) return;
  if (i < 0 || v2 > v || (v2 == v && i2 < i)) {
    v = v2;
    i = i2;
  }
}

// One block per row. Thread t scans t, t + 1024, ... in order; then a fixed tree in shared
// memory. `bad` flags a NaN or +inf anywhere in the row.
__global__ void __launch_bounds__(kArgmaxThreads)
    argmax_kernel(const float* __restrict__ logits, int64_t V, int32_t* __restrict__ out) {
  __shared__ float sv[kArgmaxThreads];
  __shared__ int si[kArgmaxThreads];
  __shared__ int bad;
  if (threadIdx.x == 0) bad = 0;
  __syncthreads();
  const float* l = logits + blockIdx.x * V;
  float v = -INFINITY;
  int idx = -1;
  for (int64_t j = threadIdx.x; j < V; j += kArgmaxThreads) {
    const float x = l[j];
    if (isnan(x) || x == INFINITY) bad = 1;
    if (x == -INFINITY) continue;
    better(v, idx, x, static_cast<int>(j));
  }
  sv[threadIdx.x] = v;
  si[threadIdx.x] = idx;
  __syncthreads();
  for (int width = kArgmaxThreads / 2; width > 0; width /= 2) {
    if (threadIdx.x < width) {
      float a = sv[threadIdx.x];
      int ai = si[threadIdx.x];
      better(a, ai, sv[threadIdx.x + width], si[threadIdx.x + width]);
      sv[threadIdx.x] = a;
      si[threadIdx.x] = ai;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = bad ? -1 : si[0];
}

}  // namespace

void argmax_rows(const float* logits, int64_t rows, int64_t V, int32_t* out) {
  if (rows == 0) return;
  if (V <= 0 || V > 0x7fffffff) fail("argmax_rows: vocabulary ", V, " out of range");
  argmax_kernel<<<grid_blocks(rows, "argmax_rows"), kArgmaxThreads, 0, op_stream()>>>(logits, V,
                                                                                      out);
  check_launch("argmax_rows");
}

}  // namespace tandem::cuda
