#include "tandem/io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "tandem/core/error.h"

namespace tandem {
namespace {

using ojson = nlohmann::ordered_json;

// A header this large is not a real checkpoint (the biggest published ones are a few MB); refusing
// it early turns a garbage length prefix into a clear error instead of a huge JSON parse.
constexpr uint64_t kMaxHeaderBytes = 100ull * 1000 * 1000;

std::string supported_dtypes() {
  std::string s;
  for (DType t : {DType::F32, DType::F16, DType::BF16, DType::F64, DType::I64, DType::I32,
                  DType::I16, DType::I8, DType::U32, DType::U8, DType::BOOL, DType::F8_E4M3}) {
    if (!s.empty()) s += ", ";
    s += dtype_name(t);
  }
  return s;
}

// Number of bytes a tensor of `shape` and element size `elem` occupies; false on overflow.
bool byte_size(const std::vector<int64_t>& shape, size_t elem, uint64_t* out) {
  uint64_t n = elem;
  for (int64_t d : shape) {
    if (__builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) return false;
  }
  *out = n;
  return true;
}

uint64_t read_le_u64(const std::byte* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint64_t>(p[i]);
  return v;
}

struct Entry {
  TensorView view;
  uint64_t begin = 0;
  uint64_t end = 0;
};

// Parses one tensor entry of the header (everything but the data pointer).
Entry parse_entry(const std::string& path, const std::string& name, const ojson& e,
                  uint64_t data_size) {
  auto bad = [&](auto&&... parts) {
    fail(path, ": tensor '", name, "': ", std::forward<decltype(parts)>(parts)...);
  };
  if (!e.is_object()) bad("header entry must be an object, got ", e.type_name());
  Entry out;
  out.view.name = name;

  auto dt = e.find("dtype");
  if (dt == e.end()) bad("missing 'dtype'");
  if (!dt->is_string()) bad("'dtype' must be a string, got ", dt->type_name());
  const auto& dts = dt->get_ref<const std::string&>();
  if (!dtype_from_safetensors(dts, &out.view.dtype)) {
    bad("unknown dtype '", dts, "' (supported: ", supported_dtypes(), ")");
  }

  auto sh = e.find("shape");
  if (sh == e.end()) bad("missing 'shape'");
  if (!sh->is_array()) bad("'shape' must be an array, got ", sh->type_name());
  for (size_t i = 0; i < sh->size(); ++i) {
    const ojson& d = (*sh)[i];
    if (!d.is_number_integer()) bad("shape[", i, "] must be an integer, got ", d.type_name());
    if (d.is_number_unsigned()) {
      const uint64_t u = d.get<uint64_t>();
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        bad("shape[", i, "] = ", u, " is too large");
      }
      out.view.shape.push_back(static_cast<int64_t>(u));
    } else {
      const int64_t v = d.get<int64_t>();
      if (v < 0) bad("shape[", i, "] = ", v, " is negative");
      out.view.shape.push_back(v);
    }
  }

  auto off = e.find("data_offsets");
  if (off == e.end()) bad("missing 'data_offsets'");
  if (!off->is_array() || off->size() != 2) {
    bad("'data_offsets' must be an array of 2 integers, got ", off->dump());
  }
  for (size_t i = 0; i < 2; ++i) {
    const ojson& o = (*off)[i];
    if (!o.is_number_integer()) bad("data_offsets[", i, "] must be an integer, got ", o.dump());
    if (!o.is_number_unsigned()) bad("data_offsets[", i, "] = ", o.dump(), " is negative");
  }
  out.begin = (*off)[0].get<uint64_t>();
  out.end = (*off)[1].get<uint64_t>();
  if (out.begin > out.end) bad("data_offsets [", out.begin, ", ", out.end, ") are reversed");
  if (out.end > data_size) {
    bad("data_offsets [", out.begin, ", ", out.end, ") run past the end of the data section (",
        data_size, " bytes); is the file truncated?");
  }

  uint64_t need = 0;
  if (!byte_size(out.view.shape, dtype_size(out.view.dtype), &need)) {
    bad("shape ", shape_str(out.view.shape), " x ", dts, " overflows 64 bits");
  }
  const uint64_t got = out.end - out.begin;
  if (need != got) {
    bad("shape ", shape_str(out.view.shape), " x ", dts, " needs ", need,
        " bytes, but data_offsets [", out.begin, ", ", out.end, ") hold ", got);
  }
  // TensorView::numel() multiplies the dims in int64 from the left, so the nonzero ones must
  // multiply within int64 even when a zero dim makes the tensor empty: [2^62, 3, 0] passes the
  // byte count above and then overflowed numel() (undefined; fuzz/regressions/fuzz_safetensors).
  int64_t elements = 1;
  for (int64_t d : out.view.shape) {
    if (d != 0 && __builtin_mul_overflow(elements, d, &elements))
      bad("shape ", shape_str(out.view.shape), " has more than 2^63 - 1 elements");
  }
  out.view.nbytes = static_cast<size_t>(got);
  return out;
}

}  // namespace

SafetensorsFile::~SafetensorsFile() {
  if (base_ != nullptr) munmap(const_cast<std::byte*>(base_), size_);
}

std::shared_ptr<const SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  // Constructed first so that its destructor unmaps on every error path below.
  std::shared_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;

  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("cannot open safetensors file ", path, ": ", std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    fail("cannot stat safetensors file ", path, ": ", std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail("safetensors path ", path, " is not a regular file");
  }
  const auto size = static_cast<uint64_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    fail(path, ": file is ", size, " bytes, too short for a safetensors file (needs an 8-byte ",
         "header length)");
  }
  // MAP_PRIVATE + PROT_READ: pages come from the page cache and are shared with other processes
  // mapping the same checkpoint; we never write, so nothing is ever copied.
  void* p = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_err = errno;
  ::close(fd);  // the mapping keeps its own reference to the file
  if (p == MAP_FAILED) fail("cannot mmap safetensors file ", path, ": ", std::strerror(map_err));
  f->base_ = static_cast<const std::byte*>(p);
  f->size_ = size;

  const uint64_t header_len = read_le_u64(f->base_);
  if (header_len > kMaxHeaderBytes) {
    fail(path, ": header length ", header_len, " is absurd (limit ", kMaxHeaderBytes,
         " bytes); not a safetensors file?");
  }
  if (header_len > size - 8) {
    fail(path, ": header length ", header_len, " exceeds the ", size - 8,
         " bytes after the length prefix; is the file truncated?");
  }
  const char* hbegin = reinterpret_cast<const char*>(f->base_ + 8);
  const uint64_t data_start = 8 + header_len;
  const uint64_t data_size = size - data_start;

  // nlohmann keeps the last of duplicate keys silently; a checkpoint with two tensors of one name
  // is ambiguous, so catch it while parsing (depth 1 = keys of the top-level object).
  std::string duplicate;
  std::set<std::string> seen;
  ojson header;
  try {
    header = ojson::parse(
        hbegin, hbegin + header_len, [&](int depth, ojson::parse_event_t ev, ojson& parsed) {
          if (depth == 1 && ev == ojson::parse_event_t::key &&
              !seen.insert(parsed.get<std::string>()).second && duplicate.empty()) {
            duplicate = parsed.get<std::string>();
          }
          return true;
        });
  } catch (const ojson::exception& e) {
    fail(path, ": header is not valid JSON: ", e.what());
  }
  if (!header.is_object()) fail(path, ": header must be a JSON object, got ", header.type_name());
  if (!duplicate.empty()) fail(path, ": header names '", duplicate, "' more than once");

  std::vector<Entry> entries;
  entries.reserve(header.size());
  for (const auto& [key, value] : header.items()) {
    if (key == "__metadata__") {
      if (!value.is_object()) {
        fail(path, ": '__metadata__' must be an object, got ", value.type_name());
      }
      for (const auto& [mk, mv] : value.items()) {
        if (!mv.is_string()) {
          fail(path, ": __metadata__['", mk, "'] must be a string, got ", mv.type_name());
        }
        f->metadata_.emplace(mk, mv.get<std::string>());
      }
      continue;
    }
    entries.push_back(parse_entry(path, key, value, data_size));
  }

  std::stable_sort(entries.begin(), entries.end(),
                   [](const Entry& a, const Entry& b) { return a.begin < b.begin; });
  // Tensors may leave gaps (the format allows it) but must not share bytes. Empty tensors occupy
  // nothing and cannot overlap.
  uint64_t covered_end = 0;
  const std::string* covered_by = nullptr;
  for (const Entry& e : entries) {
    if (e.begin == e.end) continue;
    if (covered_by != nullptr && e.begin < covered_end) {
      fail(path, ": tensor '", e.view.name, "' at data_offsets [", e.begin, ", ", e.end,
           ") overlaps tensor '", *covered_by, "' (which ends at ", covered_end, ")");
    }
    covered_end = e.end;
    covered_by = &e.view.name;
  }

  f->tensors_.reserve(entries.size());
  for (Entry& e : entries) {
    e.view.data = f->base_ + data_start + e.begin;
    f->by_name_.emplace(e.view.name, f->tensors_.size());
    f->tensors_.push_back(std::move(e.view));
  }
  return f;
}

const TensorView* SafetensorsFile::find(std::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

void write_safetensors(const std::string& path, std::span<const TensorToWrite> tensors,
                       const std::map<std::string, std::string>& metadata) {
  ojson header = ojson::object();
  if (!metadata.empty()) {
    ojson meta = ojson::object();
    for (const auto& [k, v] : metadata) meta[k] = v;
    header["__metadata__"] = std::move(meta);
  }
  uint64_t offset = 0;
  for (const TensorToWrite& t : tensors) {
    if (t.name == "__metadata__") fail("write_safetensors ", path, ": '__metadata__' is reserved");
    if (header.contains(t.name)) {
      fail("write_safetensors ", path, ": tensor '", t.name, "' given twice");
    }
    for (int64_t d : t.shape) {
      if (d < 0) {
        fail("write_safetensors ", path, ": tensor '", t.name, "' has negative dim in shape ",
             shape_str(t.shape));
      }
    }
    uint64_t need = 0;
    if (!byte_size(t.shape, dtype_size(t.dtype), &need) || need != t.bytes.size()) {
      fail("write_safetensors ", path, ": tensor '", t.name, "' shape ", shape_str(t.shape), " x ",
           dtype_name(t.dtype), " needs ", need, " bytes, got ", t.bytes.size());
    }
    header[t.name] = {{"dtype", std::string(dtype_name(t.dtype))},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + need}}};
    offset += need;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // data section starts 8-aligned

  const std::string tmp = path + ".tmp";
  std::FILE* out = std::fopen(tmp.c_str(), "wb");
  if (out == nullptr) fail("cannot create ", tmp, ": ", std::strerror(errno));
  bool ok = true;
  std::byte len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<std::byte>((text.size() >> (8 * i)) & 0xff);
  ok = ok && std::fwrite(len, 1, 8, out) == 8;
  ok = ok && std::fwrite(text.data(), 1, text.size(), out) == text.size();
  for (const TensorToWrite& t : tensors) {
    if (!ok) break;
    ok = t.bytes.empty() || std::fwrite(t.bytes.data(), 1, t.bytes.size(), out) == t.bytes.size();
  }
  int err = ok ? 0 : errno;
  if (std::fclose(out) != 0 && ok) {
    ok = false;
    err = errno;
  }
  if (!ok) {
    std::remove(tmp.c_str());
    fail("cannot write ", tmp, ": ", std::strerror(err));
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::remove(tmp.c_str());
    fail("cannot rename ", tmp, " to ", path, ": ", ec.message());
  }
}

}  // namespace tandem
