// The parameters of an OpenAI chat-completions or completions request, read from its parsed JSON
// body (key order kept: chat templates print tools and arguments as the client sent them, as
// Python dicts do) and checked: every problem is an ApiError(400) naming the parameter. Nothing
// here touches the model; the server turns an ApiRequest into an engine request.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/core/sampler.h"

namespace tandem::server {

struct ApiRequest {
  enum class Kind { Chat, Completion };
  Kind kind = Kind::Chat;
  std::string model;

  // Chat: the messages (each {role, content, ...}, content flattened to a string or null), and
  // what the chat template receives besides them.
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  nlohmann::ordered_json tools;  // null or an array
  nlohmann::ordered_json template_kwargs = nlohmann::ordered_json::object();
  bool add_generation_prompt = true;

  // Completion: the prompt as text or as token ids (exactly one is set).
  std::optional<std::string> prompt_text;
  std::vector<int32_t> prompt_ids;
  bool echo = false;

  bool stream = false;
  bool include_usage = false;         // stream_options.include_usage
  std::optional<int64_t> max_tokens;  // max_tokens / max_completion_tokens
  SamplingParams sampling;            // temperature default 1, as OpenAI's
  bool seed_given = false;            // false: the server draws a seed
  std::vector<std::string> stop;      // at most 4 non-empty strings
  int top_logprobs = -1;              // -1: no logprobs; else 0..20 alternatives
  bool ignore_eos = false;            // extension (vLLM's name)
  bool return_token_ids = false;      // extension: prompt and completion token ids
};

// The JSON of a request body. Every JSON error is ApiError(400): bad syntax, and also a number
// beyond a double's range (1e400), which nlohmann reports as out_of_range, not parse_error.
nlohmann::ordered_json parse_request_body(std::string_view text);

// `body` is the parsed JSON (from parse_request_body). A body nested deeper than 256 levels is
// refused before anything copies it: nlohmann copies recursively, so copying the messages of an
// 8 MB body of nested brackets would overflow the stack.
ApiRequest parse_chat_request(const nlohmann::ordered_json& body);
ApiRequest parse_completion_request(const nlohmann::ordered_json& body);

}  // namespace tandem::server
