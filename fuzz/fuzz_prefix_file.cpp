// Fuzz target: prefix-cache files (engine/prefix_disk), which a restarted server reads from a
// folder anything may have written to. The input is one of:
//   mode 0: a whole file, as is;
//   mode 1: edits of a valid file (a truncation length, then (offset, byte) pairs);
//   mode 2: a header of the input's choosing in front of a valid file's sections.
// Modes 1 and 2 start from a file PrefixDisk::write made, so the fuzzer reaches the checks past
// the magic, the hashes and the JSON syntax. The input is written to <dir>/f.tpc and the folder
// opened as a restarted server does. The invariants: a file is either indexed or removed; reading
// an indexed file gives a record whose shapes agree with each other, or nothing and the file is
// removed; a record read back writes and reads again as the same record; nothing else (a
// temporary file) is left in the folder.
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "fuzz_common.h"
#include "tandem/engine/prefix_disk.h"

namespace tandem::fuzz::prefix_file {

namespace fs = std::filesystem;

const PrefixDiskKey kKey{"fuzz-target-identity", "fuzz-tokenizer", "fuzz-kv-scheme"};

// A per-process scratch folder (libFuzzer may run several processes in one directory).
const fs::path& scratch() {
  static const fs::path dir = [] {
    fs::path d = fs::temp_directory_path() / ("tandem_fuzz_prefix_" + std::to_string(::getpid()));
    fs::create_directories(d);
    return d;
  }();
  return dir;
}

std::string slurp(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

PrefixRecord sample_record() {
  PrefixRecord r;
  for (int32_t i = 0; i < 20; ++i) r.tokens.push_back(100 + 7 * i);
  for (int l = 0; l < 2; ++l) {
    std::vector<float> k(20 * 4), v(20 * 4);
    for (size_t i = 0; i < 80; ++i) {
      k[i] = 0.25f * static_cast<float>(i) - static_cast<float>(l);
      v[i] = -0.5f * static_cast<float>(i) + static_cast<float>(l);
    }
    r.keys.emplace_back(sizeof(float) * k.size());
    r.values.emplace_back(sizeof(float) * v.size());
    std::memcpy(r.keys.back().data(), k.data(), sizeof(float) * k.size());
    std::memcpy(r.values.back().data(), v.data(), sizeof(float) * v.size());
  }
  r.linear.assign(16, 0.125f);
  auto c = std::make_shared<spec::Checkpoint>();
  c->processed_tokens = 20;
  c->schema = "qwen-mtp-v1";
  c->ns = "qwen-mtp-v1:fuzz";
  c->metadata = {{"hidden_size", 4}, {"kv_heads", 2}, {"head_dim", 2}};
  c->tensors["kv_keys"] = {{3, 2, 2}, std::vector<float>(12, 1.5f)};
  c->tensors["h_true"] = {{4}, {1.0f, 2.0f, 3.0f, 4.0f}};
  c->tokens = {1, 2, 3};
  r.draft = c;
  return r;
}

// A valid file's bytes and where its header ends.
struct ValidFile {
  std::string bytes;
  size_t header_end = 0;
};

const ValidFile& valid_file() {
  static const ValidFile v = [] {
    const fs::path dir = scratch() / "valid";
    fs::remove_all(dir);
    PrefixDisk disk(dir.string(), kKey);
    if (!disk.write(sample_record())) fail("cannot write the sample file");
    ValidFile f;
    for (const auto& e : fs::directory_iterator(dir)) f.bytes = slurp(e.path());
    uint64_t header_len = 0;
    std::memcpy(&header_len, f.bytes.data() + 12, sizeof(header_len));
    f.header_end = 20 + static_cast<size_t>(header_len);
    fs::remove_all(dir);
    return f;
  }();
  return v;
}

std::string file_from(const uint8_t* data, size_t size) {
  const uint8_t mode = size > 0 ? data[0] % 3 : 0;
  if (size > 0) {
    ++data;
    --size;
  }
  if (mode == 0) return std::string(reinterpret_cast<const char*>(data), size);
  const ValidFile& v = valid_file();
  if (mode == 2) {
    // The header is the input; the sections stay those of the valid file.
    std::string f = v.bytes.substr(0, 12);
    const uint64_t len = size;
    f.append(reinterpret_cast<const char*>(&len), sizeof(len));
    f.append(reinterpret_cast<const char*>(data), size);
    f.append(v.bytes, v.header_end);
    return f;
  }
  std::string f = v.bytes;
  if (size >= 4) {
    uint32_t keep = 0;
    std::memcpy(&keep, data, 4);
    if (keep < f.size()) f.resize(keep);
    data += 4;
    size -= 4;
  }
  for (size_t i = 0; i + 3 <= size && !f.empty(); i += 3) {
    const size_t at =
        (static_cast<size_t>(data[i]) | static_cast<size_t>(data[i + 1]) << 8) % f.size();
    f[at] = static_cast<char>(data[i + 2]);
  }
  return f;
}

void check_record(const PrefixRecord& r) {
  if (r.keys.size() != r.values.size()) fail("keys and values of different layer counts");
  if (r.draft) {
    for (const auto& [name, t] : r.draft->tensors) {
      int64_t n = 1;
      for (int64_t d : t.shape) {
        if (d < 0) fail("a negative checkpoint dimension was accepted");
        if (__builtin_mul_overflow(n, d, &n)) fail("a checkpoint tensor's size overflows");
      }
      if (static_cast<size_t>(n) != t.data.size())
        fail("a checkpoint tensor's data disagrees with its shape");
    }
  }
}

// Bitwise: NaN payloads must survive too.
bool same_floats(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}
bool same_layers(const std::vector<std::vector<std::byte>>& a,
                 const std::vector<std::vector<std::byte>>& b) {
  return a == b;
}

bool same_record(const PrefixRecord& a, const PrefixRecord& b) {
  if (a.tokens != b.tokens || !same_layers(a.keys, b.keys) || !same_layers(a.values, b.values) ||
      !same_floats(a.linear, b.linear))
    return false;
  if (!a.draft || !b.draft) return !a.draft && !b.draft;
  const spec::Checkpoint &x = *a.draft, &y = *b.draft;
  if (x.processed_tokens != y.processed_tokens || x.schema != y.schema || x.ns != y.ns ||
      x.metadata != y.metadata || x.tokens != y.tokens || x.tensors.size() != y.tensors.size())
    return false;
  for (const auto& [name, t] : x.tensors) {
    const auto it = y.tensors.find(name);
    if (it == y.tensors.end() || it->second.shape != t.shape ||
        !same_floats(it->second.data, t.data))
      return false;
  }
  return true;
}

inline int run_one(const uint8_t* data, size_t size) {
  const std::string bytes = file_from(data, size);
  const fs::path dir = scratch() / "cache";
  fs::remove_all(dir);
  fs::create_directories(dir);
  const fs::path file = dir / "f.tpc";
  {
    std::ofstream out(file, std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  PrefixDisk disk(dir.string(), kKey);
  if (disk.files() + disk.removed() != 1) fail("the file was neither indexed nor removed");
  if (disk.removed() == 1 && fs::exists(file)) fail("a refused file was left in the folder");
  if (disk.files() == 1) {
    const std::optional<PrefixRecord> r = disk.read(file.string());
    if (!r) {
      if (fs::exists(file) || disk.files() != 0) fail("an unreadable file was kept");
    } else {
      check_record(*r);
      // What was read writes back and reads again as the same record.
      const fs::path again = scratch() / "again";
      fs::remove_all(again);
      PrefixDisk other(again.string(), kKey);
      if (other.write(*r)) {
        if (other.files() != 1) fail("a written record was not indexed");
        std::string path;
        for (const auto& e : fs::directory_iterator(again)) path = e.path().string();
        const std::optional<PrefixRecord> back = other.read(path);
        if (!back) fail("a record written by PrefixDisk did not read back");
        if (!same_record(*r, *back)) fail("a record changed through a write and a read");
      }
      fs::remove_all(again);
    }
  }
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path() != file) fail("something other than the file is in the folder");
  return 0;
}

}  // namespace tandem::fuzz::prefix_file

#ifndef TANDEM_FUZZ_REPLAY
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return tandem::fuzz::prefix_file::run_one(data, size);
}
#endif
