#include "tandem/io/artifact_identity.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <tuple>
#include <vector>

#include "tandem/core/error.h"

namespace tandem {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// Bump when the hashed layout changes, so old cache entries and identities cannot be mistaken
// for new ones.
constexpr const char* kFingerprintTag = "tandem-config-fingerprint-v1";
constexpr const char* kIdentityTag = "tandem-artifact-identity-v1";
constexpr int kCacheVersion = 1;
constexpr size_t kChunkBytes = size_t{8} << 20;

// Fields of a (text) config that change the graph or its numbers. Everything else — names,
// versions, dtype labels, generation settings, max_position_embeddings (no rope scaling is
// supported, so it does not change any number) — stays out, so relabelling a file keeps its
// identity.
constexpr const char* kGraphFields[] = {
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "attention_bias",
    "attn_output_gate",
    "hidden_act",
    "rms_norm_eps",
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "partial_rotary_factor",
    "layer_types",
    "full_attention_interval",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "mtp_num_hidden_layers",
    "tie_word_embeddings",
};

// Fields that live at the top level of a checkpoint's config in both layouts (MLX writes its
// quantization there) and change the numbers the weights decode to.
constexpr const char* kOuterGraphFields[] = {"quantization", "quantization_config"};

std::string hex128(const XXH128_hash_t& h) {
  char buf[33];
  std::snprintf(buf, sizeof buf, "%016llx%016llx", static_cast<unsigned long long>(h.high64),
                static_cast<unsigned long long>(h.low64));
  return buf;
}

// Length-prefixed, so that no two different sequences of parts hash the same byte stream.
void update_part(XXH3_state_t* st, const std::string& part) {
  const uint64_t n = part.size();
  XXH3_128bits_update(st, &n, sizeof n);
  XXH3_128bits_update(st, part.data(), part.size());
}

struct StateDeleter {
  void operator()(XXH3_state_t* s) const { XXH3_freeState(s); }
};
using StatePtr = std::unique_ptr<XXH3_state_t, StateDeleter>;

StatePtr new_state() {
  StatePtr st(XXH3_createState());
  if (!st) fail("artifact identity: out of memory for the hash state");
  XXH3_128bits_reset(st.get());
  return st;
}

// What identifies one version of a file without reading it. The inode is an extra guard: tools
// that replace a file by writing a new one and renaming it over the old change it even when the
// size and mtime happen to match.
struct FileKey {
  std::string path;  // absolute, symlinks resolved
  uint64_t size = 0;
  int64_t mtime_ns = 0;
  uint64_t inode = 0;
  bool operator<(const FileKey& o) const {
    return std::tie(path, size, mtime_ns, inode) < std::tie(o.path, o.size, o.mtime_ns, o.inode);
  }
};

FileKey file_key(const std::string& file) {
  std::error_code ec;
  const fs::path abs = fs::canonical(fs::path(file), ec);
  if (ec) fail("artifact identity: cannot resolve ", file, ": ", ec.message());
  struct stat sb {};
  if (::stat(abs.c_str(), &sb) != 0)
    fail("artifact identity: cannot stat ", file, ": ", std::strerror(errno));
  if (!S_ISREG(sb.st_mode)) fail("artifact identity: ", file, " is not a regular file");
  FileKey k;
  k.path = abs.string();
  k.size = static_cast<uint64_t>(sb.st_size);
  k.mtime_ns = static_cast<int64_t>(sb.st_mtim.tv_sec) * 1000000000 + sb.st_mtim.tv_nsec;
  k.inode = static_cast<uint64_t>(sb.st_ino);
  return k;
}

std::string hash_file_content(const FileKey& k, const std::string& shown_name) {
  const int fd = ::open(k.path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("artifact identity: cannot open ", shown_name, ": ", std::strerror(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  StatePtr st = new_state();
  std::vector<char> buf(kChunkBytes);
  uint64_t total = 0;
  for (;;) {
    const ssize_t got = ::read(fd, buf.data(), buf.size());
    if (got < 0) {
      if (errno == EINTR) continue;
      fail("artifact identity: error reading ", shown_name, ": ", std::strerror(errno));
    }
    if (got == 0) break;
    XXH3_128bits_update(st.get(), buf.data(), static_cast<size_t>(got));
    total += static_cast<uint64_t>(got);
  }
  if (total != k.size)
    fail("artifact identity: ", shown_name, " changed size while it was hashed (", k.size, " -> ",
         total, " bytes)");
  return hex128(XXH3_128bits_digest(st.get()));
}

// $TANDEM_CACHE_DIR, else $XDG_CACHE_HOME/tandem, else ~/.cache/tandem; none when no variable
// says where (then nothing persists). Empty variables count as unset.
std::optional<fs::path> cache_dir() {
  auto env = [](const char* name) -> const char* {
    const char* v = std::getenv(name);
    return v != nullptr && *v != '\0' ? v : nullptr;
  };
  if (const char* d = env("TANDEM_CACHE_DIR")) return fs::path(d);
  if (const char* d = env("XDG_CACHE_HOME")) return fs::path(d) / "tandem";
  if (const char* d = env("HOME")) return fs::path(d) / ".cache" / "tandem";
  return std::nullopt;
}

// The on-disk memo: {"version": 1, "files": {"<abs path>": {"size", "mtime_ns", "inode",
// "xxh3_128"}}}. Keyed by path, so a file that changes replaces its entry instead of piling up
// stale ones. Anything unreadable or malformed reads as empty: the cache only saves time.
json load_cache(const fs::path& file) {
  try {
    std::ifstream in(file, std::ios::binary);
    if (!in) return json::object();
    json j = json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || j["version"] != kCacheVersion || !j["files"].is_object())
      return json::object();
    return j["files"];
  } catch (const std::exception&) {
    return json::object();
  }
}

std::optional<std::string> cached_hash(const json& files, const FileKey& k) {
  auto it = files.find(k.path);
  if (it == files.end() || !it->is_object()) return std::nullopt;
  const json& e = *it;
  auto num_eq = [&](const char* key, auto want) {
    auto f = e.find(key);
    return f != e.end() && f->is_number_integer() && f->get<decltype(want)>() == want;
  };
  if (!num_eq("size", k.size) || !num_eq("mtime_ns", k.mtime_ns) || !num_eq("inode", k.inode))
    return std::nullopt;
  auto h = e.find("xxh3_128");
  if (h == e.end() || !h->is_string() || h->get_ref<const std::string&>().size() != 32)
    return std::nullopt;
  return h->get<std::string>();
}

// Best effort: a temp file in the same directory renamed over the cache, so a reader never sees
// a half-written file. Concurrent writers may drop each other's entries; that only costs a
// rehash later.
void store_cache(const fs::path& dir, const json& files) noexcept try {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return;
  const json doc = {{"version", kCacheVersion}, {"files", files}};
  std::random_device rd;
  const fs::path tmp =
      dir / ("artifact-hashes.json.tmp-" + std::to_string(::getpid()) + "-" + std::to_string(rd()));
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return;
    // A path that is not valid UTF-8 is written replaced; its entry then never matches (rehash).
    out << doc.dump(1, ' ', false, json::error_handler_t::replace) << '\n';
    out.flush();
    if (!out) {
      out.close();
      fs::remove(tmp, ec);
      return;
    }
  }
  fs::rename(tmp, dir / "artifact-hashes.json", ec);
  if (ec) fs::remove(tmp, ec);
} catch (const std::exception&) {
  // Not persisting is always allowed.
}

// The in-process memo, shared by every caller; keyed like the disk cache plus the inode.
std::mutex g_memo_mutex;
std::map<FileKey, std::string>& memo() {
  static std::map<FileKey, std::string> m;
  return m;
}

}  // namespace

std::string config_fingerprint(const json& config) {
  if (!config.is_object())
    fail("config fingerprint: expected a JSON object, got ", config.type_name());
  // A nested checkpoint config (model_type qwen3_5) keeps the text model in text_config; a flat
  // one (qwen3_5_text) is the text config. Both describe the same graph, so only the text object
  // is read, and the outer model_type (which names the wrapper, not the graph) stays out.
  const auto tc = config.find("text_config");
  const bool nested = tc != config.end() && tc->is_object();
  const json& text = nested ? *tc : config;
  json picked = json::object();
  for (const char* key : kGraphFields) {
    auto it = text.find(key);
    // null means absent, as transformers reads it.
    if (it != text.end() && !it->is_null()) picked[key] = *it;
  }
  if (nested && !picked.contains("model_type")) picked["model_type"] = "qwen3_5_text";
  // The outer tie flag stands in when the text config has none (as the config parser does).
  if (nested && !picked.contains("tie_word_embeddings")) {
    auto it = config.find("tie_word_embeddings");
    if (it != config.end() && !it->is_null()) picked["tie_word_embeddings"] = *it;
  }
  for (const char* key : kOuterGraphFields) {
    auto it = config.find(key);
    if (it != config.end() && !it->is_null()) picked[key] = *it;
  }
  // nlohmann's json object is a sorted map, so dump() is canonical: sorted keys, no whitespace,
  // shortest round-trip numbers.
  StatePtr st = new_state();
  update_part(st.get(), kFingerprintTag);
  update_part(st.get(), picked.dump());
  return hex128(XXH3_128bits_digest(st.get()));
}

std::string artifact_identity(const std::string& fingerprint,
                              const std::vector<std::string>& files) {
  std::vector<FileKey> keys;
  keys.reserve(files.size());
  for (const std::string& f : files) keys.push_back(file_key(f));

  std::vector<std::string> hashes(files.size());
  std::vector<size_t> missing;
  {
    std::lock_guard<std::mutex> lock(g_memo_mutex);
    for (size_t i = 0; i < files.size(); ++i) {
      auto it = memo().find(keys[i]);
      if (it != memo().end())
        hashes[i] = it->second;
      else
        missing.push_back(i);
    }
  }
  if (!missing.empty()) {
    const std::optional<fs::path> dir = cache_dir();
    json cached = dir ? load_cache(*dir / "artifact-hashes.json") : json::object();
    bool changed = false;
    for (size_t i : missing) {
      if (std::optional<std::string> h = cached_hash(cached, keys[i])) {
        hashes[i] = *h;
        continue;
      }
      hashes[i] = hash_file_content(keys[i], files[i]);
      cached[keys[i].path] = {{"size", keys[i].size},
                              {"mtime_ns", keys[i].mtime_ns},
                              {"inode", keys[i].inode},
                              {"xxh3_128", hashes[i]}};
      changed = true;
    }
    if (changed && dir) store_cache(*dir, cached);
    std::lock_guard<std::mutex> lock(g_memo_mutex);
    for (size_t i : missing) memo()[keys[i]] = hashes[i];
  }

  StatePtr st = new_state();
  update_part(st.get(), kIdentityTag);
  update_part(st.get(), fingerprint);
  for (size_t i = 0; i < files.size(); ++i) {
    // The name as given (not the resolved symlink target): a Hugging Face snapshot links
    // readable names to content-addressed blobs, and the readable name is what the loader uses.
    update_part(st.get(), fs::path(files[i]).filename().string());
    update_part(st.get(), hashes[i]);
  }
  return hex128(XXH3_128bits_digest(st.get()));
}

}  // namespace tandem
