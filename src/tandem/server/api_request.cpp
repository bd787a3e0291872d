#include "tandem/server/api_request.h"

#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "tandem/io/utf8.h"
#include "tandem/server/api_error.h"

namespace tandem::server {

const char* ApiError::type() const {
  switch (status_) {
    case 401:
      return "authentication_error";
    case 404:
      return "not_found_error";
    case 413:
      return "request_too_large";
    case 429:
    case 503:
      return "overloaded_error";
    default:
      return status_ >= 500 ? "server_error" : "invalid_request_error";
  }
}

namespace {

using json = nlohmann::ordered_json;

const char* type_name(const json& v) {
  switch (v.type()) {
    case json::value_t::null:
      return "null";
    case json::value_t::boolean:
      return "a boolean";
    case json::value_t::string:
      return "a string";
    case json::value_t::array:
      return "an array";
    case json::value_t::object:
      return "an object";
    case json::value_t::binary:
      return "binary";
    default:
      return "a number";
  }
}

// A present, non-null field, or nullptr.
const json* field(const json& body, const char* name) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

bool get_bool(const json& body, const char* name, bool fallback) {
  const json* v = field(body, name);
  if (!v) return fallback;
  if (!v->is_boolean()) bad_request(name, "'", name, "' must be a boolean, got ", type_name(*v));
  return v->get<bool>();
}

double get_number(const json& body, const char* name, double fallback, double lo, double hi) {
  const json* v = field(body, name);
  if (!v) return fallback;
  if (!v->is_number()) bad_request(name, "'", name, "' must be a number, got ", type_name(*v));
  const double x = v->get<double>();
  if (!std::isfinite(x) || x < lo || x > hi)
    bad_request(name, "'", name, "' must be in [", lo, ", ", hi, "], got ", x);
  return x;
}

std::optional<int64_t> get_int(const json& body, const char* name, int64_t lo, int64_t hi) {
  const json* v = field(body, name);
  if (!v) return std::nullopt;
  // 3.0 is accepted as 3 (JSON does not distinguish), 3.5 is not.
  if (v->is_number_float()) {
    const double d = v->get<double>();
    // `d >= hi + 1`, not `d > hi`: INT64_MAX rounds up to 2^63 as a double, and 2^63 passed the
    // old test into a cast that overflows (undefined; fuzz/regressions/fuzz_api_request).
    if (!std::isfinite(d) || d != std::floor(d) || d < static_cast<double>(lo) ||
        d >= static_cast<double>(hi) + 1.0)
      bad_request(name, "'", name, "' must be an integer in [", lo, ", ", hi, "], got ", d);
    return static_cast<int64_t>(d);
  }
  if (!v->is_number_integer())
    bad_request(name, "'", name, "' must be an integer, got ", type_name(*v));
  if (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(hi))
    bad_request(name, "'", name, "' must be an integer in [", lo, ", ", hi, "], got ",
                v->get<uint64_t>());
  const int64_t x = v->get<int64_t>();
  if (x < lo || x > hi)
    bad_request(name, "'", name, "' must be an integer in [", lo, ", ", hi, "], got ", x);
  return x;
}

bool valid_utf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    uint32_t cp = 0;
    const size_t n = utf8::decode(s, i, cp);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

void check_utf8(const std::string& s, const std::string& param) {
  if (!valid_utf8(s)) bad_request(param, "'", param, "' is not valid UTF-8");
}

// Far deeper than any real request (tool schemas nest a few levels), far shallower than what
// overflows a thread's stack when nlohmann copies or compares recursively (~20,000 levels under
// AddressSanitizer).
constexpr size_t kMaxNesting = 256;

// Whether `v` nests deeper than kMaxNesting; iterative, so it is safe on any parsed body.
bool nests_too_deep(const json& v) {
  std::vector<std::pair<const json*, size_t>> todo = {{&v, 1}};
  while (!todo.empty()) {
    const auto [node, depth] = todo.back();
    todo.pop_back();
    if (!node->is_structured()) continue;
    if (depth > kMaxNesting) return true;
    for (const json& child : *node) todo.emplace_back(&child, depth + 1);
  }
  return false;
}

// model, stream, sampling, stop, max tokens: what both endpoints share.
void parse_common(const json& body, ApiRequest* r) {
  if (!body.is_object()) bad_request("", "the request body must be a JSON object");
  if (nests_too_deep(body))
    bad_request("", "the request body nests deeper than ", kMaxNesting, " levels");
  const json* model = field(body, "model");
  if (!model) bad_request("model", "you must provide a model parameter");
  if (!model->is_string()) bad_request("model", "'model' must be a string");
  r->model = model->get<std::string>();

  r->stream = get_bool(body, "stream", false);
  if (const json* so = field(body, "stream_options")) {
    if (!so->is_object()) bad_request("stream_options", "'stream_options' must be an object");
    if (!r->stream) bad_request("stream_options", "'stream_options' needs 'stream': true");
    r->include_usage = get_bool(*so, "include_usage", false);
  }

  const int64_t kMaxTokens = std::numeric_limits<int32_t>::max();
  std::optional<int64_t> mt = get_int(body, "max_tokens", 1, kMaxTokens);
  if (auto mct = get_int(body, "max_completion_tokens", 1, kMaxTokens)) {
    if (mt && *mt != *mct)
      bad_request("max_completion_tokens",
                  "'max_tokens' and 'max_completion_tokens' disagree; give one of them");
    mt = mct;
  }
  r->max_tokens = mt;

  r->sampling.temperature = static_cast<float>(get_number(body, "temperature", 1.0, 0.0, 2.0));
  r->sampling.top_p = static_cast<float>(get_number(body, "top_p", 1.0, 0.0, 1.0));
  if (r->sampling.top_p <= 0.0f) bad_request("top_p", "'top_p' must be greater than 0");
  r->sampling.min_p = static_cast<float>(get_number(body, "min_p", 0.0, 0.0, 1.0));
  // -1 and 0 both mean "off" (vLLM uses -1).
  const int64_t top_k = get_int(body, "top_k", -1, std::numeric_limits<int32_t>::max()).value_or(0);
  r->sampling.top_k = static_cast<int32_t>(top_k < 0 ? 0 : top_k);
  if (auto seed = get_int(body, "seed", std::numeric_limits<int64_t>::min(),
                          std::numeric_limits<int64_t>::max())) {
    r->sampling.seed = static_cast<uint64_t>(*seed);
    r->seed_given = true;
  }

  if (const json* n = field(body, "n")) {
    if (!n->is_number_integer() || n->get<int64_t>() != 1)
      bad_request("n", "only 'n': 1 is supported");
  }
  for (const char* p : {"presence_penalty", "frequency_penalty", "repetition_penalty"}) {
    const double neutral = std::string(p) == "repetition_penalty" ? 1.0 : 0.0;
    if (get_number(body, p, neutral, -2.0, 2.0) != neutral)
      bad_request(p, "'", p, "' is not supported (only its neutral value)");
  }
  if (const json* lb = field(body, "logit_bias")) {
    if (!lb->is_object()) bad_request("logit_bias", "'logit_bias' must be an object");
    if (!lb->empty()) bad_request("logit_bias", "'logit_bias' is not supported");
  }

  if (const json* stop = field(body, "stop")) {
    if (stop->is_string()) {
      r->stop.push_back(stop->get<std::string>());
    } else if (stop->is_array()) {
      for (const json& s : *stop) {
        if (!s.is_string()) bad_request("stop", "'stop' must be a string or an array of strings");
        r->stop.push_back(s.get<std::string>());
      }
    } else {
      bad_request("stop", "'stop' must be a string or an array of strings");
    }
    if (r->stop.size() > 4) bad_request("stop", "'stop' takes at most 4 strings");
    for (const std::string& s : r->stop) {
      if (s.empty()) bad_request("stop", "'stop' strings must not be empty");
      check_utf8(s, "stop");
    }
  }
  r->ignore_eos = get_bool(body, "ignore_eos", false);
  r->return_token_ids = get_bool(body, "return_token_ids", false);
}

// Message content: a string, null, or an array of {type: "text", text} parts (joined).
json message_content(const json& content, size_t i) {
  const std::string param = "messages[" + std::to_string(i) + "].content";
  if (content.is_null() || content.is_string()) {
    if (content.is_string()) check_utf8(content.get<std::string>(), param);
    return content;
  }
  if (!content.is_array()) bad_request(param, "'", param, "' must be a string or an array");
  std::string text;
  for (const json& part : content) {
    if (!part.is_object()) bad_request(param, "'", param, "' parts must be objects");
    const json* type = field(part, "type");
    if (!type || !type->is_string() || type->get<std::string>() != "text")
      bad_request(param, "'", param, "': only parts of type 'text' are supported");
    const json* t = field(part, "text");
    if (!t || !t->is_string()) bad_request(param, "'", param, "' text parts need a string 'text'");
    text += t->get<std::string>();
  }
  check_utf8(text, param);
  return text;
}

}  // namespace

nlohmann::ordered_json parse_request_body(std::string_view text) {
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    throw ApiError(400, std::string("the request body is not valid JSON: ") + e.what());
  }
}

ApiRequest parse_chat_request(const json& body) {
  ApiRequest r;
  r.kind = ApiRequest::Kind::Chat;
  parse_common(body, &r);
  const json* msgs = field(body, "messages");
  if (!msgs) bad_request("messages", "'messages' is required");
  if (!msgs->is_array()) bad_request("messages", "'messages' must be an array");
  if (msgs->empty()) bad_request("messages", "'messages' must not be empty");
  for (size_t i = 0; i < msgs->size(); ++i) {
    const json& m = (*msgs)[i];
    const std::string at = "messages[" + std::to_string(i) + "]";
    if (!m.is_object()) bad_request(at, "'", at, "' must be an object");
    const json* role = field(m, "role");
    if (!role || !role->is_string()) bad_request(at + ".role", "'", at, ".role' must be a string");
    const std::string rs = role->get<std::string>();
    if (rs != "system" && rs != "user" && rs != "assistant" && rs != "tool" && rs != "developer")
      bad_request(at + ".role", "'", at, ".role' is '", rs,
                  "'; expected system, developer, user, assistant or tool");
    json copy = m;
    auto content = m.find("content");
    const bool has_calls = m.contains("tool_calls") && !m["tool_calls"].is_null();
    if (content == m.end() || content->is_null()) {
      if (rs != "assistant" || !has_calls)
        bad_request(at + ".content", "'", at, ".content' is required");
      copy["content"] = nullptr;
    } else {
      copy["content"] = message_content(*content, i);
    }
    r.messages.push_back(std::move(copy));
  }
  if (const json* tools = field(body, "tools")) {
    if (!tools->is_array()) bad_request("tools", "'tools' must be an array");
    r.tools = *tools;
  }
  if (const json* kw = field(body, "chat_template_kwargs")) {
    if (!kw->is_object())
      bad_request("chat_template_kwargs", "'chat_template_kwargs' must be an object");
    r.template_kwargs = *kw;
  }
  r.add_generation_prompt = get_bool(body, "add_generation_prompt", true);
  const bool logprobs = get_bool(body, "logprobs", false);
  const auto top = get_int(body, "top_logprobs", 0, 20);
  if (top && !logprobs) bad_request("top_logprobs", "'top_logprobs' needs 'logprobs': true");
  r.top_logprobs = logprobs ? static_cast<int>(top.value_or(0)) : -1;
  return r;
}

ApiRequest parse_completion_request(const json& body) {
  ApiRequest r;
  r.kind = ApiRequest::Kind::Completion;
  parse_common(body, &r);
  const json* prompt = field(body, "prompt");
  if (!prompt) bad_request("prompt", "'prompt' is required");
  auto ids_from = [&](const json& arr) {
    std::vector<int32_t> ids;
    for (const json& v : arr) {
      if (!v.is_number_integer()) bad_request("prompt", "'prompt' token arrays must hold integers");
      const int64_t id = v.get<int64_t>();
      if (id < 0 || id > std::numeric_limits<int32_t>::max())
        bad_request("prompt", "'prompt' token id ", id, " is out of range");
      ids.push_back(static_cast<int32_t>(id));
    }
    return ids;
  };
  if (prompt->is_string()) {
    r.prompt_text = prompt->get<std::string>();
  } else if (prompt->is_array() && !prompt->empty() && (*prompt)[0].is_string()) {
    if (prompt->size() != 1)
      bad_request("prompt", "one prompt per request: 'prompt' holds ", prompt->size());
    r.prompt_text = (*prompt)[0].get<std::string>();
  } else if (prompt->is_array() && !prompt->empty() && (*prompt)[0].is_array()) {
    if (prompt->size() != 1)
      bad_request("prompt", "one prompt per request: 'prompt' holds ", prompt->size());
    r.prompt_ids = ids_from((*prompt)[0]);
  } else if (prompt->is_array()) {
    r.prompt_ids = ids_from(*prompt);
  } else {
    bad_request("prompt",
                "'prompt' must be a string, an array of token ids, or one of those in "
                "an array");
  }
  if (r.prompt_text) check_utf8(*r.prompt_text, "prompt");
  if (r.prompt_text ? r.prompt_text->empty() : r.prompt_ids.empty())
    bad_request("prompt", "'prompt' must not be empty");
  r.echo = get_bool(body, "echo", false);
  if (field(body, "suffix") != nullptr) bad_request("suffix", "'suffix' is not supported");
  if (const json* best = field(body, "best_of"))
    if (!best->is_number_integer() || best->get<int64_t>() != 1)
      bad_request("best_of", "only 'best_of': 1 is supported");
  // Legacy completions: logprobs is the number of alternatives (0..20 here).
  if (auto lp = get_int(body, "logprobs", 0, 20)) r.top_logprobs = static_cast<int>(*lp);
  if (!r.max_tokens) r.max_tokens = 16;  // OpenAI's completions default
  return r;
}

}  // namespace tandem::server
