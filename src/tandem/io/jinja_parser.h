// Parser for Jinja templates: jinja2's grammar (jinja2/parser.py), with the statements a chat
// template can use under transformers: for (with else, `if` filtering, recursive), if/elif/else,
// set (also to a namespace attribute and as a block), macro, call, filter, with, print, raw,
// break/continue (the loopcontrols extension) and transformers' generation block. Template
// inheritance and inclusion (extends, include, import) need a loader, which transformers does
// not give its environment; they are rejected here.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "tandem/io/jinja_ast.h"

namespace tandem::jinja {

struct ParsedTemplate {
  std::string name;
  std::string source;  // normalized (see normalize_source); node offsets refer to it
  Body body;
  FrameNames frame;  // of the template's top level
};

// Parses a template. Throws tandem::Error "template 'name' line L col C: TemplateSyntaxError:
// message" on a syntax error, an unknown filter or test outside an if (jinja2 reports those when
// it compiles the template, and the others when rendering reaches them), or nesting deeper than
// kMaxExprDepth / kMaxStmtDepth.
std::unique_ptr<ParsedTemplate> parse_template(std::string_view source, std::string name);

}  // namespace tandem::jinja
