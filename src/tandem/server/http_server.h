// tandem's OpenAI-compatible HTTP server (DESIGN.md §7). HTTP threads parse, validate, queue and
// stream; the engine loop (its own thread) owns every model state. Routes:
//   POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET /metrics.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "tandem/engine/batch_engine.h"
#include "tandem/io/chat_template.h"
#include "tandem/io/tokenizer.h"

namespace tandem::server {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;      // 0: any free port (start() returns it)
  std::string api_key;  // empty: no authentication
  std::string served_model_name;
  size_t max_body_bytes = 8u << 20;   // larger bodies get 413
  int64_t default_max_tokens = 4096;  // chat requests without max_tokens (capped by the context)
  int http_threads = 128;             // connections served at once (each stream holds one)
  std::string draft_name = "none";    // for usage.speculation and /metrics
};

// What the server checks requests against: token ids below vocab_size, prompt + max_tokens
// within the context (max_position_embeddings; 0: unchecked).
struct ModelLimits {
  int64_t vocab_size = 0;
  int64_t max_position_embeddings = 0;
};

class Server {
 public:
  // Everything passed in must outlive the server. `tok` and `chat_template` may be null: chat
  // requests are then refused with 400, completions accept token ids only.
  Server(BatchEngine& engine, ModelLimits limits, const Tokenizer* tok,
         const ChatTemplate* chat_template, ServerOptions options);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds the address (throws Error naming it when that fails), starts the engine loop and the
  // HTTP listener; returns the bound port.
  int start();
  // Blocks until stop() and the shutdown it starts have finished: the engine ends every request
  // it holds, the listener closes.
  void wait();
  void stop();  // any thread (not a signal handler)

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem::server
