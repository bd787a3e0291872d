// GLM-5's multi-head latent attention on the CPU (ops::mla_attention). The cache holds, per
// position, the normed compressed key/value latent (R values) and the rotated rotary key shared by
// all heads (dr values); kv_b_proj [H·(dn + dv), R] turns a latent into head h's key (its first dn
// rows) and value (the next dv rows).
//
// Two evaluation orders of the same attention:
//  - expanded (prompt prefill): every position's per-head key and value are formed from its
//    latent, then scores, softmax and the weighted sum of values as usual;
//  - absorbed (decode and verify): the key projection is folded into the query (W_ukᵀ q_nope, one
//    R-vector per head) and the value projection is applied once to the weighted sum of latents,
//    so a step reads each cached latent once instead of expanding it per head.
// Both sum positions in ascending order and a query's result depends on its own inputs only.
#include <algorithm>
#include <cmath>
#include <vector>

#include "tandem/backend/cpu/cpu_ops.h"
#include "tandem/backend/cpu/thread_pool.h"
#include "tandem/backend/cpu/weight_element.h"
#include "tandem/core/error.h"

namespace tandem::cpu {

namespace {

float dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace

void mla_attention(const float* q_nope, const float* q_pe, int64_t n, int64_t H, int64_t dn,
                   int64_t dr, int64_t dv, const float* latent, int64_t ctx, int64_t R,
                   const ops::WeightRef& kv_b, const int64_t* pos, const int32_t* allowed,
                   int64_t topk, float scale, bool absorbed, float* out) {
  if (kv_b.rows != H * (dn + dv) || kv_b.cols != R)
    fail("mla_attention: kv_b is [", kv_b.rows, " x ", kv_b.cols, "], expected [", H * (dn + dv),
         " x ", R, "] for ", H, " heads of ", dn, " + ", dv);
  if (kv_b.dtype != DType::F32 && kv_b.dtype != DType::BF16 && kv_b.dtype != DType::F16 &&
      kv_b.dtype != DType::F8_E4M3)
    fail("mla_attention: kv_b dtype ", dtype_name(kv_b.dtype),
         " (expected F32, BF16, F16 or block-scaled F8_E4M3)");
  for (int64_t i = 0; i < n; ++i)
    if (pos[i] < 0 || pos[i] >= ctx)
      fail("mla_attention: query ", i, " at position ", pos[i], " outside the ", ctx, " cached");
  const int64_t L = R + dr;  // one cached position
  // kv_b as fp32 [H][dn + dv][R]: used in place when it is aligned F32, else widened once per
  // call (safetensors does not align tensors).
  std::vector<float> widened;
  const float* wkv = static_cast<const float*>(kv_b.data);
  if (kv_b.dtype != DType::F32 || reinterpret_cast<uintptr_t>(kv_b.data) % alignof(float) != 0) {
    widened.resize(static_cast<size_t>(kv_b.rows * R));
    for (int64_t i = 0; i < kv_b.rows * R; ++i)
      widened[static_cast<size_t>(i)] = ops::weight_element(kv_b, i);
    wkv = widened.data();
  }
  // The positions a query attends to, ascending: its DSA choice, or every one up to its own.
  auto attended = [&](int64_t i, std::vector<int64_t>& cols) {
    cols.clear();
    if (allowed) {
      for (int64_t j = 0; j < topk; ++j) {
        const int32_t p = allowed[i * topk + j];
        if (p >= 0 && p <= pos[i]) cols.push_back(p);
      }
      std::sort(cols.begin(), cols.end());
    } else {
      for (int64_t p = 0; p <= pos[i]; ++p) cols.push_back(p);
    }
  };
  // softmax(score) in place; returns the sum of the exponentials.
  auto exponentiate = [](std::vector<float>& score, float mx) {
    float sum = 0.0f;
    for (float& s : score) {
      s = std::exp(s - mx);
      sum += s;
    }
    return sum;
  };

  if (!absorbed) {
    // Expanded: one head per job. The head's key and value of every position the queries can
    // reach are formed once (keys [P][dn], values [P][dv]), not once per query: a prompt's cost
    // grows with its length, not its square. Each element is the same dot product either way.
    int64_t P = 0;
    for (int64_t i = 0; i < n; ++i) P = std::max(P, pos[i] + 1);
    parallel_for(H, [&](int64_t b, int64_t e) {
      std::vector<int64_t> cols;
      std::vector<float> score, keys(static_cast<size_t>(P * dn)),
          values(static_cast<size_t>(P * dv));
      for (int64_t h = b; h < e; ++h) {
        const float* wk = wkv + h * (dn + dv) * R;  // [dn][R]
        const float* wv = wk + dn * R;              // [dv][R]
        for (int64_t p = 0; p < P; ++p) {
          const float* lat = latent + p * L;
          for (int64_t d = 0; d < dn; ++d)
            keys[static_cast<size_t>(p * dn + d)] = dot(wk + d * R, lat, R);
          for (int64_t d = 0; d < dv; ++d)
            values[static_cast<size_t>(p * dv + d)] = dot(wv + d * R, lat, R);
        }
        for (int64_t i = 0; i < n; ++i) {
          const float* qn = q_nope + (i * H + h) * dn;
          const float* qp = q_pe + (i * H + h) * dr;
          float* o = out + (i * H + h) * dv;
          attended(i, cols);
          std::fill(o, o + dv, 0.0f);
          if (cols.empty()) continue;
          score.resize(cols.size());
          float mx = -INFINITY;
          for (size_t j = 0; j < cols.size(); ++j) {
            const float* lat = latent + cols[j] * L;
            const float s =
                (dot(qn, keys.data() + cols[j] * dn, dn) + dot(qp, lat + R, dr)) * scale;
            score[j] = s;
            mx = std::max(mx, s);
          }
          const float sum = exponentiate(score, mx);
          for (size_t j = 0; j < cols.size(); ++j) {
            const float p = score[j] / sum;
            const float* v = values.data() + cols[j] * dv;
            for (int64_t d = 0; d < dv; ++d) o[d] += p * v[d];
          }
        }
      }
    });
    return;
  }

  // Absorbed: a (query, head) pair per job, so a decode step's single query still spreads over
  // the heads.
  parallel_for(n * H, [&](int64_t b, int64_t e) {
    std::vector<int64_t> cols;
    std::vector<float> score, qlat(static_cast<size_t>(R)), acc;
    for (int64_t job = b; job < e; ++job) {
      const int64_t i = job / H, h = job % H;
      const float* qn = q_nope + (i * H + h) * dn;
      const float* qp = q_pe + (i * H + h) * dr;
      const float* wk = wkv + h * (dn + dv) * R;  // [dn][R]
      const float* wv = wk + dn * R;              // [dv][R]
      attended(i, cols);
      float* o = out + (i * H + h) * dv;
      if (cols.empty()) {
        std::fill(o, o + dv, 0.0f);
        continue;
      }
      // q_lat = W_ukᵀ q_nope
      std::fill(qlat.begin(), qlat.end(), 0.0f);
      for (int64_t d = 0; d < dn; ++d)
        for (int64_t c = 0; c < R; ++c) qlat[static_cast<size_t>(c)] += qn[d] * wk[d * R + c];
      score.resize(cols.size());
      float mx = -INFINITY;
      for (size_t j = 0; j < cols.size(); ++j) {
        const float* lat = latent + cols[j] * L;
        const float s = (dot(qlat.data(), lat, R) + dot(qp, lat + R, dr)) * scale;
        score[j] = s;
        mx = std::max(mx, s);
      }
      const float sum = exponentiate(score, mx);
      // Σ p · latent, then W_uv
      acc.assign(static_cast<size_t>(R), 0.0f);
      for (size_t j = 0; j < cols.size(); ++j) {
        const float* lat = latent + cols[j] * L;
        const float p = score[j] / sum;
        for (int64_t c = 0; c < R; ++c) acc[static_cast<size_t>(c)] += p * lat[c];
      }
      for (int64_t d = 0; d < dv; ++d) o[d] = dot(wv + d * R, acc.data(), R);
    }
  });
}

}  // namespace tandem::cpu
