// Attention over a paged KV cache: one query token at a time, its softmax over its own prefix
// in position order, so decode, verify windows and prefill give the same numbers per token.
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

void kv_write(const KVLayerView& kv, const int32_t* block_table, const int64_t* positions,
              int64_t n, const float* k, const float* v) {
  const int64_t row = kv.n_kv_heads * kv.head_dim;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t p = positions[t];
    if (p < 0) fail("kv_write: token ", t, " has negative position ", p);
    const int32_t block = block_table[p / kv.block_size];
    const int64_t slot = p % kv.block_size;
    std::memcpy(kv.key(block, slot), k + t * row, sizeof(float) * row);
    std::memcpy(kv.value(block, slot), v + t * row, sizeof(float) * row);
  }
}

void kv_write_slots(const KVLayerView& kv, const int64_t* slots, int64_t n, const float* k,
                    const float* v) {
  const int64_t row = kv.n_kv_heads * kv.head_dim;
  for (int64_t t = 0; t < n; ++t) {
    if (slots[t] < 0) continue;
    const auto block = static_cast<int32_t>(slots[t] / kv.block_size);
    const int64_t slot = slots[t] % kv.block_size;
    std::memcpy(kv.key(block, slot), k + t * row, sizeof(float) * row);
    std::memcpy(kv.value(block, slot), v + t * row, sizeof(float) * row);
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
        if (scratch.size() < static_cast<size_t>(position_bound)) scratch.resize(position_bound);
        float* const scores = scratch.data();
        for (int64_t w = w0; w < w1; ++w) {
          const int64_t t = w / n_heads;
          const int64_t h = w % n_heads;
          const int64_t kvh = h / group;
          const int64_t len = positions[t] + 1;  // causal: positions 0..positions[t]
          const float* qv = q + (t * n_heads + h) * hd;
          float mx = -INFINITY;
          for (int64_t p = 0; p < len; ++p) {
            const float* kp = kv.key(block_table[p / kv.block_size], p % kv.block_size) + kvh * hd;
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
            const float* vp =
                kv.value(block_table[p / kv.block_size], p % kv.block_size) + kvh * hd;
            const float wgt = scores[p] * inv;
            for (int64_t i = 0; i < hd; ++i) o[i] += wgt * vp[i];
          }
        }
      },
      work * position_bound > 4096);
}

}  // namespace tandem::cpu
