#include "tandem/backend/graph_cache.h"

#include <cstdio>
#include <cstdlib>

#include "tandem/backend/context.h"
#include "tandem/backend/ops.h"
#ifdef TANDEM_HAVE_CUDA
#include "tandem/backend/cuda/cuda_ops.h"
#endif

namespace tandem {

size_t GraphKey::hash() const {
  // FNV-1a style mixing of the words: only chooses the bucket; equality compares the words.
  uint64_t h = 0xcbf29ce484222325ull;
  for (const uint64_t v : words_) {
    h = (h ^ v) * 0x100000001b3ull;
    h ^= h >> 29;
  }
  return static_cast<size_t>(h);
}

namespace {
thread_local int64_t t_cold_runs = 0;
thread_local int64_t t_evicted = 0;

#ifdef TANDEM_HAVE_CUDA
// TANDEM_GRAPH_COLD_OUT=FILE: one line per cold run, "cache seen words...", to find which key
// keeps changing where graphs should replay (compare the lines of one cache). Opened once; the
// process's exit flushes it.
std::FILE* cold_log() {
  static std::FILE* f = [] {
    const char* path = std::getenv("TANDEM_GRAPH_COLD_OUT");
    return path && *path ? std::fopen(path, "w") : nullptr;
  }();
  return f;
}
#endif
}  // namespace

int64_t GraphCache::cold_runs() {
  return t_cold_runs;
}

int64_t GraphCache::evicted_graphs() {
  return t_evicted;
}

GraphCache::~GraphCache() {
  clear();
}

void GraphCache::clear() {
#ifdef TANDEM_HAVE_CUDA
  for (auto& [key, e] : graphs_)
    if (e.exec) cuda::graph_destroy(e.exec);
#endif
  graphs_.clear();
}

void GraphCache::evict_least_recent() {
  auto victim = graphs_.begin();
  for (auto it = graphs_.begin(); it != graphs_.end(); ++it)
    if (it->second.last_run < victim->second.last_run) victim = it;
  if (victim == graphs_.end()) return;
#ifdef TANDEM_HAVE_CUDA
  if (victim->second.exec) cuda::graph_destroy(victim->second.exec);
#endif
  graphs_.erase(victim);
  ++evictions_;
  ++t_evicted;
}

void GraphCache::run(const GraphKey& key, const std::function<void()>& body) {
#ifdef TANDEM_HAVE_CUDA
  if (ops::backend() == ops::Backend::Cuda && ops::graphs_enabled()) {
    // A graph bakes in its context's scratch addresses, which may have moved since it was
    // captured (and another context has its own), and whether kernels overlap (PDL).
    GraphKey full = key;
    full.add(ops::current_context().id())
        .add(cuda::scratch_generation())
        .add(static_cast<uint64_t>(cuda::pdl_enabled()));
    auto it = graphs_.find(full);
    if (it == graphs_.end()) {
      if (graphs_.size() >= kMaxGraphs) evict_least_recent();
      it = graphs_.emplace(std::move(full), Entry{}).first;
    }
    Entry& e = it->second;
    e.last_run = ++clock_;
    if (e.exec) return cuda::graph_launch(e.exec);
    ++t_cold_runs;
    if (std::FILE* f = cold_log()) {
      std::fprintf(f, "%p %d", static_cast<const void*>(this), e.seen);
      for (const uint64_t w : it->first.words())
        std::fprintf(f, " %llx", static_cast<unsigned long long>(w));
      std::fputc('\n', f);
    }
    if (++e.seen < 2) return body();
    e.exec = cuda::graph_capture(body);
    ++captures_;
    return cuda::graph_launch(e.exec);
  }
#endif
  (void)key;
  body();
}

}  // namespace tandem
