// Reading a Hugging Face config.json: one JSON object's fields with errors that name the file
// and the field ("config.json: text_config.hidden_size: must be positive, got 0"). Shared by the
// model families' config parsers.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "tandem/core/error.h"

namespace tandem::config {

using json = nlohmann::json;

// One JSON object of the config plus how to name its fields in errors ("text_config.x").
// A field set to null counts as absent, as transformers treats it.
class Fields {
 public:
  Fields(const json& obj, const std::string& file, std::string prefix)
      : obj_(obj), file_(file), prefix_(std::move(prefix)) {}

  const json* get(const char* key) const {
    auto it = obj_.find(key);
    return it == obj_.end() || it->is_null() ? nullptr : &*it;
  }
  bool has(const char* key) const { return get(key) != nullptr; }
  std::string name(const char* key) const { return prefix_ + key; }

  template <class... Parts>
  [[noreturn]] void bad(const char* key, Parts&&... parts) const {
    fail(file_, ": ", name(key), ": ", std::forward<Parts>(parts)...);
  }

  const json& require(const char* key) const {
    const json* v = get(key);
    if (v == nullptr) fail(file_, ": missing required field ", name(key));
    return *v;
  }

  int64_t as_int(const char* key, const json& v) const {
    if (v.is_number_unsigned()) {
      if (v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) bad(key, "value out of range");
      return static_cast<int64_t>(v.get<uint64_t>());
    }
    if (!v.is_number_integer()) bad(key, "expected an integer, got ", v.dump());
    return v.get<int64_t>();
  }
  int64_t positive(const char* key, int64_t v) const {
    if (v <= 0) bad(key, "must be positive, got ", v);
    return v;
  }
  int64_t req_pos_int(const char* key) const { return positive(key, as_int(key, require(key))); }
  int64_t opt_pos_int(const char* key, int64_t def) const {
    const json* v = get(key);
    return v ? positive(key, as_int(key, *v)) : def;
  }
  double opt_number(const char* key, double def) const {
    const json* v = get(key);
    if (v == nullptr) return def;
    if (!v->is_number()) bad(key, "expected a number, got ", v->dump());
    return v->get<double>();
  }
  bool opt_bool(const char* key, bool def) const {
    const json* v = get(key);
    if (v == nullptr) return def;
    if (!v->is_boolean()) bad(key, "expected true or false, got ", v->dump());
    return v->get<bool>();
  }
  std::string opt_string(const char* key, const std::string& def) const {
    const json* v = get(key);
    if (v == nullptr) return def;
    if (!v->is_string()) bad(key, "expected a string, got ", v->dump());
    return v->get<std::string>();
  }
  const json* opt_object(const char* key) const {
    const json* v = get(key);
    if (v != nullptr && !v->is_object()) bad(key, "expected an object, got ", v->dump());
    return v;
  }

 private:
  const json& obj_;
  const std::string& file_;
  std::string prefix_;
};

// The whole text as JSON (an error names source_name).
json parse_json(const std::string& text, const std::string& source_name);

// eos_token_id is an int, a list of ints, or null; appends new ids to `out` in order.
void append_eos(const Fields& f, std::vector<int64_t>* out);

// Appends the eos ids of dir/generation_config.json, when there is one (Hugging Face checkpoints
// often name their end-of-turn tokens there only).
void append_generation_eos(const std::string& dir, std::vector<int64_t>* out);

}  // namespace tandem::config
