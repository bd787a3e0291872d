// A parsed Jinja template, rendered with jinja2's semantics as transformers configures them for
// chat templates (see jinja_interpreter.h). Parse once, render many times, from any number of
// threads at once (a render shares nothing mutable with others).
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "tandem/io/jinja_interpreter.h"

namespace tandem::jinja {

struct ParsedTemplate;

class Template {
 public:
  // Throws tandem::Error "template 'name' line L col C: TemplateSyntaxError: ..." when the source
  // does not parse.
  static Template parse(std::string_view source, std::string name);

  // Renders with `variables` (a JSON object; its members become template variables, with the key
  // order the JSON had). Throws tandem::Error "template 'name' line L col C: <Python exception
  // type>: <message>" on a runtime error: for raise_exception(msg) the type is TemplateError and
  // the message is msg.
  std::string render(const nlohmann::ordered_json& variables,
                     const RenderOptions& options = {}) const;
  // The same with variables already converted (a Dict of name -> value).
  std::string render(const Dict& variables, const RenderOptions& options = {}) const;

  const std::string& name() const;

 private:
  std::shared_ptr<const ParsedTemplate> parsed_;
};

}  // namespace tandem::jinja
