#include "tandem/io/jinja_template.h"

#include "tandem/core/error.h"
#include "tandem/io/jinja_lexer.h"
#include "tandem/io/jinja_parser.h"

namespace tandem::jinja {

Template Template::parse(std::string_view source, std::string name) {
  Template t;
  t.parsed_ = parse_template(source, std::move(name));
  return t;
}

const std::string& Template::name() const {
  return parsed_->name;
}

std::string Template::render(const nlohmann::ordered_json& variables,
                             const RenderOptions& options) const {
  if (!variables.is_object()) fail("template '", name(), "': the variables must be a JSON object");
  ValueLimits limits;
  limits.max_depth = options.limits.max_value_depth;
  limits.max_string_bytes = options.limits.max_output_bytes;
  Value vars;
  try {
    vars = from_json(variables, limits);
  } catch (const RenderError& e) {
    fail("template '", name(), "': ", e.type(), ": ", e.what());
  }
  return render(vars.as_dict(), options);
}

std::string Template::render(const Dict& variables, const RenderOptions& options) const {
  Interpreter in(*parsed_, variables, options);
  try {
    return in.run();
  } catch (const RenderError& e) {
    uint32_t line = 0, col = 0;
    line_col(parsed_->source, in.error_offset(), line, col);
    fail("template '", name(), "' line ", line, " col ", col, ": ", e.type(), ": ", e.what());
  }
}

}  // namespace tandem::jinja
