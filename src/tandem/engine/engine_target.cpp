#include "tandem/engine/engine_target.h"

#include "tandem/core/error.h"

namespace tandem {

void EngineTarget::set_fixed_pool(int, int64_t, int64_t) {
  fail("a fixed KV pool (--kv-blocks / --kv-memory) is not supported for this target");
}

void EngineTarget::collect_argmax(std::vector<int32_t>*) {
  fail("this target does not queue decode steps ahead of the host");
}

void EngineTarget::accept_windows(int32_t*, int32_t*, const int32_t*) {
  fail("this target does not settle verify windows on the device");
}

void EngineTarget::settle_windows(std::span<const ops::SettledRow>, const int32_t*) {
  fail("this target does not settle verify windows on the device");
}

void EngineTarget::resolve_settled(std::span<const RowKeep>) {
  fail("this target does not settle verify windows on the device");
}

const float* EngineTarget::device_hidden(bool) const {
  fail("this target does not keep its hidden states for drafters in backend memory");
}

}  // namespace tandem
