#include "tandem/server/stop_text.h"

#include <algorithm>

namespace tandem::server {

StopText::StopText(const Tokenizer& tok, std::vector<std::string> stop)
    : decoder_(tok.stream_decoder(/*skip_special=*/true)), stop_(std::move(stop)) {}

StopText::Piece StopText::push(int32_t id) {
  Piece p;
  if (stopped_) {
    p.stopped = true;
    return p;
  }
  held_ += decoder_.push(id);
  size_t first = std::string::npos;
  for (const std::string& s : stop_) first = std::min(first, held_.find(s));
  if (first != std::string::npos) {
    p.text = held_.substr(0, first);
    p.stopped = stopped_ = true;
    held_.clear();
    return p;
  }
  // The longest suffix of held_ that is a proper prefix of a stop string stays held. A stop
  // string starts at a character boundary, so the cut never splits a UTF-8 sequence.
  size_t keep = 0;
  for (const std::string& s : stop_) {
    for (size_t k = std::min(s.size() - 1, held_.size()); k > keep; --k) {
      if (held_.compare(held_.size() - k, k, s, 0, k) == 0) {
        keep = k;
        break;
      }
    }
  }
  p.text = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return p;
}

std::string StopText::finish() {
  if (stopped_) return {};
  std::string out = held_ + decoder_.finish();
  held_.clear();
  // The flushed bytes can complete a stop string too.
  size_t first = std::string::npos;
  for (const std::string& s : stop_) first = std::min(first, out.find(s));
  if (first != std::string::npos) out.resize(first);
  return out;
}

}  // namespace tandem::server
