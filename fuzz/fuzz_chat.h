// Shared by the two chat-template fuzz targets (fuzz_chat_template.cpp, fuzz_chat_messages.cpp).
#pragma once

#include <ctime>
#include <string>

#include "fuzz_common.h"
#include "tandem/io/chat_template.h"
#include "tandem/io/jinja_interpreter.h"

namespace tandem::fuzz {

// The server's limits, but with a step budget small enough that the slowest input still runs in
// tens of milliseconds (a render that exceeds it ends in tandem::Error, which is a valid answer).
// The depth limits, which protect the stack, are left at the server's values on purpose: they
// are what the fuzzer must show to be safe. A fixed clock keeps strftime_now() deterministic.
inline jinja::RenderOptions fuzz_render_options() {
  jinja::RenderOptions o;
  o.limits.max_steps = 300'000;
  o.limits.max_output_bytes = 1u << 20;
  o.limits.max_items = 1u << 16;
  o.clock = [] {
    jinja::LocalTime t;
    t.tm.tm_year = 2026 - 1900;
    t.tm.tm_mon = 11;
    t.tm.tm_mday = 1;
    t.tm.tm_hour = 12;
    timegm(&t.tm);  // fills tm_wday and tm_yday
    return t;
  };
  return o;
}

// Renders twice: a parsed template is rendered many times (and from many threads) by a server,
// so one render must leave nothing behind that changes the next. Throws tandem::Error when the
// template or the conversation is refused, which is an answer, not a bug.
inline std::string render_twice(const ChatTemplate& t, const nlohmann::ordered_json& messages,
                                bool add_generation_prompt, const nlohmann::ordered_json& tools,
                                const nlohmann::ordered_json& extra) {
  const std::string first = t.render(messages, add_generation_prompt, tools, extra);
  if (t.render(messages, add_generation_prompt, tools, extra) != first)
    fail("two renders of the same input differ");
  return first;
}

}  // namespace tandem::fuzz
