#include "tandem/model/config_fields.h"

#include <algorithm>
#include <filesystem>

#include "tandem/io/json_file.h"

namespace tandem::config {

json parse_json(const std::string& text, const std::string& source_name) {
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    fail(source_name, ": not valid JSON: ", e.what());
  }
}

void append_eos(const Fields& f, std::vector<int64_t>* out) {
  const json* v = f.get("eos_token_id");
  if (v == nullptr) return;
  auto add = [&](const json& x) {
    const int64_t id = f.as_int("eos_token_id", x);
    if (id < 0) f.bad("eos_token_id", "token ids must be non-negative, got ", id);
    if (std::find(out->begin(), out->end(), id) == out->end()) out->push_back(id);
  };
  if (v->is_array()) {
    for (const json& x : *v) add(x);
  } else {
    add(*v);
  }
}

void append_generation_eos(const std::string& dir, std::vector<int64_t>* out) {
  const std::string path = (std::filesystem::path(dir) / "generation_config.json").string();
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return;
  const json g = parse_json(read_text_file(path), path);
  if (!g.is_object()) fail(path, ": expected a JSON object, got ", g.type_name());
  append_eos(Fields(g, path, ""), out);
}

}  // namespace tandem::config
