#include "tandem/engine/qwen_engine_target.h"

namespace tandem {

QwenEngineTarget::QwenEngineTarget(const Qwen35Model& model, std::string identity, DType kv_dtype)
    : model_(model),
      view_(model, std::move(identity)),
      state_(model.config(), RecurrentRollback::PerPositionStates, kv_dtype) {}

}  // namespace tandem
