// Backend selection and dispatch: each op forwards to the active backend's implementation.
#include "tandem/backend/ops.h"

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "tandem/backend/cpu/cpu_ops.h"
#include "tandem/backend/cpu/memory_bandwidth.h"
#include "tandem/core/env_switch.h"
#include "tandem/core/error.h"
#include "tandem/core/sampler.h"
#ifdef TANDEM_HAVE_CUDA
#include "tandem/backend/cuda/attention_prompt.h"
#include "tandem/backend/cuda/cuda_ops.h"
#endif

namespace tandem::ops {

namespace {
int g_threads = 0;
Backend g_backend = Backend::Cpu;
}  // namespace

bool cuda_compiled() {
#ifdef TANDEM_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

bool cuda_available() {
#ifdef TANDEM_HAVE_CUDA
  return cuda::available();
#else
  return false;
#endif
}

std::string_view backend_name(Backend b) {
  return b == Backend::Cuda ? "cuda" : "cpu";
}

void set_backend(Backend b) {
  if (b == Backend::Cuda) {
    if (!cuda_compiled())
      fail("backend cuda: this tandem was built without the CUDA backend (no nvcc at build time)");
    if (!cuda_available()) fail("backend cuda: no usable CUDA device is visible");
  }
  g_backend = b;
}

Backend backend() {
  return g_backend;
}

Backend parse_backend(std::string_view name) {
  if (name == "cpu") return Backend::Cpu;
  if (name == "cuda") {
    if (!cuda_compiled())
      fail(
          "--backend cuda: this tandem was built without the CUDA backend (no nvcc at build time)");
    if (!cuda_available()) fail("--backend cuda: no usable CUDA device is visible");
    return Backend::Cuda;
  }
  if (name == "auto") return cuda_available() ? Backend::Cuda : Backend::Cpu;
  fail("unknown backend '", name, "' (expected cpu, cuda or auto)");
}

void set_thread_count(int n) {
  g_threads = n;
}

namespace {
// TANDEM_THREADS if set, else the CPUs this process may run on (its affinity mask, so taskset
// and cpusets are honoured), read once.
int default_thread_count() {
  static const int n = [] {
    if (const char* env = std::getenv("TANDEM_THREADS"); env && *env) {
      char* end = nullptr;
      const long v = std::strtol(env, &end, 10);
      if (*end != '\0' || v < 1 || v > 4096)
        fail("TANDEM_THREADS='", env, "': expected a thread count from 1 to 4096");
      return static_cast<int>(v);
    }
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
    return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  }();
  return n;
}
}  // namespace

int thread_count() {
  return g_threads > 0 ? g_threads : default_thread_count();
}

WeightRef weight_ref(const TensorView& t) {
  WeightRef w;
  w.dtype = t.dtype;
  w.data = t.data;
  if (t.shape.size() == 1) {
    w.rows = 1;
    w.cols = t.shape[0];
  } else if (t.shape.size() == 2) {
    w.rows = t.shape[0];
    w.cols = t.shape[1];
  } else {
    // Higher-rank weights (conv1d [C, 1, K]) collapse to [shape[0], rest].
    w.rows = t.shape.empty() ? 1 : t.shape[0];
    w.cols = w.rows ? t.numel() / w.rows : 0;
  }
  return w;
}

bool quant_bits_supported(int bits) {
  return bits == 2 || bits == 3 || bits == 4 || bits == 5 || bits == 6 || bits == 8;
}

#ifdef TANDEM_HAVE_CUDA
#define TANDEM_DISPATCH(call)                          \
  do {                                                 \
    if (g_backend == Backend::Cuda) return cuda::call; \
    return cpu::call;                                  \
  } while (0)
#else
#define TANDEM_DISPATCH(call) return cpu::call
#endif

void set_prefill(bool on, int64_t gemm_rows) {
  if (on && (gemm_rows < 16 || gemm_rows > kMaxPrefillGemmRows || gemm_rows % 16 != 0))
    fail("set_prefill: the prefill GEMM tile must be a multiple of 16 in [16, ",
         kMaxPrefillGemmRows, "] rows, got ", gemm_rows);
#ifdef TANDEM_HAVE_CUDA
  if (g_backend == Backend::Cuda) cuda::set_prefill(on, gemm_rows);
#endif
  (void)on;
  (void)gemm_rows;
}

int64_t prefill_gemm_rows(int64_t chunk) {
  if (chunk < 1) fail("prefill_gemm_rows: the prefill chunk must be at least 1, got ", chunk);
  return std::min(kMaxPrefillGemmRows, (chunk + 15) / 16 * 16);
}

bool prefill_matches_decode() {
  return backend() == Backend::Cpu;
}

void* mem_alloc(Backend where, size_t bytes) {
#ifdef TANDEM_HAVE_CUDA
  if (where == Backend::Cuda) return cuda::alloc(bytes);
#endif
  (void)where;
  void* p = std::malloc(bytes == 0 ? 1 : bytes);
  if (!p) fail("out of host memory allocating ", bytes, " bytes");
  return p;
}

void mem_free(Backend where, void* p) {
#ifdef TANDEM_HAVE_CUDA
  if (where == Backend::Cuda) return cuda::free(p);
#endif
  (void)where;
  std::free(p);
}

void copy(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
#ifdef TANDEM_HAVE_CUDA
  if (g_backend == Backend::Cuda) return cuda::copy_on_device(dst, src, bytes);
#endif
  std::memmove(dst, src, bytes);
}

void copy_from_host(void* dst, const void* src_host, size_t bytes) {
  if (bytes == 0) return;
#ifdef TANDEM_HAVE_CUDA
  if (g_backend == Backend::Cuda) return cuda::copy_to_device(dst, src_host, bytes);
#endif
  std::memcpy(dst, src_host, bytes);
}

void copy_to_host(void* dst_host, const void* src, size_t bytes) {
  if (bytes == 0) return;
#ifdef TANDEM_HAVE_CUDA
  if (g_backend == Backend::Cuda) return cuda::copy_to_host(dst_host, src, bytes);
#endif
  std::memcpy(dst_host, src, bytes);
}

void copy_to_host(const HostRead* reads, size_t n) {
  copy_to_host(reads, n, {});
}

void copy_to_host(const HostRead* reads, size_t n, const std::function<void()>& then) {
  bool any = false;  // no read, no wait: a forward whose tokens stay queued must not block
  for (size_t i = 0; i < n; ++i) any = any || reads[i].bytes > 0;
#ifdef TANDEM_HAVE_CUDA
  if (g_backend == Backend::Cuda) {
    if (any) return cuda::copy_reads_to_host(reads, n, then);
    if (then) then();
    return;
  }
#endif
  for (size_t i = 0; i < n; ++i)
    if (reads[i].bytes > 0) std::memcpy(reads[i].dst_host, reads[i].src, reads[i].bytes);
  if (then) then();
}

void fill_zero(void* dst, size_t bytes) {
  if (bytes == 0) return;
#ifdef TANDEM_HAVE_CUDA
  if (g_backend == Backend::Cuda) return cuda::fill_zero(dst, bytes);
#endif
  std::memset(dst, 0, bytes);
}

void copy_rows(float* dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows,
               int64_t cols) {
#ifdef TANDEM_HAVE_CUDA
  if (g_backend == Backend::Cuda)
    return cuda::copy_rows(dst, dst_stride, src, src_stride, rows, cols);
#endif
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(dst + r * dst_stride, src + r * src_stride, sizeof(float) * cols);
}

void copy_blocks(float* dst, const float* src, const int32_t* moves, int64_t n,
                 int64_t block_floats) {
  if (n < 0 || block_floats < 0)
    fail("copy_blocks: negative shape (", n, " blocks of ", block_floats, " floats)");
  if (n == 0 || block_floats == 0) return;
#ifdef TANDEM_HAVE_CUDA
  if (g_backend == Backend::Cuda) return cuda::copy_blocks(dst, src, moves, n, block_floats);
#endif
  for (int64_t i = 0; i < n; ++i)
    std::memcpy(dst + static_cast<int64_t>(moves[n + i]) * block_floats,
                src + static_cast<int64_t>(moves[i]) * block_floats,
                sizeof(float) * static_cast<size_t>(block_floats));
}

void synchronize() {
#ifdef TANDEM_HAVE_CUDA
  if (g_backend == Backend::Cuda) cuda::synchronize();
#endif
}

double device_wait_seconds() {
#ifdef TANDEM_HAVE_CUDA
  return cuda::wait_seconds();
#else
  return 0.0;
#endif
}

namespace {
bool g_graphs = env_switch_on("TANDEM_CUDA_GRAPHS");
}  // namespace

bool graphs_enabled() {
  return g_graphs;
}

void set_graphs_enabled(bool on) {
  g_graphs = on;
}

void argmax_rows(const float* logits, int64_t rows, int64_t V, int32_t* out) {
#ifdef TANDEM_HAVE_CUDA
  if (g_backend == Backend::Cuda) return cuda::argmax_rows(logits, rows, V, out);
#endif
  for (int64_t r = 0; r < rows; ++r) {
    const float* l = logits + r * V;
    int32_t best = -1;
    for (int64_t v = 0; v < V; ++v) {
      if (std::isnan(l[v]) || l[v] == INFINITY) {
        best = -1;
        break;
      }
      if (l[v] == -INFINITY) continue;
      if (best < 0 || l[v] > l[best]) best = static_cast<int32_t>(v);
    }
    out[r] = best;
  }
}

SampleRow sample_row(const SamplingParams& p, uint64_t index) {
  return {p.temperature, p.top_k, p.top_p, p.min_p, p.seed, index};
}

SamplingParams sampling_of(const SampleRow& r) {
  SamplingParams p;
  p.temperature = r.temperature;
  p.top_k = r.top_k;
  p.top_p = r.top_p;
  p.min_p = r.min_p;
  p.seed = r.seed;
  return p;
}

void sample_rows(const float* logits, int64_t rows, int64_t V, const SampleRow* params,
                 int32_t* out) {
#ifdef TANDEM_HAVE_CUDA
  if (g_backend == Backend::Cuda) return cuda::sample_rows(logits, rows, V, params, out);
#endif
  cpu::sample_rows(logits, rows, V, params, out);
}

void accept_windows(const int32_t* verified, const int32_t* ids, const int32_t* source,
                    const int32_t* from, const int32_t* bounds, const int32_t* limits,
                    int64_t n_rows, int32_t* accepted, int32_t* next) {
  if (n_rows < 0) fail("accept_windows: negative row count ", n_rows);
  TANDEM_DISPATCH(
      accept_windows(verified, ids, source, from, bounds, limits, n_rows, accepted, next));
}

void settle_windows(const int32_t* accepted, const SettledRow* rows, int64_t n_rows, int64_t* shift,
                    RecurrentRow* replay, int64_t layers) {
  if (n_rows < 0 || layers < 0)
    fail("settle_windows: negative row or layer count (", n_rows, ", ", layers, ")");
  TANDEM_DISPATCH(settle_windows(accepted, rows, n_rows, shift, replay, layers));
}

void shift_positions(const PositionShift& s, int64_t* positions, int64_t* kv_slots) {
  if (s.tokens < 0 || s.rows < 0)
    fail("shift_positions: negative token or row count (", s.tokens, ", ", s.rows, ")");
  if (kv_slots && (s.tables == nullptr || s.block_size <= 0 || s.table_stride <= 0))
    fail("shift_positions: KV slots need block tables, a stride and a block size");
  TANDEM_DISPATCH(shift_positions(s, positions, kv_slots));
}

void gather_window_rows(const float* src, int64_t width, int64_t row_stride, int64_t at,
                        const int32_t* offsets, int64_t n, float* dst) {
  if (n < 0 || width < 0 || at < 0 || row_stride < 0)
    fail("gather_window_rows: negative size (", n, " rows of ", width, " at ", at, ", stride ",
         row_stride, ")");
  TANDEM_DISPATCH(gather_window_rows(src, width, row_stride, at, offsets, n, dst));
}

namespace {
void check_histories(const TokenHistories& h, const char* op) {
  if (h.rows < 0 || h.stride < 0)
    fail(op, ": negative history shape (", h.rows, " rows, stride ", h.stride, ")");
  if (h.rows > 0 && (h.tokens == nullptr || h.lengths == nullptr))
    fail(op, ": histories without tokens or lengths");
}
}  // namespace

void ngram_lookup(const TokenHistories& h, int min_n, int max_n, int depth, int32_t* ids,
                  int32_t* counts) {
  check_histories(h, "ngram_lookup");
  if (min_n < 1 || max_n < min_n || depth < 0)
    fail("ngram_lookup: n from ", min_n, " to ", max_n, " at depth ", depth,
         " (need 1 <= min_n <= max_n, depth >= 0)");
  TANDEM_DISPATCH(ngram_lookup(h, min_n, max_n, depth, ids, counts));
}

void history_append(const TokenHistories& h, const int32_t* ids, int depth, const int32_t* accepted,
                    const int32_t* next) {
  check_histories(h, "history_append");
  if (depth < 0) fail("history_append: depth ", depth, " < 0");
  TANDEM_DISPATCH(history_append(h, ids, depth, accepted, next));
}

double memory_bandwidth() {
#ifdef TANDEM_HAVE_CUDA
  if (g_backend == Backend::Cuda) return cuda::copy_bandwidth();
#endif
  return cpu::measure_read_bandwidth();
}

std::string device_description() {
#ifdef TANDEM_HAVE_CUDA
  if (g_backend == Backend::Cuda) return cuda::device_name();
#endif
  return "cpu (" + std::to_string(thread_count()) + " threads)";
}

void linear(const float* x, int64_t m, const WeightRef& w, float* y) {
  TANDEM_DISPATCH(linear(x, m, w, y));
}
void linear_add(const float* x, int64_t m, const WeightRef& w, float* y, const GatedNorm* norm,
                const WeightRef* prefetch) {
  if (norm) {
    const int64_t hd = norm->head_dim();
    if (hd < 1 || w.cols % hd != 0)
      fail("linear_add: a gated norm over heads of ", hd, " floats does not tile rows of ", w.cols);
  }
#ifdef TANDEM_HAVE_CUDA
  if (g_backend == Backend::Cuda) return cuda::linear_add(x, m, w, y, norm, prefetch);
#endif
  (void)prefetch;  // as linear_split's
  std::vector<float> normed;
  if (norm) {
    const int64_t hd = norm->head_dim();
    normed.resize(static_cast<size_t>(m * w.cols));
    cpu::gated_rms_norm(x, norm->z, m * (w.cols / hd), hd, norm->w, norm->eps, normed.data());
    x = normed.data();
  }
  std::vector<float> p(static_cast<size_t>(m * w.rows));
  cpu::linear(x, m, w, p.data());
  cpu::add_inplace(y, p.data(), m * w.rows);
}

namespace {

// The CPU's input norm: x normalised into `rows` (x itself when there is no norm).
const float* cpu_input_rows(const float* x, int64_t m, int64_t k, const RowNorm* norm,
                            std::vector<float>& rows) {
  if (!norm) return x;
  rows.resize(static_cast<size_t>(m * k));
  cpu::rms_norm(x, m, k, norm->w, norm->zero_centred, norm->eps, rows.data());
  return rows.data();
}

}  // namespace

void linear_split(const float* x, int64_t m, const WeightRef& w, const OutputSlice* slices,
                  int n_slices, const RowNorm* norm, const WeightRef* prefetch,
                  const SliceConv* conv) {
  int64_t cols = 0;
  for (int i = 0; i < n_slices; ++i) cols += slices[i].cols;
  if (n_slices < 1 || n_slices > 4 || cols != w.rows)
    fail("linear_split: ", n_slices, " slices covering ", cols, " columns of a ", w.rows,
         "-row weight (1..4 slices covering every row)");
  if (norm && norm->w.rows * norm->w.cols != w.cols)
    fail("linear_split: the input norm has ", norm->w.rows * norm->w.cols, " weights for rows of ",
         w.cols);
  if (conv) {  // checked before anything is written
    if (conv->out == nullptr) fail("linear_split: the conv has no output");
    const DType dt = conv->w.dtype;
    if ((dt != DType::F32 && dt != DType::BF16 && dt != DType::F16) || conv->kernel < 1 ||
        conv->kernel > 16 || conv->w.rows != slices[0].cols || conv->w.cols != conv->kernel)
      fail("linear_split: the conv weight is ", dtype_name(dt), " [", conv->w.rows, ", ",
           conv->w.cols, "], expected a float weight of [", slices[0].cols, ", ", conv->kernel,
           "] with 1..16 taps");
    if (conv->n_rows < 0 || conv->max_n < 0 || (conv->n_rows > 0 && conv->rows == nullptr))
      fail("linear_split: the conv has ", conv->n_rows, " rows (max_n ", conv->max_n,
           ") and descriptors ", conv->rows ? "given" : "missing");
  }
#ifdef TANDEM_HAVE_CUDA
  if (g_backend == Backend::Cuda)
    return cuda::linear_split(x, m, w, slices, n_slices, norm, prefetch, conv);
#endif
  std::vector<float> rows;
  (void)prefetch;  // the CPU's caches hold a small part of a projection's weight
  x = cpu_input_rows(x, m, w.cols, norm, rows);
  std::vector<float> y(static_cast<size_t>(m * w.rows));
  cpu::linear(x, m, w, y.data());
  int64_t c0 = 0;
  for (int i = 0; i < n_slices; ++i) {
    copy_rows(slices[i].dst, slices[i].cols, y.data() + c0, w.rows, m, slices[i].cols);
    c0 += slices[i].cols;
  }
  if (conv)
    cpu::causal_conv_silu_rows(slices[0].dst, slices[0].cols, conv->kernel, conv->w, conv->rows,
                               conv->n_rows, conv->max_n, conv->out);
}
WeightRef leading_rows(const WeightRef& w, double fraction) {
  WeightRef r = w;
  r.rows = static_cast<int64_t>(static_cast<double>(w.rows) * std::clamp(fraction, 0.0, 1.0));
  return r;
}

void gate_up_swiglu(const float* x, int64_t m, const WeightRef& gate_up, float* act,
                    const RowNorm* norm) {
  if (gate_up.rows % (2 * kGateUpGroup) != 0)
    fail("gate_up_swiglu: the stacked weight has ", gate_up.rows, " rows, not a multiple of ",
         2 * kGateUpGroup, " (pairs of ", kGateUpGroup, "-row blocks)");
  if (norm && norm->w.rows * norm->w.cols != gate_up.cols)
    fail("gate_up_swiglu: the input norm has ", norm->w.rows * norm->w.cols,
         " weights for rows of ", gate_up.cols);
#ifdef TANDEM_HAVE_CUDA
  if (g_backend == Backend::Cuda) return cuda::gate_up_swiglu(x, m, gate_up, act, norm);
#endif
  std::vector<float> rows;
  x = cpu_input_rows(x, m, gate_up.cols, norm, rows);
  const int64_t I = gate_up.rows / 2, G = kGateUpGroup;
  std::vector<float> y(static_cast<size_t>(m * 2 * I));
  cpu::linear(x, m, gate_up, y.data());
  std::vector<float> g(static_cast<size_t>(I)), u(static_cast<size_t>(I));
  for (int64_t r = 0; r < m; ++r) {
    const float* row = y.data() + r * 2 * I;
    for (int64_t c = 0; c < I; ++c) {
      g[static_cast<size_t>(c)] = row[(c / G) * 2 * G + c % G];
      u[static_cast<size_t>(c)] = row[(c / G) * 2 * G + G + c % G];
    }
    cpu::swiglu(g.data(), u.data(), I, act + r * I);
  }
}
void swiglu_mlp_add(const float* x, int64_t m, const WeightRef& gate_up, const WeightRef& down,
                    float* y, const RowNorm* norm, const WeightRef* prefetch) {
  const int64_t I = gate_up.rows / 2;
  if (down.cols != I || down.rows != gate_up.cols)
    fail("swiglu_mlp_add: the down projection is [", down.rows, " x ", down.cols, "], expected [",
         gate_up.cols, " x ", I, "] for a [", gate_up.rows, " x ", gate_up.cols,
         "] gate/up weight");
#ifdef TANDEM_HAVE_CUDA
  if (g_backend == Backend::Cuda)
    return cuda::swiglu_mlp_add(x, m, gate_up, down, y, norm, prefetch);
#endif
  (void)prefetch;  // as linear_split's
  std::vector<float> act(static_cast<size_t>(m * I));
  gate_up_swiglu(x, m, gate_up, act.data(), norm);
  linear_add(act.data(), m, down, y);
}
void route_top_k(const float* logits, int64_t E, int64_t k, bool renormalise, int32_t* ids,
                 float* weights) {
  cpu::route_top_k(logits, E, k, renormalise, ids, weights);
}
void mla_attention(const float* q_nope, const float* q_pe, int64_t n, int64_t H, int64_t dn,
                   int64_t dr, int64_t dv, const float* latent, int64_t ctx, int64_t R,
                   const WeightRef& kv_b, const int64_t* pos, const int32_t* allowed, int64_t topk,
                   float scale, bool absorbed, float* out) {
  TANDEM_DISPATCH(mla_attention(q_nope, q_pe, n, H, dn, dr, dv, latent, ctx, R, kv_b, pos, allowed,
                                topk, scale, absorbed, out));
}
void rope_slice(float* x, int64_t n_tokens, int64_t n_heads, int64_t head_stride, int64_t offset,
                int64_t dim, const int64_t* positions, const float* inv_freq, bool interleaved) {
  TANDEM_DISPATCH(
      rope_slice(x, n_tokens, n_heads, head_stride, offset, dim, positions, inv_freq, interleaved));
}
void layer_norm(const float* x, int64_t m, int64_t d, const WeightRef& w, const WeightRef& b,
                float eps, float* y) {
  TANDEM_DISPATCH(layer_norm(x, m, d, w, b, eps, y));
}
void scale(float* x, int64_t n, float s) {
  TANDEM_DISPATCH(scale(x, n, s));
}
void dsa_select(const float* q, const float* w, int64_t n, int64_t heads, int64_t D,
                const float* keys, int64_t ctx, const int64_t* pos, int64_t topk, int32_t* out) {
  TANDEM_DISPATCH(dsa_select(q, w, n, heads, D, keys, ctx, pos, topk, out));
}
void route_noaux_tc(const float* logits, const float* bias, int64_t E, int64_t k, int64_t n_group,
                    int64_t topk_group, bool renormalise, float scale, int32_t* ids,
                    float* weights) {
  cpu::route_noaux_tc(logits, bias, E, k, n_group, topk_group, renormalise, scale, ids, weights);
}
void moe_mlp_add(const float* x, int64_t T, const MoeWeights& w, float* y,
                 std::vector<int32_t>* routed_ids, std::vector<float>* routed_weights,
                 const MoeInputNorm* norm) {
  const int64_t E = w.router.rows, H = w.router.cols;
  if (E < 1 || w.top_k < 1 || w.top_k > E || static_cast<int64_t>(w.gate.size()) != E ||
      static_cast<int64_t>(w.up.size()) != E || static_cast<int64_t>(w.down.size()) != E)
    fail("moe_mlp_add: ", w.gate.size(), "/", w.up.size(), "/", w.down.size(),
         " expert weights, top ", w.top_k, " of a router over ", E, " experts");
  for (int64_t e = 0; e < E; ++e) {
    const WeightRef &g = w.gate[static_cast<size_t>(e)], &u = w.up[static_cast<size_t>(e)],
                    &d = w.down[static_cast<size_t>(e)];
    if (g.cols != H || u.cols != H || u.rows != g.rows || d.rows != H || d.cols != g.rows)
      fail("moe_mlp_add: expert ", e, " is gate [", g.rows, " x ", g.cols, "], up [", u.rows, " x ",
           u.cols, "], down [", d.rows, " x ", d.cols, "] for hidden size ", H);
  }
  const bool shared = w.shared_gate_proj.rows > 0;  // else no shared expert
  const bool gated = w.shared_gate.rows > 0;        // else the shared expert is added as it is
  if (shared &&
      ((gated && (w.shared_gate.rows != 1 || w.shared_gate.cols != H)) ||
       w.shared_gate_proj.cols != H || w.shared_up_proj.rows != w.shared_gate_proj.rows ||
       w.shared_down_proj.rows != H || w.shared_down_proj.cols != w.shared_gate_proj.rows))
    fail("moe_mlp_add: the shared expert's shapes do not fit hidden size ", H);
  if (w.routing == MoeRouting::NoauxTc) {
    if (w.score_bias.dtype != DType::F32 || w.score_bias.rows * w.score_bias.cols != E)
      fail("moe_mlp_add: noaux_tc routing needs an F32 correction bias of ", E, " values, got ",
           w.score_bias.rows * w.score_bias.cols, " ", dtype_name(w.score_bias.dtype));
    if (w.n_group < 1 || E % w.n_group != 0 || w.topk_group < 1 || w.topk_group > w.n_group)
      fail("moe_mlp_add: ", E, " experts in ", w.n_group, " groups, top ", w.topk_group);
  }
  if (norm && norm->norm.w.rows * norm->norm.w.cols != H)
    fail("moe_mlp_add: the input norm has ", norm->norm.w.rows * norm->norm.w.cols,
         " weights for hidden size ", H);
  if (norm && (!norm->normed || norm->normed == x || norm->normed == y))
    fail("moe_mlp_add: the normalised rows need their own buffer");
  if (x == y && !norm) fail("moe_mlp_add: y must not alias x");
#ifdef TANDEM_HAVE_CUDA
  if (g_backend == Backend::Cuda) {
    const int64_t I = w.gate.front().rows;
    if (w.experts_gate_up.rows != 2 * I * E || w.experts_gate_up.cols != H ||
        w.experts_down.rows != H * E || w.experts_down.cols != I)
      fail("moe_mlp_add: the CUDA backend needs the experts stacked (stack_moe_experts): gate/up [",
           w.experts_gate_up.rows, " x ", w.experts_gate_up.cols, "], down [", w.experts_down.rows,
           " x ", w.experts_down.cols, "] for ", E, " experts of [", I, " x ", H, "]");
    return cuda::moe_mlp_add(x, T, w, y, routed_ids, routed_weights, norm);
  }
#endif
  if (norm) {
    const RowNorm& n = norm->norm;
    rms_norm(x, T, H, n.w, n.zero_centred, n.eps, norm->normed);
    x = norm->normed;
  }
  cpu::moe_mlp_add(x, T, w, y, routed_ids, routed_weights);
}
void embed_rows(const WeightRef& table, const int32_t* ids, int64_t n, float* out) {
  TANDEM_DISPATCH(embed_rows(table, ids, n, out));
}

void embed_rows_selected(const WeightRef& table, const int32_t* ids, const int32_t* source,
                         const int32_t* from, int64_t n, float* out) {
  TANDEM_DISPATCH(embed_rows_selected(table, ids, source, from, n, out));
}
void rms_norm(const float* x, int64_t m, int64_t d, const WeightRef& w, bool zero_centred,
              float eps, float* y) {
  TANDEM_DISPATCH(rms_norm(x, m, d, w, zero_centred, eps, y));
}
void rms_norm_pair(const float* a, const float* b, int64_t m, int64_t d, const WeightRef& wa,
                   const WeightRef& wb, bool zero_centred, float eps, float* y) {
  if (m > 0 && d > 0 && (y == a || y == b))
    fail("rms_norm_pair: the output must not alias an input");
  TANDEM_DISPATCH(rms_norm_pair(a, b, m, d, wa, wb, zero_centred, eps, y));
}
void rms_norm_pair_embedded(const WeightRef& table, const int32_t* ids, const float* b, int64_t m,
                            const WeightRef& wa, const WeightRef& wb, bool zero_centred, float eps,
                            float* y) {
  if (m > 0 && table.cols > 0 && y == b)
    fail("rms_norm_pair_embedded: the output must not alias an input");
  TANDEM_DISPATCH(rms_norm_pair_embedded(table, ids, b, m, wa, wb, zero_centred, eps, y));
}
void add_rms_norm(float* x, const float* r, int64_t m, int64_t d, const WeightRef& w,
                  bool zero_centred, float eps, float* y) {
  if (y == x) fail("add_rms_norm: the output must not alias the residual stream x");
#ifdef TANDEM_HAVE_CUDA
  if (g_backend == Backend::Cuda) return cuda::add_rms_norm(x, r, m, d, w, zero_centred, eps, y);
#endif
  cpu::add_inplace(x, r, m * d);
  cpu::rms_norm(x, m, d, w, zero_centred, eps, y);
}
void gated_rms_norm(const float* x, const float* z, int64_t m, int64_t d, const WeightRef& w,
                    float eps, float* y) {
  TANDEM_DISPATCH(gated_rms_norm(x, z, m, d, w, eps, y));
}
void swiglu(const float* gate, const float* up, int64_t n, float* out) {
  TANDEM_DISPATCH(swiglu(gate, up, n, out));
}
void sigmoid_gate(float* x, const float* gate, int64_t n) {
  TANDEM_DISPATCH(sigmoid_gate(x, gate, n));
}
void add_inplace(float* x, const float* y, int64_t n) {
  TANDEM_DISPATCH(add_inplace(x, y, n));
}
void rope(float* x, int64_t n_tokens, int64_t n_heads, int64_t head_dim, int64_t rotary_dim,
          const int64_t* positions, const float* inv_freq) {
  TANDEM_DISPATCH(rope(x, n_tokens, n_heads, head_dim, rotary_dim, positions, inv_freq));
}
void qk_norm_rope(const QkNormRope& s, const float* qg, const WeightRef& q_norm,
                  const WeightRef& k_norm, const int64_t* positions, const float* inv_freq,
                  float* q, float* gate, float* k) {
  if (s.n_tokens < 0 || s.n_heads < 0 || s.n_kv_heads < 0 || s.head_dim < 1 || s.rotary_dim < 0 ||
      s.rotary_dim % 2 != 0 || s.rotary_dim > s.head_dim)
    fail("qk_norm_rope: bad shape: ", s.n_tokens, " tokens, ", s.n_heads, "/", s.n_kv_heads,
         " heads of ", s.head_dim, ", rotary_dim ", s.rotary_dim);
  if (s.kv) {
    if (!s.kv_slots || !s.v) fail("qk_norm_rope: a KV target needs the slots and the value rows");
    if (s.kv->pool == nullptr || s.kv->block_size < 1 || s.kv->n_kv_heads != s.n_kv_heads ||
        s.kv->head_dim != s.head_dim)
      fail("qk_norm_rope: the KV target holds ", s.kv->n_kv_heads, " heads of ", s.kv->head_dim,
           " (block size ", s.kv->block_size, "), the keys ", s.n_kv_heads, " heads of ",
           s.head_dim);
    check_kv_dtype(s.kv->dtype, "qk_norm_rope");
  }
#ifdef TANDEM_HAVE_CUDA
  if (g_backend == Backend::Cuda)
    return cuda::qk_norm_rope(s, qg, q_norm, k_norm, positions, inv_freq, q, gate, k);
#endif
  const int64_t T = s.n_tokens, nh = s.n_heads, nkv = s.n_kv_heads, hd = s.head_dim;
  copy_rows(q, hd, qg, 2 * hd, T * nh, hd);
  copy_rows(gate, hd, qg + hd, 2 * hd, T * nh, hd);
  cpu::rms_norm(q, T * nh, hd, q_norm, s.zero_centred, s.eps, q);
  cpu::rms_norm(k, T * nkv, hd, k_norm, s.zero_centred, s.eps, k);
  cpu::rope(q, T, nh, hd, s.rotary_dim, positions, inv_freq);
  cpu::rope(k, T, nkv, hd, s.rotary_dim, positions, inv_freq);
  if (s.kv) cpu::kv_write_slots(*s.kv, s.kv_slots, T, k, s.v);
}
void check_kv_dtype(DType dtype, const char* what) {
  if (dtype != DType::F32 && dtype != DType::BF16)
    fail(what, ": KV storage must be f32 or bf16, got ", dtype_name(dtype));
}
void kv_write(const KVLayerView& kv, const int32_t* block_table, const int64_t* positions,
              int64_t n, const float* k, const float* v) {
  TANDEM_DISPATCH(kv_write(kv, block_table, positions, n, k, v));
}
void kv_write_stored(const KVLayerView& kv, const int32_t* block_table, const int64_t* positions,
                     int64_t n, const void* k, const void* v) {
  TANDEM_DISPATCH(kv_write_stored(kv, block_table, positions, n, k, v));
}
void attention(const KVLayerView& kv, const int32_t* block_table, const int64_t* positions,
               int64_t n, int64_t position_bound, const float* q, int64_t n_heads, float scale,
               float* out, const float* gate) {
#ifdef TANDEM_HAVE_CUDA
  if (g_backend == Backend::Cuda)
    return cuda::attention(kv, block_table, positions, n, position_bound, q, n_heads, scale, out,
                           gate);
#endif
  cpu::attention(kv, block_table, positions, n, position_bound, q, n_heads, scale, out);
  if (gate) cpu::sigmoid_gate(out, gate, n * n_heads * kv.head_dim);
}
void attention_rows(const KVLayerView& kv, const int32_t* tables, int64_t table_stride,
                    const int64_t* query_rows, const int64_t* positions, int64_t n,
                    int64_t position_bound, int64_t window, const float* q, int64_t n_heads,
                    float scale, float* out, const float* gate) {
#ifdef TANDEM_HAVE_CUDA
  if (g_backend == Backend::Cuda)
    return cuda::attention_rows(kv, tables, table_stride, query_rows, positions, n, position_bound,
                                window, q, n_heads, scale, out, gate);
#endif
  if (window < 1) fail("attention_rows: window ", window, " is not a query count >= 1");
  // Runs of consecutive queries of one row, each one attention() call.
  const int64_t qf = n_heads * kv.head_dim;
  for (int64_t t0 = 0; t0 < n;) {
    int64_t t1 = t0 + 1;
    while (t1 < n && query_rows[t1] == query_rows[t0]) ++t1;
    if (query_rows[t0] >= 0)
      attention(kv, tables + query_rows[t0] * table_stride, positions + t0, t1 - t0, position_bound,
                q + t0 * qf, n_heads, scale, out + t0 * qf, gate ? gate + t0 * qf : nullptr);
    t0 = t1;
  }
}
void attention_prompt(const KVLayerView& kv, const int32_t* block_table, const int64_t* positions,
                      int64_t n, const float* q, const float* k, const float* v, int64_t n_heads,
                      float scale, float* out) {
#ifdef TANDEM_HAVE_CUDA
  if (g_backend == Backend::Cuda)
    return cuda::attention_prompt(q, k, v, n, n_heads, kv.n_kv_heads, kv.head_dim, scale, out);
#endif
  (void)k;
  (void)v;
  cpu::attention(kv, block_table, positions, n, n, q, n_heads, scale, out);
}
void causal_conv_silu(const float* x, int64_t n, int64_t channels, int64_t kernel,
                      const WeightRef& w, float* state, float* out, float* state_after) {
  TANDEM_DISPATCH(causal_conv_silu(x, n, channels, kernel, w, state, out, state_after));
}
void gated_delta_rule(const float* q, const float* k, const float* v, const float* a,
                      const float* b, const WeightRef& A_log, const WeightRef& dt_bias, int64_t n,
                      const DeltaHeads& h, float* state, float* out, float* state_after) {
  TANDEM_DISPATCH(gated_delta_rule(q, k, v, a, b, A_log, dt_bias, n, h, state, out, state_after));
}
void causal_conv_silu_rows(const float* x, int64_t channels, int64_t kernel, const WeightRef& w,
                           const RecurrentRow* rows, int64_t n_rows, int64_t max_n, float* out) {
  TANDEM_DISPATCH(causal_conv_silu_rows(x, channels, kernel, w, rows, n_rows, max_n, out));
}
void gated_delta_rule_rows(const float* q, const float* k, const float* v, const float* a,
                           const float* b, const WeightRef& A_log, const WeightRef& dt_bias,
                           const RecurrentRow* rows, int64_t n_rows, int64_t max_n,
                           const DeltaHeads& h, float* out) {
  TANDEM_DISPATCH(
      gated_delta_rule_rows(q, k, v, a, b, A_log, dt_bias, rows, n_rows, max_n, h, out));
}
void recurrent_layers_rows(const RecurrentLayers& layers, int64_t channels, int64_t kernel,
                           const RecurrentRow* rows, int64_t n_rows, int64_t max_n,
                           const DeltaHeads& h) {
  if (layers.count < 0) fail("recurrent_layers_rows: negative layer count ", layers.count);
  if (layers.count > 0 && (layers.host == nullptr || layers.device == nullptr))
    fail("recurrent_layers_rows: ", layers.count, " layers but no layer table");
  if (h.qkv_token_stride != channels || channels != 2 * h.n_k_heads * h.dk + h.n_v_heads * h.dv)
    fail("recurrent_layers_rows: the conv's ", channels,
         " channels are not the recurrence's q | k | v rows (", h.n_k_heads, " key heads of ", h.dk,
         ", ", h.n_v_heads, " value heads of ", h.dv, ", token stride ", h.qkv_token_stride, ")");
  TANDEM_DISPATCH(recurrent_layers_rows(layers, channels, kernel, rows, n_rows, max_n, h));
}
void linear_quantized(const float* x, int64_t m, const QuantWeightRef& w, float* y) {
  // The CUDA backend dequantizes drafter weights to bf16 when it places them (WeightArena), so
  // quantized weights only ever reach the CPU kernel.
  if (g_backend != Backend::Cpu)
    fail(
        "linear_quantized: quantized weights run on the CPU backend only (the CUDA backend "
        "dequantizes them at load)");
  cpu::linear_quantized(x, m, w, y);
}

}  // namespace tandem::ops
