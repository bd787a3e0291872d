// A model's chat template: turns OpenAI-style chat messages into the prompt text exactly as
// transformers' tokenizer.apply_chat_template(messages, tokenize=False, ...) does, rendering the
// template with tandem's own Jinja interpreter (jinja_template.h).
//
// The variables a template sees are those transformers passes: messages, tools (None when there
// are none), documents (None), add_generation_prompt, the tokenizer's special tokens (bos_token,
// eos_token, and unk/pad/sep/cls/mask_token when tokenizer_config.json has them), then any extra
// keyword arguments (enable_thinking, ...). JSON key order is kept (tools print with |tojson in
// the order the client sent), which is why the JSON arguments are ordered_json; a plain
// nlohmann::json converts implicitly but has already sorted its keys.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tandem/io/jinja_template.h"

namespace tandem {

class ChatTemplate {
 public:
  // From a model directory: chat_template.jinja when present, else tokenizer_config.json's
  // "chat_template" (a string, or a list of {"name", "template"} of which "default" is used),
  // else chat_template.json's "chat_template". Special tokens come from tokenizer_config.json
  // (a string or an {"content": ...} object each). std::nullopt when the directory has no
  // template; tandem::Error naming the file when one does not parse.
  static std::optional<ChatTemplate> load(const std::string& model_dir);

  // From template text; `source_name` names it in errors. A token left std::nullopt is not
  // defined in the template (as when tokenizer_config.json has null for it).
  static ChatTemplate from_source(std::string source, std::optional<std::string> bos_token,
                                  std::optional<std::string> eos_token, std::string source_name);

  // messages: a JSON array of {role, content, ...}; tools: a JSON array or null; extra: more
  // template variables (a JSON object, e.g. {"enable_thinking": false}). Throws tandem::Error on
  // a template runtime error; for raise_exception("msg") what() ends with "TemplateError: msg"
  // (a server answers those with 400).
  std::string render(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                     const nlohmann::ordered_json& tools = nullptr,
                     const nlohmann::ordered_json& extra = nlohmann::ordered_json::object()) const;

  // Limits and the clock strftime_now() reads (see jinja::RenderOptions).
  void set_options(jinja::RenderOptions options) { options_ = std::move(options); }
  const jinja::RenderOptions& options() const { return options_; }

  const std::string& source() const { return source_; }
  const std::string& name() const { return template_.name(); }
  // The special tokens given to the template, in the order transformers' special_tokens_map
  // lists them.
  const std::vector<std::pair<std::string, std::string>>& special_tokens() const {
    return special_tokens_;
  }

 private:
  ChatTemplate(std::string source, jinja::Template t)
      : source_(std::move(source)), template_(std::move(t)) {}

  std::string source_;
  jinja::Template template_;
  std::vector<std::pair<std::string, std::string>> special_tokens_;
  jinja::RenderOptions options_;
};

}  // namespace tandem
