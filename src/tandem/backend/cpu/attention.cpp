// Attention over a paged KV cache: one query token at a time, its softmax over its own prefix
// in position order, so decode, verify windows and prefill give the same numbers per token.
// bf16 rows are widened to fp32 before the same arithmetic as fp32 rows (bf16 -> fp32 is exact).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "tandem/backend/cpu/cpu_ops.h"
#include "tandem/backend/cpu/simd.h"
#include "tandem/backend/cpu/thread_pool.h"
#include "tandem/core/error.h"

namespace tandem::cpu {

using namespace tandem::ops;

namespace {

// One position's keys (or values) into the pool's storage: copied for fp32, rounded to nearest
// even for bf16.
void store_row(const KVLayerView& kv, std::byte* dst, const float* src) {
  const int64_t row = kv.row_elements();
  if (kv.dtype == DType::F32) {
    std::memcpy(dst, src, sizeof(float) * static_cast<size_t>(row));
    return;
  }
  auto* d = reinterpret_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < row; ++i) d[i] = f32_to_bf16(src[i]);
}

// The `n` values at `src` (one kv head's part of a stored row) as fp32: `src` itself for fp32
// storage, else widened into `scratch`.
const float* load_row(const KVLayerView& kv, const std::byte* src, int64_t n, float* scratch) {
  if (kv.dtype == DType::F32) return reinterpret_cast<const float*>(src);
  const auto* s = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) scratch[i] = bf16_to_f32(s[i]);
  return scratch;
}

// fn(t, key row, value row) for token t = 0..n-1 at positions[t] through block_table; a
// negative position is the caller's bug, named with op.
template <class Fn>
void for_each_position(const KVLayerView& kv, const int32_t* block_table, const int64_t* positions,
                       int64_t n, const char* op, Fn fn) {
  for (int64_t t = 0; t < n; ++t) {
    const int64_t p = positions[t];
    if (p < 0) fail(op, ": token ", t, " has negative position ", p);
    const int32_t block = block_table[p / kv.block_size];
    const int64_t slot = p % kv.block_size;
    fn(t, kv.key(block, slot), kv.value(block, slot));
  }
}

}  // namespace

void kv_write(const KVLayerView& kv, const int32_t* block_table, const int64_t* positions,
              int64_t n, const float* k, const float* v) {
  const int64_t row = kv.row_elements();
  for_each_position(kv, block_table, positions, n, "kv_write",
                    [&](int64_t t, std::byte* key, std::byte* value) {
                      store_row(kv, key, k + t * row);
                      store_row(kv, value, v + t * row);
                    });
}

void kv_write_stored(const KVLayerView& kv, const int32_t* block_table, const int64_t* positions,
                     int64_t n, const void* k, const void* v) {
  const size_t row = kv.row_bytes();
  for_each_position(kv, block_table, positions, n, "kv_write_stored",
                    [&](int64_t t, std::byte* key, std::byte* value) {
                      std::memcpy(key, static_cast<const std::byte*>(k) + t * row, row);
                      std::memcpy(value, static_cast<const std::byte*>(v) + t * row, row);
                    });
}

void kv_write_slots(const KVLayerView& kv, const int64_t* slots, int64_t n, const float* k,
                    const float* v) {
  const int64_t row = kv.row_elements();
  for (int64_t t = 0; t < n; ++t) {
    if (slots[t] < 0) continue;
    const auto block = static_cast<int32_t>(slots[t] / kv.block_size);
    const int64_t slot = slots[t] % kv.block_size;
    store_row(kv, kv.key(block, slot), k + t * row);
    store_row(kv, kv.value(block, slot), v + t * row);
  }
}

void attention(const KVLayerView& kv, const int32_t* block_table, const int64_t* positions,
               int64_t n, int64_t position_bound, const float* q, int64_t n_heads, float scale,
               float* out) {
  // The bound is the caller's promise (the CUDA kernel sizes its grid from it); holding the
  // reference to it catches a wrong bound on the CPU tests already.
  for (int64_t t = 0; t < n; ++t)
    if (positions[t] < 0 || positions[t] >= position_bound)
      fail("attention: query ", t, " at position ", positions[t], " is outside [0, ",
           position_bound, ")");
  const int64_t hd = kv.head_dim;
  const int64_t group = n_heads / kv.n_kv_heads;
  const int64_t work = n * n_heads;
  // Each (token, head) is independent; scores[0, len) is rewritten for each before use, so a
  // thread's scratch carries nothing from one query (or call) to the next.
  parallel_for(
      work,
      [&](int64_t w0, int64_t w1) {
        thread_local std::vector<float> scratch;
        if (scratch.size() < static_cast<size_t>(position_bound + hd))
          scratch.resize(static_cast<size_t>(position_bound + hd));
        float* const scores = scratch.data();
        float* const widened = scores + position_bound;  // one bf16 row's head, as fp32
        for (int64_t w = w0; w < w1; ++w) {
          const int64_t t = w / n_heads;
          const int64_t h = w % n_heads;
          const int64_t kvh = h / group;
          const int64_t len = positions[t] + 1;  // causal: positions 0..positions[t]
          const float* qv = q + (t * n_heads + h) * hd;
          float mx = -INFINITY;
          for (int64_t p = 0; p < len; ++p) {
            const float* kp = load_row(kv,
                                       kv.key(block_table[p / kv.block_size], p % kv.block_size) +
                                           kvh * hd * dtype_size(kv.dtype),
                                       hd, widened);
            const float dot = dot_fixed(qv, kp, hd);
            scores[p] = dot * scale;
            mx = std::max(mx, scores[p]);
          }
          double sum = 0.0;
          for (int64_t p = 0; p < len; ++p) {
            scores[p] = std::exp(scores[p] - mx);
            sum += scores[p];
          }
          const float inv = static_cast<float>(1.0 / sum);
          float* o = out + (t * n_heads + h) * hd;
          for (int64_t i = 0; i < hd; ++i) o[i] = 0.0f;
          for (int64_t p = 0; p < len; ++p) {
            const float* vp = load_row(kv,
                                       kv.value(block_table[p / kv.block_size], p % kv.block_size) +
                                           kvh * hd * dtype_size(kv.dtype),
                                       hd, widened);
            const float wgt = scores[p] * inv;
            for (int64_t i = 0; i < hd; ++i) o[i] += wgt * vp[i];
          }
        }
      },
      work * position_bound > 4096);
}

}  // namespace tandem::cpu
