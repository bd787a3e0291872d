// Identity of a model artifact (DESIGN.md §5.5): checkpoints and cache entries are reused only
// under the same identity, so a drafter state is never restored against other weights.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace tandem {

// Hash (hex) of the graph-shaping fields of a config.json object: sizes, head counts, layer
// types, rope, norms, vocabulary, tie flag, MTP layer count. Fields that do not change the
// numbers (names, versions, dtype labels, generation settings) do not enter it.
std::string config_fingerprint(const nlohmann::json& config);

// Hash (hex) of `fingerprint` and every file's name and full content. Content hashes are
// memoized by (absolute path, size, mtime) in an on-disk cache ($TANDEM_CACHE_DIR, else
// $XDG_CACHE_HOME/tandem, else ~/.cache/tandem; an unwritable cache only costs a rehash), so a
// restart does not rehash gigabytes.
std::string artifact_identity(const std::string& fingerprint,
                              const std::vector<std::string>& files);

}  // namespace tandem
