// A Qwen3.5 target (dense or MoE) for the batch engine: the model, its hybrid state (paged KV
// for the attention layers, per-row recurrent states for the Gated DeltaNet layers) and the
// prompt forward in flight.
#pragma once

#include <string>

#include "tandem/engine/engine_target.h"
#include "tandem/model/qwen3_5.h"

namespace tandem {

class QwenEngineTarget final : public EngineTarget {
 public:
  // Borrows the model, which must outlive the target.
  QwenEngineTarget(const Qwen35Model& model, std::string identity, DType kv_dtype);

  const spec::TargetView& view() const override { return view_; }
  std::span<const int64_t> eos_token_ids() const override { return model_.config().eos_token_ids; }
  ops::Context& context() const override { return model_.context(); }

  int open_row() override { return state_.open_row(); }
  void close_row(int slot) override { state_.close_row(slot); }
  int64_t length(int slot) const override { return state_.length(slot); }

  void set_fixed_pool(int max_rows, int64_t blocks, int64_t max_window) override {
    state_.set_capacity({max_rows, blocks, max_window});
  }
  bool fixed() const override { return state_.fixed(); }
  int64_t block_tokens() const override { return Qwen35State::kBlockSize; }
  int64_t total_blocks() const override { return state_.total_blocks(); }
  int64_t free_blocks() const override { return state_.free_block_count(); }
  int64_t blocks_for(int64_t tokens) const override { return Qwen35State::blocks_for(tokens); }
  bool has_kv() const override { return state_.attention_layers() > 0; }
  void reserve(int slot, int64_t tokens) override { state_.reserve(slot, tokens); }

  void forward(const ForwardRequest& req, ForwardOutput* out) override {
    model_.forward(state_, req, out);
  }
  void commit_windows(std::span<const RowKeep> rows) override {
    model_.commit_windows(state_, rows);
  }

  void begin_prompt(const ForwardRequest& req) override {
    model_.begin_prompt(state_, req, &inflight_);
  }
  bool continue_prompt(int max_layers, ForwardOutput* out) override {
    return model_.continue_prompt(state_, inflight_, max_layers, out);
  }
  bool prompt_active() const override { return inflight_.active(); }
  std::span<const RowInput> prompt_rows() const override { return inflight_.rows(); }
  void abandon_prompt() override { inflight_.abandon(); }

  bool pipelines_steps() const override { return true; }
  bool takes_draft_ids() const override { return true; }
  void collect_argmax(std::vector<int32_t>* argmax) override { model_.collect_argmax(argmax); }
  void drop_deferred_argmax() override { model_.drop_deferred_argmax(); }

  bool settles_windows() const override {
    return state_.linear_layers() == 0 || state_.rollback() == RecurrentRollback::Replay;
  }
  void accept_windows(int32_t* accepted, int32_t* next, const int32_t* limits) override {
    model_.accept_windows(accepted, next, limits);
  }
  void settle_windows(std::span<const ops::SettledRow> rows, const int32_t* accepted) override {
    model_.settle_windows(state_, rows, accepted);
  }
  void resolve_settled(std::span<const RowKeep> rows) override;
  const float* device_hidden(bool prenorm) const override { return model_.last_hidden(prenorm); }
  bool keeps_prompt_hidden() const override { return true; }
  const float* prompt_hidden(bool prenorm) const override {
    return model_.prompt_hidden(inflight_, prenorm);
  }

  bool prompt_matches_decode() const override { return ops::prefill_matches_decode(); }
  std::unique_ptr<PrefixStore> open_prefix_cache(size_t max_bytes) override;

 private:
  const Qwen35Model& model_;
  spec::QwenTargetView view_;
  Qwen35State state_;
  Qwen35Model::PromptForward inflight_;
};

}  // namespace tandem
