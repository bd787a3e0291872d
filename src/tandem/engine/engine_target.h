// What the batch engine needs of a target model: its forwards, the rows of the state they append
// to, and the seam its drafters read. One EngineTarget owns one state, used by one engine.
//
// Implementations: QwenEngineTarget (Qwen3.5 dense and MoE: paged KV with an optional fixed
// pool, layer-sliced prompt forwards, pipelined decode steps, the prefix cache) and
// Glm5EngineTarget (GLM-5: per-row latent caches that grow on demand; prompt forwards run
// whole). Capabilities a target lacks are refused by name (set_fixed_pool, open_prefix_cache) or
// reported (pipelines_steps).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "tandem/backend/context.h"
#include "tandem/engine/prefix_store.h"
#include "tandem/model/forward.h"
#include "tandem/spec/draft.h"

namespace tandem {

class EngineTarget {
 public:
  virtual ~EngineTarget() = default;

  // The seam drafters are opened against (DESIGN.md 5.4); named by the target's identity.
  virtual const spec::TargetView& view() const = 0;
  // The backend context the target's model runs on (backend/context.h): the engine enters it for
  // each step, so its drafters and copies share the model's stream. The caller's by default.
  virtual ops::Context& context() const { return ops::current_context(); }
  virtual std::span<const int64_t> eos_token_ids() const = 0;
  int64_t vocab_size() const { return view().vocab_size(); }
  int64_t hidden_size() const { return view().hidden_size(); }

  // Rows. open_row throws Error when no slot is free.
  virtual int open_row() = 0;
  virtual void close_row(int slot) = 0;
  virtual int64_t length(int slot) const = 0;  // tokens the row holds

  // A fixed pool of KV blocks (EngineOptions::kv_blocks): every row's blocks are reserved at
  // admission, so no round runs out of memory half-way.
  virtual void set_fixed_pool(int max_rows, int64_t blocks, int64_t max_window);
  virtual bool fixed() const { return false; }
  virtual int64_t block_tokens() const { return 0; }  // tokens per KV block
  virtual int64_t total_blocks() const { return 0; }
  virtual int64_t free_blocks() const { return 0; }
  virtual int64_t blocks_for(int64_t /*tokens*/) const { return 0; }
  virtual bool has_kv() const { return true; }  // false: no layer keeps a per-token cache
  virtual void reserve(int /*slot*/, int64_t /*tokens*/) {}

  // Forwards (ForwardRequest's contract; host outputs in `out`).
  virtual void forward(const ForwardRequest& req, ForwardOutput* out) = 0;
  virtual void commit_windows(std::span<const RowKeep> rows) = 0;

  // A prompt forward that may run a few layers per call (layer-sliced prefill). begin copies
  // the request; continue runs up to max_layers layers (0: all that remain) and returns true
  // after the last one, with `out` filled. A target without slicing runs it whole.
  virtual void begin_prompt(const ForwardRequest& req) = 0;
  virtual bool continue_prompt(int max_layers, ForwardOutput* out) = 0;
  virtual bool prompt_active() const = 0;
  virtual std::span<const RowInput> prompt_rows() const = 0;  // of the forward in flight
  virtual void abandon_prompt() = 0;

  // Decode steps queued ahead of the host (ForwardRequest::defer_argmax, tokens_from_argmax,
  // with greedy or drawn tokens).
  virtual bool pipelines_steps() const { return false; }
  // Verify forwards whose drafted tokens stay in backend memory (ForwardRequest::draft_ids).
  virtual bool takes_draft_ids() const { return false; }
  virtual void collect_argmax(std::vector<int32_t>* argmax);
  virtual void drop_deferred_argmax() {}

  // Rounds settled on the device (Qwen35Model::accept_windows / settle_windows, and
  // Qwen35State's resolve_settled): after a verify forward with all_logits and want_argmax, the
  // accept walk and the commit stay where the tokens are, and later forwards of the rows may be
  // queued before resolve_settled tells the host what was kept. Targets that cannot say no.
  virtual bool settles_windows() const { return false; }
  virtual void accept_windows(int32_t* accepted, int32_t* next, const int32_t* limits);
  virtual void settle_windows(std::span<const ops::SettledRow> rows, const int32_t* accepted);
  virtual void resolve_settled(std::span<const RowKeep> rows);
  // The last forward's hidden of every token in backend memory, final-normed (that forward had
  // all_logits or want_hidden) or pre-norm; valid until the next forward.
  virtual const float* device_hidden(bool prenorm) const;
  // Whether a prompt forward with ForwardRequest::hidden_on_device leaves its hiddens in backend
  // memory, and where: the last finished prompt forward's, [T, H], final-normed or pre-norm as
  // it asked; valid until the next prompt forward. Targets that cannot: false, null.
  virtual bool keeps_prompt_hidden() const { return false; }
  virtual const float* prompt_hidden(bool prenorm) const {
    (void)prenorm;
    return nullptr;
  }

  // Whether a prompt forward gives each token the bits decoding gives it (then a prompt's end
  // and a finished turn are boundaries a cold prefill reaches too; otherwise only the prefill
  // chunk grid is).
  virtual bool prompt_matches_decode() const = 0;
  // A prefix cache over this target's state (PrefixStore) with a byte budget; null: none.
  virtual std::unique_ptr<PrefixStore> open_prefix_cache(size_t /*max_bytes*/) { return nullptr; }
};

}  // namespace tandem
