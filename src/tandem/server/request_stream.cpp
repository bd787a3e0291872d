#include "tandem/server/request_stream.h"

namespace tandem::server {

namespace {
double seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}
}  // namespace

RequestStream::RequestStream(const Tokenizer* tok, std::vector<std::string> stop,
                             ServerMetrics& metrics)
    : metrics_(metrics), arrived_(std::chrono::steady_clock::now()) {
  if (tok) text_.emplace(*tok, std::move(stop));
}

bool RequestStream::on_token(const TokenOutput& token) {
  const auto now = std::chrono::steady_clock::now();
  if (!any_token_)
    metrics_.time_to_first_token().observe(seconds(now - arrived_));
  else
    metrics_.inter_token_latency().observe(seconds(now - last_token_));
  any_token_ = true;
  last_token_ = now;
  StopText::Piece piece;
  if (text_) piece = text_->push(token.id);  // may throw: the engine ends this request alone
  {
    std::lock_guard lock(mu_);
    pending_.text += piece.text;
    pending_.tokens.push_back(token);
  }
  ready_.notify_all();
  if (piece.stopped) stopped_on_string_ = true;
  return !piece.stopped;
}

void RequestStream::on_finish(const RequestOutcome& outcome) {
  std::string tail;
  if (text_ && outcome.end == RequestEnd::Finished) {
    try {
      tail = text_->finish();
    } catch (...) {  // the tokens were all decoded once already; nothing more to add
    }
  }
  if (any_token_) metrics_.request_latency().observe(seconds(last_token_ - arrived_));
  metrics_.count_request(outcome.end == RequestEnd::Finished    ? "ok"
                         : outcome.end == RequestEnd::Cancelled ? "cancelled"
                                                                : "error");
  {
    std::lock_guard lock(mu_);
    pending_.text += tail;
    pending_.outcome = outcome;
    finished_ = true;
  }
  ready_.notify_all();
}

bool RequestStream::take(StreamBatch* out, std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  const bool got = ready_.wait_for(lock, timeout, [&] {
    return !pending_.tokens.empty() || !pending_.text.empty() || pending_.outcome.has_value();
  });
  if (!got) return false;
  *out = std::move(pending_);
  pending_ = StreamBatch{};
  return true;
}

bool RequestStream::finished() const {
  std::lock_guard lock(mu_);
  return finished_;
}

}  // namespace tandem::server
