#include "tandem/engine/prefix_disk.h"

#include <fcntl.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <system_error>

#include "tandem/core/error.h"

namespace tandem {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr char kMagic[8] = {'T', 'A', 'N', 'D', 'E', 'M', 'P', 'C'};
constexpr const char* kSuffix = ".tpc";
constexpr uint64_t kMaxHeaderBytes = uint64_t{64} << 20;

std::string hex64(uint64_t h) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

// A section to write: bytes at `data`.
struct Section {
  std::string name, dtype;
  std::vector<int64_t> shape;
  const void* data;
  size_t bytes;
};

// Header numbers are whole numbers in range: nlohmann converts a float (2e21) or an unsigned
// above INT64_MAX to an integer type without a check, so each is checked here first.
uint64_t as_count(const json& v, const char* what) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  fail("header field ", what, ": not a whole number >= 0");
}
int64_t as_int(const json& v, const char* what) {
  if (v.is_number_unsigned() && v.get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX))
    return static_cast<int64_t>(v.get<uint64_t>());
  if (v.is_number_integer() && !v.is_number_unsigned()) return v.get<int64_t>();
  fail("header field ", what, ": not a 64-bit whole number");
}
std::vector<int64_t> as_shape(const json& v, const char* what) {
  if (!v.is_array()) fail("header field ", what, ": not an array");
  std::vector<int64_t> shape;
  for (const json& d : v) shape.push_back(as_int(d, what));
  return shape;
}

// The section dtype of KV stored as `t` (F32 or BF16).
const char* kv_section_dtype(DType t) {
  return t == DType::BF16 ? "bf16" : "f32";
}

// An open file with its header parsed; sections are read from it on demand. Throws Error on
// anything malformed.
struct Parsed {
  json header;
  std::ifstream in;
  uint64_t payload = 0;  // offset of the first section
  uint64_t size = 0;     // of the whole file
};

Parsed parse(const std::string& path) {
  Parsed p;
  p.in.open(path, std::ios::binary);
  if (!p.in) fail(path, ": cannot open");
  char magic[8];
  uint32_t version = 0;
  uint64_t header_len = 0;
  p.in.read(magic, 8);
  p.in.read(reinterpret_cast<char*>(&version), sizeof(version));
  p.in.read(reinterpret_cast<char*>(&header_len), sizeof(header_len));
  if (!p.in || std::memcmp(magic, kMagic, 8) != 0) fail(path, ": not a tandem prefix-cache file");
  if (version != PrefixDisk::kFormatVersion)
    fail(path, ": format version ", version, ", this build reads ", PrefixDisk::kFormatVersion);
  std::error_code ec;
  p.size = fs::file_size(path, ec);
  if (ec) fail(path, ": cannot stat");
  p.payload = 8 + sizeof(version) + sizeof(header_len) + header_len;
  if (header_len == 0 || header_len > kMaxHeaderBytes || p.payload > p.size)
    fail(path, ": bad header length");
  std::string header(header_len, '\0');
  p.in.read(header.data(), static_cast<std::streamsize>(header_len));
  if (!p.in) fail(path, ": truncated header");
  p.header = json::parse(header);  // throws on malformed JSON
  return p;
}

// A section's values, read straight into their vector and checked against the section's header
// entry (dtype, shape, bounds, size, content hash). Elements are element_bytes each (a multiple
// of sizeof(T): bf16 sections read as bytes).
template <class T>
std::vector<T> section_values(Parsed& p, const std::string& name, const char* dtype,
                              size_t element_bytes = sizeof(T)) {
  for (const json& s : p.header.at("sections")) {
    if (s.at("name").get<std::string>() != name) continue;
    if (s.at("dtype").get<std::string>() != dtype) fail("section ", name, ": dtype");
    // Elements, kept below 2^40 so that the byte count cannot overflow either.
    int64_t n = 1;
    for (const json& d : s.at("shape")) {
      const int64_t v = as_int(d, "shape");
      if (v < 0 || __builtin_mul_overflow(n, v, &n) || n > (int64_t{1} << 40))
        fail("section ", name, ": shape");
    }
    const uint64_t off = as_count(s.at("offset"), "offset");
    const uint64_t size = as_count(s.at("bytes"), "bytes");
    if (size != static_cast<uint64_t>(n) * element_bytes) fail("section ", name, ": size");
    const uint64_t room = p.size - p.payload;
    if (off > room || size > room - off)
      fail("section ", name, ": past the end of the file (truncated?)");
    std::vector<T> v(static_cast<size_t>(size / sizeof(T)));
    if (size > 0) {  // an empty vector's data() may be null
      p.in.seekg(static_cast<std::streamoff>(p.payload + off));
      p.in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(size));
      if (!p.in) fail("section ", name, ": read failed");
    }
    if (hex64(XXH3_64bits(v.data(), size)) != s.at("xxh3").get<std::string>())
      fail("section ", name, ": content hash mismatch");
    return v;
  }
  fail("no section ", name);
}

bool key_matches(const json& h, const PrefixDiskKey& key) {
  return h.value("target_identity", "") == key.target_identity &&
         h.value("tokenizer_hash", "") == key.tokenizer_hash &&
         h.value("kv_scheme", "") == key.kv_scheme;
}

std::atomic<uint64_t> g_tmp_counter{0};

}  // namespace

PrefixDisk::PrefixDisk(std::string dir, PrefixDiskKey key)
    : dir_(std::move(dir)), key_(std::move(key)) {
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) fail("--prefix-cache-dir ", dir_, ": cannot create: ", ec.message());
  fs::directory_iterator it(dir_, ec);
  if (ec) fail("--prefix-cache-dir ", dir_, ": cannot list: ", ec.message());
  for (const auto& e : it) {
    const std::string path = e.path().string();
    if (!e.is_regular_file() || e.path().extension() != kSuffix) continue;
    try {
      // The header and the token ids only: a restart does not read every cached state.
      Parsed p = parse(path);
      if (!key_matches(p.header, key_)) fail(path, ": written under another key");
      // A whole file ends where its last section does (a truncated one is caught here; a
      // corrupt section when it is read).
      uint64_t end = 0;
      for (const json& sec : p.header.at("sections")) {
        uint64_t e = 0;
        if (__builtin_add_overflow(as_count(sec.at("offset"), "offset"),
                                   as_count(sec.at("bytes"), "bytes"), &e))
          fail(path, ": a section ends past 2^64");
        end = std::max(end, e);
      }
      if (p.payload + end != p.size) fail(path, ": size differs from its header's");
      index_.push_back({path, section_values<int32_t>(p, "tokens", "i32"), p.size});
    } catch (const std::exception&) {
      drop(path);
    }
  }
}

int64_t PrefixDisk::bytes() const {
  uint64_t n = 0;
  for (const Indexed& i : index_) n += i.bytes;
  return static_cast<int64_t>(n);
}

void PrefixDisk::drop(const std::string& path) {
  std::error_code ec;
  fs::remove(path, ec);
  index_.erase(std::remove_if(index_.begin(), index_.end(),
                              [&](const Indexed& i) { return i.path == path; }),
               index_.end());
  ++removed_;
}

std::string PrefixDisk::file_name(std::span<const int32_t> tokens) const {
  XXH3_state_t* s = XXH3_createState();
  XXH3_64bits_reset(s);
  for (const std::string* part : {&key_.target_identity, &key_.tokenizer_hash, &key_.kv_scheme})
    XXH3_64bits_update(s, part->data(), part->size() + 1);  // with the terminator: unambiguous
  XXH3_64bits_update(s, tokens.data(), tokens.size_bytes());
  const uint64_t h = XXH3_64bits_digest(s);
  XXH3_freeState(s);
  return (fs::path(dir_) / (hex64(h) + "-" + std::to_string(tokens.size()) + kSuffix)).string();
}

bool PrefixDisk::write(const PrefixRecord& r) {
  TANDEM_CHECK(r.kv_dtype == key_.kv_dtype, "prefix disk: a record of ", dtype_name(r.kv_dtype),
               " KV written under a ", dtype_name(key_.kv_dtype), " key");
  std::vector<Section> sections;
  const int64_t n = static_cast<int64_t>(r.tokens.size());
  sections.push_back({"tokens", "i32", {n}, r.tokens.data(), r.tokens.size() * 4});
  const char* kv_dtype = kv_section_dtype(r.kv_dtype);
  const size_t kv_element = dtype_size(r.kv_dtype);
  for (size_t l = 0; l < r.keys.size(); ++l) {
    sections.push_back({"kv." + std::to_string(l) + ".keys",
                        kv_dtype,
                        {static_cast<int64_t>(r.keys[l].size() / kv_element)},
                        r.keys[l].data(),
                        r.keys[l].size()});
    sections.push_back({"kv." + std::to_string(l) + ".values",
                        kv_dtype,
                        {static_cast<int64_t>(r.values[l].size() / kv_element)},
                        r.values[l].data(),
                        r.values[l].size()});
  }
  sections.push_back({"linear",
                      "f32",
                      {static_cast<int64_t>(r.linear.size())},
                      r.linear.data(),
                      r.linear.size() * 4});
  json header = {{"format", kFormatVersion},
                 {"target_identity", key_.target_identity},
                 {"tokenizer_hash", key_.tokenizer_hash},
                 {"kv_scheme", key_.kv_scheme},
                 {"tokens", n},
                 {"attention_layers", r.keys.size()}};
  if (r.draft) {
    const spec::Checkpoint& c = *r.draft;
    json tensors = json::array();
    for (const auto& [name, t] : c.tensors) {
      tensors.push_back(name);
      sections.push_back(
          {"draft.tensor." + name, "f32", t.shape, t.data.data(), t.data.size() * 4});
    }
    sections.push_back({"draft.tokens",
                        "i32",
                        {static_cast<int64_t>(c.tokens.size())},
                        c.tokens.data(),
                        c.tokens.size() * 4});
    header["draft"] = {{"schema", c.schema},
                       {"ns", c.ns},
                       {"processed_tokens", c.processed_tokens},
                       {"metadata", c.metadata},
                       {"tensors", tensors}};
  }
  json list = json::array();
  uint64_t offset = 0;
  for (const Section& s : sections) {
    list.push_back({{"name", s.name},
                    {"dtype", s.dtype},
                    {"shape", s.shape},
                    {"offset", offset},
                    {"bytes", s.bytes},
                    {"xxh3", hex64(XXH3_64bits(s.data, s.bytes))}});
    offset += s.bytes;
  }
  header["sections"] = list;
  const std::string head = header.dump();
  const std::string path = file_name(r.tokens);
  const std::string tmp = path + ".tmp." + std::to_string(::getpid()) + "." +
                          std::to_string(g_tmp_counter.fetch_add(1));
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return false;
  bool ok = true;
  auto put = [&](const void* p, size_t bytes) {
    const char* c = static_cast<const char*>(p);
    while (ok && bytes > 0) {
      const ssize_t w = ::write(fd, c, bytes);
      if (w <= 0) {
        ok = false;
        break;
      }
      c += w;
      bytes -= static_cast<size_t>(w);
    }
  };
  const uint32_t version = kFormatVersion;
  const uint64_t head_len = head.size();
  put(kMagic, 8);
  put(&version, sizeof(version));
  put(&head_len, sizeof(head_len));
  put(head.data(), head.size());
  for (const Section& s : sections) put(s.data, s.bytes);
  ok = ok && ::fsync(fd) == 0;
  ok = ::close(fd) == 0 && ok;
  ok = ok && ::rename(tmp.c_str(), path.c_str()) == 0;
  if (!ok) {
    ::unlink(tmp.c_str());
    return false;
  }
  const uint64_t size = sizeof(kMagic) + sizeof(version) + sizeof(head_len) + head.size() + offset;
  auto same =
      std::find_if(index_.begin(), index_.end(), [&](const Indexed& i) { return i.path == path; });
  if (same == index_.end())
    index_.push_back({path, r.tokens, size});
  else
    same->bytes = size;
  return true;
}

PrefixDisk::Found PrefixDisk::find(std::span<const int32_t> prompt, int64_t longer_than) const {
  Found best;
  best.tokens = longer_than;
  for (const Indexed& i : index_) {
    const int64_t n = static_cast<int64_t>(i.tokens.size());
    if (n <= best.tokens || n > static_cast<int64_t>(prompt.size()) - 1) continue;
    if (std::equal(i.tokens.begin(), i.tokens.end(), prompt.begin())) best = {n, i.path};
  }
  if (best.path.empty()) best.tokens = 0;
  return best;
}

std::optional<PrefixRecord> PrefixDisk::read(const std::string& path) {
  try {
    Parsed p = parse(path);
    if (!key_matches(p.header, key_)) fail(path, ": written under another key");
    PrefixRecord r;
    r.tokens = section_values<int32_t>(p, "tokens", "i32");
    if (static_cast<int64_t>(r.tokens.size()) != as_int(p.header.at("tokens"), "tokens"))
      fail(path, ": token count");
    const uint64_t layers = as_count(p.header.at("attention_layers"), "attention_layers");
    if (layers > 4096) fail(path, ": attention layers");
    // The KV's storage is part of the key; the sections must say the same.
    r.kv_dtype = key_.kv_dtype;
    const char* kv_dtype = kv_section_dtype(r.kv_dtype);
    const size_t kv_element = dtype_size(r.kv_dtype);
    for (uint64_t l = 0; l < layers; ++l) {
      r.keys.push_back(
          section_values<std::byte>(p, "kv." + std::to_string(l) + ".keys", kv_dtype, kv_element));
      r.values.push_back(section_values<std::byte>(p, "kv." + std::to_string(l) + ".values",
                                                   kv_dtype, kv_element));
    }
    r.linear = section_values<float>(p, "linear", "f32");
    if (p.header.contains("draft")) {
      const json& d = p.header.at("draft");
      auto c = std::make_shared<spec::Checkpoint>();
      c->schema = d.at("schema").get<std::string>();
      c->ns = d.at("ns").get<std::string>();
      c->processed_tokens = as_int(d.at("processed_tokens"), "processed_tokens");
      c->metadata = d.at("metadata");
      for (const json& name : d.at("tensors")) {
        const std::string n = name.get<std::string>();
        spec::CheckpointTensor t;
        for (const json& s : p.header.at("sections"))
          if (s.at("name").get<std::string>() == "draft.tensor." + n)
            t.shape = as_shape(s.at("shape"), "shape");
        t.data = section_values<float>(p, "draft.tensor." + n, "f32");
        c->tensors[n] = std::move(t);
      }
      c->tokens = section_values<int32_t>(p, "draft.tokens", "i32");
      r.draft = std::move(c);
    }
    return r;
  } catch (const std::exception&) {
    drop(path);
    return std::nullopt;
  }
}

}  // namespace tandem
