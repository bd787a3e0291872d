// A request sink that keeps what the engine streamed: every token id and the outcome. Shared by
// the engine tests (CPU and GPU executables).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "tandem/engine/batch_engine.h"
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

// Runs one request to completion on `engine` (alone in it, after the earlier ones finished):
// its streamed tokens go to `tokens`, and its outcome is returned.
inline RequestOutcome serve_alone(BatchEngine& engine, const GenerateRequest& r,
                                  std::vector<int32_t>* tokens) {
  auto sink = std::make_shared<RecordingSink>();
  EngineRequest er;
  er.gen = r;
  EXPECT_EQ(engine.submit(er, sink), BatchEngine::Submit::Queued);
  engine.run_to_completion();
  EXPECT_TRUE(sink->outcome.has_value());
  *tokens = sink->tokens;
  return *sink->outcome;
}

}  // namespace tandem::test
