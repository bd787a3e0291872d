// A request sink that keeps what the engine streamed: every token id and the outcome. Shared by
// the engine tests (CPU and GPU executables).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "tandem/engine/request_sink.h"

namespace tandem::test {

class RecordingSink : public RequestSink {
 public:
  std::vector<int32_t> tokens;
  std::optional<RequestOutcome> outcome;
  bool on_token(const TokenOutput& t) override {
    tokens.push_back(t.id);
    return true;
  }
  void on_finish(const RequestOutcome& o) override { outcome = o; }
};

}  // namespace tandem::test
