#include "tandem/io/weight_store.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "tandem/core/error.h"
#include "tandem/io/json_file.h"

namespace tandem {
namespace {

namespace fs = std::filesystem;

constexpr uint64_t kProgressThreshold = 256ull << 20;  // below this, loading is quick and quiet
constexpr size_t kPrefaultChunk = 64ull << 20;         // unit of work handed to a prefault thread

// Shard names come from a JSON file; keep them inside the model directory.
bool is_safe_relative(const std::string& name) {
  const fs::path p(name);
  if (name.empty() || p.is_absolute()) return false;
  for (const auto& part : p) {
    if (part == "..") return false;
  }
  return true;
}

// Reads dir/model.safetensors.index.json: shard file name -> tensor names it must contain.
std::map<std::string, std::vector<std::string>> read_index(const fs::path& index_path) {
  const std::string idx = index_path.string();
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_text_file(index_path));
  } catch (const nlohmann::json::exception& e) {
    fail(idx, ": not valid JSON: ", e.what());
  }
  if (!j.is_object()) fail(idx, ": must be a JSON object, got ", j.type_name());
  auto wm = j.find("weight_map");
  if (wm == j.end()) fail(idx, ": missing 'weight_map'");
  if (!wm->is_object()) fail(idx, ": 'weight_map' must be an object, got ", wm->type_name());
  if (wm->empty()) fail(idx, ": 'weight_map' is empty");
  std::map<std::string, std::vector<std::string>> shards;
  for (const auto& [name, shard] : wm->items()) {
    if (!shard.is_string()) {
      fail(idx, ": weight_map['", name, "'] must be a shard file name, got ", shard.type_name());
    }
    const auto& s = shard.get_ref<const std::string&>();
    if (!is_safe_relative(s)) {
      fail(idx, ": weight_map['", name, "'] = '", s,
           "' must be a file name relative to the model directory");
    }
    shards[s].push_back(name);
  }
  return shards;
}

// Levenshtein distance, for "did you mean" suggestions on a miss (error path only).
size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

// Faults in every page of every file so that the first forward pass does not pay for disk reads
// or page-table setup. Threads pull fixed-size chunks from a shared counter; the calling thread
// reports progress.
void prefault_files(const std::vector<std::shared_ptr<const SafetensorsFile>>& files) {
  struct Chunk {
    size_t file;
    size_t offset;
    size_t len;
  };
  std::vector<Chunk> chunks;
  uint64_t total = 0;
  for (size_t i = 0; i < files.size(); ++i) {
    const auto bytes = files[i]->bytes();
    // The mapping start is page-aligned (mmap); WILLNEED starts asynchronous read-ahead.
    madvise(const_cast<std::byte*>(bytes.data()), bytes.size(), MADV_WILLNEED);
    for (size_t off = 0; off < bytes.size(); off += kPrefaultChunk) {
      chunks.push_back({i, off, std::min(kPrefaultChunk, bytes.size() - off)});
    }
    total += bytes.size();
  }
  std::vector<std::atomic<size_t>> chunks_left(files.size());
  for (const Chunk& c : chunks) chunks_left[c.file].fetch_add(1, std::memory_order_relaxed);

  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  std::atomic<size_t> next{0};
  std::atomic<uint64_t> done_bytes{0};
  std::atomic<size_t> files_done{0};
  std::mutex mu;
  std::condition_variable all_done;
  size_t workers_left = 0;  // guarded by mu
  auto worker = [&] {
    uint64_t sink = 0;
    for (size_t k; (k = next.fetch_add(1)) < chunks.size();) {
      const Chunk& c = chunks[k];
      const volatile std::byte* p = files[c.file]->bytes().data() + c.offset;
      for (size_t off = 0; off < c.len; off += page) sink += static_cast<uint64_t>(p[off]);
      done_bytes.fetch_add(c.len);
      if (chunks_left[c.file].fetch_sub(1) == 1) files_done.fetch_add(1);
    }
    static std::atomic<uint64_t> g_sink{0};  // keeps the reads observable
    g_sink.fetch_add(sink, std::memory_order_relaxed);
    std::lock_guard<std::mutex> lock(mu);
    if (--workers_left == 0) all_done.notify_one();
  };

  const bool report = total > kProgressThreshold;
  const bool tty = isatty(STDERR_FILENO) != 0;
  auto print = [&](bool final_line) {
    if (!report || (!tty && !final_line)) return;
    std::fprintf(stderr, "%sloading weights: %zu/%zu shards, %.1f/%.1f GB%s", tty ? "\r" : "",
                 files_done.load(), files.size(), static_cast<double>(done_bytes.load()) / 1e9,
                 static_cast<double>(total) / 1e9, final_line ? "\n" : "");
    std::fflush(stderr);
  };

  const size_t hw = std::max(1u, std::thread::hardware_concurrency());
  const size_t n_threads = std::min<size_t>({hw, 8, std::max<size_t>(chunks.size(), 1)});
  workers_left = n_threads;
  std::vector<std::thread> threads;
  for (size_t t = 0; t < n_threads; ++t) threads.emplace_back(worker);
  {
    std::unique_lock<std::mutex> lock(mu);
    while (!all_done.wait_for(lock, std::chrono::milliseconds(250),
                              [&] { return workers_left == 0; })) {
      print(false);
    }
  }
  for (auto& t : threads) t.join();
  print(true);
}

}  // namespace

WeightStore WeightStore::open(const std::string& dir, bool prefault) {
  const fs::path d(dir);
  std::error_code ec;
  if (!fs::exists(d, ec)) fail("model directory ", dir, " does not exist");
  if (!fs::is_directory(d, ec)) fail("model path ", dir, " is not a directory");

  WeightStore ws;
  ws.dir_ = dir;
  // For an index: which names each opened file must contain (checked after open).
  std::vector<std::pair<std::string, std::vector<std::string>>> required;
  const fs::path single = d / "model.safetensors";
  const fs::path index = d / "model.safetensors.index.json";
  if (fs::is_regular_file(single, ec)) {
    ws.files_.push_back(SafetensorsFile::open(single.string()));
  } else if (fs::is_regular_file(index, ec)) {
    for (auto& [shard, names] : read_index(index)) {
      const fs::path sp = d / shard;
      if (!fs::is_regular_file(sp, ec)) {
        fail(index.string(), ": shard '", shard, "' (holding tensor '", names.front(), "'",
             names.size() > 1 ? " and " + std::to_string(names.size() - 1) + " more" : "",
             ") does not exist in ", dir);
      }
      ws.files_.push_back(SafetensorsFile::open(sp.string()));
      required.emplace_back(sp.string(), std::move(names));
    }
  } else {
    std::vector<fs::path> found;
    for (const auto& e : fs::directory_iterator(d, ec)) {
      if (e.is_regular_file() && e.path().extension() == ".safetensors") found.push_back(e.path());
    }
    if (ec) fail("cannot list model directory ", dir, ": ", ec.message());
    if (found.empty()) {
      fail("no weights in ", dir,
           ": expected model.safetensors, model.safetensors.index.json or one *.safetensors file");
    }
    if (found.size() > 1) {
      std::sort(found.begin(), found.end());
      std::string list;
      for (const auto& f : found) list += (list.empty() ? "" : ", ") + f.filename().string();
      fail("ambiguous weights in ", dir, ": ", found.size(), " *.safetensors files (", list,
           ") but no model.safetensors.index.json to say how they fit together");
    }
    ws.files_.push_back(SafetensorsFile::open(found.front().string()));
  }

  for (const auto& [path, names] : required) {
    // Init-captures: clang before 16 cannot capture structured bindings.
    const auto& file = *std::find_if(ws.files_.begin(), ws.files_.end(),
                                     [&p = path](const auto& f) { return f->path() == p; });
    for (const std::string& name : names) {
      if (file->find(name) == nullptr) {
        fail(index.string(), ": maps tensor '", name, "' to ", path, ", which has no such tensor (",
             file->tensors().size(), " tensors there)");
      }
    }
  }
  for (const auto& file : ws.files_) {
    for (const TensorView& t : file->tensors()) {
      auto [it, inserted] = ws.by_name_.emplace(t.name, &t);
      if (!inserted) {
        const std::string& other =
            std::find_if(ws.files_.begin(), ws.files_.end(),
                         [&t, first = it->second](auto& f) { return f->find(t.name) == first; })
                ->get()
                ->path();
        fail("tensor '", t.name, "' appears in both ", other, " and ", file->path());
      }
      ws.total_bytes_ += t.nbytes;
    }
  }

  if (prefault) prefault_files(ws.files_);
  return ws;
}

const TensorView* WeightStore::find(std::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : it->second;
}

const TensorView& WeightStore::get(std::string_view name) const {
  if (const TensorView* t = find(name)) return *t;
  std::vector<std::pair<size_t, const std::string*>> near;
  const size_t limit = std::max<size_t>(4, name.size() / 2);
  for (const auto& [n, _] : by_name_) {
    const size_t dist = edit_distance(name, n);
    if (dist <= limit) near.emplace_back(dist, &n);
  }
  std::sort(near.begin(), near.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  std::string hint;
  for (size_t i = 0; i < near.size() && i < 3; ++i) {
    hint += (i ? ", '" : "; did you mean '") + *near[i].second + "'";
  }
  if (!hint.empty()) hint += "?";
  fail("tensor '", name, "' not found in ", dir_, " (", by_name_.size(), " tensors", hint, ")");
}

std::vector<std::string> WeightStore::names() const {
  std::vector<std::string> out;
  out.reserve(by_name_.size());
  for (const auto& [n, _] : by_name_) out.push_back(n);
  return out;
}

std::vector<std::string> WeightStore::names_with_prefix(std::string_view prefix) const {
  std::vector<std::string> out;
  for (auto it = by_name_.lower_bound(prefix);
       it != by_name_.end() && std::string_view(it->first).starts_with(prefix); ++it) {
    out.push_back(it->first);
  }
  return out;
}

std::vector<std::string> WeightStore::files() const {
  std::vector<std::string> out;
  for (const auto& f : files_) out.push_back(f->path());
  return out;
}

}  // namespace tandem
