// The parameters of an OpenAI chat-completions or completions request, read from its parsed JSON
// body and checked: every problem is an ApiError(400) naming the parameter. Nothing here touches
// the model; the server turns an ApiRequest into an engine request.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "tandem/core/sampler.h"

namespace tandem::server {

struct ApiRequest {
  enum class Kind { Chat, Completion };
  Kind kind = Kind::Chat;
  std::string model;

  // Chat: the messages (each {role, content, ...}, content flattened to a string or null), and
  // what the chat template receives besides them.
  nlohmann::json messages = nlohmann::json::array();
  nlohmann::json tools;                                       // null or an array
  nlohmann::json template_kwargs = nlohmann::json::object();  // chat_template_kwargs
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

// `body` is the parsed JSON (the caller maps a parse failure to a 400 itself).
ApiRequest parse_chat_request(const nlohmann::json& body);
ApiRequest parse_completion_request(const nlohmann::json& body);

}  // namespace tandem::server
