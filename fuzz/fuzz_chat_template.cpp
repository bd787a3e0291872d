// Fuzz target: the Jinja interpreter on arbitrary chat templates and conversations (a model
// directory's chat template is as untrusted as the checkpoint it came with).
//
// Input: template source, then optionally a NUL byte and JSON for the render's arguments:
// either an array (the messages) or an object with any of "messages", "tools",
// "add_generation_prompt", "extra" (more template variables), "bos_token" and "eos_token". JSON
// that does not parse, and a missing part, leave the defaults: a short system/user/assistant
// conversation, no tools, add_generation_prompt true, Qwen's special tokens.
//
// Parsing and rendering must end in text or tandem::Error (syntax errors, runtime errors,
// raise_exception, exhausted limits); a crash, a sanitizer report or any other exception is a
// bug. Sources that are not UTF-8 are skipped, as ChatTemplate::load refuses them.
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

#include "fuzz_chat.h"
#include "fuzz_common.h"
#include "tandem/core/error.h"
#include "tandem/io/chat_template.h"
#include "tandem/io/jinja_unicode.h"

namespace tandem::fuzz::chat_template {

using ojson = nlohmann::ordered_json;

struct Arguments {
  ojson messages = ojson::parse(R"([
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi <b>there</b> \u00e9\u4f60"},
    {"role": "assistant", "content": "<think>\nhm\n</think>\n\nHello."},
    {"role": "user", "content": "Weather in Paris?"}])");
  ojson tools = nullptr;
  bool add_generation_prompt = true;
  ojson extra = ojson::object();
  std::optional<std::string> bos_token;
  std::optional<std::string> eos_token = "<|im_end|>";
};

Arguments parse_arguments(std::string_view text) {
  Arguments a;
  ojson j;
  try {
    j = ojson::parse(text);
  } catch (const ojson::exception&) {
    return a;
  }
  if (j.is_array()) {
    a.messages = std::move(j);
    return a;
  }
  if (!j.is_object()) return a;
  // Wrong types are passed on as they are: render() must refuse them itself.
  if (auto it = j.find("messages"); it != j.end()) a.messages = *it;
  if (auto it = j.find("tools"); it != j.end()) a.tools = *it;
  if (auto it = j.find("extra"); it != j.end()) a.extra = *it;
  if (auto it = j.find("add_generation_prompt"); it != j.end() && it->is_boolean())
    a.add_generation_prompt = it->get<bool>();
  // A token given as anything but a string is left undefined, as a null in tokenizer_config.
  const auto token = [&](const char* key, std::optional<std::string>& slot) {
    if (auto it = j.find(key); it != j.end())
      slot = it->is_string() ? std::optional(it->get<std::string>()) : std::nullopt;
  };
  token("bos_token", a.bos_token);
  token("eos_token", a.eos_token);
  return a;
}

inline int run_one(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const size_t nul = input.find('\0');
  const std::string_view source = input.substr(0, nul);
  if (!jinja::unicode::is_valid(source)) return 0;
  const Arguments a =
      parse_arguments(nul == std::string_view::npos ? std::string_view() : input.substr(nul + 1));
  try {
    ChatTemplate t =
        ChatTemplate::from_source(std::string(source), a.bos_token, a.eos_token, "fuzz");
    t.set_options(fuzz_render_options());
    render_twice(t, a.messages, a.add_generation_prompt, a.tools, a.extra);
  } catch (const Error&) {
    // Refused template or conversation: the answer a server turns into an error response.
  }
  return 0;
}

}  // namespace tandem::fuzz::chat_template

#ifndef TANDEM_FUZZ_REPLAY
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return tandem::fuzz::chat_template::run_one(data, size);
}
#endif
