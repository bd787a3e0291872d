#include "tandem/backend/graph_cache.h"

#include "tandem/backend/ops.h"
#ifdef TANDEM_HAVE_CUDA
#include "tandem/backend/cuda/cuda_ops.h"
#endif

namespace tandem {

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

void GraphCache::run(uint64_t key, const std::function<void()>& body) {
#ifdef TANDEM_HAVE_CUDA
  if (ops::backend() == ops::Backend::Cuda && ops::graphs_enabled()) {
    // Internal scratch of the CUDA ops may have moved since a graph was captured; whether
    // kernels overlap (PDL) is baked into the captured edges.
    key = KeyHasher().add(key).add(cuda::scratch_generation()).add(cuda::pdl_enabled()).value();
    auto it = graphs_.find(key);
    if (it == graphs_.end()) {
      if (graphs_.size() >= kMaxGraphs) clear();
      it = graphs_.emplace(key, Entry{}).first;
    }
    Entry& e = it->second;
    if (e.exec) return cuda::graph_launch(e.exec);
    if (++e.seen < 2) return body();
    e.exec = cuda::graph_capture(body);
    return cuda::graph_launch(e.exec);
  }
#endif
  (void)key;
  body();
}

}  // namespace tandem
