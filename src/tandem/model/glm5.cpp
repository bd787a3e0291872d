#include "tandem/model/glm5.h"

#include <algorithm>
#include <cmath>

#include "tandem/backend/weight_rows.h"
#include "tandem/core/error.h"
#include "tandem/model/gated_attention.h"
#include "tandem/model/moe_weights.h"

namespace tandem {

std::unique_ptr<Glm5Model> Glm5Model::load(const std::string& dir, const LoadOptions& opts) {
  std::unique_ptr<Glm5Model> m(new Glm5Model());
  m->context_ = ops::Context::for_new_model();
  const ops::ContextScope scope(*m->context_);
  m->cfg_ = load_glm5_config(dir);
  m->store_ = WeightStore::open(dir, opts.prefault);
  m->tensors_ = std::make_unique<Glm5Tensors>(m->cfg_, m->store_);
  m->bind_weights();
  return m;
}

void Glm5Model::bind_weights() {
  const Glm5Config& c = cfg_;
  Glm5Tensors& t = *tensors_;
  const int64_t H = c.hidden_size;
  embed_ = t.tensor("model.embed_tokens.weight", {c.vocab_size, H});
  final_norm_ = t.tensor("model.norm.weight", {H});
  if (c.tie_word_embeddings) {
    lm_head_ = embed_;
  } else {
    if (!store_.find("lm_head.weight"))
      fail("tensor 'lm_head.weight' not found in ", store_.dir(),
           " (config says tie_word_embeddings=false)");
    lm_head_ = t.tensor("lm_head.weight", {c.vocab_size, H});
  }
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const auto li = static_cast<size_t>(i);
    layers_.push_back(bind_glm5_layer(t, c, "model.layers." + std::to_string(i) + ".",
                                      c.sparse_layers[li], !c.shared_index_layers[li], true));
  }
  const std::vector<float> inv_freq = rope_inv_freq(c.rope_theta, c.qk_rope_head_dim);
  inv_freq_.grow_to(static_cast<int64_t>(inv_freq.size()));
  ops::copy_from_host(inv_freq_.data(), inv_freq.data(), sizeof(float) * inv_freq.size());
}

void Glm5Model::embed(std::span<const int32_t> ids, float* out) const {
  const ops::ContextScope scope(*context_);
  for (size_t i = 0; i < ids.size(); ++i)
    if (ids[i] < 0 || ids[i] >= cfg_.vocab_size)
      fail("token id ", ids[i], " at input position ", i, " is out of range [0, ", cfg_.vocab_size,
           ")");
  const auto n = static_cast<int64_t>(ids.size());
  ws_.ids.grow_to(n);
  if (n > 0) ops::copy_from_host(ws_.ids.data(), ids.data(), sizeof(int32_t) * ids.size());
  ops::embed_rows(embed_, ws_.ids.data(), n, out);
}

void Glm5Model::embed_device(const int32_t* ids, int64_t n, float* out) const {
  const ops::ContextScope scope(*context_);
  ops::embed_rows(embed_, ids, n, out);
}

void Glm5Model::head(const float* hidden, int64_t n, float* out, int64_t rows) const {
  const ops::ContextScope scope(*context_);
  ops::linear(hidden, n, rows > 0 ? ops::leading_rows(lm_head_, rows, "head") : lm_head_, out);
}

void Glm5Model::forward(Glm5State& st, const ForwardRequest& req, ForwardOutput* out) const {
  const ops::ContextScope scope(*context_);
  if (req.tokens_from_argmax || req.defer_argmax)
    fail("forward: GLM-5 takes host tokens and returns its argmax at once (tokens_from_argmax and ",
         "defer_argmax are not supported)");
  if (!req.draft_from.empty())
    fail("forward: GLM-5 takes its tokens from the host (draft_from is not supported)");
  if (req.after_reads)
    fail("forward: GLM-5 commits its windows from the host (after_reads is not supported)");
  Glm5Tokens b;
  b.prompt = req.prompt;
  check_forward_rows(
      req.rows, [&](int slot) { return st.row_open(slot); },
      [&](int slot) {
        return st.window(slot) > 0 ? std::to_string(st.window(slot)) + " tokens" : std::string();
      });
  std::vector<int> slots;
  for (const RowInput& r : req.rows) {
    b.rows.push_back({b.T, r.n_tokens, st.length(r.slot)});
    slots.push_back(r.slot);
    b.T += r.n_tokens;
  }
  if (b.T != static_cast<int64_t>(req.tokens.size()))
    fail("forward: rows cover ", b.T, " tokens but ", req.tokens.size(), " were given");
  check_tap_layers(req.tap_layers, static_cast<int64_t>(layers_.size()));
  check_sample_rows(req, b.T);
  for (const Glm5Tokens::Row& r : b.rows)
    for (int64_t j = 0; j < r.n; ++j) b.pos.push_back(r.start + j);
  const int64_t T = b.T, H = cfg_.hidden_size, V = cfg_.vocab_size;
  Workspace& w = ws_;
  w.x.grow_to(T * H);
  float* x = w.x.data();
  embed(req.tokens, x);  // checks the ids before any state changes
  w.layer.prepare(cfg_, b);

  out->routing.clear();
  out->index_selection.clear();
  const int64_t n_taps = static_cast<int64_t>(req.tap_layers.size());
  w.taps.grow_to(T * n_taps * H);
  std::vector<Glm5RowCache> caches(slots.size());
  try {
    const ops::PrefillScope prefill(req.prompt, req.prompt_gemm_rows);
    for (size_t l = 0; l < layers_.size(); ++l) {
      for (int64_t j = 0; j < n_taps; ++j)
        if (req.tap_layers[static_cast<size_t>(j)] == static_cast<int>(l))
          ops::copy_rows(w.taps.data() + j * H, n_taps * H, x, H, T, H);
      for (size_t i = 0; i < slots.size(); ++i) {
        Glm5State::Row& row = st.row(slots[i]);
        caches[i] = {&row.latent[l], &row.index_keys[l]};
      }
      glm5_layer_forward(cfg_, layers_[l], inv_freq_.data(), b, caches, w.layer, x,
                         req.want_routing ? &out->routing : nullptr,
                         req.want_index_selection ? &out->index_selection : nullptr);
    }
  } catch (...) {
    // A forward that fails part way (out of device memory growing a cache) leaves every row as
    // it was: the layers it reached had appended the rows' new positions.
    for (int slot : slots) {
      Glm5State::Row& row = st.row(slot);
      st.truncate(row, row.length);
    }
    throw;
  }
  for (size_t i = 0; i < req.rows.size(); ++i) {
    Glm5State::Row& row = st.row(req.rows[i].slot);
    row.length += req.rows[i].n_tokens;
    row.window = req.rows[i].speculative ? req.rows[i].n_tokens : 0;
  }

  auto to_host = [](std::vector<float>& dst, const float* src, int64_t n) {
    dst.resize(static_cast<size_t>(n));
    if (n > 0) ops::copy_to_host(dst.data(), src, sizeof(float) * static_cast<size_t>(n));
  };
  to_host(out->layer_taps, w.taps.data(), T * n_taps * H);
  if (req.want_prenorm_hidden) to_host(out->prenorm_hidden, x, T * H);
  w.normed.grow_to(T * H);
  float* normed = w.normed.data();
  ops::rms_norm(x, T, H, final_norm_, false, static_cast<float>(cfg_.rms_norm_eps), normed);
  if (req.want_hidden) to_host(out->hidden, normed, T * H);
  const float* head_in = normed;
  int64_t rows = T;
  if (!req.all_logits) {
    rows = static_cast<int64_t>(b.rows.size());
    w.last.grow_to(rows * H);
    for (int64_t i = 0; i < rows; ++i) {
      const Glm5Tokens::Row& r = b.rows[static_cast<size_t>(i)];
      ops::copy_rows(w.last.data() + i * H, H, normed + (r.first + r.n - 1) * H, H, 1, H);
    }
    head_in = w.last.data();
  }
  out->logits_rows = rows;
  out->argmax.clear();
  out->logits.clear();
  if (!req.want_logits && !req.want_argmax) return;
  w.logits.grow_to(rows * V);
  head(head_in, rows, w.logits.data());
  if (req.want_argmax) {
    w.argmax.grow_to(rows);
    if (req.sample_rows.empty()) {
      ops::argmax_rows(w.logits.data(), rows, V, w.argmax.data());
    } else {
      w.sample_rows.grow_to(rows);
      ops::copy_from_host(w.sample_rows.data(), req.sample_rows.data(),
                          sizeof(ops::SampleRow) * req.sample_rows.size());
      ops::sample_rows(w.logits.data(), rows, V, w.sample_rows.data(), w.argmax.data());
    }
    out->argmax.resize(static_cast<size_t>(rows));
    ops::copy_to_host(out->argmax.data(), w.argmax.data(), sizeof(int32_t) * rows);
    for (size_t r = 0; r < out->argmax.size(); ++r)
      if (out->argmax[r] < 0)
        fail("forward: logits row ", r, " holds NaN or +inf, or only -inf",
             req.sample_rows.empty() ? "" : ", or its sampling parameters are invalid");
  }
  if (req.want_logits) to_host(out->logits, w.logits.data(), rows * V);
}

uint64_t Glm5Model::decode_weight_bytes() const {
  uint64_t n = final_norm_.bytes() + lm_head_.bytes();
  for (const Glm5Layer& L : layers_)
    for_each_glm5_layer_weight(L, [&](const ops::WeightRef& w) { n += w.bytes(); });
  const uint64_t experts = expert_weight_bytes();
  if (experts > 0)
    n -= experts - experts / static_cast<uint64_t>(cfg_.n_routed_experts) *
                       static_cast<uint64_t>(cfg_.num_experts_per_tok);
  return n;
}

uint64_t Glm5Model::expert_weight_bytes() const {
  uint64_t n = 0;
  for (const Glm5Layer& L : layers_)
    if (L.sparse) n += moe_expert_bytes(L.moe);
  return n;
}

void Glm5Model::commit_windows(Glm5State& st, std::span<const RowKeep> rows) const {
  const ops::ContextScope scope(*context_);
  for (size_t i = 0; i < rows.size(); ++i) {
    const RowKeep& k = rows[i];
    if (!st.row_open(k.slot)) fail("commit_windows: row slot ", k.slot, " is not open");
    const int64_t w = st.window(k.slot);
    if (w == 0) fail("commit_windows: row slot ", k.slot, " has no open speculative window");
    if (k.kept < 1 || k.kept > w)
      fail("commit_windows: row slot ", k.slot, " keeps ", k.kept, " of a ", w, "-token window");
    for (size_t j = 0; j < i; ++j)
      if (rows[j].slot == k.slot) fail("commit_windows: row slot ", k.slot, " is listed twice");
  }
  for (const RowKeep& k : rows) {
    Glm5State::Row& r = st.row(k.slot);
    st.truncate(r, r.length - r.window + k.kept);
    r.window = 0;
  }
}

}  // namespace tandem
