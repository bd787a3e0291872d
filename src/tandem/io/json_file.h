// Reading a text or JSON file with errors that name it.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace tandem {

// The whole file as bytes; a missing or unreadable file throws Error naming it.
std::string read_text_file(const std::string& path);

// Parses `path`; a missing/unreadable file or invalid JSON throws Error naming the file.
nlohmann::json read_json_file(const std::string& path);

}  // namespace tandem
