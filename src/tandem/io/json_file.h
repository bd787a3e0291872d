// Reading a JSON file with errors that name it.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace tandem {

// Parses `path`; a missing/unreadable file or invalid JSON throws Error naming the file.
nlohmann::json read_json_file(const std::string& path);

}  // namespace tandem
