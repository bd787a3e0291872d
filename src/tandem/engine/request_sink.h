// What a request served by the batch engine receives, and how its consumer talks back: tokens as
// they are accepted, one outcome at the end, and a cancellation flag polled between rounds.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "tandem/engine/generator.h"
#include "tandem/engine/speculative.h"

namespace tandem {

// One emitted token. Log-probabilities are the target's raw distribution (log softmax of its
// logits, before temperature and filters), present only when the request asked for them.
struct TokenOutput {
  int32_t id = 0;
  uint64_t index = 0;  // absolute output index (0 = the first generated token)
  bool has_logprob = false;
  float logprob = 0.0f;
  std::vector<std::pair<int32_t, float>> top_logprobs;  // descending, ties by ascending id
};

enum class RequestEnd {
  Finished,   // EOS, max tokens, or the consumer's stop (result.finish says which)
  Cancelled,  // the consumer cancelled (a client that went away)
  Failed,     // an error ended this request alone (error says what)
};

struct RequestOutcome {
  RequestEnd end = RequestEnd::Finished;
  FinishReason finish = FinishReason::Length;
  std::string error;
  int64_t prompt_tokens = 0;
  int64_t cached_tokens = 0;     // prompt tokens restored from the prefix cache, not prefilled
  int64_t generated_tokens = 0;  // tokens handed to on_token
  SpecStats speculation;
};

// Callbacks run on the engine thread, between or inside rounds: keep them short. The engine
// catches what they throw and ends that request alone (RequestEnd::Failed).
class RequestSink {
 public:
  virtual ~RequestSink() = default;
  // Returns false to end the request after this token (a stop string matched): the rest of the
  // round's tokens for it are dropped and it finishes with FinishReason::Stop.
  virtual bool on_token(const TokenOutput& token) = 0;
  // Exactly once, last.
  virtual void on_finish(const RequestOutcome& outcome) = 0;
  // Any thread may set it; the engine polls it between rounds and frees the row.
  virtual bool cancelled() const { return false; }
};

struct EngineRequest {
  GenerateRequest gen;
  int top_logprobs = -1;  // -1: no log-probabilities; 0..20: the token's and that many others
};

}  // namespace tandem
