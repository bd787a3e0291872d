// Fuzz target: the conversations a client sends, rendered by the real chat templates the
// project ships fixtures for (tests/fixtures/chat_templates/*.jinja, each with the special
// tokens its fixture file lists), along the server's path: request body -> parse_request_body ->
// parse_chat_request -> ChatTemplate::render.
//
// Input: one byte choosing the template (modulo their number), then the request body. A body
// the parsers refuse must be ApiError(400); an accepted one must render to text or end in
// tandem::Error (raise_exception, a missing field the template needs, exhausted limits), which
// the server answers with a 400. Anything else is a bug. The templates are found through
// $TANDEM_FUZZ_TEMPLATES (a folder), else the source tree's fixtures.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_chat.h"
#include "fuzz_common.h"
#include "tandem/core/error.h"
#include "tandem/io/chat_template.h"
#include "tandem/server/api_error.h"
#include "tandem/server/api_request.h"

namespace tandem::fuzz::chat_messages {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot read " + path.string());
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Every *.jinja of the folder, sorted by name, with the bos/eos tokens of its <name>.cases.json.
std::vector<ChatTemplate> load_templates() {
  const char* env = std::getenv("TANDEM_FUZZ_TEMPLATES");
  const fs::path dir =
      env ? fs::path(env) : fs::path(TANDEM_SOURCE_DIR) / "tests/fixtures/chat_templates";
  std::vector<fs::path> paths;
  if (fs::is_directory(dir))
    for (const auto& entry : fs::directory_iterator(dir))
      if (entry.path().extension() == ".jinja") paths.push_back(entry.path());
  if (paths.empty()) fail("no *.jinja in " + dir.string() + " (set TANDEM_FUZZ_TEMPLATES)");
  std::sort(paths.begin(), paths.end());
  std::vector<ChatTemplate> templates;
  for (const fs::path& path : paths) {
    std::optional<std::string> bos, eos;
    fs::path cases = path;
    cases.replace_extension(".cases.json");
    if (fs::exists(cases)) {
      const ojson tokens = ojson::parse(read_text(cases)).value("special_tokens", ojson::object());
      if (tokens.contains("bos_token")) bos = tokens["bos_token"].get<std::string>();
      if (tokens.contains("eos_token")) eos = tokens["eos_token"].get<std::string>();
    }
    templates.push_back(ChatTemplate::from_source(read_text(path), bos, eos, path.string()));
    templates.back().set_options(fuzz_render_options());
  }
  return templates;
}

const std::vector<ChatTemplate>& templates() {
  static const std::vector<ChatTemplate> all = load_templates();
  return all;
}

inline int run_one(const uint8_t* data, size_t size) {
  const std::vector<ChatTemplate>& all = templates();
  if (size == 0) return 0;
  const ChatTemplate& t = all[data[0] % all.size()];
  const std::string_view body_text(reinterpret_cast<const char*>(data + 1), size - 1);
  server::ApiRequest r;
  try {
    r = server::parse_chat_request(server::parse_request_body(body_text));
  } catch (const server::ApiError& e) {
    if (e.status() != 400) fail("ApiError with status " + std::to_string(e.status()));
    return 0;
  }
  try {
    render_twice(t, r.messages, r.add_generation_prompt, r.tools, r.template_kwargs);
  } catch (const Error&) {
    // The template refused the conversation: the server's 400.
  }
  return 0;
}

}  // namespace tandem::fuzz::chat_messages

#ifndef TANDEM_FUZZ_REPLAY
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return tandem::fuzz::chat_messages::run_one(data, size);
}
#endif
