// A request's text as its tokens arrive, with its stop strings applied (OpenAI semantics: the
// text ends just before the first occurrence of any stop string, which is not returned).
// Text that could still become the start of a stop string is held back until it cannot, so no
// byte is ever sent and then taken back.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tandem/io/tokenizer.h"

namespace tandem::server {

class StopText {
 public:
  // `tok` must outlive this. Special tokens (EOS, chat markers) are left out of the text.
  StopText(const Tokenizer& tok, std::vector<std::string> stop);

  struct Piece {
    std::string text;      // ready to send
    bool stopped = false;  // a stop string matched; the text ends before it
  };
  Piece push(int32_t id);
  // The text still held at the end of a request that did not stop on a stop string: incomplete
  // UTF-8 becomes U+FFFD, held-back stop prefixes are released.
  std::string finish();

 private:
  Tokenizer::StreamDecoder decoder_;
  std::vector<std::string> stop_;
  std::string held_;  // decoded, not yet sent: a suffix that may begin a stop string
  bool stopped_ = false;
};

}  // namespace tandem::server
