// The op set models are written against. Each op is one coarse step (one fused kernel on a GPU):
// a decode step is a fixed sequence of these calls, with no graph and no allocation.
//
// Conventions shared by every op:
//  - Activations are fp32, row-major, contiguous: `x[m, k]` means m rows of k floats.
//  - Weights are `WeightRef`s into stored (often memory-mapped) tensors: fp32, bf16 or f16,
//    row-major [out_features, in_features] exactly as safetensors stores a Linear.
//  - Compute and accumulation are fp32. Every op computes a row's result with a reduction order
//    that does not depend on how many rows are in the call (batch invariance, DESIGN.md §1.2):
//    a token's numbers are the same alone, in a verify window, or next to other requests.
//  - Ops parallelise internally (the CPU thread pool of backend/cpu/thread_pool.h, CUDA blocks)
//    over independent outputs, never over a reduction, so no number depends on the thread count.
//  - Every pointer (activations, weights, states, positions, block tables) lives in the memory
//    of the active backend: host memory on the CPU, device memory on CUDA. Buffers
//    (backend/buffer.h) and WeightArena (backend/weight_arena.h) allocate in the right place.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/core/dtype.h"
#include "tandem/core/tensor.h"

namespace tandem {
struct SamplingParams;  // core/sampler.h (not included: CUDA sources compile as C++17)
}  // namespace tandem

namespace tandem::ops {

// The block scales of an fp8 e4m3 weight (GLM-5 / DeepSeek-V3's published "weight_scale_inv"):
// weight[r][c] = e4m3(code[r][c]) · scale_inv[r / block_rows][c / block_cols], scale_inv
// row-major [ceil(rows / block_rows), ceil(cols / block_cols)] of F32 or BF16 (the last blocks of
// a row or column may be partial). Loaders check the scale tensor's shape against the weight's.
struct BlockScales {
  const void* data = nullptr;
  DType dtype = DType::F32;
  int64_t block_rows = 0;
  int64_t block_cols = 0;
};

// A borrowed 1-D or 2-D weight: `rows` x `cols`, row-major, any float storage dtype, or fp8 e4m3
// codes with their block scales (F8_E4M3: `scales` set; CUDA takes them in ops::linear,
// linear_add and a mixture's stacked experts).
// `data` may be unaligned (safetensors does not align tensor data).
struct WeightRef {
  DType dtype = DType::F32;
  const void* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  BlockScales scales;  // F8_E4M3 only
  uint64_t bytes() const { return static_cast<uint64_t>(rows * cols) * dtype_size(dtype); }
};
WeightRef weight_ref(const TensorView& t);  // 1-D tensors become rows = 1

// The backend every op runs on and every Buffer allocates from. Chosen once, before any model is
// loaded; process-wide (a setting, not a resource: the streams, handles and scratch ops use
// belong to the current backend context, backend/context.h). Cuda requires a build with the
// CUDA backend and a visible device.
enum class Backend { Cpu, Cuda };
void set_backend(Backend b);  // throws Error if the backend is not usable here
Backend backend();
std::string_view backend_name(Backend b);
bool cuda_compiled();
bool cuda_available();  // compiled and a device is present
// "cpu", "cuda" or "auto" (cuda when available, else cpu). Throws Error on other names or when
// "cuda" is asked for and unusable.
Backend parse_backend(std::string_view name);

// Prompt-prefill mode of the current context (backend/context.h; set by a model for a forward of
// prompt tokens): on CUDA, linear uses a faster tensor-core GEMM path with its own (still
// batch-invariant) reduction order: one cuBLASLt product per projection over all of the call's
// rows, with the algorithm tuned for products of gemm_rows rows (a multiple of 16,
// 16..kMaxPrefillGemmRows) and kept per weight shape, so a prompt token's numbers depend on
// gemm_rows and on nothing else in the call. Engines derive gemm_rows from their prefill chunk
// (prefill_gemm_rows), so a small chunk runs an algorithm suited to it.
// Decode and verify forwards never set it. No effect on the CPU backend, whose linear is the same
// at every m.
inline constexpr int64_t kMaxPrefillGemmRows = 4096;
// The tile of the engines' default prefill chunk (256 tokens), for forwards that name none.
inline constexpr int64_t kDefaultPrefillGemmRows = 256;
void set_prefill(bool on, int64_t gemm_rows = kDefaultPrefillGemmRows);
// RAII: set_prefill(on, gemm_rows) for a scope (a prompt forward's layers), turned off at its
// end, also when the forward throws.
class PrefillScope {
 public:
  PrefillScope(bool on, int64_t gemm_rows) { set_prefill(on, gemm_rows); }
  ~PrefillScope() { set_prefill(false); }
  PrefillScope(const PrefillScope&) = delete;
  PrefillScope& operator=(const PrefillScope&) = delete;
};
// The prefill GEMM tile for prompts prefilled `chunk` tokens at a time (chunk >= 1): the chunk
// rounded up to a multiple of 16, at most kMaxPrefillGemmRows.
int64_t prefill_gemm_rows(int64_t chunk);
// Whether a prompt forward gives every token the same bits as decoding it one at a time, however
// the prompt is chunked (the CPU: its kernels are the same at every m). Then any prefix's state is
// what a cold prefill of a longer prompt reaches there, wherever it came from; otherwise (CUDA's
// tensor-core prompt GEMMs and attention) only states at the fixed chunk boundaries of a prompt
// prefill are (the prefix cache saves boundaries accordingly).
bool prefill_matches_decode();

// Memory of the active backend (host on CPU). Copies are ordered with the ops; to_host waits.
void* mem_alloc(Backend where, size_t bytes);
void mem_free(Backend where, void* p);
void copy(void* dst, const void* src, size_t bytes);  // same backend
void copy_from_host(void* dst, const void* src_host, size_t bytes);
void copy_to_host(void* dst_host, const void* src, size_t bytes);
// Several reads that the host waits for once: a forward's tokens and hiddens together. On CUDA one
// copy_to_host each would block once each, and every block costs a wake-up after the device's
// last kernel. Reads of zero bytes are skipped.
struct HostRead {
  void* dst_host;
  const void* src;
  size_t bytes;
};
void copy_to_host(const HostRead* reads, size_t n);  // (a pointer: CUDA sources are C++17)
// The same, and `then` queues more work behind the reads before the host waits for them alone
// (on the CPU it runs after the copies): a verify's commit the device runs while the host walks.
void copy_to_host(const HostRead* reads, size_t n, const std::function<void()>& then);
void fill_zero(void* dst, size_t bytes);
// dst[r * dst_stride + c] = src[r * src_stride + c] for r < rows, c < cols (floats).
void copy_rows(float* dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows,
               int64_t cols);
// Block moves in one launch: for i < n, block moves[n + i] of dst (floats from
// moves[n + i] · block_floats on) becomes block moves[i] of src. moves [2n]: the source blocks,
// then the destination blocks, backend memory. The blocks one call writes must not overlap the
// blocks it reads.
void copy_blocks(float* dst, const float* src, const int32_t* moves, int64_t n,
                 int64_t block_floats);
void synchronize();  // waits for queued work (no-op on CPU)
// Seconds the calling thread has spent blocked on the device so far (stream and event waits,
// synchronous reads; 0 on the CPU, where nothing is queued). A loop's time minus its growth is
// what the host itself spent: where that exceeds the device's work, the device waited for it.
double device_wait_seconds();
// CUDA graph replay of repeated forwards (GraphCache). On by default; TANDEM_CUDA_GRAPHS=0 in the
// environment turns it off (for A/B timing and debugging).
bool graphs_enabled();
void set_graphs_enabled(bool on);
// out[r] = greedy token of logits row r (lowest index among the maxima, -inf ignored); all in
// backend memory. Throws Error naming the row if it holds NaN or +inf or only -inf (checked
// when the result is read; on CUDA the kernel writes -1 and copy-out reports it).
void argmax_rows(const float* logits, int64_t rows, int64_t V, int32_t* out);
// One logits row's draw for sample_rows: the request's sampling parameters (core/sampler.h) and
// the absolute output index whose key the draw uses. Plain data, kept in backend memory.
struct SampleRow {
  float temperature = 0.0f;
  int32_t top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  uint64_t seed = 0;
  uint64_t index = 0;
};
SampleRow sample_row(const SamplingParams& p, uint64_t index);
SamplingParams sampling_of(const SampleRow& r);  // the parameters back (without the index)
// out[r] = sample_token(logits row r, params[r], params[r].index) (core/sampler.h): the same
// token on every backend, bit for bit (integer weights, core/sample_weights.h); temperature 0
// gives argmax_rows' token. logits, params and out are backend memory. -1 where a row holds NaN
// or +inf or only -inf, or its parameters are invalid (the caller reports it, as for argmax_rows).
// Throws Error for V outside 1..kMaxSampleVocab.
void sample_rows(const float* logits, int64_t rows, int64_t V, const SampleRow* params,
                 int32_t* out);

// --- Verify windows settled where the tokens are (a round without a host round trip) ---------
// The accept walk of match verification over every row of a verify forward. Row r's window is
// tokens bounds[r] .. bounds[r+1]-1 of the forward: token t is source[from[t]] where from is
// given and from[t] >= 0, else ids[t] (ForwardRequest::draft_from); verified[t] is the target's
// token after window position t (its argmax or draw). accepted[r] = the longest j such that
// window token i+1 equals verified[first + i] for every i < j; next[r] = verified[first +
// accepted[r]], the correction or bonus token. A one-token row accepts 0. Where limits is given,
// row r accepts at most limits[r] proposals (a drafter that found fewer than its window holds
// pads the rest). All arrays are backend memory; bounds has n_rows + 1 entries.
void accept_windows(const int32_t* verified, const int32_t* ids, const int32_t* source,
                    const int32_t* from, const int32_t* bounds, const int32_t* limits,
                    int64_t n_rows, int32_t* accepted, int32_t* next);
struct RecurrentRow;  // below, with the recurrences
// One row of a commit settled on the device: its state slot and its row in the forward (the
// index of its accept_windows result).
struct SettledRow {
  int32_t slot = 0;
  int32_t row = 0;
};
// The commit of windows whose kept counts are on the device: row i keeps 1 + a tokens of its
// window, a = accepted[rows[i].row]. shift[rows[i].slot] += a (per slot, the tokens its settled
// commits kept past their windows' first), and where replay is given, replay[l·n_rows + i].n = a
// for every l < layers (the Replay rollback's descriptors: the kept tokens after the first).
// All arrays are backend memory.
void settle_windows(const int32_t* accepted, const SettledRow* rows, int64_t n_rows, int64_t* shift,
                    RecurrentRow* replay, int64_t layers);
// A forward queued before the host learned what settled commits kept: the host laid its
// positions out without those tokens, so each token of row r moves d_r = shift[row_slot[r]] −
// known[r] places on (known: the part of the slot's shift the host counted). All arrays are
// backend memory.
struct PositionShift {
  const int64_t* shift = nullptr;      // [slots] settle_windows' per-slot totals
  const int32_t* row_slot = nullptr;   // [rows] each row's slot
  const int64_t* known = nullptr;      // [rows]
  const int64_t* token_row = nullptr;  // [tokens] each token's row; tokens of rows < 0 stay
  int64_t tokens = 0, rows = 0;
  // Given: kv_slots[t] becomes the physical slot of the new position in row r's block table
  // (tables + r · table_stride, blocks of block_size positions), as the forward lays it out.
  const int32_t* tables = nullptr;
  int64_t table_stride = 0, block_size = 0;
  // Given: each logits row's draw index moves on with its row (sample_row's output index):
  // logits row k belongs to token k's row when sample_per_token, else to row k.
  SampleRow* sample = nullptr;
  bool sample_per_token = true;
  // Given: each of the first park_tokens tokens whose row has park_unless[r] != park_full moves
  // park_by places further (an MTP commit's completion row, laid out where it belongs when every
  // proposal was accepted, parked past the positions its chain writes where not).
  int64_t park_tokens = 0;
  const int32_t* park_unless = nullptr;
  int64_t park_full = 0, park_by = 0;
};
void shift_positions(const PositionShift& s, int64_t* positions, int64_t* kv_slots);
// dst[i] = src[i · row_stride + at + (offsets ? offsets[i] : 0)], rows of `width` floats: a
// token of each of n equal verify windows (at + accepted[i]: the last accepted one). All arrays
// are backend memory.
void gather_window_rows(const float* src, int64_t width, int64_t row_stride, int64_t at,
                        const int32_t* offsets, int64_t n, float* dst);

// --- Token histories where the tokens are (the n-gram drafter's settled rounds) --------------
// Row r's history is tokens[r · stride, r · stride + lengths[r]): the tokens the target processed,
// then the pending one (spec/token_rows.h). Both arrays are backend memory.
struct TokenHistories {
  int32_t* tokens = nullptr;   // [rows, stride]
  int64_t* lengths = nullptr;  // [rows]
  int64_t stride = 0, rows = 0;
};
// The n-gram drafter's lookup (spec/ngram.h) for every row: for n = max_n down to min_n with
// n < length, the earliest start s < length − n whose n tokens equal the trailing n; the first n
// that has one proposes tokens s + n .. min(s + n + depth, length) − 1. Writes ids[r] = the row's
// pending token (its last), ids[rows + r · depth + j] = proposal j, past counts[r] the pending
// token again (a window's padding is a valid id, never accepted: accept_windows' limits), and
// counts[r] = the proposals found (0 with no match). ids and counts are backend memory.
void ngram_lookup(const TokenHistories& h, int min_n, int max_n, int depth, int32_t* ids,
                  int32_t* counts);
// Each row appends its accepted proposals and then the token now pending: ids[rows + r · depth
// + j] for j < accepted[r], then next[r] (ngram_lookup's layout and accept_windows' results);
// lengths[r] += accepted[r] + 1. The caller keeps length + depth + 1 <= stride; a row without
// that room is left as it was.
void history_append(const TokenHistories& h, const int32_t* ids, int depth, const int32_t* accepted,
                    const int32_t* next);
// The memory roofline's denominator on the active backend, bytes/s: the CPU's measured read
// bandwidth (all threads), or the GPU's device-to-device copy bandwidth (bytes read + written).
double memory_bandwidth();
// A name for reports: "cpu (N threads)" or the GPU's name.
std::string device_description();

// Threads used by every CPU op (the caller and thread_count() - 1 pool workers). 0 = the default:
// TANDEM_THREADS from the environment if set, else every CPU the process may run on. Set it
// before ops run; the pool is rebuilt at the next op when the count changes.
void set_thread_count(int n);
int thread_count();

// y[m, w.rows] = x[m, w.cols] · wᵀ. fp8 weights (F8_E4M3, CPU): each row dequantized exactly into
// fp32, then dotted in the same fixed order (batch invariant).
void linear(const float* x, int64_t m, const WeightRef& w, float* y);

// The DeltaNet's gated per-head norm a projection may apply to its input rows first
// (gated_rms_norm's z, w and eps; heads of w's size): its output projection's input.
struct GatedNorm {
  const float* z = nullptr;  // [m, w.cols of the projection], laid out as x
  WeightRef w;
  float eps = 1e-6f;
  int64_t head_dim() const { return w.rows * w.cols; }
};

// y[m, w.rows] += x[m, w.cols] · wᵀ (a sublayer's output projection adding into the residual
// stream). Every value is the one linear into a temporary followed by add_inplace computes; on
// CUDA the add happens in the projection's epilogue. norm (optional): the product is taken of
// gated_rms_norm(x, z) instead of x, bitwise that op into a temporary first; x is unchanged.
// prefetch (optional): as linear_split's.
void linear_add(const float* x, int64_t m, const WeightRef& w, float* y,
                const GatedNorm* norm = nullptr, const WeightRef* prefetch = nullptr);

// An RMSNorm a projection applies to its input rows first (rms_norm's w, zero_centred, eps): a
// sublayer's input norm folded into its first projection, which on CUDA's decode shapes saves
// the norm's launch.
struct RowNorm {
  WeightRef w;
  bool zero_centred = true;
  float eps = 1e-6f;
};

// The same product with the output columns cut into consecutive slices, each written as its own
// row-major [m, cols] array (a stacked q|k|v weight straight into three buffers). At most 4
// slices; their cols must add up to w.rows. Every value is the one linear computes.
// norm (optional): the product is taken of rms_norm(x) instead of x; every value is the one
// rms_norm into a temporary followed by the product computes. x is left unchanged.
// prefetch (optional): a weight, or its leading rows, that the caller reads soon after this call,
// behind ops that stream little memory (a DeltaNet's recurrence, an attention): on CUDA's decode
// and verify shapes (up to 16 rows) the projection's blocks ask L2 to fetch it as they finish, so
// those bytes stream from HBM while the latency-bound ops run. A hint: no value changes.
// conv (optional): a DeltaNet's conv over the first slice's columns (its q|k|v), into conv->out:
// every value is the one causal_conv_silu_rows on slices[0] after the product computes, and the
// conv states change as that call changes them (on CUDA's decode steps, rows of one token each,
// the projection's kernel runs it after its product: one launch fewer per layer). A bad conv is
// refused before anything is written.
struct OutputSlice {
  float* dst = nullptr;
  int64_t cols = 0;
};
struct SliceConv {
  WeightRef w;  // [channels, kernel] (F32 on CUDA), channels = the first slice's cols, 1..16 taps
  int64_t kernel = 0;
  // As causal_conv_silu_rows' rows, n_rows and max_n; the rows lay the tokens out in order (row
  // r's first_token is the sum of the earlier rows' n), as a forward's descriptors do.
  const RecurrentRow* rows = nullptr;
  int64_t n_rows = 0, max_n = 0;
  float* out = nullptr;  // [m, channels]
};
void linear_split(const float* x, int64_t m, const WeightRef& w, const OutputSlice* slices,
                  int n_slices, const RowNorm* norm = nullptr, const WeightRef* prefetch = nullptr,
                  const SliceConv* conv = nullptr);
// The first `fraction` of w's rows (rounded down), as a weight of its own: a prefetch range.
WeightRef leading_rows(const WeightRef& w, double fraction);

// The SwiGLU MLP's first half in one pass: act[m, I] = silu(x · gateᵀ) · (x · upᵀ), where
// `gate_up` [2I, K] holds the gate and up projections in pairs of 8-row blocks (8 rows of gate,
// the same 8 rows of up, the next 8 of gate, ...; WeightArena::interleave_rows with group 8).
// I must be a multiple of 8. Every value is the one linear (gate and up) followed by swiglu
// computes; the [m, 2I] projection is never written out on CUDA's decode path. norm: as
// linear_split's.
constexpr int64_t kGateUpGroup = 8;
void gate_up_swiglu(const float* x, int64_t m, const WeightRef& gate_up, float* act,
                    const RowNorm* norm = nullptr);

// A sublayer's SwiGLU MLP added into the residual stream:
//   y[m, H] += act · downᵀ,  act = gate_up_swiglu(x, gate_up, norm)   (x [m, H], act [m, I])
// gate_up [2I, H] in gate_up_swiglu's pair layout, down [H, I]. Every value is the one
// gate_up_swiglu into a temporary followed by linear_add computes (on CUDA's decode paths the
// activations pass between the two projections in bf16, the rounding the down projection applies
// to its inputs anyway). y may be x.
// prefetch (optional): as linear_split's, issued by the down projection.
void swiglu_mlp_add(const float* x, int64_t m, const WeightRef& gate_up, const WeightRef& down,
                    float* y, const RowNorm* norm = nullptr, const WeightRef* prefetch = nullptr);

// How a mixture picks a token's experts: Qwen3.5-MoE's softmax top-k (route_top_k), or GLM-5 /
// DeepSeek-V3's noaux_tc (route_noaux_tc: sigmoid scores, a correction bias, expert groups, a
// routed scale).
enum class MoeRouting { SoftmaxTopK, NoauxTc };

// A mixture-of-experts MLP: a router over E experts, each a SwiGLU MLP, and a shared expert,
// scaled by a sigmoid gate (Qwen3.5-MoE) or added as it is (GLM-5: shared_gate empty). Shapes:
// router [E, H]; expert e: gate[e], up[e] [I, H], down[e] [H, I]; shared: gate/up [Is, H], down
// [H, Is]; shared_gate [1, H]. The refs may view slices of one fused tensor (transformers'
// experts.gate_up_proj / down_proj). No shared expert: the shared refs empty (0 rows).
struct MoeWeights {
  WeightRef router;
  std::vector<WeightRef> gate, up, down;  // per expert
  WeightRef shared_gate_proj, shared_up_proj, shared_down_proj, shared_gate;
  // The CUDA backend's grouped products read every expert at a fixed stride: gate then up rows of
  // expert e at rows 2I·e of experts_gate_up [E·2I, H], its down at rows H·e of experts_down
  // [E·H, I] (the per-expert refs above view the same bytes). Empty on the CPU.
  WeightRef experts_gate_up, experts_down;
  // CUDA, optional (stack_moe_experts; empty on the CPU): the shared expert's gate and up as one
  // weight [2Is, H], and the router with shared_gate as its last row [E + 1, H] (router and
  // shared_gate view its rows), so each is one product. shared_in_groups: the shared expert has
  // the routed experts' shape (Is = I, bf16) and shared_gate_up is its gate rows then its up rows
  // (their views), as an expert's are stacked: it runs as one more group of the experts' grouped
  // products. Else shared_gate_up is gate_up_swiglu's pair layout (shared_gate_proj /
  // shared_up_proj then keep their shapes but no data).
  WeightRef shared_gate_up, router_shared_gate;
  bool shared_in_groups = false;
  int64_t top_k = 0;
  bool renormalise = true;  // the top-k probabilities rescaled to sum to 1
  MoeRouting routing = MoeRouting::SoftmaxTopK;
  // NoauxTc: e_score_correction_bias [E] (F32), the expert groups, the routed weights' scale.
  WeightRef score_bias;
  int64_t n_group = 1, topk_group = 1;
  float routed_scale = 1.0f;
};

// One token's routing from its router logits [E]: softmax in fp32, the top k experts by
// probability (equal probabilities: the lower expert id wins), their probabilities renormalised
// to sum to 1 when `renormalise`. ids and weights [k] in descending probability order.
void route_top_k(const float* logits, int64_t E, int64_t k, bool renormalise, int32_t* ids,
                 float* weights);

// One token's GLM-5 / DeepSeek-V3 routing ("noaux_tc", transformers' GlmMoeDsa router) from its
// router logits [E] and e_score_correction_bias [E], E experts in n_group equal groups:
//   score = sigmoid(logit) in fp32; choice = score + bias;
//   a group's worth = the sum of its two best choices; the best topk_group groups are kept;
//   the other groups' experts are out (transformers 5.17's masked_fill with -inf);
//   the k best choices are the experts (ids in descending choice); their weights are the
//   unbiased scores, divided by their sum (+ 1e-20) when `renormalise`, times `scale`.
// Equal values (group worths, choices) go to the lower index. CPU arithmetic on host memory.
void route_noaux_tc(const float* logits, const float* bias, int64_t E, int64_t k, int64_t n_group,
                    int64_t topk_group, bool renormalise, float scale, int32_t* ids,
                    float* weights);

// y[T, H] += moe(x) for normalised input rows x [T, H] (y must not alias x):
//   moe(x_t) = Σ_{e chosen for t, ascending e} w_{t,e} · down_e(silu(gate_e x_t) ⊙ up_e x_t)
//            + sigmoid(shared_gate · x_t) · shared(x_t)      (when there is a shared expert;
//                                                             without shared_gate: + shared(x_t))
// added to y_t as one term (the experts' sum, then the gated shared expert, then the residual:
// transformers' order). A token's value depends on its own routing only: each expert's product
// of a row is the same whichever other tokens share the expert (batch invariance), and its
// experts are summed in a fixed order. routing (optional): [T, top_k] ids and weights as
// route_top_k gives them (on CUDA: copied to the host, a synchronisation; tests and --json
// routing only). CUDA needs experts_gate_up / experts_down (stack_moe_experts).
// norm (optional): x is the raw residual stream, the mixture's input is rms_norm(x) with
// norm->norm, written to norm->normed [T, H] (not aliasing x or y) for the experts to read; y may
// then alias x, which only the norm reads. On CUDA the router normalises a single token as it
// stages it, saving the norm's launch.
struct MoeInputNorm {
  RowNorm norm;
  float* normed = nullptr;
};
void moe_mlp_add(const float* x, int64_t T, const MoeWeights& w, float* y,
                 std::vector<int32_t>* routed_ids = nullptr,
                 std::vector<float>* routed_weights = nullptr, const MoeInputNorm* norm = nullptr);

// GLM-5's DSA indexer choice (transformers' GlmMoeDsaIndexer) for n queries: q [n, heads, D]
// (rotated), w [n, heads] (the head weights, weights_proj · heads^-1/2), keys [ctx, D] (the
// rotated, normed index keys of positions 0 .. ctx-1). Query i at position pos[i] < ctx scores
// every position p <= pos[i] as Σ_h w[i,h] · relu((q[i,h] · keys[p]) · D^-1/2) and keeps the best
// min(topk, pos[i] + 1): out [n, topk] holds their positions by descending score (the lower
// position on equal scores), -1 after them. With pos[i] + 1 <= topk the choice is every earlier
// position (dense attention). CUDA: pos in device memory, each query sorting the whole context.
void dsa_select(const float* q, const float* w, int64_t n, int64_t heads, int64_t D,
                const float* keys, int64_t ctx, const int64_t* pos, int64_t topk, int32_t* out);

// GLM-5's multi-head latent attention (MLA) for n queries of one row over its latent cache:
// q_nope [n, H, dn], q_pe [n, H, dr] (rotated); latent [ctx, R + dr], per position the normed
// compressed key/value (R) then the rotated rotary key all heads share (dr); kv_b [H·(dn + dv), R]
// (kv_b_proj: head h's dn key rows, then its dv value rows). Query i at position pos[i] attends
// to the positions p <= pos[i] in allowed[i, :topk] (the DSA choice, -1 padded), or to all of them
// when allowed is null, with scores (q_nope·k_nope + q_pe·k_pe) · scale. out [n, H, dv].
// absorbed: the decode form (the key projection folded into the query, the value projection
// applied once to the weighted latents); else the prefill form (keys and values formed per
// position and head). Both equal the attention within fp32 rounding. CUDA evaluates both in the
// absorbed order (kv_b F32 or BF16 there; pos and allowed in device memory).
void mla_attention(const float* q_nope, const float* q_pe, int64_t n, int64_t H, int64_t dn,
                   int64_t dr, int64_t dv, const float* latent, int64_t ctx, int64_t R,
                   const WeightRef& kv_b, const int64_t* pos, const int32_t* allowed, int64_t topk,
                   float scale, bool absorbed, float* out);

// out[i, :] = table[ids[i], :] converted to fp32. An id out of range gives a row of NaN (callers
// check host ids first; ids already in backend memory, a draft step's argmax of -1 for NaN
// logits, cannot be checked without a wait).
void embed_rows(const WeightRef& table, const int32_t* ids, int64_t n, float* out);
// embed_rows of ids[i], or of source[from[i]] where from[i] >= 0: a verify window whose drafted
// tokens are still where the drafter's chain left them (all arrays backend memory).
void embed_rows_selected(const WeightRef& table, const int32_t* ids, const int32_t* source,
                         const int32_t* from, int64_t n, float* out);

// RMSNorm over the last axis of x[m, d]:
//   y = x · rsqrt(mean(x²) + eps) · scale,  scale = (1 + w) if zero_centred else w.
// In place is allowed (y == x).
void rms_norm(const float* x, int64_t m, int64_t d, const WeightRef& w, bool zero_centred,
              float eps, float* y);

// The input rows of a drafter's fc (MTP, EAGLE-3): y[t] = [rms_norm(a[t]) | rms_norm(b[t])], a and
// b normalised with wa and wb (a, b: [m, d]; y: [m, 2d], aliasing neither). Each half carries
// rms_norm's bits; one pass instead of two norms and two copies.
void rms_norm_pair(const float* a, const float* b, int64_t m, int64_t d, const WeightRef& wa,
                   const WeightRef& wb, bool zero_centred, float eps, float* y);
// rms_norm_pair of a = embed_rows(table, ids, m) (d = table.cols), bit for bit, without the
// embedded rows in between: a draft step's input in one launch.
void rms_norm_pair_embedded(const WeightRef& table, const int32_t* ids, const float* b, int64_t m,
                            const WeightRef& wa, const WeightRef& wb, bool zero_centred, float eps,
                            float* y);

// The residual add and the next RMSNorm in one pass: x[m, d] += r[m, d], then
// y = rms_norm(x) with rms_norm's arithmetic. y may alias r (not x). Bitwise add_inplace followed
// by rms_norm.
void add_rms_norm(float* x, const float* r, int64_t m, int64_t d, const WeightRef& w,
                  bool zero_centred, float eps, float* y);

// Gated RMSNorm of the DeltaNet output, per head: y = rms_norm(x) · w · silu(z), x, z: [m, d].
void gated_rms_norm(const float* x, const float* z, int64_t m, int64_t d, const WeightRef& w,
                    float eps, float* y);

// SwiGLU: out[i] = silu(gate[i]) · up[i] for n elements.
void swiglu(const float* gate, const float* up, int64_t n, float* out);

// x[i] *= sigmoid(gate[i]) for n elements.
void sigmoid_gate(float* x, const float* gate, int64_t n);

// x[i] += y[i]
void add_inplace(float* x, const float* y, int64_t n);

// x[i] *= s for n elements (one fp32 product each: exact across backends).
void scale(float* x, int64_t n, float s);

// Rotary embedding, rotate-half (NeoX) layout, applied to the first `rotary_dim` dims of every
// head: x[n_tokens, n_heads, head_dim], positions[n_tokens]. inv_freq[rotary_dim / 2].
void rope(float* x, int64_t n_tokens, int64_t n_heads, int64_t head_dim, int64_t rotary_dim,
          const int64_t* positions, const float* inv_freq);

// Rotary embedding of a slice of every head, in either pair layout: x[n_tokens, n_heads,
// head_stride], the `dim` values at `offset` of each head rotated by positions[t] · inv_freq[i]
// (inv_freq[dim / 2]), pair i being (x[2i], x[2i + 1]) when `interleaved` (DeepSeek's layout,
// GLM-5's attention and indexer as transformers runs them) or (x[i], x[i + dim / 2]) (NeoX, as
// rope). positions and inv_freq in backend memory.
void rope_slice(float* x, int64_t n_tokens, int64_t n_heads, int64_t head_stride, int64_t offset,
                int64_t dim, const int64_t* positions, const float* inv_freq, bool interleaved);

// LayerNorm over the last axis of x[m, d] (GLM-5's indexer key norm): y = (x − mean) ·
// rsqrt(var + eps) · w + b with the population variance. In place is allowed.
void layer_norm(const float* x, int64_t m, int64_t d, const WeightRef& w, const WeightRef& b,
                float eps, float* y);

// Gated attention's query/key preparation for T tokens in one pass: from the projection
// qg [T, n_heads, 2·head_dim] ([query | gate] per head) and k [T, n_kv_heads, head_dim],
//   q[t, h]    = rope(rms_norm(qg[t, h, :head_dim], q_norm), positions[t])
//   gate[t, h] = qg[t, h, head_dim:]
//   k[t, j]    = rope(rms_norm(k[t, j], k_norm), positions[t])      (in place)
// Every value is the one copy_rows, rms_norm and rope compute, called one after the other.
// With kv set, each token's keys k[t] (as written above) and values v[t] [n_kv_heads, head_dim]
// also go to the paged KV at the physical slot kv_slots[t] (block kv_slots[t] / block_size,
// offset kv_slots[t] % block_size; a negative slot writes nothing): the rows kv_write would
// write, without its launch on the decode path. kv_slots and v are backend memory.
struct KVLayerView;
struct QkNormRope {
  int64_t n_tokens = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0, rotary_dim = 0;
  bool zero_centred = true;
  float eps = 1e-6f;
  const KVLayerView* kv = nullptr;
  const int64_t* kv_slots = nullptr;  // [n_tokens], with kv
  const float* v = nullptr;           // [n_tokens, n_kv_heads, head_dim], with kv
};
void qk_norm_rope(const QkNormRope& s, const float* qg, const WeightRef& q_norm,
                  const WeightRef& k_norm, const int64_t* positions, const float* inv_freq,
                  float* q, float* gate, float* k);

// Paged KV for one full-attention layer. Keys and values of position p of a row live in block
// `block_table[p / block_size]` at slot `p % block_size`; a block holds
// [block_size, n_kv_heads, head_dim] keys followed by the same for values.
// Storage is bf16 (the default: half the memory and bandwidth) or fp32 (`--kv-dtype f32`).
// Whatever it is, attention computes in fp32 on the stored values, and kv_write rounds fp32
// keys and values to nearest even on the way in; every reader of a stored row sees the same
// values, so decoding, verify windows and a cache restore agree bitwise under either storage.
// The physical KV slot (block · block_size + offset) of position p of a row whose block table is
// `table` (ops::QkNormRope's kv_slots; constexpr: device code computes it too).
constexpr int64_t kv_slot_of(const int32_t* table, int64_t block_size, int64_t p) {
  return int64_t{table[p / block_size]} * block_size + p % block_size;
}
struct KVLayerView {
  void* pool = nullptr;  // [n_blocks, 2, block_size, n_kv_heads, head_dim] of `dtype`
  int64_t block_size = 0;
  int64_t n_kv_heads = 0;
  int64_t head_dim = 0;
  DType dtype = DType::F32;                                       // F32 or BF16
  int64_t row_elements() const { return n_kv_heads * head_dim; }  // one position's keys
  size_t row_bytes() const { return static_cast<size_t>(row_elements()) * dtype_size(dtype); }
  // Where position `slot` of `block` keeps its keys (values): row_bytes() bytes; the rows of a
  // block's slots are contiguous.
  std::byte* key(int32_t block, int64_t slot) const {
    return static_cast<std::byte*>(pool) +
           static_cast<size_t>((static_cast<int64_t>(block) * 2) * block_size + slot) * row_bytes();
  }
  std::byte* value(int32_t block, int64_t slot) const {
    return static_cast<std::byte*>(pool) +
           static_cast<size_t>((static_cast<int64_t>(block) * 2 + 1) * block_size + slot) *
               row_bytes();
  }
};
// Throws Error unless dtype is a KV storage type (F32 or BF16).
void check_kv_dtype(DType dtype, const char* what);

// Writes k, v [n, n_kv_heads, head_dim] of one row: token j at position positions[j].
// positions [n] and block_table are backend memory (device on CUDA), so a captured decode step can
// be replayed at a later position by refreshing `positions` alone.
void kv_write(const KVLayerView& kv, const int32_t* block_table, const int64_t* positions,
              int64_t n, const float* k, const float* v);
// kv_write of rows already in the pool's storage type (kv.dtype; row_bytes() each), copied as
// they are: the restore of saved KV (the prefix cache's disk tier), which must not round twice.
void kv_write_stored(const KVLayerView& kv, const int32_t* block_table, const int64_t* positions,
                     int64_t n, const void* k, const void* v);

// Causal attention of one row's n query tokens over its cached keys/values: query j attends to
// positions 0..positions[j]. q: [n, n_heads, head_dim], out: [n, n_heads, head_dim].
// positions [n] and block_table are backend memory. position_bound (host) bounds every
// positions[j] (< position_bound); it sizes the work (CUDA grid, CPU score buffer) and never the
// arithmetic. Query head h reads kv head h / (n_heads / n_kv_heads). Each query's softmax is
// reduced in an order fixed by its own position, so the result does not depend on n, on
// position_bound or on the other queries of the call. A position outside [0, position_bound) is
// the caller's bug: the CPU throws; CUDA (which cannot see positions on the host) writes NaN for
// that query. gate (optional, [n, n_heads, head_dim]): the output is multiplied by
// sigmoid(gate), every value bitwise sigmoid_gate applied afterwards (gated attention's output
// gate, in the same pass on CUDA).
void attention(const KVLayerView& kv, const int32_t* block_table, const int64_t* positions,
               int64_t n, int64_t position_bound, const float* q, int64_t n_heads, float scale,
               float* out, const float* gate = nullptr);

// attention() of several rows' queries in one call (one launch on CUDA). Query t belongs to row
// query_rows[t] and reads that row's block table, at tables + query_rows[t] · table_stride;
// query_rows[t] = -1 skips the query (its output is left untouched). tables, query_rows and
// positions [n] are backend memory. position_bound bounds every query's position. Each query's
// output is bitwise the one attention() gives for it with its row's table: a query's arithmetic
// depends on its own position alone, never on the other rows of the call. window (>= 1), like
// position_bound, sizes the work and never the arithmetic: the length every row's queries share
// when each row's run of consecutive queries starts at a multiple of it (a step of verify
// windows), which lets CUDA serve several of a row's queries from one block; 1 when rows
// differ.
void attention_rows(const KVLayerView& kv, const int32_t* tables, int64_t table_stride,
                    const int64_t* query_rows, const int64_t* positions, int64_t n,
                    int64_t position_bound, int64_t window, const float* q, int64_t n_heads,
                    float scale, float* out, const float* gate = nullptr);

// Attention of one row's prompt: n tokens at positions 0..n-1 whose keys/values k, v
// ([n, n_kv_heads, head_dim], contiguous) were just written to the row's KV with kv_write.
// Same semantics as attention() over those positions. CUDA computes it from the contiguous k, v
// with tensor-core GEMMs (tf32-level rounding; prompt tokens only, a token's bits may depend on
// n); the CPU runs attention() (same bits as decoding).
void attention_prompt(const KVLayerView& kv, const int32_t* block_table, const int64_t* positions,
                      int64_t n, const float* q, const float* k, const float* v, int64_t n_heads,
                      float scale, float* out);

// Depthwise causal conv1d with state, then SiLU, for one row's n tokens.
// x, out: [n, channels]; w: [channels, kernel] (HF Conv1d weight squeezed); state: [channels,
// kernel-1] holds the previous kernel-1 inputs, oldest first, and is advanced by n tokens.
// state_after (optional): [n, channels, kernel-1] receives the state after each token (what a
// verify window keeps to cut the row back to any prefix).
void causal_conv_silu(const float* x, int64_t n, int64_t channels, int64_t kernel,
                      const WeightRef& w, float* state, float* out, float* state_after = nullptr);

// Gated delta rule recurrence of one row, token by token (the same per-token step for prefill,
// decode and verify, so a window's states equal decoding one token at a time).
//  q, k: [n, n_k_heads, dk] (raw; L2-normalised inside, q also scaled by dk^-0.5)
//  v:    [n, n_v_heads, dv]
//  a, b: [n, n_v_heads] raw projections; decay g = -exp(A_log)·softplus(a + dt_bias), beta =
//        sigmoid(b). Value head h uses key head h / (n_v_heads / n_k_heads).
//  state: [n_v_heads, dk, dv] fp32, advanced in place.  out: [n, n_v_heads, dv].
//  state_after (optional): [n, n_v_heads, dk, dv] receives the state after each token.
struct DeltaHeads {
  int64_t n_k_heads, n_v_heads, dk, dv;
  // Floats between consecutive tokens of q, k and v; 0 = packed (q, k: n_k_heads·dk, v:
  // n_v_heads·dv). Lets the recurrence read q, k, v in place from the conv output, whose tokens
  // are [q | k | v] rows.
  int64_t qkv_token_stride = 0;
};
void gated_delta_rule(const float* q, const float* k, const float* v, const float* a,
                      const float* b, const WeightRef& A_log, const WeightRef& dt_bias, int64_t n,
                      const DeltaHeads& h, float* state, float* out, float* state_after = nullptr);

// Batched recurrent calls: every row of a forward in one call (one launch on CUDA). Each row's
// outputs and states are bitwise identical to the single-row op above run on that row alone (the
// same per-token arithmetic; rows never share a state or a reduction).
//
// One row's slice of a batched recurrent call. The tokens of all rows are concatenated in the
// call's token-major arrays (T tokens); this row owns tokens first_token .. first_token + n - 1,
// and no two rows of a call own the same token or state. The states are the row's own, as the
// single-row ops take them; one descriptor array can serve both ops of a layer. A null conv_after
// / state_after skips that row's per-token states (rows of one call may differ: some speculative,
// others not). A row with n == 0 is skipped: its states are left untouched.
//
// `settled` leading tokens are the ones the row's states keep: after the call, conv_state and
// state are what they are after token settled - 1 (the ones before the call for settled == 0),
// while every token's outputs (and per-token states) are those of a row that kept them all. A
// negative value, the default, settles all n tokens. Qwen35State's Replay rollback settles a
// verify window's first token, which every commit keeps (the round's last emitted token), and
// its commit replays only the kept tokens after it.
struct RecurrentRow {
  int64_t first_token = 0;
  int64_t n = 0;
  float* conv_state = nullptr;   // [channels, kernel-1]
  float* conv_after = nullptr;   // optional [n, channels, kernel-1]
  float* state = nullptr;        // [n_v_heads, dk, dv]
  float* state_after = nullptr;  // optional [n, n_v_heads, dk, dv]
  int64_t settled = -1;
};
// The tokens a row's states keep: its `settled` clamped to 0..n, all n when negative (constexpr:
// the CUDA kernels call it too).
constexpr int64_t settled_tokens(const RecurrentRow& r) {
  return r.settled < 0 || r.settled > r.n ? r.n : r.settled;
}

// causal_conv_silu of n_rows rows: x, out [T, channels]; row r runs on its tokens with its
// conv_state and conv_after. `rows` is n_rows descriptors in backend memory (device memory on
// CUDA, read by the kernel: a captured graph replays with whatever they hold then). max_n (host)
// is >= every row's n; a call with max_n == 0 does nothing.
void causal_conv_silu_rows(const float* x, int64_t channels, int64_t kernel, const WeightRef& w,
                           const RecurrentRow* rows, int64_t n_rows, int64_t max_n, float* out);

// gated_delta_rule of n_rows rows: row r runs on its tokens with its state and state_after.
// rows, max_n: as causal_conv_silu_rows.
//  q, k: [T, n_k_heads, dk]  v: [T, n_v_heads, dv]  a, b: [T, n_v_heads]  out: [T, n_v_heads, dv]
void gated_delta_rule_rows(const float* q, const float* k, const float* v, const float* a,
                           const float* b, const WeightRef& A_log, const WeightRef& dt_bias,
                           const RecurrentRow* rows, int64_t n_rows, int64_t max_n,
                           const DeltaHeads& h, float* out);

// One linear-attention layer of recurrent_layers_rows: its recorded inputs, its weights and where
// its outputs go (T tokens, the call's token-major arrays as above).
struct RecurrentLayer {
  const float* conv_input = nullptr;  // [T, channels]
  WeightRef conv_weight;              // [channels, kernel]
  const float* a = nullptr;           // [T, n_v_heads]
  const float* b = nullptr;           // [T, n_v_heads]
  WeightRef A_log, dt_bias;           // [n_v_heads]
  float* conv_out = nullptr;          // [T, channels]: the recurrence's q | k | v rows
  float* out = nullptr;               // [T, n_v_heads, dv]
};
// The same layer entries twice: `host` in host memory (checks; CUDA's per-layer fallback) and
// `device` in backend memory (what CUDA's kernels read, so a captured graph replays with them; the
// CPU reads `host`).
struct RecurrentLayers {
  const RecurrentLayer* host = nullptr;
  const RecurrentLayer* device = nullptr;
  int64_t count = 0;
};
// causal_conv_silu_rows, then gated_delta_rule_rows, of several layers in one call (one launch
// each on CUDA where the rows are short, at most 8 tokens): layer l runs on the descriptors
// rows[l·n_rows .. (l+1)·n_rows), its conv from conv_input into conv_out, its recurrence reading
// q, k, v from conv_out ([q | k | v] rows: h.qkv_token_stride == channels). Each layer's states
// and outputs are bitwise those of the two per-layer calls. The Replay rollback's commit: every
// layer's kept tokens replayed at once.
void recurrent_layers_rows(const RecurrentLayers& layers, int64_t channels, int64_t kernel,
                           const RecurrentRow* rows, int64_t n_rows, int64_t max_n,
                           const DeltaHeads& h);

// A Linear weight in MLX's affine quantized layout ([rows, cols] logical):
//  - packed: uint32 [rows, cols * bits / 32]; each row is a little-endian bit stream in which
//    element c occupies bits [c·bits, (c+1)·bits), first element in the lowest bits of the first
//    word (MLX packs 3/5/6-bit values across word boundaries this same way);
//  - scales, biases: [rows, cols / group_size], fp32/bf16/f16;
//  - value(r, c) = scales[r, g] · q(r, c) + biases[r, g], g = c / group_size.
// Supported: bits 2, 3, 4, 5, 6, 8; group_size a multiple of 32 dividing cols.
struct QuantWeightRef {
  const void* packed = nullptr;  // may be unaligned (safetensors does not align)
  WeightRef scales, biases;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t group_size = 0;
  int bits = 0;
};
bool quant_bits_supported(int bits);

// y[m, w.rows] = x[m, w.cols] · dequant(w)ᵀ. Each weight row is dequantized once per call into an
// fp32 buffer and dotted with every input row in a fixed order (batch invariant; exact fp32 math
// on the dequantized values).
void linear_quantized(const float* x, int64_t m, const QuantWeightRef& w, float* y);

}  // namespace tandem::ops
