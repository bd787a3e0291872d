// The batched recurrent ops on the CPU: the descriptors are host memory, so each row is simply the
// single-row op on that row's slice of the token-major arrays, which makes its bits those of the
// single-row op by construction. Rows run one after another; each op parallelises inside a row
// (channels, value heads) as it does alone.
#include <vector>

#include "tandem/backend/cpu/cpu_ops.h"
#include "tandem/core/error.h"

namespace tandem::cpu {

namespace {
// The descriptor contract of ops.h, checked before any row runs so a bad call changes no state.
void check_rows(const ops::RecurrentRow* rows, int64_t n_rows, int64_t max_n, const char* op,
                bool conv) {
  if (n_rows < 0 || max_n < 0) fail(op, ": negative row count ", n_rows, " or max_n ", max_n);
  if (n_rows > 0 && rows == nullptr) fail(op, ": ", n_rows, " rows but no descriptors");
  for (int64_t r = 0; r < n_rows; ++r) {
    const ops::RecurrentRow& row = rows[r];
    if (row.n < 0 || row.n > max_n || row.first_token < 0)
      fail(op, ": row ", r, " has first_token ", row.first_token, ", n ", row.n, " (max_n ", max_n,
           ")");
    if (row.n > 0 && (conv ? row.conv_state : row.state) == nullptr)
      fail(op, ": row ", r, " has no state");
  }
}
}  // namespace

void causal_conv_silu_rows(const float* x, int64_t channels, int64_t kernel,
                           const ops::WeightRef& w, const ops::RecurrentRow* rows, int64_t n_rows,
                           int64_t max_n, float* out) {
  check_rows(rows, n_rows, max_n, "causal_conv_silu_rows", true);
  std::vector<float> scratch;  // a frozen row runs on a copy of its state
  for (int64_t r = 0; r < n_rows; ++r) {
    const ops::RecurrentRow& row = rows[r];
    if (row.n == 0) continue;  // state untouched, as the CUDA kernel leaves it
    const int64_t t0 = row.first_token;
    float* state = row.conv_state;
    if (row.frozen) {
      scratch.assign(row.conv_state, row.conv_state + channels * (kernel - 1));
      state = scratch.data();
    }
    cpu::causal_conv_silu(x + t0 * channels, row.n, channels, kernel, w, state, out + t0 * channels,
                          row.conv_after);
  }
}

void gated_delta_rule_rows(const float* q, const float* k, const float* v, const float* a,
                           const float* b, const ops::WeightRef& A_log,
                           const ops::WeightRef& dt_bias, const ops::RecurrentRow* rows,
                           int64_t n_rows, int64_t max_n, const ops::DeltaHeads& h, float* out) {
  check_rows(rows, n_rows, max_n, "gated_delta_rule_rows", false);
  const int64_t v_row = h.n_v_heads * h.dv;
  const int64_t qk_step = h.qkv_token_stride ? h.qkv_token_stride : h.n_k_heads * h.dk;
  const int64_t v_step = h.qkv_token_stride ? h.qkv_token_stride : v_row;
  std::vector<float> scratch;  // a frozen row runs on a copy of its state
  for (int64_t r = 0; r < n_rows; ++r) {
    const ops::RecurrentRow& row = rows[r];
    if (row.n == 0) continue;
    const int64_t t0 = row.first_token;
    float* state = row.state;
    if (row.frozen) {
      scratch.assign(row.state, row.state + h.n_v_heads * h.dk * h.dv);
      state = scratch.data();
    }
    cpu::gated_delta_rule(q + t0 * qk_step, k + t0 * qk_step, v + t0 * v_step, a + t0 * h.n_v_heads,
                          b + t0 * h.n_v_heads, A_log, dt_bias, row.n, h, state, out + t0 * v_row,
                          row.state_after);
  }
}

}  // namespace tandem::cpu
