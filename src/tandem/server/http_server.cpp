#include "tandem/server/http_server.h"

#include <httplib.h>

#include <atomic>
#include <ctime>
#include <nlohmann/json.hpp>
#include <random>

#include "tandem/core/error.h"
#include "tandem/server/api_error.h"
#include "tandem/server/api_request.h"
#include "tandem/server/metrics.h"
#include "tandem/server/request_stream.h"

namespace tandem::server {

namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;
constexpr auto kPoll = std::chrono::milliseconds(50);

// Serialises JSON that may carry client bytes (an echoed parse error): ill-formed UTF-8 becomes
// U+FFFD instead of an exception.
std::string dump(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

json error_body(const ApiError& e) {
  json err = {{"message", e.what()},
              {"type", e.type()},
              {"param", e.param().empty() ? json(nullptr) : json(e.param())},
              {"code", e.code().empty() ? json(nullptr) : json(e.code())}};
  return {{"error", err}};
}

void send_error(httplib::Response& res, const ApiError& e) {
  res.status = e.status();
  res.set_content(dump(error_body(e)), "application/json");
}

std::string random_id(const char* prefix) {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  char buf[40];
  std::snprintf(buf, sizeof(buf), "%s%016llx%08llx", prefix, static_cast<unsigned long long>(rng()),
                static_cast<unsigned long long>(rng() & 0xffffffffu));
  return buf;
}

uint64_t random_seed() {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  return rng();
}

const char* finish_name(const RequestOutcome& o) {
  return finish_reason_name(o.finish);
}

}  // namespace

struct Server::Impl {
  BatchEngine& engine;
  const ModelLimits limits;
  const Tokenizer* tok;
  const ChatTemplate* chat_template;
  ServerOptions opts;
  httplib::Server http;
  ServerMetrics metrics;
  std::thread engine_thread, http_thread;
  std::atomic<bool> stopping{false};
  int64_t created = static_cast<int64_t>(std::time(nullptr));

  Impl(BatchEngine& e, ModelLimits c, const Tokenizer* t, const ChatTemplate* ct, ServerOptions o)
      : engine(e), limits(c), tok(t), chat_template(ct), opts(std::move(o)) {}

  void check_auth(const httplib::Request& req) const {
    if (opts.api_key.empty()) return;
    const std::string want = "Bearer " + opts.api_key;
    const std::string got = req.get_header_value("Authorization");
    // Compared in full, whatever the first difference, so timing tells nothing about the key.
    bool same = got.size() == want.size();
    unsigned diff = 0;
    for (size_t i = 0; i < want.size(); ++i)
      diff |= static_cast<unsigned>(want[i]) ^ static_cast<unsigned>(i < got.size() ? got[i] : 0);
    if (!same || diff != 0)
      throw ApiError(401, "missing or invalid API key (Authorization: Bearer KEY)", "",
                     "invalid_api_key");
  }

  json token_logprob(const TokenOutput& t) const {
    auto text = [&](int32_t id) {
      if (!tok) return "token_id:" + std::to_string(id);
      const int32_t one[1] = {id};
      return tok->decode(one);
    };
    auto bytes = [](const std::string& s) {
      json b = json::array();
      for (unsigned char c : s) b.push_back(c);
      return b;
    };
    json top = json::array();
    for (const auto& [id, lp] : t.top_logprobs) {
      const std::string s = text(id);
      top.push_back({{"token", s}, {"logprob", lp}, {"bytes", bytes(s)}});
    }
    const std::string s = text(t.id);
    return {{"token", s}, {"logprob", t.logprob}, {"bytes", bytes(s)}, {"top_logprobs", top}};
  }

  // Completions' legacy logprobs object for a run of tokens starting at text offset `offset`.
  json legacy_logprobs(const std::vector<TokenOutput>& toks, size_t offset) const {
    json tokens = json::array(), lps = json::array(), tops = json::array(), offsets = json::array();
    for (const TokenOutput& t : toks) {
      const json one = token_logprob(t);
      tokens.push_back(one["token"]);
      lps.push_back(t.logprob);
      json top = json::object();
      for (const json& alt : one["top_logprobs"])
        top[alt["token"].get<std::string>()] = alt["logprob"];
      tops.push_back(top);
      offsets.push_back(offset);
      offset += one["token"].get<std::string>().size();
    }
    return {{"tokens", tokens},
            {"token_logprobs", lps},
            {"top_logprobs", tops},
            {"text_offset", offsets}};
  }

  json usage(const RequestOutcome& o) const {
    const SpecStats& s = o.speculation;
    json spec = {{"draft", opts.draft_name},
                 {"depth", engine.depth()},
                 {"rounds", s.rounds},
                 {"drafted", s.drafted},
                 {"accepted", s.accepted},
                 {"accepted_by_position", s.accepted_by_position},
                 {"mean_accepted_length", s.mean_accepted_length()}};
    return {{"prompt_tokens", o.prompt_tokens},
            {"completion_tokens", o.generated_tokens},
            {"total_tokens", o.prompt_tokens + o.generated_tokens},
            {"prompt_tokens_details", {{"cached_tokens", o.cached_tokens}}},
            {"speculation", spec}};
  }

  // A request as the engine takes it; throws ApiError for anything wrong with it.
  struct Prepared {
    ApiRequest api;
    EngineRequest engine;
    std::string prompt_text;  // completions with echo
  };

  Prepared prepare(const httplib::Request& req, ApiRequest::Kind kind) const {
    const nlohmann::ordered_json body = parse_request_body(req.body);
    Prepared p;
    p.api =
        kind == ApiRequest::Kind::Chat ? parse_chat_request(body) : parse_completion_request(body);
    ApiRequest& a = p.api;
    if (a.model != opts.served_model_name)
      throw ApiError(404,
                     "the model '" + a.model + "' does not exist; this server serves '" +
                         opts.served_model_name + "'",
                     "model", "model_not_found");
    if (!a.stop.empty() && !tok)
      bad_request("stop", "'stop' needs a tokenizer; this model directory has none");
    std::vector<int32_t> ids;
    if (kind == ApiRequest::Kind::Chat) {
      if (!chat_template || !tok)
        bad_request("messages",
                    "this model has no chat template (or no tokenizer); use "
                    "/v1/completions");
      std::string text;
      try {
        text =
            chat_template->render(a.messages, a.add_generation_prompt, a.tools, a.template_kwargs);
      } catch (const Error& e) {
        bad_request("messages", "the chat template refused the conversation: ", e.what());
      }
      ids = tok->encode(text);
    } else if (a.prompt_text) {
      if (!tok) bad_request("prompt", "text prompts need a tokenizer; send token ids");
      ids = tok->encode(*a.prompt_text);
      p.prompt_text = *a.prompt_text;
    } else {
      ids = a.prompt_ids;
      for (int32_t id : ids)
        if (id >= limits.vocab_size)
          bad_request("prompt", "token id ", id, " is out of range [0, ", limits.vocab_size, ")");
      if (a.echo && tok) p.prompt_text = tok->decode(ids);
    }
    if (ids.empty()) bad_request("prompt", "the prompt has no tokens");
    const int64_t context = limits.max_position_embeddings;
    const int64_t n = static_cast<int64_t>(ids.size());
    if (context > 0 && n >= context)
      throw ApiError(400,
                     "the prompt is " + std::to_string(n) + " tokens; the model's context is " +
                         std::to_string(context) + " tokens",
                     "messages", "context_length_exceeded");
    int64_t max_tokens = a.max_tokens.value_or(opts.default_max_tokens);
    if (context > 0) {
      if (a.max_tokens && n + *a.max_tokens > context)
        throw ApiError(400,
                       "the prompt (" + std::to_string(n) + " tokens) plus max_tokens (" +
                           std::to_string(*a.max_tokens) + ") exceed the model's context of " +
                           std::to_string(context) + " tokens",
                       "max_tokens", "context_length_exceeded");
      max_tokens = std::min(max_tokens, context - n);
    }
    p.engine.gen.prompt = std::move(ids);
    p.engine.gen.sampling = a.sampling;
    if (!a.seed_given) p.engine.gen.sampling.seed = random_seed();
    p.engine.gen.max_tokens = max_tokens;
    p.engine.gen.ignore_eos = a.ignore_eos;
    p.engine.top_logprobs = a.top_logprobs;
    return p;
  }

  void generate(const httplib::Request& req, httplib::Response& res, ApiRequest::Kind kind) {
    std::shared_ptr<RequestStream> stream;
    Prepared p;
    try {
      check_auth(req);
      p = prepare(req, kind);
      stream = std::make_shared<RequestStream>(tok, p.api.stop, metrics);
      BatchEngine::Submit s;
      try {
        s = engine.submit(p.engine, stream);
      } catch (const ApiError&) {
        throw;
      } catch (const Error& e) {
        throw ApiError(400, e.what());
      }
      if (s == BatchEngine::Submit::QueueFull)
        throw ApiError(503, "the server is overloaded: its queue is full; retry later", "",
                       "overloaded");
    } catch (const ApiError& e) {
      if (e.status() != 401) metrics.count_request(e.status() == 503 ? "overloaded" : "invalid");
      send_error(res, e);
      return;
    }
    const bool chat = kind == ApiRequest::Kind::Chat;
    const std::string id = random_id(chat ? "chatcmpl-" : "cmpl-");
    const int64_t created_at = static_cast<int64_t>(std::time(nullptr));
    auto base = [&, id, created_at](const char* object) {
      return json{{"id", id},
                  {"object", object},
                  {"created", created_at},
                  {"model", opts.served_model_name}};
    };
    if (p.api.stream) {
      stream_response(res, stream, p, base(chat ? "chat.completion.chunk" : "text_completion"));
      return;
    }
    // Whole response: wait for the end.
    std::string text = p.api.echo ? p.prompt_text : "";
    std::vector<TokenOutput> tokens;
    RequestOutcome outcome;
    for (;;) {
      StreamBatch b;
      if (!stream->take(&b, kPoll)) continue;
      text += b.text;
      tokens.insert(tokens.end(), b.tokens.begin(), b.tokens.end());
      if (b.outcome) {
        outcome = *b.outcome;
        break;
      }
    }
    if (outcome.end != RequestEnd::Finished) {
      const bool shutdown = outcome.end == RequestEnd::Cancelled;
      send_error(res, ApiError(shutdown ? 503 : 500,
                               (shutdown ? "request cancelled: " : "generation failed: ") +
                                   outcome.error));
      return;
    }
    json choice = {{"index", 0}, {"finish_reason", finish_name(outcome)}, {"logprobs", nullptr}};
    if (chat) {
      choice["message"] = {{"role", "assistant"}, {"content", text}};
      if (p.engine.top_logprobs >= 0) {
        json content = json::array();
        for (const TokenOutput& t : tokens) content.push_back(token_logprob(t));
        choice["logprobs"] = {{"content", content}};
      }
    } else {
      choice["text"] = text;
      if (p.engine.top_logprobs >= 0)
        choice["logprobs"] = legacy_logprobs(tokens, p.api.echo ? p.prompt_text.size() : 0);
    }
    json out = base(chat ? "chat.completion" : "text_completion");
    if (p.api.return_token_ids) {
      json ids = json::array();
      for (const TokenOutput& t : tokens) ids.push_back(t.id);
      choice["token_ids"] = ids;
      out["prompt_token_ids"] = p.engine.gen.prompt;
    }
    out["choices"] = json::array({choice});
    out["usage"] = usage(outcome);
    res.set_content(dump(out), "application/json");
  }

  // Server-sent events: OpenAI's chunk objects, a final chunk with finish_reason, the usage
  // chunk when asked for, then `data: [DONE]`. A client that goes away cancels its row.
  void stream_response(httplib::Response& res, std::shared_ptr<RequestStream> stream,
                       const Prepared& p, json base) {
    struct State {
      bool started = false, done = false;
      size_t text_offset = 0;
    };
    auto st = std::make_shared<State>();
    const bool chat = base["object"] == "chat.completion.chunk";
    const bool include_usage = p.api.include_usage;
    const int top_logprobs = p.engine.top_logprobs;
    const bool return_ids = p.api.return_token_ids;
    std::string echo = p.api.echo ? p.prompt_text : "";
    std::vector<int32_t> prompt_ids = p.engine.gen.prompt;
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, stream, st, base, chat, include_usage, top_logprobs, return_ids, echo, prompt_ids](
            size_t, httplib::DataSink& sink) mutable {
          auto send = [&](const json& j) {
            const std::string s = "data: " + dump(j) + "\n\n";
            return sink.write(s.data(), s.size());
          };
          auto chunk = [&](json choice) {
            json c = base;
            c["choices"] = json::array({std::move(choice)});
            if (include_usage) c["usage"] = nullptr;
            return c;
          };
          if (st->done) {
            sink.done();
            return true;
          }
          if (!st->started) {
            st->started = true;
            json first = chat ? chunk({{"index", 0},
                                       {"delta", {{"role", "assistant"}, {"content", ""}}},
                                       {"logprobs", nullptr},
                                       {"finish_reason", nullptr}})
                              : chunk({{"index", 0},
                                       {"text", echo},
                                       {"logprobs", nullptr},
                                       {"finish_reason", nullptr}});
            if (return_ids) first["prompt_token_ids"] = prompt_ids;
            st->text_offset = echo.size();
            return send(first);
          }
          StreamBatch b;
          if (!stream->take(&b, kPoll)) return sink.is_writable();
          if (!b.tokens.empty() || !b.text.empty()) {
            json choice = {{"index", 0}, {"logprobs", nullptr}, {"finish_reason", nullptr}};
            if (chat)
              choice["delta"] = {{"content", b.text}};
            else
              choice["text"] = b.text;
            if (top_logprobs >= 0) {
              if (chat) {
                json content = json::array();
                for (const TokenOutput& t : b.tokens) content.push_back(token_logprob(t));
                choice["logprobs"] = {{"content", content}};
              } else {
                choice["logprobs"] = legacy_logprobs(b.tokens, st->text_offset);
              }
            }
            if (return_ids) {
              json ids = json::array();
              for (const TokenOutput& t : b.tokens) ids.push_back(t.id);
              choice["token_ids"] = ids;
            }
            st->text_offset += b.text.size();
            if (!send(chunk(choice))) return false;
          }
          if (!b.outcome) return true;
          const RequestOutcome& o = *b.outcome;
          if (o.end != RequestEnd::Finished) {
            const bool shutdown = o.end == RequestEnd::Cancelled;
            send(error_body(
                ApiError(shutdown ? 503 : 500,
                         (shutdown ? "request cancelled: " : "generation failed: ") + o.error)));
          } else {
            json last = {{"index", 0}, {"logprobs", nullptr}, {"finish_reason", finish_name(o)}};
            if (chat)
              last["delta"] = json::object();
            else
              last["text"] = "";
            send(chunk(last));
            if (include_usage) {
              json u = base;
              u["choices"] = json::array();
              u["usage"] = usage(o);
              send(u);
            }
          }
          const std::string done = "data: [DONE]\n\n";
          sink.write(done.data(), done.size());
          st->done = true;
          sink.done();
          return true;
        },
        [stream](bool) {
          // Whatever ended the response (client gone, write error, shutdown): free the row.
          if (!stream->finished()) stream->cancel();
        });
  }

  void install_routes() {
    http.set_payload_max_length(opts.max_body_bytes);
    // Streams write one small chunk per round: Nagle's algorithm would hold them back for the
    // client's delayed ACK (tens of ms), bunching tokens and inflating inter-token latency.
    http.set_tcp_nodelay(true);
    const size_t threads = static_cast<size_t>(std::max(8, opts.http_threads));
    http.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
    http.Post("/v1/chat/completions", [this](const httplib::Request& q, httplib::Response& r) {
      generate(q, r, ApiRequest::Kind::Chat);
    });
    http.Post("/v1/completions", [this](const httplib::Request& q, httplib::Response& r) {
      generate(q, r, ApiRequest::Kind::Completion);
    });
    http.Get("/v1/models", [this](const httplib::Request& q, httplib::Response& r) {
      try {
        check_auth(q);
      } catch (const ApiError& e) {
        return send_error(r, e);
      }
      json m = {{"id", opts.served_model_name},
                {"object", "model"},
                {"created", created},
                {"owned_by", "tandem"},
                {"max_model_len", limits.max_position_embeddings}};
      r.set_content(json{{"object", "list"}, {"data", json::array({m})}}.dump(),
                    "application/json");
    });
    http.Get("/v1/models/(.+)", [this](const httplib::Request& q, httplib::Response& r) {
      try {
        check_auth(q);
        if (q.matches[1] != opts.served_model_name)
          throw ApiError(404, "the model '" + std::string(q.matches[1]) + "' does not exist",
                         "model", "model_not_found");
      } catch (const ApiError& e) {
        return send_error(r, e);
      }
      r.set_content(json{{"id", opts.served_model_name},
                         {"object", "model"},
                         {"created", created},
                         {"owned_by", "tandem"}}
                        .dump(),
                    "application/json");
    });
    http.Get("/health", [this](const httplib::Request&, httplib::Response& r) {
      if (stopping) {
        r.status = 503;
        r.set_content(R"({"status":"shutting down"})", "application/json");
      } else {
        r.set_content(R"({"status":"ok"})", "application/json");
      }
    });
    http.Get("/metrics", [this](const httplib::Request& q, httplib::Response& r) {
      try {
        check_auth(q);
      } catch (const ApiError& e) {
        return send_error(r, e);
      }
      r.set_content(metrics.render(engine.counters(), opts.draft_name),
                    "text/plain; version=0.0.4");
    });
    // Every error without a body of its own (no route, wrong method, body too large, a request
    // httplib could not parse) in OpenAI's shape.
    const httplib::Server::HandlerWithResponse on_error = [](const httplib::Request& q,
                                                             httplib::Response& r) {
      if (!r.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
      std::string msg;
      if (r.status == 404)
        msg = "no route " + q.method + " " + q.path;
      else if (r.status == 413)
        msg = "the request body is too large";
      else
        msg = "the request could not be served (HTTP " + std::to_string(r.status) + ")";
      r.set_content(dump(error_body(ApiError(r.status, msg))), "application/json");
      return httplib::Server::HandlerResponse::Handled;
    };
    http.set_error_handler(on_error);
    http.set_exception_handler(
        [](const httplib::Request&, httplib::Response& r, std::exception_ptr ep) {
          std::string msg = "internal error";
          try {
            std::rethrow_exception(ep);
          } catch (const std::exception& e) {
            msg += std::string(": ") + e.what();
          } catch (...) {
          }
          send_error(r, ApiError(500, msg));
        });
  }
};

Server::Server(BatchEngine& engine, ModelLimits limits, const Tokenizer* tok,
               const ChatTemplate* chat_template, ServerOptions options)
    : impl_(std::make_unique<Impl>(engine, limits, tok, chat_template, std::move(options))) {
  impl_->install_routes();
}

Server::~Server() {
  stop();
  wait();
}

int Server::start() {
  Impl& s = *impl_;
  int port = s.opts.port;
  if (port == 0) {
    port = s.http.bind_to_any_port(s.opts.host);
    if (port < 0) fail("cannot listen on ", s.opts.host, " (any port)");
  } else if (!s.http.bind_to_port(s.opts.host, port)) {
    fail("cannot listen on ", s.opts.host, ":", port, " (address in use, or not allowed)");
  }
  s.engine_thread = std::thread([&s] { s.engine.serve(); });
  s.http_thread = std::thread([&s] { s.http.listen_after_bind(); });
  return port;
}

void Server::stop() {
  Impl& s = *impl_;
  if (s.stopping.exchange(true)) return;
  // The engine first: it ends every request it holds (each HTTP thread then writes its
  // response), then the listener.
  s.engine.stop();
  if (s.engine_thread.joinable()) s.engine_thread.join();
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  s.http.stop();
}

void Server::wait() {
  // The listener returns once stop() has ended the engine loop (stop joins that thread).
  if (impl_->http_thread.joinable()) impl_->http_thread.join();
}

}  // namespace tandem::server
