#include "tandem/engine/engine_target.h"

#include "tandem/core/error.h"

namespace tandem {

void EngineTarget::set_fixed_pool(int, int64_t, int64_t) {
  fail("a fixed KV pool (--kv-blocks / --kv-memory) is not supported for this target");
}

void EngineTarget::collect_argmax(std::vector<int32_t>*) {
  fail("this target does not queue decode steps ahead of the host");
}

}  // namespace tandem
