// The Qwen3.5 hybrid target model (Gated DeltaNet + gated full attention), written against the
// backend op set. Weights stay in their stored dtype inside memory-mapped safetensors files.
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tandem/backend/buffer.h"
#include "tandem/backend/context.h"
#include "tandem/backend/graph_cache.h"
#include "tandem/backend/ops.h"
#include "tandem/backend/readback.h"
#include "tandem/backend/staged_upload.h"
#include "tandem/backend/weight_arena.h"
#include "tandem/io/weight_store.h"
#include "tandem/model/forward.h"
#include "tandem/model/gated_attention.h"
#include "tandem/model/qwen3_5_config.h"
#include "tandem/model/qwen3_5_state.h"

namespace tandem {

class Qwen35Model {
 public:
  static constexpr int64_t kMaxWindowTokens = 16;  // the largest verify window benchmarks time
  struct LoadOptions {
    bool prefault = true;
  };
  // Loads config.json + weights of a Hugging Face Qwen3.5 directory and validates every tensor
  // the text model needs (shape and dtype). Vision tensors are ignored; `mtp.*` stay reachable
  // through weights() for the drafter.
  static std::unique_ptr<Qwen35Model> load(const std::string& dir, const LoadOptions& opts);
  static std::unique_ptr<Qwen35Model> load(const std::string& dir) { return load(dir, {}); }
  // A model of `cfg`'s shape with random weights created directly in the active backend's
  // memory (no files): benchmarks at real sizes. Weight scales follow write_random_qwen35.
  static std::unique_ptr<Qwen35Model> random(const Qwen35Config& cfg, uint64_t seed);

  // Not copyable or movable: ws_ points into the model itself.
  Qwen35Model(const Qwen35Model&) = delete;
  Qwen35Model& operator=(const Qwen35Model&) = delete;

  const Qwen35Config& config() const { return cfg_; }
  const WeightStore& weights() const { return store_; }
  // The backend context the model's work runs on (backend/context.h): its own, or its loader's
  // current one (Context::for_new_model). Every entry point below enters it.
  ops::Context& context() const { return *context_; }
  const std::string& prefix() const { return prefix_; }  // "model.language_model." or "model."

  // Runs the rows' new tokens through the model, appending them to each row's state.
  // Token ids must be in [0, vocab) (throws Error otherwise, before any state changes).
  // Outputs are copied to host memory. Every token's numbers are independent of the other rows
  // in the forward (batch invariance). On CUDA, `req.prompt` selects the prefill GEMM path, so a
  // prompt token's numbers differ (within bf16 rounding) from the same token decoded.
  void forward(Qwen35State& state, const ForwardRequest& req, ForwardOutput* out) const;

  // A prompt forward run a few layers at a time (layer-sliced prefill): a serving engine spreads
  // one chunk's layers over several steps, between the decode rounds of other rows, so no round
  // waits for a whole chunk. The slices queue exactly the kernels forward() queues for the same
  // request, in the same order, into a workspace of their own, so the results are forward()'s
  // bit for bit. From begin_prompt until the slice that finishes it, the forward's rows must stay
  // open and take no other forward; the state's other rows may run forwards and commits freely.
  // Not copyable; dropping an unfinished one leaves its rows' recurrent state part-advanced
  // (close those rows).
  class PromptForward {
   public:
    PromptForward();
    ~PromptForward();
    PromptForward(const PromptForward&) = delete;
    PromptForward& operator=(const PromptForward&) = delete;
    bool active() const { return active_; }
    int next_layer() const { return next_layer_; }
    std::span<const RowInput> rows() const { return rows_; }
    // Forgets an unfinished forward (after an error, or when its rows are being closed): their
    // recurrent state is part-advanced, so those rows must be closed, not continued.
    void abandon() { active_ = false; }

   private:
    friend class Qwen35Model;
    struct Workspace;
    std::unique_ptr<Workspace> ws_;
    std::vector<int32_t> tokens_;
    std::vector<RowInput> rows_;
    std::vector<int> tap_layers_;
    ForwardRequest req_;  // its spans view tokens_, rows_ and tap_layers_
    int64_t tokens_total_ = 0;
    int next_layer_ = 0;
    bool active_ = false;
  };
  // Validates `req` (a prompt forward: req.prompt, no defer_argmax, no tokens_from_argmax, no
  // speculative rows) as forward() does, reserves the rows' KV and stages the forward's metadata
  // and embedding into pf. Throws before anything changes; pf must not be active.
  void begin_prompt(Qwen35State& state, const ForwardRequest& req, PromptForward* pf) const;
  // Runs the next max_layers layers of pf (0: all that remain). After the last layer it runs the
  // head, appends the tokens to the rows, fills *out as forward() would and returns true (pf is
  // then inactive); otherwise returns false and *out is untouched.
  bool continue_prompt(Qwen35State& state, PromptForward& pf, int max_layers,
                       ForwardOutput* out) const;
  // The last finished prompt forward of pf: every token's hidden, [T, H] in backend memory,
  // final-normed (it had want_hidden) or pre-norm (the residual stream after the last layer);
  // valid until pf's next begin_prompt. Null before any.
  const float* prompt_hidden(const PromptForward& pf, bool prenorm) const;
  int layer_count() const { return static_cast<int>(layers_.size()); }
  // The argmax of the oldest forward run with defer_argmax whose tokens were not collected yet
  // (blocks until they are on the host). Throws if none is pending, or naming the logits row
  // that held NaN or +inf (the forward that took such a token as input has been queued already;
  // its output is meaningless). At most kMaxDeferred forwards may be pending.
  void collect_argmax(std::vector<int32_t>* argmax) const;
  // Waits for and discards every pending deferred argmax (an engine unwinding from an error).
  void drop_deferred_argmax() const;
  static constexpr int kMaxDeferred = 2;

  // Cuts speculative rows back to the kept prefix of their last window: KV coverage shrinks and
  // the DeltaNet conv/recurrent state becomes bit-identical to a run that never saw the rejected
  // tokens. Every listed row must have had a speculative forward since its last commit.
  // All-or-nothing: every row is checked (open, window open, 1 <= kept <= window, listed once)
  // before any state changes; a violation throws Error naming the row. A row with an open window
  // takes no forward (speculative or not) until it is committed; close_row discards the window.
  // KV blocks past the new length stay with the row and are overwritten by its next window.
  // Cost (Qwen35State's RecurrentRollback): PerPositionStates copies one state per DeltaNet layer
  // and row (nothing when kept == n); Replay re-runs the kept tokens' conv + recurrence from the
  // recorded inputs (no projections, no attention, no MLP): one batched launch per op and layer
  // for all the listed rows.
  void commit_windows(Qwen35State& state, std::span<const RowKeep> rows) const;

  // A round without a host read between its verify and the next round's forwards (issue 19):
  // accept_windows walks the last forward's windows where its tokens are (ops::accept_windows:
  // accepted[r] proposals and the next pending token next[r] of each of its rows, backend memory,
  // one entry per row). That forward must have had all_logits and want_argmax (its tokens, greedy
  // or drawn, are the verified ones) and no other forward may have run since; Error otherwise.
  // limits (backend memory, [rows], or null): row r accepts at most limits[r] proposals.
  void accept_windows(int32_t* accepted, int32_t* next, const int32_t* limits = nullptr) const;
  // commit_windows with the kept counts in backend memory: rows[i] keeps 1 + accepted[rows[i].row]
  // tokens of its window, `row` indexing accepted_windows' rows. Queued, the host's lengths lag
  // behind until Qwen35State::resolve_settled (its "Commits settled on the device"); later
  // forwards of the rows may be queued before that. Checks as commit_windows (all-or-nothing);
  // a state with DeltaNet layers must use the Replay rollback.
  void settle_windows(Qwen35State& state, std::span<const ops::SettledRow> rows,
                      const int32_t* accepted) const;
  // The last forward's hidden of every token, [T, H] in backend memory, valid until the next
  // forward: final-normed where it had all_logits or want_hidden, or pre-norm (the residual
  // stream after the last layer). What a drafter settling on the device reads.
  const float* last_hidden(bool prenorm) const {
    return prenorm ? own_ws_.x.data() : own_ws_.h.data();
  }

  // out[n, H] = embedding rows of ids (host ids, must be in range; out in backend memory).
  // Drafters embed through the target.
  void embed(std::span<const int32_t> ids, float* out) const;
  // ids in backend memory; an id out of range embeds as a row of NaN (ops::embed_rows).
  void embed_device(const int32_t* ids, int64_t n, float* out) const;
  const ops::WeightRef* embedding_table() const { return &embed_; }  // what embed_device reads
  // out[n, V] = the head applied to hidden[n, H] (no norm applied here; backend memory).
  // rows > 0: only the head's first `rows` rows (token ids 0..rows-1, a drafter's reduced
  // vocabulary), out[n, rows], as a weight of that shape. Throws if rows > V.
  void head(const float* hidden, int64_t n, float* out, int64_t rows = 0) const;
  // The backend memory holding the model's weights (0 for a CPU model of mapped files).
  uint64_t placed_weight_bytes() const { return arena_.bytes(); }

  // Bytes of weights one decode step of one row reads (every layer + the head; the embedding row
  // is noise; of a mixture of experts, the top_k experts a token is routed to).
  uint64_t decode_weight_bytes() const;
  // Bytes of all routed experts of all layers (0 for a dense model): a step of several rows reads
  // the union of the experts its tokens are routed to.
  uint64_t expert_weight_bytes() const;
  uint64_t parameter_count() const;

 private:
  // On CUDA the input projections of a mixer are stacked into one weight (`in_proj`: q|k|v for
  // attention, qkv|z|b|a for DeltaNet) so they stream in one launch; the separate refs are then
  // views of its rows. Null on the CPU.
  struct AttnWeights {
    ops::WeightRef q_proj, k_proj, v_proj, o_proj, q_norm, k_norm, in_proj;
  };
  struct DeltaWeights {
    ops::WeightRef in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, conv1d, A_log, dt_bias, norm,
        out_proj, in_proj;
  };
  struct Layer {
    LayerKind kind;
    int index_in_kind = 0;  // attention-layer or linear-layer ordinal (state addressing)
    ops::WeightRef input_norm, post_norm, gate_proj, up_proj, down_proj;
    // CUDA (I a multiple of 8): gate_proj and up_proj interleaved into one [2I, H] weight in
    // ops::gate_up_swiglu's pair layout (one launch computes the MLP activation); gate_proj and
    // up_proj then keep their shapes but no data. Null on the CPU, which keeps the mapped tensors.
    ops::WeightRef gate_up;
    // Qwen3.5-MoE: the layer's MLP is this mixture of experts (gate/up/down_proj unused).
    ops::MoeWeights moe;
    AttnWeights attn;
    DeltaWeights delta;
  };

  // First member: destroyed last, after every buffer of the model was freed.
  std::shared_ptr<ops::Context> context_;
  Qwen35Config cfg_;
  WeightStore store_;
  WeightArena arena_;  // backend copies of the weights (CUDA) or nothing (CPU)
  std::string prefix_;
  ops::WeightRef embed_, final_norm_, lm_head_;
  std::vector<Layer> layers_;
  Buffer<float> inv_freq_;

  // Scratch reused across calls (grown, never shrunk). A model serves one forward at a time.
  // Buffers are backend memory; the *_host vectors stage what the host computes per forward.
  struct Workspace {
    Buffer<float> x;  // [T, H] the residual stream
    Buffer<float> h, a0, a1, a2, a3, a5;
    Buffer<float> mlp_g, mlp_u;  // [T, I] gate and up projections; only without stacked gate_up
    Buffer<float> last;          // [rows, H]: each row's last normed hidden, for the head
    Buffer<float> taps;          // [T, tap layers · H]: ForwardRequest::tap_layers' captures
    Buffer<float> out;           // [rows or T, V] logits before the copy to the host
    Buffer<int32_t> embed_ids;   // ids of embed() calls (drafters)
    Buffer<int32_t> argmax;      // [logits rows]
    // A forward's metadata, one block in backend memory filled by one upload (meta_upload):
    std::vector<int32_t>* routing = nullptr;  // where mlp() appends routing, when recorded
    Buffer<uint8_t> meta;
    int32_t* ids = nullptr;     // [T] token ids
    int64_t* pos = nullptr;     // [T] positions, then [T] physical KV slots, then [T] token rows
    int32_t* tables = nullptr;  // the rows' block tables, fixed stride
    int64_t table_stride = 0;   // int32s between two rows' tables
    ops::RecurrentRow* recurrent_rows = nullptr;  // [linear layers][rows] state descriptors
    ops::SampleRow* sample_rows = nullptr;        // [logits rows] ForwardRequest::sample_rows
    int32_t* draft_from = nullptr;                // [T] ForwardRequest::draft_from
    // Per row: its slot, the part of its settled shift the positions count, its tokens' bounds
    // ([rows + 1]: row r is tokens bounds[r] .. bounds[r+1]-1).
    int32_t* row_slots = nullptr;
    int64_t* row_known = nullptr;
    int32_t* row_bounds = nullptr;
    bool shifted = false;  // a row has unresolved settled commits: ops::shift_positions first
    // What accept_windows reads of the last forward (set by forward(); cleared by the next).
    struct Verified {
      bool ready = false;
      int64_t rows = 0;
      const int32_t* draft_ids = nullptr;
    } verified;
    // Whatever reads `meta` on the device calls meta_upload.consumed() once queued (forward,
    // accept_windows): the next forward's upload then lands beside the work queued before it.
    StagedUpload meta_upload;
    int64_t max_row_tokens = 0;
    std::vector<int64_t> pos_host;
    std::vector<int32_t> tables_host;
    std::vector<int64_t> bounds_host;               // [rows] attention position bounds
    std::vector<ops::RecurrentRow> recurrent_host;  // staging of recurrent_rows
    // The forward writes its DeltaNet inputs into the state's recording (Replay rollback).
    bool recording = false;
    // commit_windows' replay descriptors [linear layers][committed rows], one upload per commit.
    Buffer<uint8_t> replay_meta;
    StagedUpload replay_upload;
    std::vector<ops::RecurrentRow> replay_host;
    std::vector<ops::RecurrentLayer> replay_layers;  // host copy of the uploaded layer table
    std::vector<AttentionSegment> segments;
    GatedAttentionScratch attn;
  };
  mutable Workspace own_ws_;
  // The workspace the body runs in: own_ws_, or a PromptForward's while one of its slices runs.
  mutable Workspace* ws_ = &own_ws_;
  mutable GraphCache graphs_;  // decode/verify forwards replayed as CUDA graphs
  // Deferred argmax copies (ForwardRequest::defer_argmax): a ring of kMaxDeferred readbacks,
  // collected oldest first.
  struct DeferredArgmax {
    Readback copy;
    int64_t rows = 0;
  };
  mutable DeferredArgmax deferred_[kMaxDeferred];
  mutable int deferred_first_ = 0, deferred_count_ = 0;
  // Row slots whose argmax ws_.argmax holds (the last forward's, when it had one logits row per
  // row and want_argmax), in row order: what tokens_from_argmax may read.
  mutable std::vector<ops::HostRead> host_reads_;  // finish_forward's, kept for their capacity
  mutable std::vector<int> argmax_slots_;
  mutable const Qwen35State* argmax_state_ = nullptr;  // the state those rows belong to

  Qwen35Model() = default;
  // Where bind_weights gets each tensor: by name, with the shape and role it must have.
  enum class Role { Matrix, Vector };
  using WeightSource = std::function<ops::WeightRef(const std::string& name,
                                                    const std::vector<int64_t>& shape, Role)>;
  void bind_weights(const WeightSource& source, const std::string& prefix);
  // Qwen3.5-MoE: the checkpoint's experts come fused (transformers' experts.gate_up_proj /
  // down_proj), else one tensor per projection and expert (bind_moe_weights).
  bool fused_experts_ = false;
  // The device work of a forward: embedding, layers, final norm and head into ws_.out. Only
  // queues ops (captured into a CUDA graph for decode/verify shapes).
  void forward_body(Qwen35State& st, const ForwardRequest& req, int64_t T) const;
  // The parts of forward_body: the embedding, layers [first, end) (with the prefill mode of
  // req.prompt on for their duration), and the final norm, head and argmax.
  void body_embed(const ForwardRequest& req, int64_t T) const;
  void body_layers(Qwen35State& st, const ForwardRequest& req, int64_t T, size_t first,
                   size_t end) const;
  void body_head(const ForwardRequest& req, int64_t T) const;
  // forward()'s checks and set-up before the body (reserve, windows, metadata upload, segments)
  // into *ws_; returns the forward's token count.
  int64_t prepare_forward(Qwen35State& st, const ForwardRequest& req) const;
  // forward()'s end: rows' lengths, outputs. track_argmax: ws_ is the model's own workspace and
  // what it now holds may feed tokens_from_argmax.
  void finish_forward(Qwen35State& st, const ForwardRequest& req, int64_t T, ForwardOutput* out,
                      bool track_argmax) const;
  // Grows every workspace buffer the body uses for T tokens and R logits rows.
  void reserve_workspace(int64_t T, int64_t R, bool all_logits) const;
  // A sublayer: its input is rms_norm(ws_.x, L.input_norm), its output is added into ws_.x.
  void attention_layer(const Layer& L, Qwen35State& st, int64_t T, bool prompt) const;
  void delta_layer(const Layer& L, Qwen35State& st, const ForwardRequest& req, int64_t T) const;
  // next: the weight the forward reads after this MLP (the next layer's input projection, or
  // the head), whose leading rows the down projection asks L2 to fetch.
  void mlp(const Layer& L, int64_t T, const ops::WeightRef& next) const;
  // A sublayer's input rms_norm(ws_.x, norm). Stacked weights (one projection) get ws_.x and the
  // norm to apply themselves (fold()); otherwise the norm is applied into ws_.h, x = ws_.h and
  // fold() is null.
  struct SublayerInput {
    const float* x;
    ops::RowNorm norm;
    bool folded;
    const ops::RowNorm* fold() const { return folded ? &norm : nullptr; }
  };
  SublayerInput sublayer_input(const ops::WeightRef& norm, int64_t T, bool stacked) const;

  // The DeltaNet heads, reading q, k, v in place from conv output rows.
  ops::DeltaHeads delta_heads() const;
  // Calls fn on every weight a decode step reads (layers, final norm, head; not the embedding).
  void for_each_layer_weight(const std::function<void(const ops::WeightRef&)>& fn) const;
  // Replay rollback's commit: the listed rows' kept tokens through the batched conv and delta
  // rule calls the forward ran, from the recorded inputs, so the states reach the bits a forward
  // of the kept tokens alone would leave.
  // With `accepted` (settle_windows): each row's kept is its window's size, an upper bound, and
  // ops::settle_windows writes the descriptors' counts from accepted before the replay.
  void replay_windows(Qwen35State& st, std::span<const RowKeep> rows,
                      std::span<const ops::SettledRow> settled = {},
                      const int32_t* accepted = nullptr) const;
};

}  // namespace tandem
