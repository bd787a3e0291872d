// The verify-window ops on CUDA (backend/window_rows.h's steps, one thread per row or token): a
// round's accept walk, the commit it settles and the next forward's positions, all where the
// tokens are, so no host read stands between a verify and the round after it.
#include "tandem/backend/cuda/check.cuh"
#include "tandem/backend/window_rows.h"

namespace tandem::cuda {

namespace {

constexpr int kWindowThreads = 128;

// After a kernel whose writes the next kernel may read before its pdl_wait() (state descriptors,
// positions: metadata, which the PDL invariant (check.cuh) lets kernels read early): the next
// kernel of this context starts only once everything before it has completed.
void fence() {
  current().serialize_next_launch = true;
}

__global__ void accept_windows_kernel(const int32_t* verified, const int32_t* ids,
                                      const int32_t* source, const int32_t* from,
                                      const int32_t* bounds, const int32_t* limits, int64_t n_rows,
                                      int32_t* accepted, int32_t* next) {
  pdl_wait();
  pdl_release();
  const int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (r < n_rows)
    window_rows::accept_row(verified, ids, source, from, bounds, limits, r, accepted, next);
}

__global__ void settle_windows_kernel(const int32_t* accepted, const ops::SettledRow* rows,
                                      int64_t n_rows, int64_t* shift, ops::RecurrentRow* replay,
                                      int64_t layers) {
  pdl_wait();
  pdl_release();
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i < n_rows) window_rows::settle_row(accepted, rows, n_rows, i, shift, replay, layers);
}

__global__ void shift_positions_kernel(const ops::PositionShift s, int64_t* positions,
                                       int64_t* kv_slots) {
  pdl_wait();
  pdl_release();
  const int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (t < s.tokens) window_rows::shift_token(s, t, positions, kv_slots);
  if (t < s.rows) window_rows::shift_row_draw(s, t);
}

// Grid (rows); each block copies one row.
__global__ void gather_window_rows_kernel(const float* src, int64_t width, int64_t row_stride,
                                          int64_t at, const int32_t* offsets, float* dst) {
  pdl_wait();
  pdl_release();
  const int64_t i = blockIdx.x;
  const float* from = src + window_rows::window_row(i, row_stride, at, offsets) * width;
  for (int64_t c = threadIdx.x; c < width; c += blockDim.x) dst[i * width + c] = from[c];
}

unsigned blocks_for(int64_t n) {
  return grid_blocks(ceil_div(n, kWindowThreads), "window rows");
}

}  // namespace

void accept_windows(const int32_t* verified, const int32_t* ids, const int32_t* source,
                    const int32_t* from, const int32_t* bounds, const int32_t* limits,
                    int64_t n_rows, int32_t* accepted, int32_t* next) {
  if (n_rows == 0) return;
  launch("accept_windows", accept_windows_kernel, blocks_for(n_rows), kWindowThreads, 0, verified,
         ids, source, from, bounds, limits, n_rows, accepted, next);
}

void settle_windows(const int32_t* accepted, const ops::SettledRow* rows, int64_t n_rows,
                    int64_t* shift, ops::RecurrentRow* replay, int64_t layers) {
  if (n_rows == 0) return;
  launch("settle_windows", settle_windows_kernel, blocks_for(n_rows), kWindowThreads, 0, accepted,
         rows, n_rows, shift, replay, layers);
  if (replay) fence();  // the replay's kernels read their descriptors before pdl_wait
}

void shift_positions(const ops::PositionShift& s, int64_t* positions, int64_t* kv_slots) {
  const int64_t n = s.tokens > s.rows ? s.tokens : s.rows;
  if (n == 0) return;
  launch("shift_positions", shift_positions_kernel, blocks_for(n), kWindowThreads, 0, s, positions,
         kv_slots);
  fence();  // positions, KV slots and draw indices are metadata, read before pdl_wait
}

void gather_window_rows(const float* src, int64_t width, int64_t row_stride, int64_t at,
                        const int32_t* offsets, int64_t n, float* dst) {
  if (n == 0 || width == 0) return;
  launch("gather_window_rows", gather_window_rows_kernel, grid_blocks(n, "gather_window_rows"), 256,
         0, src, width, row_stride, at, offsets, dst);
}

}  // namespace tandem::cuda
