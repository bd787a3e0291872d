// Non-speculative generation: prefill every request's prompt as rows of one forward, then decode
// all live rows together, one token per row per step, until EOS / max tokens.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "tandem/core/sampler.h"
#include "tandem/model/qwen3_5.h"

namespace tandem {

// Prompt tokens per prefill chunk, by default. Every engine prefills a prompt in chunks of a
// fixed size counted from the prompt's start, one chunk per row per forward, so a prompt's numbers
// never depend on a token budget or on which prompts shared its forwards (DESIGN.md §7). The CPU
// kernels are chunk-invariant outright; on CUDA a prompt's numbers depend on where its chunks
// start, so two runs agree byte for byte when they use the same chunk size.
inline constexpr int64_t kPrefillChunkTokens = 256;

struct GenerateRequest {
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  int64_t max_tokens = 128;
  bool ignore_eos = false;
};

enum class FinishReason { Length, Stop };
const char* finish_reason_name(FinishReason r);  // OpenAI names: "length", "stop"

struct GenerateStats {
  double prefill_seconds = 0, decode_seconds = 0;
  double decode_wait_seconds = 0;  // of decode_seconds, blocked on the device
  // Speculative runs (EngineCounters): the drafter's prompt pass and the engine's other work.
  double drafter_prefill_seconds = 0, row_change_seconds = 0;
  double drafter_move_seconds = 0;  // of drafter_prefill_seconds: the rows' move
  int64_t prompt_tokens = 0, generated_tokens = 0;
  int64_t decode_steps = 0;   // forwards after the prefill
  int64_t decode_tokens = 0;  // tokens those forwards produced (all rows)
  // Speculative rounds only (EngineCounters): time drafting, verifying, walking, committing.
  double draft_seconds = 0, verify_seconds = 0, accept_seconds = 0, commit_seconds = 0;
  // Speculative runs: rounds by the depth they ran at ([0..depth], EngineCounters).
  std::vector<int64_t> rounds_by_depth;
  int64_t cold_graph_runs = 0;       // speculative runs: EngineCounters::cold_graph_runs
  int64_t device_commit_rounds = 0;  // speculative runs: EngineCounters::device_commit_rounds
  double prefill_tokens_per_second() const;
  double decode_tokens_per_second() const;  // decode_tokens / decode_seconds
};

struct GenerateResult {
  std::vector<int32_t> tokens;  // generated ids (EOS included when it ended the request)
  FinishReason finish = FinishReason::Length;
};

// Called once per emitted token, in order per request: (request index, token id).
using TokenCallback = std::function<void(size_t, int32_t)>;

// Checks every request against the model before any work starts: empty prompt, ids out of range,
// max_tokens < 1, invalid sampling parameters → Error naming the request.
void validate_requests(const std::vector<GenerateRequest>& requests, int64_t vocab_size);

// Appends an emitted token to `result` and applies the stop rules (EOS unless ignore_eos, then
// max_tokens), setting result->finish. Returns whether the request has finished.
// eos_token_ids: the model's (its config's eos_token_ids).
bool append_token(const GenerateRequest& request, std::span<const int64_t> eos_token_ids,
                  int32_t token, GenerateResult* result);

class Generator {
 public:
  // prefill_chunk: see kPrefillChunkTokens (>= 1). kv_dtype: the KV's storage (Qwen35State).
  explicit Generator(const Qwen35Model& model, int64_t prefill_chunk = kPrefillChunkTokens,
                     DType kv_dtype = Qwen35State::kDefaultKvDType);
  // Validates every request first (empty prompt, ids out of range, sampling parameters,
  // max_tokens < 1 → Error), then runs them all as one batch.
  std::vector<GenerateResult> run(const std::vector<GenerateRequest>& requests,
                                  const TokenCallback& on_token = {},
                                  GenerateStats* stats = nullptr);

 private:
  void decode_greedy(const std::vector<GenerateRequest>& requests, Qwen35State& state,
                     const std::vector<int>& slots, std::vector<bool>& live,
                     const std::function<void(size_t, int32_t)>& emit,
                     std::vector<GenerateResult>& results, GenerateStats& st) const;
  const Qwen35Model& model_;
  int64_t prefill_chunk_;
  DType kv_dtype_;
};

}  // namespace tandem
