// CUDA op timings at the shapes that decide Qwen3.5-9B decode and prefill speed: each op alone,
// median of repeated launches, with the bytes it must move and the bandwidth that implies.
// Usage: tandem_bench_ops [repeats [NxK[s],...]]. Results are recorded in BENCHMARKS.md.
// With a list of weight shapes (N rows of K; a trailing `s`: gate_up_swiglu), only the linear
// section runs, over those shapes at 32 to 256 rows (one product under a profiler, or the same
// arithmetic at other tile counts).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "tandem/backend/cuda/cuda_ops.h"

using namespace tandem;

namespace {

// Median over `repeats` samples of the time per call when kBackToBack calls are queued back to
// back and synchronised once, as a captured decode step runs them (the launch and host sync are
// spread over the calls; consecutive kernels overlap where PDL lets them).
constexpr int kBackToBack = 20;

double median_us(const std::function<void()>& f, int repeats) {
  f();
  cuda::synchronize();
  std::vector<double> t;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < kBackToBack; ++i) f();
    cuda::synchronize();
    t.push_back(
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() /
        kBackToBack);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

struct Dev {
  void* p;
  explicit Dev(size_t bytes) : p(cuda::alloc(bytes)) { cuda::fill_zero(p, bytes); }
  ~Dev() { cuda::free(p); }
  float* f() { return static_cast<float*>(p); }
};

struct Shape {
  int64_t N, K;
  bool swiglu;  // gate_up_swiglu on the pair layout instead of a plain linear
};

// "NxK[s],..." as shapes; exits with a message on anything else.
std::vector<Shape> parse_shapes(const std::string& list) {
  std::vector<Shape> shapes;
  size_t at = 0;
  while (at <= list.size()) {
    const size_t end = std::min(list.find(',', at), list.size());
    const std::string item = list.substr(at, end - at);
    long long n = 0, k = 0;
    char tail[4] = {0};
    const int got = std::sscanf(item.c_str(), "%lldx%lld%3s", &n, &k, tail);
    const bool swiglu = got == 3 && std::string(tail) == "s";
    if (got < 2 || (got == 3 && !swiglu) || n < 1 || k < 16 || k % 16 != 0) {
      std::fprintf(stderr,
                   "tandem_bench_ops: '%s' is not a weight shape NxK[s] (K a multiple of 16)\n",
                   item.c_str());
      std::exit(2);
    }
    shapes.push_back({n, k, swiglu});
    at = end + 1;
  }
  return shapes;
}

int run(int argc, char** argv);

}  // namespace

// Errors of the ops (a shape they refuse, no device) as a message, not an uncaught exception.
int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tandem_bench_ops: %s\n", e.what());
    return 1;
  }
}

namespace {

int run(int argc, char** argv) {
  const int repeats = argc > 1 ? std::atoi(argv[1]) : 50;
  if (repeats < 1) {
    std::fprintf(stderr, "tandem_bench_ops: repeats must be a positive count\n");
    return 2;
  }
  const bool only_linear = argc > 2;
  // The 9B decode matrices: delta in_proj, attention in_proj, down_proj, out/o_proj, gate_up
  // (with its SwiGLU epilogue), the head; or the shapes asked for (checked before the device).
  const std::vector<Shape> shapes =
      only_linear
          ? parse_shapes(argv[2])
          : std::vector<Shape>{{12352, 4096, false}, {10240, 4096, false}, {4096, 12288, false},
                               {4096, 4096, false},  {24576, 4096, true},  {248320, 4096, false}};
  std::printf("device %s\n", cuda::device_name().c_str());
  const double bw = cuda::copy_bandwidth();
  std::printf("copy bandwidth %.0f GB/s\n\n", bw / 1e9);

  std::printf("linear (bf16 weights; per call, %d calls back to back)\n", kBackToBack);
  const std::vector<int64_t> rows = only_linear
                                        ? std::vector<int64_t>{32, 64, 128, 256}
                                        : std::vector<int64_t>{1, 4, 8, 16, 32, 64, 128, 256};
  for (auto [N, K, swiglu] : shapes) {
    Dev w(sizeof(uint16_t) * N * K), x(sizeof(float) * 256 * K), y(sizeof(float) * 256 * N);
    cuda::fill_random_bf16(static_cast<uint16_t*>(w.p), N * K, 1, 0.02f);
    ops::WeightRef ref{DType::BF16, w.p, N, K, {}};
    // Decode rows, and the many-row products of verify windows (32 rows x 2, 4 or 8 tokens).
    for (int64_t m : rows) {
      const double us = median_us(
          [&] {
            if (swiglu)
              cuda::gate_up_swiglu(x.f(), m, ref, y.f());
            else
              cuda::linear(x.f(), m, ref, y.f());
          },
          repeats);
      std::printf("  N %6lld K %5lld m %3lld%s: %8.1f us  %6.0f GB/s weights\n", (long long)N,
                  (long long)K, (long long)m, swiglu ? " swiglu" : "", us, 2.0 * N * K / us / 1e3);
    }
  }

  if (only_linear) return 0;

  // A sublayer's first projection with its input norm folded in (normalised while the rows are
  // staged) against a norm kernel followed by the projection.
  std::printf("\ninput norm + projection (K 4096)\n");
  for (auto [N, swiglu] : {std::pair<int64_t, bool>{12352, false}, {24576, true}}) {
    const int64_t K = 4096;
    Dev w(sizeof(uint16_t) * N * K), x(sizeof(float) * 4 * K), h(sizeof(float) * 4 * K),
        y(sizeof(float) * 4 * N), nw(sizeof(float) * K);
    cuda::fill_random_bf16(static_cast<uint16_t*>(w.p), N * K, 1, 0.02f);
    cuda::fill_random_f32(x.f(), 4 * K, 2, 0.0f, 1.0f);
    cuda::fill_random_f32(nw.f(), K, 3, 0.0f, 0.1f);
    const ops::WeightRef ref{DType::BF16, w.p, N, K, {}}, norm_w{DType::F32, nw.p, 1, K, {}};
    const ops::RowNorm norm{norm_w, true, 1e-6f};
    auto project = [&](const float* in, int64_t m, const ops::RowNorm* n) {
      if (swiglu) {
        cuda::gate_up_swiglu(in, m, ref, y.f(), n);
      } else {
        const ops::OutputSlice all{y.f(), N};
        cuda::linear_split(in, m, ref, &all, 1, n);
      }
    };
    for (int64_t m : {1, 4}) {
      const double fused = median_us([&] { project(x.f(), m, &norm); }, repeats);
      const double separate = median_us(
          [&] {
            cuda::rms_norm(x.f(), m, K, norm_w, true, 1e-6f, h.f());
            project(h.f(), m, nullptr);
          },
          repeats);
      std::printf("  N %6lld m %lld%s: folded %6.1f us, norm kernel + projection %6.1f us\n",
                  (long long)N, (long long)m, swiglu ? " swiglu" : "", fused, separate);
    }
  }

  // The MLP sublayer: its two projections with bf16 activations between them, against
  // gate_up_swiglu into fp32 and linear_add (both with the input norm folded in).
  std::printf("\nMLP sublayer (H 4096, I 12288)\n");
  {
    const int64_t H = 4096, I = 12288;
    Dev gu(sizeof(uint16_t) * 2 * I * H), dn(sizeof(uint16_t) * H * I), x(sizeof(float) * 4 * H),
        act(sizeof(float) * 4 * I), nw(sizeof(float) * H);
    cuda::fill_random_bf16(static_cast<uint16_t*>(gu.p), 2 * I * H, 4, 0.02f);
    cuda::fill_random_bf16(static_cast<uint16_t*>(dn.p), H * I, 5, 0.01f);
    cuda::fill_random_f32(x.f(), 4 * H, 6, 0.0f, 1.0f);
    cuda::fill_random_f32(nw.f(), H, 7, 0.0f, 0.1f);
    const ops::WeightRef gate_up{DType::BF16, gu.p, 2 * I, H, {}},
        down{DType::BF16, dn.p, H, I, {}};
    const ops::RowNorm norm{{DType::F32, nw.p, 1, H, {}}, true, 1e-6f};
    for (int64_t m : {1, 4}) {
      const double fused =
          median_us([&] { cuda::swiglu_mlp_add(x.f(), m, gate_up, down, x.f(), &norm); }, repeats);
      const double parts = median_us(
          [&] {
            cuda::gate_up_swiglu(x.f(), m, gate_up, act.f(), &norm);
            cuda::linear_add(act.f(), m, down, x.f());
          },
          repeats);
      std::printf("  m %lld: swiglu_mlp_add %6.1f us, gate_up_swiglu + linear_add %6.1f us\n",
                  (long long)m, fused, parts);
    }
  }

  std::printf("\nattention (16 heads, 4 kv heads, head_dim 256)\n");
  {
    const int64_t ctx = 4096, bs = 16, kvh = 4, hd = 256, nh = 16;
    const int64_t blocks = ctx / bs + 1;
    Dev pool(sizeof(float) * blocks * 2 * bs * kvh * hd), q(sizeof(float) * ctx * nh * hd),
        o(sizeof(float) * ctx * nh * hd), tab(sizeof(int32_t) * blocks);
    std::vector<int32_t> t(blocks);
    for (int64_t i = 0; i < blocks; ++i) t[i] = static_cast<int32_t>(i);
    cuda::copy_to_device(tab.p, t.data(), sizeof(int32_t) * blocks);
    ops::KVLayerView kv{pool.f(), bs, kvh, hd};
    const auto* bt = static_cast<const int32_t*>(tab.p);
    // Positions 0..ctx-1 on the device; a call at `start` reads them from pos + start.
    Dev pos_buf(sizeof(int64_t) * ctx);
    std::vector<int64_t> pos_host(ctx);
    for (int64_t i = 0; i < ctx; ++i) pos_host[i] = i;
    cuda::copy_to_device(pos_buf.p, pos_host.data(), sizeof(int64_t) * ctx);
    const auto* pos = static_cast<const int64_t*>(pos_buf.p);
    for (int64_t start : {512, 4000})
      for (int64_t n : {1, 4, 8}) {
        const int64_t bound = (start + n + 1023) / 1024 * 1024;  // as the model rounds it
        const double us = median_us(
            [&] { cuda::attention(kv, bt, pos + start, n, bound, q.f(), nh, 0.0625f, o.f()); },
            repeats);
        std::printf("  decode/verify: context %5lld, %lld queries: %8.1f us\n", (long long)start,
                    (long long)n, us);
      }
    const double us =
        median_us([&] { cuda::attention(kv, bt, pos, ctx, ctx, q.f(), nh, 0.0625f, o.f()); },
                  std::max(1, repeats / 10));
    std::printf("  prefill %lld queries: %8.1f us\n", (long long)ctx, us);
  }

  std::printf(
      "\nattention of many rows (attention_rows; bf16 KV, context 512, the 9B's heads): a step "
      "of R rows x k queries, each row's k queries sharing a block (window hint k) or not (1)\n");
  {
    const int64_t ctx = 512, bs = 16, kvh = 4, hd = 256, nh = 16, max_rows = 32, max_k = 8;
    const int64_t per_row = (ctx + max_k) / bs + 1;  // blocks of one row's table
    const int64_t blocks = max_rows * per_row;
    Dev pool(sizeof(uint16_t) * blocks * 2 * bs * kvh * hd),
        q(sizeof(float) * max_rows * max_k * nh * hd),
        o(sizeof(float) * max_rows * max_k * nh * hd), tab(sizeof(int32_t) * blocks);
    cuda::fill_random_f32(q.f(), max_rows * max_k * nh * hd, 3, 0, 1);
    // The rows' blocks interleaved through the pool, as rows that grew together hold them.
    std::vector<int32_t> t(blocks);
    for (int64_t r = 0; r < max_rows; ++r)
      for (int64_t b = 0; b < per_row; ++b)
        t[r * per_row + b] = static_cast<int32_t>(b * max_rows + r);
    cuda::copy_to_device(tab.p, t.data(), sizeof(int32_t) * blocks);
    ops::KVLayerView kv{pool.p, bs, kvh, hd};
    kv.dtype = DType::BF16;
    const auto* tables = static_cast<const int32_t*>(tab.p);
    Dev pos_buf(sizeof(int64_t) * max_rows * max_k), rows_buf(sizeof(int64_t) * max_rows * max_k);
    for (int64_t rows : {8, 32})
      for (int64_t k : {1, 4, 8}) {
        std::vector<int64_t> pos, row_of;
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t j = 0; j < k; ++j) {
            pos.push_back(ctx + j);
            row_of.push_back(r);
          }
        cuda::copy_to_device(pos_buf.p, pos.data(), sizeof(int64_t) * pos.size());
        cuda::copy_to_device(rows_buf.p, row_of.data(), sizeof(int64_t) * row_of.size());
        const auto* dpos = static_cast<const int64_t*>(pos_buf.p);
        const auto* drows = static_cast<const int64_t*>(rows_buf.p);
        const int64_t n = rows * k;
        std::printf("  %2lld rows x %lld queries:", (long long)rows, (long long)k);
        for (int64_t hint : {int64_t{1}, k}) {
          if (hint == 1 && k == 1 && hint != k) continue;
          const double us = median_us(
              [&] {
                cuda::attention_rows(kv, tables, per_row, drows, dpos, n, 1024, hint, q.f(), nh,
                                     0.0625f, o.f(), nullptr);
              },
              repeats);
          std::printf("  hint %lld %8.1f us", (long long)hint, us);
          if (k == 1) break;
        }
        std::printf("\n");
      }
  }

  std::printf("\ngated delta rule (16 key heads, 32 value heads, dk = dv = 128)\n");
  {
    const int64_t n = 4096, nk = 16, nv = 32, d = 128;
    Dev q(sizeof(float) * n * nk * d), k(sizeof(float) * n * nk * d), v(sizeof(float) * n * nv * d),
        a(sizeof(float) * n * nv), b(sizeof(float) * n * nv), st(sizeof(float) * nv * d * d),
        out(sizeof(float) * n * nv * d), after(sizeof(float) * 8 * nv * d * d),
        alog(sizeof(float) * nv), dtb(sizeof(float) * nv);
    cuda::fill_random_f32(q.f(), n * nk * d, 1, 0, 1);
    cuda::fill_random_f32(k.f(), n * nk * d, 2, 0, 1);
    ops::WeightRef A{DType::F32, alog.p, 1, nv, {}}, B{DType::F32, dtb.p, 1, nv, {}};
    const ops::DeltaHeads h{nk, nv, d, d};
    for (int64_t t : {1, 4, 8}) {
      const double us = median_us(
          [&] {
            cuda::gated_delta_rule(q.f(), k.f(), v.f(), a.f(), b.f(), A, B, t, h, st.f(), out.f(),
                                   t > 1 ? after.f() : nullptr);
          },
          repeats);
      std::printf("  %lld tokens: %8.1f us\n", (long long)t, us);
    }
    cuda::set_prefill(true);  // the layout prompts take
    const double us = median_us(
        [&] {
          cuda::gated_delta_rule(q.f(), k.f(), v.f(), a.f(), b.f(), A, B, n, h, st.f(), out.f(),
                                 nullptr);
        },
        std::max(1, repeats / 10));
    cuda::set_prefill(false);
    std::printf("  %lld tokens (prefill): %8.1f us\n", (long long)n, us);
  }

  std::printf("\nsmall ops at decode shape (hidden 4096)\n");
  {
    Dev x(sizeof(float) * 16 * 12288), y(sizeof(float) * 16 * 12288), w(sizeof(float) * 8192),
        st(sizeof(float) * 8192 * 3), cw(sizeof(float) * 8192 * 4);
    ops::WeightRef nw{DType::F32, w.p, 1, 4096, {}}, cwr{DType::F32, cw.p, 8192, 4, {}};
    std::printf(
        "  rms_norm 1x4096: %6.1f us\n",
        median_us([&] { cuda::rms_norm(x.f(), 1, 4096, nw, true, 1e-6f, y.f()); }, repeats));
    std::printf(
        "  add_rms_norm 1x4096: %6.1f us\n",
        median_us([&] { cuda::add_rms_norm(x.f(), y.f(), 1, 4096, nw, true, 1e-6f, y.f()); },
                  repeats));
    std::printf("  swiglu 12288:    %6.1f us\n",
                median_us([&] { cuda::swiglu(x.f(), y.f(), 12288, x.f()); }, repeats));
    std::printf("  add 4096:        %6.1f us\n",
                median_us([&] { cuda::add_inplace(x.f(), y.f(), 4096); }, repeats));
    std::printf(
        "  conv 1x8192:     %6.1f us\n",
        median_us([&] { cuda::causal_conv_silu(x.f(), 1, 8192, 4, cwr, st.f(), y.f(), nullptr); },
                  repeats));
  }
  std::printf("\nargmax over a 248,320-token vocabulary\n");
  {
    const int64_t V = 248320;
    Dev logits(sizeof(float) * 8 * V), out(sizeof(int32_t) * 8);
    cuda::fill_random_f32(logits.f(), 8 * V, 3, 0, 1);
    for (int64_t rows : {1, 8})
      std::printf(
          "  %lld rows: %6.1f us\n", (long long)rows,
          median_us([&] { cuda::argmax_rows(logits.f(), rows, V, static_cast<int32_t*>(out.p)); },
                    repeats));
  }
  return 0;
}

}  // namespace
