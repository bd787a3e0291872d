// The CUDA implementation of the op set (backend/ops.h). Plain C++ declarations: callers never
// see CUDA types, so the CPU-only build and the rest of the engine compile without nvcc.
//
// Conventions (on top of ops.h's):
//  - Every pointer argument is device memory (cudaMalloc), including positions, block tables and
//    inv_freq. Scalars (m, n, start, ...) are host values.
//  - Weights on the device are BF16 for matrices (linear, embedding tables) and F32 for vectors
//    (norm weights, A_log, dt_bias, conv weights). Ops check the dtype they need and throw
//    tandem::Error naming it.
//  - Activations and recurrent state are fp32; linear rounds its input rows to bf16 and multiplies
//    on the tensor cores with fp32 accumulation.
//  - All work is queued on the current context's stream (stream(); backend/context.h); ops never
//    synchronize the host, so a decode step can be captured into a CUDA graph. Only the
//    copy_to_host / synchronize calls block.
//  - Batch invariance (DESIGN.md principle 2): every op computes a row's (token's) result with a
//    reduction order that depends only on that row's data and the weight shape, never on how
//    many rows are in the call. Prompt prefill (set_prefill) takes a second, faster linear path
//    (cuBLAS on row tiles of one fixed size per forward) and a gated delta rule layout suited to
//    long token chains, both batch-invariant among prompt rows; a token's numbers therefore depend
//    on whether it was a prompt token or a decoded/verified one, never on the batch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "tandem/backend/ops.h"

namespace tandem::cuda {

// --- Device and memory -------------------------------------------------------------------------
bool available();           // a CUDA device is present and usable (no throw)
std::string device_name();  // e.g. "NVIDIA H200"; throws if none
void* alloc(size_t bytes);  // cudaMalloc; throws Error("CUDA out of memory ...") with sizes
void free(void* p);         // null is fine; never throws (destructors call it at exit)
void copy_to_device(void* dst, const void* src, size_t bytes);  // host → device, ordered on stream
void copy_to_host(void* dst, const void* src, size_t bytes);    // device → host, waits for it
// Reads the host waits for once (ops::copy_to_host of several, a forward's tokens and hiddens):
// those that fit the calling thread's staging land there through one kernel
// (one launch for tokens and hiddens instead of one each), larger ones by copy-engine transfers.
// Then `then` (may be empty) queues more work behind them, and the host waits for the reads
// alone, not for that work: a host round's commit runs on the device while the host walks.
void copy_reads_to_host(const ops::HostRead* reads, size_t n, const std::function<void()>& then);
// Device → device, async. Up to kKernelDeviceCopyBytes (and not overlapping) a kernel copies,
// larger copies go through the copy engine; TANDEM_CUDA_KERNEL_COPY=0 sends all there.
constexpr size_t kKernelDeviceCopyBytes = size_t{1} << 20;
void copy_on_device(void* dst, const void* src, size_t bytes);
void fill_zero(void* p, size_t bytes);  // async
// Pinned host memory (cudaHostAlloc), what an asynchronous device → host copy lands in without
// blocking the host; free_pinned never throws. copy_to_host_async queues such a copy on the
// stream; an event recorded after it tells the host when it has landed.
void* alloc_pinned(size_t bytes);
void free_pinned(void* p);
void copy_to_host_async(void* dst_pinned, const void* src, size_t bytes);
// The same into memory from alloc_pinned (mapped): up to kKernelReadbackBytes a kernel stores the
// bytes there (no copy-engine transfer between kernels), larger reads as copy_to_host_async.
constexpr size_t kKernelReadbackBytes = size_t{256} << 10;
void copy_to_pinned_async(void* dst_pinned, const void* src, size_t bytes);
// Host → device from memory from alloc_pinned (mapped; StagedUpload), ordered on the stream: up
// to kKernelUploadBytes a kernel loads the bytes from there (unless TANDEM_CUDA_KERNEL_COPY=0),
// larger uploads as copy_to_device.
// The host must not touch src_pinned until an event recorded after the call has completed.
constexpr size_t kKernelUploadBytes = size_t{64} << 10;
void copy_from_pinned_async(void* dst, const void* src_pinned, size_t bytes);
// The same copy beside the work queued so far instead of behind it: on a second stream of the
// context, which the context's stream waits for before anything queued after this call. The
// caller guarantees that nothing queued before it reads or writes dst (StagedUpload::consumed).
void copy_from_pinned_ahead(void* dst, const void* src_pinned, size_t bytes);
// Several such uploads in one kernel (the ones within kKernelUploadBytes; larger ones, or all
// under TANDEM_CUDA_KERNEL_COPY=0, as copy_to_device each): the inputs of one graph together.
struct PinnedCopy {
  void* dst;
  const void* src_pinned;
  size_t bytes;
};
void copy_from_pinned_parts(const PinnedCopy* parts, size_t n);
void* create_event();  // a cudaEvent_t without timing
void destroy_event(void* event);
// The point of the current context's stream an event marks (record_event): the work queued
// before it. wait_event skips the device call for a point the host already waited past.
struct StreamPoint {
  const void* context = nullptr;
  uint64_t seq = 0;
};
StreamPoint record_event(void* event);  // on the stream, after the work queued so far
// Blocks the host until `event`, recorded at `point`, has completed; throws with the first kernel
// error. Returns at once when the host already waited for that point or a later one of the same
// stream (an event wait, synchronize() or copy_reads_to_host()).
void wait_event(void* event, StreamPoint point);
// Whether `event`, recorded at `point`, has completed, without waiting: at once for a point the
// host already waited past, else by asking the device (an event of another context: the same).
bool event_completed(void* event, StreamPoint point);
void synchronize();     // waits for the stream; throws with the first kernel error
double wait_seconds();  // this thread's time blocked in stream and event waits so far
void* stream();         // the current context's cudaStream_t, which every op uses

// Contexts (backend/context.h; context.cuh): ops::Context creates and destroys them and its
// scopes enter and leave them. context_enter makes `context` the thread's current one and
// returns the previous (null: none), switching the device when it differs (the one left is
// stored in *previous_device, else -1); context_leave restores both. Each orders the stream
// entered after the one left. context_leave never throws.
void* context_create(int device);
void context_destroy(void* context);
void* context_default();  // the context ops use outside any scope (never destroyed)
void* context_enter(void* context, int* previous_device);
void context_leave(void* context, void* previous, int previous_device);

// Uploads `n` fp32 values converted to bf16 (round to nearest even).
void upload_bf16(uint16_t* dst, const float* src, int64_t n);
// Fills bf16 [n] with uniform values in [-scale, scale] from a counter-based generator keyed by
// `seed` (the same seed gives the same weights on any device). For random-weight benchmarks.
void fill_random_bf16(uint16_t* dst, int64_t n, uint64_t seed, float scale);
// Fills fp32 [n] with offset + uniform [-scale, scale].
void fill_random_f32(float* dst, int64_t n, uint64_t seed, float offset, float scale);

// Device-to-device copy bandwidth in bytes/s (bytes read + bytes written over time), median of
// several copies of `bytes` (default 2 GiB). The roofline denominator.
double copy_bandwidth(size_t bytes = size_t(2) << 30);

// Programmatic dependent launch between consecutive kernels (check.cuh): off unless the
// environment sets TANDEM_CUDA_PDL=1. Changes no number, only how kernel boundaries overlap.
bool pdl_enabled();
void set_pdl_enabled(bool on);

// --- CUDA graphs (backend/graph_cache.h) --------------------------------------------------------
// Captures the work `body` queues on stream() into an executable graph (returned as void*).
void* graph_capture(const std::function<void()>& body);
void graph_launch(void* exec);
void graph_destroy(void* exec);
// The current context's count of internal scratch reallocations (an address changed): graph keys
// include it, so no graph replays a freed scratch address.
uint64_t scratch_generation();
void bump_scratch_generation();

// --- Ops (signatures and semantics as in backend/ops.h) --------------------------------------
// Prompt-prefill mode for linear and the gated delta rule (see header comment), with the rows of
// every prefill GEMM tile (ops::set_prefill checks them). Set by the model per forward; default
// off.
void set_prefill(bool on, int64_t gemm_rows = ops::kDefaultPrefillGemmRows);
bool prefill_mode();
int64_t prefill_rows();  // the prefill GEMM tile; 0 outside prefill mode

// linear_split of norm(x) that also writes the normalised rows, rms_norm's output, to normed
// [m, K] for later kernels (a mixture's router and its experts): at one row the product's first
// block writes them as it folds the norm, else an rms_norm kernel first. Same values either way.
void linear_split_keeping_norm(const float* x, int64_t m, const ops::WeightRef& w,
                               const ops::OutputSlice* slices, int n_slices,
                               const ops::RowNorm& norm, float* normed);
void linear(const float* x, int64_t m, const ops::WeightRef& w, float* y);
// linear for fp8 e4m3 weights with block scales (linear_fp8.cu); linear() and linear_add() route
// fp8 here. Decode and verify: weights decoded exactly and scaled as the CPU does, fp32
// activations and sums, batch-invariant. Prompt prefill: on the FP8 tensor cores (cuBLASLt with
// the weight's 128 x 128 block scales), the input rows quantised to e4m3 per token and 128
// columns as the checkpoint's dynamic activation scheme does; shapes cuBLASLt cannot take (or
// TANDEM_CUDA_FP8_PREFILL=bf16) dequantise the weight to bf16 for the bf16 prefill product.
void linear_fp8(const float* x, int64_t m, const ops::WeightRef& w, float* y,
                bool accumulate = false);
// The bf16 prefill product of fp32 rows (in prompt-prefill mode; linear.cu): what linear does
// for a bf16 weight in that mode, for weights made bf16 on the fly.
void linear_prefill_bf16(const float* x, int64_t m, const ops::WeightRef& w, float* y,
                         bool accumulate);
// Which route linear_fp8 takes in prompt prefill (at the current prefill tile) for this weight:
// "fp8 tensor cores" (cuBLASLt; ", bf16 outputs" where it offers no fp32 ones), or "bf16 (why
// not)". Asked of cuBLASLt once per shape and kept.
std::string fp8_prefill_route(const ops::WeightRef& w);
// ops::dsa_select (dsa.cu).
void dsa_select(const float* q, const float* w, int64_t n, int64_t heads, int64_t D,
                const float* keys, int64_t ctx, const int64_t* pos, int64_t topk, int32_t* out);
// ops::mla_attention (mla.cu): both orders evaluated in the absorbed one.
void mla_attention(const float* q_nope, const float* q_pe, int64_t n, int64_t H, int64_t dn,
                   int64_t dr, int64_t dv, const float* latent, int64_t ctx, int64_t R,
                   const ops::WeightRef& kv_b, const int64_t* pos, const int32_t* allowed,
                   int64_t topk, float scale, bool absorbed, float* out);
// norm (optional): decode-shaped calls (m <= 4, K a multiple of 16) normalise the rows while
// staging them, in rms_norm's order; every other call runs rms_norm into a scratch buffer first.
// conv (optional): decode steps (as many rows as tokens, at most one token a row) run it in the
// product's epilogue (conv_channel.cuh's ConvFold), other calls as causal_conv_silu_rows after it.
void linear_split(const float* x, int64_t m, const ops::WeightRef& w,
                  const ops::OutputSlice* slices, int n_slices, const ops::RowNorm* norm = nullptr,
                  const ops::WeightRef* prefetch = nullptr, const ops::SliceConv* conv = nullptr);
// The accumulation happens in the epilogue (prompt prefill: cuBLAS, then add_inplace). norm:
// gated_rms_norm_bf16 first, whose rows the product reads without staging them.
void linear_add(const float* x, int64_t m, const ops::WeightRef& w, float* y,
                const ops::GatedNorm* norm = nullptr, const ops::WeightRef* prefetch = nullptr);
void gate_up_swiglu(const float* x, int64_t m, const ops::WeightRef& gate_up, float* act,
                    const ops::RowNorm* norm = nullptr);
// On the decode paths the [m, I] activations reach the down projection in bf16.
void swiglu_mlp_add(const float* x, int64_t m, const ops::WeightRef& gate_up,
                    const ops::WeightRef& down, float* y, const ops::RowNorm* norm = nullptr,
                    const ops::WeightRef* prefetch = nullptr);
// y[rows, N] = the rows of x [rows, K] grouped by expert, each group times its expert's weight:
// group g (g < groups) is rows start[g] .. start[g + 1] with expert expert[g] of the `experts`
// weights stacked in `stacked` [experts · N, K] (bf16), or opt.extra_expert where expert[g] is
// `experts`. start [groups + 1] and expert [groups]
// are device arrays (written by an earlier kernel); groups beyond the used ones have no rows.
// max_rows bounds every group's rows; each row's value is the one cuda::linear of its expert's
// weight gives it, whatever its group's size (batch invariance).
struct GroupedOptions {
  // Input row r is row gather[r] of x (a device array), instead of row r.
  const int32_t* gather = nullptr;
  // Each expert's N rows are gate (first N / 2) then up, as transformers stacks gate_up_proj; y
  // is [rows, N / 2] = silu(gate) · up, bitwise the product followed by swiglu.
  bool swiglu = false;
  // The weight of expert id `experts` (one past the stack), shaped as one stacked expert (bf16):
  // a mixture's shared expert runs as one more group of the same launch. Groups of at most 32
  // rows (max_rows).
  const ops::WeightRef* extra_expert = nullptr;
};
void linear_grouped(const float* x, int64_t rows, int64_t max_rows, const ops::WeightRef& stacked,
                    int64_t experts, int64_t groups, const int32_t* expert, const int32_t* start,
                    float* y, const GroupedOptions& opt = {});
// linear_grouped of fp8 stacked experts (linear_fp8.cu), each expert's rows a whole number of
// scale blocks: decode and verify stream the codes as linear_fp8 does (a row's value is
// linear_fp8's for that expert and row alone); prompt prefill dequantises the stack to bf16 and
// takes the bf16 grouped product.
void linear_grouped_fp8(const float* x, int64_t rows, int64_t max_rows,
                        const ops::WeightRef& stacked, int64_t experts, int64_t groups,
                        const int32_t* expert, const int32_t* start, float* y,
                        const GroupedOptions& opt);
// ops::moe_mlp_add on the device (moe.cu); w.experts_gate_up / experts_down must be set.
void moe_mlp_add(const float* x, int64_t T, const ops::MoeWeights& w, float* y,
                 std::vector<int32_t>* routed_ids, std::vector<float>* routed_weights,
                 const ops::MoeInputNorm* norm);
void embed_rows(const ops::WeightRef& table, const int32_t* ids, int64_t n, float* out);
void embed_rows_selected(const ops::WeightRef& table, const int32_t* ids, const int32_t* source,
                         const int32_t* from, int64_t n, float* out);
void rms_norm(const float* x, int64_t m, int64_t d, const ops::WeightRef& w, bool zero_centred,
              float eps, float* y);
// rms_norm's values rounded to bf16 (nearest even): the input rows of a linear, normalised and
// rounded in one pass (y: [m, d] bf16).
void rms_norm_bf16(const float* x, int64_t m, int64_t d, const ops::WeightRef& w, bool zero_centred,
                   float eps, uint16_t* y);
void rms_norm_pair(const float* a, const float* b, int64_t m, int64_t d, const ops::WeightRef& wa,
                   const ops::WeightRef& wb, bool zero_centred, float eps, float* y);
void rms_norm_pair_embedded(const ops::WeightRef& table, const int32_t* ids, const float* b,
                            int64_t m, const ops::WeightRef& wa, const ops::WeightRef& wb,
                            bool zero_centred, float eps, float* y);
void add_rms_norm(float* x, const float* r, int64_t m, int64_t d, const ops::WeightRef& w,
                  bool zero_centred, float eps, float* y);
// gated_rms_norm's values rounded to bf16 (y: [m, d] bf16).
void gated_rms_norm_bf16(const float* x, const float* z, int64_t m, int64_t d,
                         const ops::WeightRef& w, float eps, uint16_t* y);
void gated_rms_norm(const float* x, const float* z, int64_t m, int64_t d, const ops::WeightRef& w,
                    float eps, float* y);
void swiglu(const float* gate, const float* up, int64_t n, float* out);
void sigmoid_gate(float* x, const float* gate, int64_t n);
void add_inplace(float* x, const float* y, int64_t n);
void rope_slice(float* x, int64_t n_tokens, int64_t n_heads, int64_t head_stride, int64_t offset,
                int64_t dim, const int64_t* positions, const float* inv_freq, bool interleaved);
void layer_norm(const float* x, int64_t m, int64_t d, const ops::WeightRef& w,
                const ops::WeightRef& b, float eps, float* y);
void scale(float* x, int64_t n, float s);
void rope(float* x, int64_t n_tokens, int64_t n_heads, int64_t head_dim, int64_t rotary_dim,
          const int64_t* positions, const float* inv_freq);
void qk_norm_rope(const ops::QkNormRope& s, const float* qg, const ops::WeightRef& q_norm,
                  const ops::WeightRef& k_norm, const int64_t* positions, const float* inv_freq,
                  float* q, float* gate, float* k);
void kv_write(const ops::KVLayerView& kv, const int32_t* block_table, const int64_t* positions,
              int64_t n, const float* k, const float* v);
void kv_write_stored(const ops::KVLayerView& kv, const int32_t* block_table,
                     const int64_t* positions, int64_t n, const void* k, const void* v);
void attention(const ops::KVLayerView& kv, const int32_t* block_table, const int64_t* positions,
               int64_t n, int64_t position_bound, const float* q, int64_t n_heads, float scale,
               float* out, const float* gate = nullptr);
void attention_rows(const ops::KVLayerView& kv, const int32_t* tables, int64_t table_stride,
                    const int64_t* query_rows, const int64_t* positions, int64_t n,
                    int64_t position_bound, int64_t window, const float* q, int64_t n_heads,
                    float scale, float* out, const float* gate);
// The most consecutive queries of one row an attention block serves: 0 decides by the grid (the
// default, or TANDEM_CUDA_ATTENTION_RUN=1|2|4 at start-up); 1, 2 or 4 fixes it whatever the grid.
// No value changes a bit (tests and A/B timing).
void set_attention_runs(int most);
void causal_conv_silu(const float* x, int64_t n, int64_t channels, int64_t kernel,
                      const ops::WeightRef& w, float* state, float* out, float* state_after);
void gated_delta_rule(const float* q, const float* k, const float* v, const float* a,
                      const float* b, const ops::WeightRef& A_log, const ops::WeightRef& dt_bias,
                      int64_t n, const ops::DeltaHeads& h, float* state, float* out,
                      float* state_after);
// rows: n_rows descriptors in device memory, read by the kernels (a captured graph replays with
// whatever they hold then). Each row's bits equal the single-row op's on that row.
void causal_conv_silu_rows(const float* x, int64_t channels, int64_t kernel,
                           const ops::WeightRef& w, const ops::RecurrentRow* rows, int64_t n_rows,
                           int64_t max_n, float* out);
void recurrent_layers_rows(const ops::RecurrentLayers& layers, int64_t channels, int64_t kernel,
                           const ops::RecurrentRow* rows, int64_t n_rows, int64_t max_n,
                           const ops::DeltaHeads& h);
void gated_delta_rule_rows(const float* q, const float* k, const float* v, const float* a,
                           const float* b, const ops::WeightRef& A_log,
                           const ops::WeightRef& dt_bias, const ops::RecurrentRow* rows,
                           int64_t n_rows, int64_t max_n, const ops::DeltaHeads& h, float* out);
// Column tiles per block of gated_delta_rule_rows' short-row kernel (rows of at most 8 tokens):
// 0 picks by the batch (the default, or TANDEM_CUDA_DELTA_TILES=1|2|4 at start-up); 1, 2 or 4
// fixes it where the shape allows. No value changes a bit (tests and A/B timing).
void set_short_delta_tiles(int tiles);
// Strided copy of `rows` rows of `cols` floats: dst[r*dst_stride + c] = src[r*src_stride + c].
void copy_rows(float* dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows,
               int64_t cols);
// ops::copy_blocks (n, block_floats > 0).
void copy_blocks(float* dst, const float* src, const int32_t* moves, int64_t n,
                 int64_t block_floats);
// out[r] = the lowest index of the maximum of logits[r, :V] ignoring -inf; -1 when the row holds a
// NaN or +inf or only -inf (the caller reports it).
void argmax_rows(const float* logits, int64_t rows, int64_t V, int32_t* out);
// ops::sample_rows: each row spread over up to 64 blocks, the host sampler's token bit for bit
// (sampling.cu).
void sample_rows(const float* logits, int64_t rows, int64_t V, const ops::SampleRow* params,
                 int32_t* out);
// ops' verify-window bookkeeping (windows.cu): one thread per row or token.
void accept_windows(const int32_t* verified, const int32_t* ids, const int32_t* source,
                    const int32_t* from, const int32_t* bounds, const int32_t* limits,
                    int64_t n_rows, int32_t* accepted, int32_t* next);
void settle_windows(const int32_t* accepted, const ops::SettledRow* rows, int64_t n_rows,
                    int64_t* shift, ops::RecurrentRow* replay, int64_t layers);
void shift_positions(const ops::PositionShift& s, int64_t* positions, int64_t* kv_slots);
void gather_window_rows(const float* src, int64_t width, int64_t row_stride, int64_t at,
                        const int32_t* offsets, int64_t n, float* dst);
void ngram_lookup(const ops::TokenHistories& h, int min_n, int max_n, int depth, int32_t* ids,
                  int32_t* counts);
void history_append(const ops::TokenHistories& h, const int32_t* ids, int depth,
                    const int32_t* accepted, const int32_t* next);

#if TANDEM_CUDA_TRACE
// --- Kernel timeline (diagnostic builds: cmake -DTANDEM_CUDA_TRACE=ON; backend/cuda/trace.cuh) ---
// One mark per kernel: when its first block passed pdl_wait(), and its launch shape.
struct KernelMark {
  const char* unit;  // the .cu file that holds the kernel ("linear", "recurrent", ...)
  uint64_t ns;       // global timer
  unsigned grid[3];
  unsigned block;
  // Unit "launch" (a graph launch, no kernel): the host's steady_clock when it was queued; else 0.
  uint64_t host_ns;
};
// Every mark since the last clear, in time order; synchronizes. Throws if any unit's buffer
// overflowed, naming how many marks were dropped.
std::vector<KernelMark> kernel_marks();
void clear_kernel_marks();  // synchronizes
#endif

}  // namespace tandem::cuda
