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

// Runs a row's tokens through run(first_token, n, state, state_after): its settled tokens on its
// state, the rest on a copy of the state they leave (so the row's state keeps the settled ones
// only). Both ops walk tokens one by one, so splitting a row changes no value.
template <class Run>
void run_settled(const ops::RecurrentRow& row, int64_t state_floats, float* state, float* after,
                 std::vector<float>& scratch, Run&& run) {
  const int64_t settled = ops::settled_tokens(row);
  if (settled > 0) run(row.first_token, settled, state, after);
  if (settled == row.n) return;
  scratch.assign(state, state + state_floats);
  run(row.first_token + settled, row.n - settled, scratch.data(),
      after ? after + settled * state_floats : nullptr);
}
}  // namespace

void causal_conv_silu_rows(const float* x, int64_t channels, int64_t kernel,
                           const ops::WeightRef& w, const ops::RecurrentRow* rows, int64_t n_rows,
                           int64_t max_n, float* out) {
  check_rows(rows, n_rows, max_n, "causal_conv_silu_rows", true);
  const int64_t state_floats = channels * (kernel - 1);
  std::vector<float> scratch;  // the unsettled tokens run on a copy of the settled state
  for (int64_t r = 0; r < n_rows; ++r) {
    const ops::RecurrentRow& row = rows[r];
    if (row.n == 0) continue;  // state untouched, as the CUDA kernel leaves it
    run_settled(row, state_floats, row.conv_state, row.conv_after, scratch,
                [&](int64_t t0, int64_t n, float* state, float* after) {
                  cpu::causal_conv_silu(x + t0 * channels, n, channels, kernel, w, state,
                                        out + t0 * channels, after);
                });
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
  std::vector<float> scratch;  // the unsettled tokens run on a copy of the settled state
  for (int64_t r = 0; r < n_rows; ++r) {
    const ops::RecurrentRow& row = rows[r];
    if (row.n == 0) continue;
    run_settled(row, h.n_v_heads * h.dk * h.dv, row.state, row.state_after, scratch,
                [&](int64_t t0, int64_t n, float* state, float* after) {
                  cpu::gated_delta_rule(q + t0 * qk_step, k + t0 * qk_step, v + t0 * v_step,
                                        a + t0 * h.n_v_heads, b + t0 * h.n_v_heads, A_log, dt_bias,
                                        n, h, state, out + t0 * v_row, after);
                });
  }
}

void recurrent_layers_rows(const ops::RecurrentLayers& layers, int64_t channels, int64_t kernel,
                           const ops::RecurrentRow* rows, int64_t n_rows, int64_t max_n,
                           const ops::DeltaHeads& h) {
  // Every layer's descriptors first: a bad call changes no layer's state.
  for (int64_t l = 0; l < layers.count; ++l) {
    check_rows(rows + l * n_rows, n_rows, max_n, "recurrent_layers_rows (conv)", true);
    check_rows(rows + l * n_rows, n_rows, max_n, "recurrent_layers_rows (recurrence)", false);
  }
  const int64_t kd = h.n_k_heads * h.dk;
  for (int64_t l = 0; l < layers.count; ++l) {
    const ops::RecurrentLayer& L = layers.host[l];
    const ops::RecurrentRow* lr = rows + l * n_rows;
    cpu::causal_conv_silu_rows(L.conv_input, channels, kernel, L.conv_weight, lr, n_rows, max_n,
                               L.conv_out);
    cpu::gated_delta_rule_rows(L.conv_out, L.conv_out + kd, L.conv_out + 2 * kd, L.a, L.b, L.A_log,
                               L.dt_bias, lr, n_rows, max_n, h, L.out);
  }
}

}  // namespace tandem::cpu
