// The Gated DeltaNet recurrence, one token at a time per value head. The recurrent state is
// S[dk, dv] per value head, fp32:
//   S ← S·exp(g);  u = (v − Sᵀk)·β;  S ← S + k uᵀ;  o = Sᵀq
// with q, k L2-normalised (eps 1e-6, as the reference) and q scaled by dk^-0.5.
#include <cmath>
#include <vector>

#include "tandem/backend/cpu/cpu_ops.h"
#include "tandem/backend/cpu/thread_pool.h"
#include "tandem/backend/cpu/weight_element.h"

namespace tandem::cpu {

using namespace tandem::ops;

namespace {
inline float softplus(float x) {
  return x > 20.0f ? x : std::log1p(std::exp(x));
}

inline void l2_normalise(const float* x, int64_t d, float scale, float* y) {
  float ss = 0.0f;
  for (int64_t i = 0; i < d; ++i) ss += x[i] * x[i];
  const float inv = scale / std::sqrt(ss + 1e-6f);
  for (int64_t i = 0; i < d; ++i) y[i] = x[i] * inv;
}
}  // namespace

void gated_delta_rule(const float* q, const float* k, const float* v, const float* a,
                      const float* b, const WeightRef& A_log, const WeightRef& dt_bias, int64_t n,
                      const DeltaHeads& h, float* state, float* out, float* state_after) {
  const int64_t dk = h.dk, dv = h.dv;
  const int64_t group = h.n_v_heads / h.n_k_heads;
  // Floats from one token's q/k (v) to the next: packed, or the conv output's row stride.
  const int64_t qk_step = h.qkv_token_stride ? h.qkv_token_stride : h.n_k_heads * dk;
  const int64_t v_step = h.qkv_token_stride ? h.qkv_token_stride : h.n_v_heads * dv;
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(dk));
  // Heads are independent; qn, kn and u are rewritten for every (head, token) before use, so
  // a thread's scratch carries nothing from one head (or call) to the next.
  parallel_for(
      h.n_v_heads,
      [&](int64_t vh0, int64_t vh1) {
        thread_local std::vector<float> scratch;
        if (scratch.size() < static_cast<size_t>(2 * dk + dv)) scratch.resize(2 * dk + dv);
        float* const qn = scratch.data();
        float* const kn = qn + dk;
        float* const u = kn + dk;
        for (int64_t vh = vh0; vh < vh1; ++vh) {
          const int64_t kh = vh / group;
          float* S = state + vh * dk * dv;
          const float A = -std::exp(weight_element(A_log, vh));
          const float bias = weight_element(dt_bias, vh);
          for (int64_t t = 0; t < n; ++t) {
            l2_normalise(q + t * qk_step + kh * dk, dk, q_scale, qn);
            l2_normalise(k + t * qk_step + kh * dk, dk, 1.0f, kn);
            const float* vt = v + t * v_step + vh * dv;
            const float decay = std::exp(A * softplus(a[t * h.n_v_heads + vh] + bias));
            const float beta = 1.0f / (1.0f + std::exp(-b[t * h.n_v_heads + vh]));
            for (int64_t j = 0; j < dv; ++j) u[j] = 0.0f;
            for (int64_t i = 0; i < dk; ++i) {
              float* Si = S + i * dv;
              for (int64_t j = 0; j < dv; ++j) {
                Si[j] *= decay;
                u[j] += Si[j] * kn[i];
              }
            }
            for (int64_t j = 0; j < dv; ++j) u[j] = (vt[j] - u[j]) * beta;
            float* o = out + (t * h.n_v_heads + vh) * dv;
            for (int64_t j = 0; j < dv; ++j) o[j] = 0.0f;
            for (int64_t i = 0; i < dk; ++i) {
              float* Si = S + i * dv;
              for (int64_t j = 0; j < dv; ++j) {
                Si[j] += kn[i] * u[j];
                o[j] += Si[j] * qn[i];
              }
            }
            if (state_after) {
              float* dst = state_after + (t * h.n_v_heads + vh) * dk * dv;
              for (int64_t i = 0; i < dk * dv; ++i) dst[i] = S[i];
            }
          }
        }
      },
      h.n_v_heads * dk * dv * n > 16384);
}

}  // namespace tandem::cpu
