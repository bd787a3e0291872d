#include "tandem/engine/generator.h"

#include <algorithm>
#include <chrono>

#include "tandem/core/error.h"

namespace tandem {

namespace {
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

const char* finish_reason_name(FinishReason r) {
  return r == FinishReason::Stop ? "stop" : "length";
}

double GenerateStats::prefill_tokens_per_second() const {
  return prefill_seconds > 0 ? static_cast<double>(prompt_tokens) / prefill_seconds : 0.0;
}

double GenerateStats::decode_tokens_per_second() const {
  return decode_seconds > 0 ? static_cast<double>(decode_tokens) / decode_seconds : 0.0;
}

void validate_requests(const std::vector<GenerateRequest>& requests, const Qwen35Config& cfg) {
  for (size_t i = 0; i < requests.size(); ++i) {
    const GenerateRequest& r = requests[i];
    if (r.prompt.empty()) fail("request ", i, ": the prompt is empty");
    for (int32_t id : r.prompt)
      if (id < 0 || id >= cfg.vocab_size)
        fail("request ", i, ": token id ", id, " is out of range [0, ", cfg.vocab_size, ")");
    if (r.max_tokens < 1) fail("request ", i, ": max_tokens must be at least 1");
    r.sampling.validate();
  }
}

bool append_token(const GenerateRequest& request, const Qwen35Config& cfg, int32_t token,
                  GenerateResult* result) {
  result->tokens.push_back(token);
  const bool eos = std::find(cfg.eos_token_ids.begin(), cfg.eos_token_ids.end(), token) !=
                   cfg.eos_token_ids.end();
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

std::vector<GenerateResult> Generator::run(const std::vector<GenerateRequest>& requests,
                                           const TokenCallback& on_token, GenerateStats* stats) {
  const Qwen35Config& cfg = model_.config();
  validate_requests(requests, cfg);
  const size_t B = requests.size();
  std::vector<GenerateResult> results(B);
  if (B == 0) return results;

  Qwen35State state(cfg);
  std::vector<int> slots(B);
  for (size_t i = 0; i < B; ++i) slots[i] = state.open_row();

  std::vector<bool> live(B, true);
  // Emits the token sampled for request i; returns whether the request continues.
  auto emit = [&](size_t i, int32_t tok) {
    if (append_token(requests[i], cfg, tok, &results[i])) live[i] = false;
    if (on_token) on_token(i, tok);
  };

  GenerateStats st;
  ForwardOutput out;
  std::vector<int32_t> tokens;
  std::vector<RowInput> rows;
  std::vector<size_t> row_req;

  auto t0 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < B; ++i) {
    tokens.insert(tokens.end(), requests[i].prompt.begin(), requests[i].prompt.end());
    rows.push_back({slots[i], static_cast<int64_t>(requests[i].prompt.size())});
    st.prompt_tokens += static_cast<int64_t>(requests[i].prompt.size());
  }
  // Greedy requests only: the forward picks the tokens where the logits are (one small copy
  // per step instead of the logits). Same tokens as sample_token at temperature 0.
  const bool greedy = std::all_of(requests.begin(), requests.end(),
                                  [](const GenerateRequest& r) { return r.sampling.greedy(); });
  ForwardRequest prefill{tokens, rows, false, false};
  prefill.prompt = true;
  prefill.want_logits = !greedy;
  prefill.want_argmax = greedy;
  model_.forward(state, prefill, &out);
  const int64_t V = cfg.vocab_size;
  auto pick = [&](size_t r, size_t i, uint64_t index) {
    if (greedy) return out.argmax[r];
    std::span<const float> logits(out.logits.data() + r * V, static_cast<size_t>(V));
    return sample_token(logits, requests[i].sampling, index);
  };
  for (size_t i = 0; i < B; ++i) emit(i, pick(i, i, 0));
  st.prefill_seconds = seconds_since(t0);

  t0 = std::chrono::steady_clock::now();
  for (;;) {
    tokens.clear();
    rows.clear();
    row_req.clear();
    for (size_t i = 0; i < B; ++i) {
      if (!live[i]) continue;
      tokens.push_back(results[i].tokens.back());
      rows.push_back({slots[i], 1});
      row_req.push_back(i);
    }
    if (rows.empty()) break;
    ForwardRequest step{tokens, rows, false, false};
    step.want_logits = !greedy;
    step.want_argmax = greedy;
    model_.forward(state, step, &out);
    for (size_t r = 0; r < row_req.size(); ++r) {
      const size_t i = row_req[r];
      emit(i, pick(r, i, static_cast<uint64_t>(results[i].tokens.size())));
    }
    ++st.decode_steps;
    st.decode_tokens += static_cast<int64_t>(row_req.size());
  }
  st.decode_seconds = seconds_since(t0);
  for (const auto& r : results) st.generated_tokens += static_cast<int64_t>(r.tokens.size());
  if (stats) *stats = st;
  return results;
}

}  // namespace tandem
