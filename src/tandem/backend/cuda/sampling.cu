// Greedy token choice on the device, so a greedy decode step copies token ids, not logits, to the
// host.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "tandem/backend/cuda/check.cuh"
#include "tandem/backend/cuda/cuda_ops.h"
#include "tandem/backend/cuda/scratch.cuh"

namespace tandem::cuda {

namespace {

constexpr int kArgmaxThreads = 256;
constexpr int64_t kSliceMin = 4096;  // logits per block at least (a slice)
constexpr int kMaxSlices = 64;       // blocks per row at most (<= kArgmaxThreads: one per thread)
constexpr int64_t kMaxRowsPerLaunch = 1024;

// Per-slice winners of the running launch ([row][slice], kMaxRowsPerLaunch x kMaxSlices) and
// per-row counts of finished slices ([kMaxRowsPerLaunch], zero when allocated). The last block
// of a row resets its count to 0, so every launch starts from zeros. In the context's scratch.
struct SliceWinners {
  float* best_v;
  int* best_i;
  int* bad;
  unsigned* slices_done;
};

struct ArgmaxScratch {
  DeviceScratch best_v, best_i, bad, slices_done;
};

// Of two candidates (value, index), the larger value; on equal values the lower index. Index -1
// means "none yet" and loses to any candidate. A total order on candidates: the winner of a set
// does not depend on the order it is scanned in.
__device__ inline void better(float& v, int& i, float v2, int i2) {
  if (i2 < 0) return;
  if (i < 0 || v2 > v || (v2 == v && i2 < i)) {
    v = v2;
    i = i2;
  }
}

// The best of the block's kArgmaxThreads candidates (sv, si; the bad flags ORed), left in slot 0
// by a halving tree with a barrier per level. Every thread calls it once its candidate is stored.
__device__ inline void block_best(float* sv, int* si, int* sbad) {
  for (int width = kArgmaxThreads / 2; width > 0; width /= 2) {
    if (threadIdx.x < width) {
      float a = sv[threadIdx.x];
      int ai = si[threadIdx.x];
      better(a, ai, sv[threadIdx.x + width], si[threadIdx.x + width]);
      sv[threadIdx.x] = a;
      si[threadIdx.x] = ai;
      sbad[threadIdx.x] |= sbad[threadIdx.x + width];
    }
    __syncthreads();
  }
}

// Grid (slices, rows): block (s, r) finds the winner of slice s of row r; the last block of a row
// to finish (an atomic count) picks the row's winner from the slice winners. `bad` flags a NaN or
// +inf anywhere in the row. The greedy token of a 248k vocabulary is thus read by ~60 blocks at
// once instead of one.
__global__ void __launch_bounds__(kArgmaxThreads)
    argmax_kernel(const float* __restrict__ logits, int64_t V, int64_t slice, int32_t* out,
                  SliceWinners g) {
  pdl_wait();
  pdl_release();
  __shared__ float sv[kArgmaxThreads];
  __shared__ int si[kArgmaxThreads];
  __shared__ int sbad[kArgmaxThreads];
  __shared__ bool last;
  const int64_t row = blockIdx.y;
  const float* l = logits + row * V;
  const int64_t lo = blockIdx.x * slice, hi = min(V, lo + slice);
  float v = -INFINITY;
  int idx = -1, bad = 0;
#pragma unroll 4
  for (int64_t j = lo + threadIdx.x; j < hi; j += kArgmaxThreads) {
    const float x = l[j];
    bad |= isnan(x) || x == INFINITY;
    if (x != -INFINITY) better(v, idx, x, static_cast<int>(j));
  }
  sv[threadIdx.x] = v;
  si[threadIdx.x] = idx;
  sbad[threadIdx.x] = bad;
  __syncthreads();
  block_best(sv, si, sbad);
  const int slot = static_cast<int>(row * gridDim.x + blockIdx.x);
  if (threadIdx.x == 0) {
    g.best_v[slot] = sv[0];
    g.best_i[slot] = si[0];
    g.bad[slot] = sbad[0];
    __threadfence();  // the slice's winner is visible before the count says so
    last = atomicAdd(&g.slices_done[row], 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  // The row's last block: thread s loads slice s's winner (all at once), then the same tree.
  __threadfence();
  const int q = static_cast<int>(row * gridDim.x + threadIdx.x);
  const bool have = threadIdx.x < gridDim.x;
  sv[threadIdx.x] = have ? __ldcg(&g.best_v[q]) : -INFINITY;
  si[threadIdx.x] = have ? __ldcg(&g.best_i[q]) : -1;
  sbad[threadIdx.x] = have ? __ldcg(&g.bad[q]) : 0;
  __syncthreads();
  block_best(sv, si, sbad);
  if (threadIdx.x == 0) {
    out[row] = sbad[0] ? -1 : si[0];
    g.slices_done[row] = 0;
  }
}

}  // namespace

void argmax_rows(const float* logits, int64_t rows, int64_t V, int32_t* out) {
  if (rows == 0) return;
  if (V <= 0 || V > 0x7fffffff) fail("argmax_rows: vocabulary ", V, " out of range");
  const int64_t slices = std::min<int64_t>(kMaxSlices, ceil_div(V, kSliceMin));
  const int64_t slice = ceil_div(V, slices);
  ArgmaxScratch& sc = current().unit<ArgmaxScratch>();
  constexpr int64_t kSlots = kMaxRowsPerLaunch * kMaxSlices;
  const SliceWinners winners{sc.best_v.get<float>(kSlots), sc.best_i.get<int>(kSlots),
                             sc.bad.get<int>(kSlots),
                             sc.slices_done.get_zeroed<unsigned>(kMaxRowsPerLaunch)};
  for (int64_t r0 = 0; r0 < rows; r0 += kMaxRowsPerLaunch) {
    const int64_t n = std::min(kMaxRowsPerLaunch, rows - r0);
    launch("argmax_rows", argmax_kernel,
           dim3(static_cast<unsigned>(slices), static_cast<unsigned>(n)), kArgmaxThreads, 0,
           logits + r0 * V, V, slice, out + r0, winners);
  }
}

TANDEM_CUDA_TRACE_UNIT(sampling)

}  // namespace tandem::cuda
