#include "tandem/engine/glm5_engine_target.h"

#include "tandem/core/error.h"
#include "tandem/engine/glm5_prefix_cache.h"

namespace tandem {

Glm5EngineTarget::Glm5EngineTarget(const Glm5Model& model, std::string identity)
    : model_(model), view_(model, std::move(identity)), state_(model.config(), 0) {}

std::unique_ptr<PrefixStore> Glm5EngineTarget::open_prefix_cache(size_t max_bytes) {
  return std::make_unique<Glm5PrefixCache>(state_, max_bytes);
}

void Glm5EngineTarget::begin_prompt(const ForwardRequest& req) {
  TANDEM_CHECK(!active_, "a prompt forward is already in flight");
  tokens_.assign(req.tokens.begin(), req.tokens.end());
  rows_.assign(req.rows.begin(), req.rows.end());
  tap_layers_.assign(req.tap_layers.begin(), req.tap_layers.end());
  req_ = req;
  req_.tokens = tokens_;
  req_.rows = rows_;
  req_.tap_layers = tap_layers_;
  active_ = true;
}

bool Glm5EngineTarget::continue_prompt(int /*max_layers*/, ForwardOutput* out) {
  TANDEM_CHECK(active_, "no prompt forward is in flight");
  // The forward leaves the state unchanged when it refuses the request; either way it is over.
  active_ = false;
  model_.forward(state_, req_, out);
  return true;
}

}  // namespace tandem
