// One HTTP request's view of its engine row: the engine thread pushes tokens (detokenized, stop
// strings applied) and the outcome; the HTTP thread waits for them and writes the response.
// Cancelling (a client that went away) is seen by the engine between rounds.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "tandem/engine/request_sink.h"
#include "tandem/server/metrics.h"
#include "tandem/server/stop_text.h"

namespace tandem::server {

// What arrived since the last take(): text, the tokens behind it, and the end if it came.
struct StreamBatch {
  std::string text;
  std::vector<TokenOutput> tokens;
  std::optional<RequestOutcome> outcome;
};

class RequestStream : public RequestSink {
 public:
  // `tok` null: no text (token-id completions of a model without a tokenizer).
  RequestStream(const Tokenizer* tok, std::vector<std::string> stop, ServerMetrics& metrics);

  // Engine thread.
  bool on_token(const TokenOutput& token) override;
  void on_finish(const RequestOutcome& outcome) override;
  bool cancelled() const override { return cancelled_; }

  // HTTP thread. Waits up to `timeout` for something new; returns false on timeout.
  bool take(StreamBatch* out, std::chrono::milliseconds timeout);
  void cancel() { cancelled_ = true; }
  bool finished() const;
  // Whether a stop string ended the request (finish_reason "stop").
  bool stopped_on_string() const { return stopped_on_string_; }

 private:
  std::optional<StopText> text_;
  ServerMetrics& metrics_;
  std::chrono::steady_clock::time_point arrived_, last_token_;
  bool any_token_ = false;
  std::atomic<bool> cancelled_{false};
  std::atomic<bool> stopped_on_string_{false};

  mutable std::mutex mu_;
  std::condition_variable ready_;
  StreamBatch pending_;
  bool finished_ = false;
};

}  // namespace tandem::server
