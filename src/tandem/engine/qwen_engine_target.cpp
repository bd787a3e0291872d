#include "tandem/engine/qwen_engine_target.h"

#include "tandem/engine/prefix_cache.h"

namespace tandem {

QwenEngineTarget::QwenEngineTarget(const Qwen35Model& model, std::string identity, DType kv_dtype)
    : model_(model),
      view_(model, std::move(identity)),
      state_(model.config(), Qwen35State::kDefaultRollback, kv_dtype) {}

void QwenEngineTarget::resolve_settled(std::span<const RowKeep> rows) {
  state_.resolve_settled(rows);
}

std::unique_ptr<PrefixStore> QwenEngineTarget::open_prefix_cache(size_t max_bytes) {
  return std::make_unique<PrefixCache>(
      state_, max_bytes, Qwen35State::block_bytes(model_.config(), state_.kv_dtype()));
}

}  // namespace tandem
