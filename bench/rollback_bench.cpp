// Cost of target rollback under speculation (DESIGN.md §5.3), per RecurrentRollback strategy:
// a speculative verify forward over a 4-token window followed by commit_windows at kept=1 (three
// tokens rejected: the expensive case) and kept=4 (all accepted), against a plain 1-token decode
// step and a non-speculative 4-token forward, on one row, in the same process. Medians over
// interleaved repeats, so drift (thermal, other load) hits every variant alike.
//
//   tandem_bench_rollback MODEL_DIR [--repeats N] [--context N] [--threads N] [--kernels-only]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "tandem/backend/ops.h"
#include "tandem/core/error.h"
#include "tandem/model/qwen3_5.h"

namespace {

using namespace tandem;
using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

double minimum(const std::vector<double>& v) {
  return *std::min_element(v.begin(), v.end());
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::vector<int32_t> ids(int64_t n, int64_t vocab, int64_t seed) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<int32_t>((seed * 7919 + i * 104729) % vocab);
  return v;
}

struct Timings {
  std::vector<double> decode, plain4, spec1_fwd, spec1_commit, spec4_fwd, spec4_commit;
};

void run_once(const Qwen35Model& m, Qwen35State& st, int slot, int64_t round, Timings& t) {
  const int64_t V = m.config().vocab_size;
  ForwardOutput out;
  auto forward = [&](const std::vector<int32_t>& tok, bool speculative) {
    const RowInput r{slot, static_cast<int64_t>(tok.size()), speculative};
    // Verify forwards need every window position's logits; a decode step needs the last.
    m.forward(st, {tok, {&r, 1}, tok.size() > 1, false}, &out);
  };
  auto commit = [&](int64_t kept) {
    const RowKeep k{slot, kept};
    m.commit_windows(st, {&k, 1});
  };
  const auto one = ids(1, V, round), four = ids(4, V, round + 1);

  auto t0 = Clock::now();
  forward(one, false);
  t.decode.push_back(ms_since(t0));

  t0 = Clock::now();
  forward(four, false);
  t.plain4.push_back(ms_since(t0));

  t0 = Clock::now();
  forward(four, true);
  t.spec1_fwd.push_back(ms_since(t0));
  t0 = Clock::now();
  commit(1);
  t.spec1_commit.push_back(ms_since(t0));

  t0 = Clock::now();
  forward(four, true);
  t.spec4_fwd.push_back(ms_since(t0));
  t0 = Clock::now();
  commit(4);
  t.spec4_commit.push_back(ms_since(t0));
}

// The work the two strategies add, isolated from the rest of the forward (which is the same for
// both and dominates the noise on a shared machine): the DeltaNet recurrence of a 4-token window
// over every linear layer of the model's shapes, with and without per-position records, and the
// state copy and replay a Replay round does on the CPU (a window's tokens after its first run on a
// copy of the state; the commit replays the kept tokens after the first, none when it keeps one).
// Synthetic inputs; weights in fp32.
void kernel_costs(const Qwen35Config& c, int64_t n_linear, int repeats) {
  const int64_t n = 4, conv_dim = c.linear_conv_dim(), K = c.linear_conv_kernel_dim;
  const int64_t kd = c.linear_key_dim(), vd = c.linear_value_dim(), nv = c.linear_num_value_heads;
  const ops::DeltaHeads heads{c.linear_num_key_heads, nv, c.linear_key_head_dim,
                              c.linear_value_head_dim};
  const int64_t conv_floats = conv_dim * (K - 1), rec_floats = nv * heads.dk * heads.dv;
  std::vector<float> conv_w(static_cast<size_t>(conv_dim * K), 0.1f), A_log(nv, 0.5f),
      dt_bias(nv, 0.1f);
  const ops::WeightRef w_conv{DType::F32, conv_w.data(), conv_dim, K, {}},
      w_A{DType::F32, A_log.data(), 1, nv, {}}, w_dt{DType::F32, dt_bias.data(), 1, nv, {}};
  std::vector<float> x(static_cast<size_t>(n * conv_dim)), ab(static_cast<size_t>(2 * n * nv));
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 2654435761u) % 1000) / 1e3f;
  for (size_t i = 0; i < ab.size(); ++i) ab[i] = static_cast<float>(i % 7) / 7.0f;
  // Per layer: live state [conv | rec], snapshot, per-position records.
  std::vector<float> state(static_cast<size_t>(n_linear * (conv_floats + rec_floats)), 0.01f);
  std::vector<float> snap(state.size()), after(static_cast<size_t>(n * (conv_floats + rec_floats)));
  std::vector<float> conv_out(x.size()), qkv(static_cast<size_t>(n * (2 * kd + vd))),
      core(static_cast<size_t>(n * vd));
  auto layer_state = [&](std::vector<float>& v, int64_t l) {
    return v.data() + l * (conv_floats + rec_floats);
  };
  // The recurrence of `m` window tokens for every layer; `record`: keep per-position states.
  auto recurrence = [&](int64_t m, bool record) {
    for (int64_t l = 0; l < n_linear; ++l) {
      float* st = layer_state(state, l);
      ops::causal_conv_silu(x.data(), m, conv_dim, K, w_conv, st, conv_out.data(),
                            record ? after.data() : nullptr);
      for (int64_t t = 0; t < m; ++t) {
        std::copy_n(conv_out.data() + t * conv_dim, kd, qkv.data() + t * kd);
        std::copy_n(conv_out.data() + t * conv_dim + kd, kd, qkv.data() + (m + t) * kd);
        std::copy_n(conv_out.data() + t * conv_dim + 2 * kd, vd, qkv.data() + 2 * m * kd + t * vd);
      }
      ops::gated_delta_rule(qkv.data(), qkv.data() + m * kd, qkv.data() + 2 * m * kd, ab.data(),
                            ab.data() + n * nv, w_A, w_dt, m, heads, st + conv_floats, core.data(),
                            record ? after.data() + n * conv_floats : nullptr);
    }
  };
  auto copy_all = [&](std::vector<float>& dst, const std::vector<float>& src) {
    for (int64_t l = 0; l < n_linear; ++l)
      std::copy_n(src.data() + l * (conv_floats + rec_floats), conv_floats + rec_floats,
                  layer_state(dst, l));
  };
  std::vector<double> plain, record, snapshot, replay1, replay3, pick;
  for (int i = 0; i < repeats; ++i) {
    auto t0 = Clock::now();
    recurrence(n, false);
    plain.push_back(ms_since(t0));
    t0 = Clock::now();
    recurrence(n, true);
    record.push_back(ms_since(t0));
    t0 = Clock::now();
    copy_all(snap, state);
    snapshot.push_back(ms_since(t0));
    t0 = Clock::now();
    recurrence(1, false);
    replay1.push_back(ms_since(t0));
    t0 = Clock::now();
    recurrence(3, false);
    replay3.push_back(ms_since(t0));
    t0 = Clock::now();  // PerPositionStates commit: one state copy per layer
    for (int64_t l = 0; l < n_linear; ++l) {
      std::copy_n(after.data(), conv_floats, layer_state(state, l));
      std::copy_n(after.data() + n * conv_floats, rec_floats, layer_state(state, l) + conv_floats);
    }
    pick.push_back(ms_since(t0));
  }
  std::printf("\nDeltaNet work only, %lld linear layers, 4-token window, ms (median | min):\n",
              static_cast<long long>(n_linear));
  auto line = [](const char* what, const std::vector<double>& v) {
    std::printf("  %-58s %8.3f | %8.3f\n", what, median(v), minimum(v));
  };
  line("recurrence, 4 tokens, no records (plain verify)", plain);
  line("recurrence, 4 tokens, per-position records", record);
  line("copy of the state (Replay verify: unsettled tokens, CPU)", snapshot);
  line("replay 1 token (Replay commit kept=2; kept=1 replays none)", replay1);
  line("replay 3 tokens (Replay commit kept=4)", replay3);
  line("copy the kept position's state (PerPositionStates commit)", pick);
  const double rec_extra = median(record) - median(plain);
  std::printf("  => per round: PerPositionStates %+.3f (records) %+.3f (commit, if any rejected)\n",
              rec_extra, median(pick));
  std::printf(
      "                Replay            %+.3f (state copy) %+.3f..%+.3f (commit kept=2..4)\n",
      median(snapshot), median(replay1), median(replay3));
}

int main_impl(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr,
                 "usage: %s MODEL_DIR [--repeats N] [--context N] [--threads N] [--kernels-only]\n"
                 "Times a 4-token speculative verify forward + commit_windows (kept=1, kept=4)\n"
                 "for each RecurrentRollback strategy against a 1-token decode step.\n",
                 argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  int repeats = 15, threads = 0;
  int64_t context = 64;
  bool kernels_only = false;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--kernels-only") {
      kernels_only = true;
      continue;
    }
    if (i + 1 >= argc) fail("option ", a, " needs a value");
    const long v = std::strtol(argv[++i], nullptr, 10);
    if (a == "--repeats")
      repeats = static_cast<int>(v);
    else if (a == "--context")
      context = v;
    else if (a == "--threads")
      threads = static_cast<int>(v);
    else
      fail("unknown option ", a);
  }
  if (repeats < 1 || context < 1) fail("--repeats and --context must be positive");
  ops::set_thread_count(threads);
  const auto model = Qwen35Model::load(dir);
  const Qwen35Config& c = model->config();
  if (kernels_only) {
    std::printf("model %s, threads %d\n", dir.c_str(), ops::thread_count());
    int64_t n_linear = 0;
    for (LayerKind k : c.layer_types) n_linear += k == LayerKind::LinearAttention;
    kernel_costs(c, n_linear, repeats);
    return 0;
  }

  const RecurrentRollback strategies[2] = {RecurrentRollback::PerPositionStates,
                                           RecurrentRollback::Replay};
  const char* names[2] = {"PerPositionStates", "Replay"};
  Qwen35State states[2] = {Qwen35State(c, strategies[0]), Qwen35State(c, strategies[1])};
  int slots[2];
  Timings t[2];
  for (int s = 0; s < 2; ++s) {
    slots[s] = states[s].open_row();
    const auto prompt = ids(context, c.vocab_size, 1);
    const RowInput r{slots[s], context, false};
    ForwardOutput out;
    model->forward(states[s], {prompt, {&r, 1}, false, false}, &out);
    Timings warm;  // first round grows workspaces and window buffers
    run_once(*model, states[s], slots[s], 0, warm);
  }
  for (int i = 0; i < repeats; ++i)
    for (int s = 0; s < 2; ++s) run_once(*model, states[s], slots[s], i + 1, t[s]);

  std::printf("model %s: %lld layers (%lld DeltaNet), threads %d, context %lld, repeats %d\n",
              dir.c_str(), static_cast<long long>(c.num_hidden_layers),
              static_cast<long long>(states[0].linear_layers()), ops::thread_count(),
              static_cast<long long>(context), repeats);
  std::printf("recurrent state per DeltaNet layer: %.2f MiB; conv state: %.1f KiB\n",
              states[0].recurrent_state_floats() * 4.0 / (1 << 20),
              states[0].conv_state_floats() * 4.0 / 1024);
  std::printf("\n%-18s %-34s %10s %10s %10s %9s\n", "strategy", "step", "forward ms", "commit ms",
              "total ms", "x decode");
  for (int s = 0; s < 2; ++s) {
    const double dec = median(t[s].decode);
    auto row = [&](const char* step, double f, double cm) {
      std::printf("%-18s %-34s %10.3f %10.3f %10.3f %9.3f\n", names[s], step, f, cm, f + cm,
                  (f + cm) / dec);
    };
    row("decode, 1 token", dec, 0.0);
    row("forward, 4 tokens, not speculative", median(t[s].plain4), 0.0);
    row("verify 4 + commit kept=1", median(t[s].spec1_fwd), median(t[s].spec1_commit));
    row("verify 4 + commit kept=4", median(t[s].spec4_fwd), median(t[s].spec4_commit));
  }
  // On a shared machine the minimum is the steadier estimate of what the work itself costs.
  std::printf("\nrollback overhead vs a non-speculative 4-token forward, ms (median | min):\n");
  for (int s = 0; s < 2; ++s) {
    auto total_min = [](const std::vector<double>& f, const std::vector<double>& cm) {
      std::vector<double> sum(f.size());
      for (size_t i = 0; i < f.size(); ++i) sum[i] = f[i] + cm[i];
      return minimum(sum);
    };
    const double base = median(t[s].plain4), base_min = minimum(t[s].plain4);
    std::printf("  %-18s kept=1: %+8.3f | %+8.3f   kept=4: %+8.3f | %+8.3f\n", names[s],
                median(t[s].spec1_fwd) + median(t[s].spec1_commit) - base,
                total_min(t[s].spec1_fwd, t[s].spec1_commit) - base_min,
                median(t[s].spec4_fwd) + median(t[s].spec4_commit) - base,
                total_min(t[s].spec4_fwd, t[s].spec4_commit) - base_min);
  }
  std::printf("  (min of decode: %.3f ms | %.3f ms)\n", minimum(t[0].decode), minimum(t[1].decode));
  kernel_costs(c, states[0].linear_layers(), std::max(repeats, 20));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return main_impl(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
