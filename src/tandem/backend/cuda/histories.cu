// The token-history ops on CUDA (backend/history_rows.h's steps): the n-gram drafter's lookup and
// append where the tokens are, so a settled round drafts without a host read. One block per row;
// the lookup's threads share the row's starts and keep the earliest match.
#include <climits>

#include "tandem/backend/cuda/check.cuh"
#include "tandem/backend/history_rows.h"

namespace tandem::cuda {

namespace {

constexpr int kLookupThreads = 256;

// Grid (rows). For each n from max_n down, every thread scans its starts (s ≡ threadIdx.x mod
// blockDim.x, increasing, stopping at its first match) and the block keeps the smallest; the
// first n with any match decides, as on the CPU.
__global__ void ngram_lookup_kernel(const ops::TokenHistories h, int min_n, int max_n, int depth,
                                    int32_t* ids, int32_t* counts) {
  pdl_wait();
  pdl_release();
  __shared__ unsigned long long best;
  const int64_t r = blockIdx.x;
  const int32_t* t = history_rows::row_tokens(h, r);
  const int64_t len = h.lengths[r];
  int found_n = 0;
  int64_t start = -1;
  for (int n = max_n; n >= min_n; --n) {
    if (n >= len) continue;  // uniform across the block
    if (threadIdx.x == 0) best = ULLONG_MAX;
    __syncthreads();
    const int64_t tail = len - n;
    for (int64_t s = threadIdx.x; s < tail; s += blockDim.x)
      if (history_rows::gram_equal(t, s, tail, n)) {
        atomicMin(&best, static_cast<unsigned long long>(s));
        break;
      }
    __syncthreads();
    const unsigned long long b = best;
    __syncthreads();  // every thread read best before thread 0 resets it for the next n
    if (b != ULLONG_MAX) {
      start = static_cast<int64_t>(b);
      found_n = n;
      break;
    }
  }
  if (threadIdx.x == 0) history_rows::write_window(h, r, start, found_n, depth, ids, counts);
}

__global__ void history_append_kernel(const ops::TokenHistories h, const int32_t* ids, int depth,
                                      const int32_t* accepted, const int32_t* next) {
  pdl_wait();
  pdl_release();
  const int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (r < h.rows) history_rows::append_row(h, r, ids, depth, accepted, next);
}

}  // namespace

void ngram_lookup(const ops::TokenHistories& h, int min_n, int max_n, int depth, int32_t* ids,
                  int32_t* counts) {
  if (h.rows == 0) return;
  launch("ngram_lookup", ngram_lookup_kernel, grid_blocks(h.rows, "ngram_lookup"), kLookupThreads,
         0, h, min_n, max_n, depth, ids, counts);
}

void history_append(const ops::TokenHistories& h, const int32_t* ids, int depth,
                    const int32_t* accepted, const int32_t* next) {
  if (h.rows == 0) return;
  launch("history_append", history_append_kernel, grid_blocks(ceil_div(h.rows, 128), "history"),
         128, 0, h, ids, depth, accepted, next);
}

}  // namespace tandem::cuda
