#include "tandem/io/chat_template.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "tandem/core/error.h"
#include "tandem/io/jinja_unicode.h"

namespace tandem {
namespace {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot read ", path.string());
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

ojson read_json(const fs::path& path) {
  try {
    return ojson::parse(read_text(path));
  } catch (const ojson::exception& e) {
    fail(path.string(), ": not valid JSON: ", e.what());
  }
}

// A special token as tokenizer_config.json writes it: "text", {"content": "text", ...}, or null.
std::optional<std::string> token_text(const ojson& config, const char* key) {
  auto it = config.find(key);
  if (it == config.end() || it->is_null()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object()) {
    auto c = it->find("content");
    if (c != it->end() && c->is_string()) return c->get<std::string>();
  }
  return std::nullopt;
}

// tokenizer_config.json's "chat_template": a string, or named templates of which transformers
// uses "default".
std::optional<std::string> config_template(const ojson& config, const fs::path& path) {
  auto it = config.find("chat_template");
  if (it == config.end() || it->is_null()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_array()) {
    for (const auto& entry : *it) {
      if (entry.is_object() && entry.value("name", "") == "default") {
        auto t = entry.find("template");
        if (t != entry.end() && t->is_string()) return t->get<std::string>();
      }
    }
    fail(path.string(), ": \"chat_template\" lists named templates but none named \"default\"");
  }
  fail(path.string(), ": \"chat_template\" must be a string or a list of {name, template}");
}

}  // namespace

ChatTemplate ChatTemplate::from_source(std::string source, std::optional<std::string> bos_token,
                                       std::optional<std::string> eos_token,
                                       std::string source_name) {
  jinja::Template t = jinja::Template::parse(source, std::move(source_name));
  ChatTemplate ct(std::move(source), std::move(t));
  if (bos_token) ct.special_tokens_.emplace_back("bos_token", *bos_token);
  if (eos_token) ct.special_tokens_.emplace_back("eos_token", *eos_token);
  return ct;
}

std::optional<ChatTemplate> ChatTemplate::load(const std::string& model_dir) {
  const fs::path dir(model_dir);
  const fs::path jinja_file = dir / "chat_template.jinja";
  const fs::path config_file = dir / "tokenizer_config.json";
  const fs::path processor_file = dir / "chat_template.json";
  ojson config = ojson::object();
  if (fs::exists(config_file)) config = read_json(config_file);
  if (!config.is_object()) fail(config_file.string(), ": expected a JSON object");

  std::optional<std::string> source;
  fs::path from;
  if (fs::exists(jinja_file)) {
    source = read_text(jinja_file);
    from = jinja_file;
  } else if ((source = config_template(config, config_file))) {
    from = config_file;
  } else if (fs::exists(processor_file)) {
    const ojson processor = read_json(processor_file);
    if (processor.is_object() && processor.contains("chat_template") &&
        processor["chat_template"].is_string()) {
      source = processor["chat_template"].get<std::string>();
      from = processor_file;
    }
  }
  if (!source) return std::nullopt;
  if (!jinja::unicode::is_valid(*source))
    fail(from.string(), ": the chat template is not valid UTF-8");

  ChatTemplate ct = from_source(std::move(*source), token_text(config, "bos_token"),
                                token_text(config, "eos_token"), from.string());
  // The rest of transformers' special_tokens_map, in its order.
  for (const char* key : {"unk_token", "sep_token", "pad_token", "cls_token", "mask_token"})
    if (auto t = token_text(config, key)) ct.special_tokens_.emplace_back(key, *t);
  return ct;
}

std::string ChatTemplate::render(const ojson& messages, bool add_generation_prompt,
                                 const ojson& tools, const ojson& extra) const {
  if (!messages.is_array()) fail("chat template '", name(), "': messages must be a JSON array");
  if (!tools.is_null() && !tools.is_array())
    fail("chat template '", name(), "': tools must be a JSON array or null");
  if (!extra.is_object())
    fail("chat template '", name(), "': extra template variables must be a JSON object");

  jinja::ValueLimits limits;
  limits.max_depth = options_.limits.max_value_depth;
  limits.max_string_bytes = options_.limits.max_output_bytes;
  jinja::Dict vars;
  try {
    // transformers: template.render(messages=..., tools=..., documents=...,
    // add_generation_prompt=..., **{**special_tokens_map, **kwargs}).
    vars.set(jinja::Value("messages"), jinja::from_json(messages, limits));
    vars.set(jinja::Value("tools"),
             tools.is_null() ? jinja::Value::none() : jinja::from_json(tools, limits));
    vars.set(jinja::Value("documents"), jinja::Value::none());
    vars.set(jinja::Value("add_generation_prompt"), jinja::Value(add_generation_prompt));
    for (const auto& [k, v] : special_tokens_) vars.set(jinja::Value(k), jinja::Value(v));
    for (const auto& [k, v] : extra.items()) {
      if (k == "messages" || k == "tools" || k == "documents" || k == "add_generation_prompt")
        fail("chat template '", name(), "': TypeError: got multiple values for keyword argument '",
             k, "'");
      vars.set(jinja::Value(k), jinja::from_json(v, limits));
    }
  } catch (const jinja::RenderError& e) {
    fail("chat template '", name(), "': ", e.type(), ": ", e.what());
  }
  return template_.render(vars, options_);
}

}  // namespace tandem
