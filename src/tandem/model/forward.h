// What a forward of a target model takes and gives: rows of new tokens appended to a state, and
// the logits, hidden states and records asked for. Shared by every target (Qwen3.5, GLM-5).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "tandem/backend/ops.h"

namespace tandem {

// One row's slice of a forward: `n_tokens` new tokens appended after the row's current length.
struct RowInput {
  int slot = 0;
  int64_t n_tokens = 0;
  // A verify window: the state keeps what it needs to cut the row back to any prefix of these
  // tokens (Qwen35Model::commit_windows). Until that commit, the row covers all n_tokens.
  bool speculative = false;
};

// After a speculative forward: keep the first `kept` (1..n_tokens) tokens of the row's window.
struct RowKeep {
  int slot = 0;
  int64_t kept = 0;
};

struct ForwardRequest {
  std::span<const int32_t> tokens;  // Σ n_tokens ids, rows in order
  std::span<const RowInput> rows;
  bool all_logits = false;           // false: only each row's last token gets logits
  bool want_hidden = false;          // final-normed hidden of every token
  bool want_prenorm_hidden = false;  // the last layer's output before the final norm, every token
  // With want_hidden or want_prenorm_hidden: leave them in backend memory (where the target
  // offers them, e.g. Qwen35Model::prompt_hidden) instead of copying them to the host; the
  // output's vectors stay empty. Targets that cannot keep them copy them as usual.
  bool hidden_on_device = false;
  bool want_logits = true;   // copy the logits to the host
  bool want_argmax = false;  // greedy token of every logits row, computed where the logits are
  // Prompt tokens: the CUDA backend takes its prefill GEMM path (see Qwen35Model::forward).
  // Engines set it for the forward that processes prompts, in plain and speculative decoding
  // alike, so both compute prompt tokens identically.
  bool prompt = false;
  // Rows of each prefill GEMM tile when `prompt` (ops::set_prefill): a prompt token's bits depend
  // on it, so engines set ops::prefill_gemm_rows(their prefill chunk) and agree with each other.
  int64_t prompt_gemm_rows = ops::kDefaultPrefillGemmRows;
  // Greedy decoding without a host round trip per token. tokens_from_argmax: `tokens` is empty
  // and each row's one input token is the argmax the previous forward computed for it (the
  // previous forward had want_argmax, one logits row per row, and exactly these rows in this
  // order; the ids never leave the device). defer_argmax (with want_argmax): out->argmax stays
  // empty and the tokens are read back asynchronously; collect_argmax() returns them, oldest
  // forward first. So a step can be queued before the host has seen the previous step's token.
  bool tokens_from_argmax = false;
  bool defer_argmax = false;
  // With want_argmax: the token of logits row i is drawn with sample_rows[i] (ops::sample_rows:
  // the host sampler's token, computed where the logits are) instead of taken greedily. Empty:
  // the argmax of every row. One entry per logits row; not for prompt forwards. The forward
  // copies it; the pipelined and deferred paths above work the same with it.
  std::span<const ops::SampleRow> sample_rows = {};
  // Verify windows whose drafted tokens are still in backend memory (DraftRows::draft_queued):
  // where draft_from[t] >= 0, token t is draft_ids[draft_from[t]] and tokens[t] a placeholder
  // (any valid id). Empty: every token is tokens[t]. One entry per token; not with
  // tokens_from_argmax or prompt. The forward reads draft_ids on the device, after everything
  // queued before it.
  const int32_t* draft_ids = nullptr;
  std::span<const int32_t> draft_from = {};
  // Mixtures of experts: record every sparse layer's routing (ForwardOutput::routing), for tests
  // and tools.
  bool want_routing = false;
  // GLM-5: record every layer's DSA choice (ForwardOutput::index_selection), for tests and tools.
  bool want_index_selection = false;
  // Layer taps of every token (ForwardOutput::layer_taps): the residual stream entering each
  // listed decoder layer, 0 <= layer < num_hidden_layers (transformers' output_hidden_states
  // entry `layer`; entry 0 is the embedding output), what projected-context drafters read. The
  // viewed array must outlive the forward (a layer-sliced prompt forward copies it).
  std::span<const int> tap_layers = {};
  // Work queued behind the forward's reads to the host, before the host waits for them (the reads
  // alone): a host round's accept walk and commit where the tokens are, which the device runs
  // while the host walks the same tokens (BatchEngine). Not for prompt forwards, nor with
  // defer_argmax; targets that cannot queue work there refuse it.
  std::function<void()> after_reads = {};
};

struct ForwardOutput {
  std::vector<float> logits;  // [logits_rows, vocab] when want_logits
  int64_t logits_rows = 0;
  std::vector<int32_t> argmax;        // [logits_rows] when want_argmax (drawn with sample_rows)
  std::vector<float> hidden;          // [Σ n_tokens, hidden] when requested
  std::vector<float> prenorm_hidden;  // [Σ n_tokens, hidden] when requested
  // [Σ n_tokens, tap_layers.size() · hidden]: per token, the listed layers' inputs in the listed
  // order; empty without tap_layers.
  std::vector<float> layer_taps;
  // [sparse layers, Σ n_tokens, experts per token]: the experts each token was routed to, in
  // the router's order (descending probability or choice score), when want_routing.
  std::vector<int32_t> routing;
  // [layers, Σ n_tokens, index_topk]: the positions each token attended to (GLM-5's DSA choice,
  // descending index score, -1 padded), when want_index_selection.
  std::vector<int32_t> index_selection;
};

// A forward's rows as every target checks them: each open, with tokens, listed once, and without
// an uncommitted speculative window (open_window(slot) describes the row's window, "" when it
// has none). Throws Error naming the row; returns the rows' total tokens.
int64_t check_forward_rows(std::span<const RowInput> rows, const std::function<bool(int)>& is_open,
                           const std::function<std::string(int)>& open_window);

// Throws Error unless req.sample_rows is empty or has one entry per logits row of a forward of
// `tokens` tokens that wants its argmax and is not a prompt forward.
void check_sample_rows(const ForwardRequest& req, int64_t tokens);

// Throws Error naming the entry unless every tap layer is in [0, layers).
void check_tap_layers(std::span<const int> tap_layers, int64_t layers);

}  // namespace tandem
