// A GLM-5 target for the batch engine: the model and its per-row latent caches, which grow on
// demand (no fixed pool). Prompt forwards run whole, and decode steps are
// not queued ahead of the host: the CPU backend gains nothing from either. Its prefix cache
// (Glm5PrefixCache) keeps copies of the caches at the prefill grid's boundaries.
#pragma once

#include <string>
#include <vector>

#include "tandem/engine/engine_target.h"
#include "tandem/model/glm5.h"

namespace tandem {

class Glm5EngineTarget final : public EngineTarget {
 public:
  // Borrows the model, which must outlive the target.
  Glm5EngineTarget(const Glm5Model& model, std::string identity);

  const spec::TargetView& view() const override { return view_; }
  std::span<const int64_t> eos_token_ids() const override { return model_.config().eos_token_ids; }
  ops::Context& context() const override { return model_.context(); }

  int open_row() override { return state_.open_row(); }
  void close_row(int slot) override { state_.close_row(slot); }
  int64_t length(int slot) const override { return state_.length(slot); }

  void forward(const ForwardRequest& req, ForwardOutput* out) override {
    model_.forward(state_, req, out);
  }
  void commit_windows(std::span<const RowKeep> rows) override {
    model_.commit_windows(state_, rows);
  }

  void begin_prompt(const ForwardRequest& req) override;
  bool continue_prompt(int max_layers, ForwardOutput* out) override;
  bool prompt_active() const override { return active_; }
  std::span<const RowInput> prompt_rows() const override { return rows_; }
  void abandon_prompt() override { active_ = false; }

  // The prompt form (MLA expanded) and decoding (absorbed) agree within rounding, not bitwise.
  bool prompt_matches_decode() const override { return false; }
  std::unique_ptr<PrefixStore> open_prefix_cache(size_t max_bytes) override;

 private:
  const Glm5Model& model_;
  spec::Glm5TargetView view_;
  Glm5State state_;
  // The prompt forward begun and not yet run: its request, whose spans view tokens_, rows_ and
  // tap_layers_.
  bool active_ = false;
  std::vector<int32_t> tokens_;
  std::vector<RowInput> rows_;
  std::vector<int> tap_layers_;
  ForwardRequest req_;
};

}  // namespace tandem
