// Fuzz target: an HTTP request body as the server reads it. The bytes go through
// parse_request_body (the server's JSON parse: any JSON error must be ApiError 400), then through
// both request parsers, which must either accept the body or throw ApiError(400) naming the
// problem. Anything else (a crash, a sanitizer report, another exception type escaping, a non-400
// status) is a bug: the server would answer 500 or die.
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "fuzz_common.h"
#include "tandem/server/api_error.h"
#include "tandem/server/api_request.h"

namespace tandem::fuzz::api_request {

using server::ApiError;
using server::ApiRequest;

// One parser on one body: an accepted request must hold what the server relies on, a refused
// one must be a 400. Any other exception propagates (libFuzzer reports it as a crash).
template <class Parse>
void check_parser(const nlohmann::ordered_json& body, Parse parse, ApiRequest::Kind kind) {
  try {
    const ApiRequest r = parse(body);
    if (r.kind != kind) fail("wrong request kind");
    if (r.stop.size() > 4) fail("more than 4 stop strings accepted");
    if (r.top_logprobs < -1 || r.top_logprobs > 20) fail("top_logprobs out of range accepted");
    if (r.max_tokens && *r.max_tokens < 1) fail("max_tokens < 1 accepted");
    if (kind == ApiRequest::Kind::Chat && (!r.messages.is_array() || r.messages.empty()))
      fail("a chat request without messages accepted");
    if (kind == ApiRequest::Kind::Completion &&
        (r.prompt_text ? r.prompt_text->empty() : r.prompt_ids.empty()))
      fail("a completion request without a prompt accepted");
  } catch (const ApiError& e) {
    if (e.status() != 400)
      fail("ApiError with status " + std::to_string(e.status()) + ": " + e.what());
  }
}

inline int run_one(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  nlohmann::ordered_json body;
  try {
    body = server::parse_request_body(text);
  } catch (const ApiError& e) {
    if (e.status() != 400) fail("a body that is not JSON answered " + std::to_string(e.status()));
    return 0;
  }
  check_parser(body, server::parse_chat_request, ApiRequest::Kind::Chat);
  check_parser(body, server::parse_completion_request, ApiRequest::Kind::Completion);
  return 0;
}

}  // namespace tandem::fuzz::api_request

#ifndef TANDEM_FUZZ_REPLAY
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return tandem::fuzz::api_request::run_one(data, size);
}
#endif
