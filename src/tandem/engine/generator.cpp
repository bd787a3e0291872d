#include "tandem/engine/generator.h"

#include <algorithm>
#include <chrono>

#include "tandem/backend/ops.h"
#include "tandem/core/error.h"

namespace tandem {

namespace {
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

Generator::Generator(const Qwen35Model& model, int64_t prefill_chunk, DType kv_dtype)
    : model_(model), prefill_chunk_(prefill_chunk), kv_dtype_(kv_dtype) {
  ops::check_kv_dtype(kv_dtype_, "Generator");
  if (prefill_chunk_ < 1) fail("the prefill chunk must be at least 1 token, got ", prefill_chunk_);
}

const char* finish_reason_name(FinishReason r) {
  return r == FinishReason::Stop ? "stop" : "length";
}

double GenerateStats::prefill_tokens_per_second() const {
  return prefill_seconds > 0 ? static_cast<double>(prompt_tokens) / prefill_seconds : 0.0;
}

double GenerateStats::decode_tokens_per_second() const {
  return decode_seconds > 0 ? static_cast<double>(decode_tokens) / decode_seconds : 0.0;
}

void validate_requests(const std::vector<GenerateRequest>& requests, int64_t vocab_size) {
  for (size_t i = 0; i < requests.size(); ++i) {
    const GenerateRequest& r = requests[i];
    if (r.prompt.empty()) fail("request ", i, ": the prompt is empty");
    for (int32_t id : r.prompt)
      if (id < 0 || id >= vocab_size)
        fail("request ", i, ": token id ", id, " is out of range [0, ", vocab_size, ")");
    if (r.max_tokens < 1) fail("request ", i, ": max_tokens must be at least 1");
    r.sampling.validate();
  }
}

bool append_token(const GenerateRequest& request, std::span<const int64_t> eos_token_ids,
                  int32_t token, GenerateResult* result) {
  result->tokens.push_back(token);
  const bool eos =
      std::find(eos_token_ids.begin(), eos_token_ids.end(), token) != eos_token_ids.end();
  if (!request.ignore_eos && eos) {
    result->finish = FinishReason::Stop;
    return true;
  }
  if (static_cast<int64_t>(result->tokens.size()) >= request.max_tokens) {
    result->finish = FinishReason::Length;
    return true;
  }
  return false;
}

namespace {
// A decode step of one token per live request, from the host: each request's last token, its
// row, and which request each row is.
void live_step(const std::vector<GenerateResult>& results, const std::vector<int>& slots,
               const std::vector<bool>& live, std::vector<int32_t>& tokens,
               std::vector<RowInput>& rows, std::vector<size_t>& row_req) {
  tokens.clear();
  rows.clear();
  row_req.clear();
  for (size_t i = 0; i < results.size(); ++i) {
    if (!live[i]) continue;
    tokens.push_back(results[i].tokens.back());
    rows.push_back({slots[i], 1});
    row_req.push_back(i);
  }
}
}  // namespace

// Greedy decode steps, pipelined one deep: while step S runs, step S+1 is queued taking S's tokens
// from device memory (tokens_from_argmax), and only then does the host wait for S's tokens. The
// device never waits for the host's turnaround (reading a token back, stop checks, building and
// uploading the next step). S+1 is queued only if it has exactly S's rows: a row whose token
// count reaches max_tokens at S (known before S's token is) ends the chain, and a row that S's
// token stops (EOS) has one extra token computed at S+1, which is dropped; the next step then
// starts from host tokens. The tokens are the ones the unpipelined loop picks, step for step.
void Generator::decode_greedy(const std::vector<GenerateRequest>& requests, Qwen35State& state,
                              const std::vector<int>& slots, std::vector<bool>& live,
                              const std::function<void(size_t, int32_t)>& emit,
                              std::vector<GenerateResult>& results, GenerateStats& st) const {
  ForwardOutput out;
  std::vector<int32_t> tokens, ids;
  struct Step {
    std::vector<RowInput> rows;
    std::vector<size_t> req;  // request of each row
  };
  Step running, next;
  bool in_flight = false;
  // An error (a NaN row, a device fault) leaves no deferred copy behind for the next run.
  struct DropDeferred {
    const Qwen35Model& model;
    ~DropDeferred() {
      try {
        model.drop_deferred_argmax();
      } catch (...) {  // the error being thrown already says what went wrong
      }
    }
  } drop{model_};
  for (;;) {
    if (!in_flight) {  // a step from host tokens: every live request
      live_step(results, slots, live, tokens, running.rows, running.req);
      if (running.rows.empty()) break;
      ForwardRequest step{tokens, running.rows, false, false};
      step.want_logits = false;
      step.want_argmax = true;
      step.defer_argmax = true;
      model_.forward(state, step, &out);
      in_flight = true;
    }
    // The running step's rows continue into the next one unless one of them ends with its token
    // by length, or has already stopped.
    bool chain = true;
    for (const size_t i : running.req)
      if (!live[i] || static_cast<int64_t>(results[i].tokens.size()) + 1 >= requests[i].max_tokens)
        chain = false;
    if (chain) {
      next.rows = running.rows;
      next.req = running.req;
      ForwardRequest step{{}, next.rows, false, false};
      step.want_logits = false;
      step.want_argmax = true;
      step.defer_argmax = true;
      step.tokens_from_argmax = true;
      model_.forward(state, step, &out);
    }
    model_.collect_argmax(&ids);
    ++st.decode_steps;
    for (size_t r = 0; r < running.req.size(); ++r) {
      const size_t i = running.req[r];
      if (!live[i]) continue;  // stopped at the previous step: this token is dropped
      emit(i, ids[r]);
      ++st.decode_tokens;
    }
    in_flight = chain;
    if (chain) std::swap(running, next);
  }
}

std::vector<GenerateResult> Generator::run(const std::vector<GenerateRequest>& requests,
                                           const TokenCallback& on_token, GenerateStats* stats) {
  const Qwen35Config& cfg = model_.config();
  validate_requests(requests, cfg.vocab_size);
  const size_t B = requests.size();
  std::vector<GenerateResult> results(B);
  if (B == 0) return results;

  Qwen35State state(cfg, Qwen35State::kDefaultRollback, kv_dtype_);
  std::vector<int> slots(B);
  for (size_t i = 0; i < B; ++i) slots[i] = state.open_row();

  std::vector<bool> live(B, true);
  // Emits the token sampled for request i; returns whether the request continues.
  auto emit = [&](size_t i, int32_t tok) {
    if (append_token(requests[i], cfg.eos_token_ids, tok, &results[i])) live[i] = false;
    if (on_token) on_token(i, tok);
  };

  GenerateStats st;
  ForwardOutput out;
  std::vector<int32_t> tokens;
  std::vector<RowInput> rows;
  std::vector<size_t> row_req;

  auto t0 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < B; ++i)
    st.prompt_tokens += static_cast<int64_t>(requests[i].prompt.size());
  // Greedy requests only: the forward picks the tokens where the logits are (one small copy
  // per step instead of the logits). Same tokens as sample_token at temperature 0.
  const bool greedy = std::all_of(requests.begin(), requests.end(),
                                  [](const GenerateRequest& r) { return r.sampling.greedy(); });
  const int64_t V = cfg.vocab_size;
  auto pick = [&](size_t r, size_t i, uint64_t index) {
    if (greedy) return out.argmax[r];
    std::span<const float> logits(out.logits.data() + r * V, static_cast<size_t>(V));
    return sample_token(logits, requests[i].sampling, index);
  };
  // Prompts run in chunks of prefill_chunk_ tokens counted from their start, one chunk per row per
  // forward, exactly as the batch engine prefills them: both compute a prompt's numbers alike.
  std::vector<int64_t> prefilled(B, 0);
  for (;;) {
    tokens.clear();
    rows.clear();
    row_req.clear();
    for (size_t i = 0; i < B; ++i) {
      const int64_t L = static_cast<int64_t>(requests[i].prompt.size());
      if (prefilled[i] == L) continue;
      const int64_t n = std::min(prefill_chunk_, L - prefilled[i]);
      tokens.insert(tokens.end(), requests[i].prompt.begin() + prefilled[i],
                    requests[i].prompt.begin() + prefilled[i] + n);
      rows.push_back({slots[i], n});
      row_req.push_back(i);
    }
    if (rows.empty()) break;
    ForwardRequest prefill{tokens, rows, false, false};
    prefill.prompt = true;
    prefill.prompt_gemm_rows = ops::prefill_gemm_rows(prefill_chunk_);
    prefill.want_logits = !greedy;
    prefill.want_argmax = greedy;
    model_.forward(state, prefill, &out);
    for (size_t r = 0; r < rows.size(); ++r) {
      const size_t i = row_req[r];
      prefilled[i] += rows[r].n_tokens;
      if (prefilled[i] == static_cast<int64_t>(requests[i].prompt.size())) emit(i, pick(r, i, 0));
    }
  }
  st.prefill_seconds = seconds_since(t0);

  t0 = std::chrono::steady_clock::now();
  const double wait0 = ops::device_wait_seconds();
  if (greedy) {
    decode_greedy(requests, state, slots, live, emit, results, st);
  } else {
    for (;;) {
      live_step(results, slots, live, tokens, rows, row_req);
      if (rows.empty()) break;
      ForwardRequest step{tokens, rows, false, false};
      model_.forward(state, step, &out);
      for (size_t r = 0; r < row_req.size(); ++r) {
        const size_t i = row_req[r];
        emit(i, pick(r, i, static_cast<uint64_t>(results[i].tokens.size())));
      }
      ++st.decode_steps;
      st.decode_tokens += static_cast<int64_t>(row_req.size());
    }
  }
  st.decode_seconds = seconds_since(t0);
  st.decode_wait_seconds = ops::device_wait_seconds() - wait0;
  for (const auto& r : results) st.generated_tokens += static_cast<int64_t>(r.tokens.size());
  if (stats) *stats = st;
  return results;
}

}  // namespace tandem
