#include "tandem/model/qwen3_5.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "tandem/backend/weight_rows.h"
#include "tandem/core/error.h"
#include "tandem/model/gated_attention.h"
#include "tandem/model/moe_weights.h"

namespace tandem {

namespace {

// The share of a mixer's output projection its input projection asks L2 to fetch (the
// linear_split prefetch hint): those bytes stream while the conv and recurrence, or the query
// norms and attention, run with HBM mostly idle. On the H200, half measured best for both layer
// kinds (0.3 to 1.0 tried, BENCHMARKS.md).
constexpr double kOutputPrefetch = 0.5;
// What a projection followed directly by another asks L2 to fetch of it: its blocks finish over
// a few microseconds, when HBM has spare bandwidth. 5% of the next weight measured best on the
// H200 (10% and 20% were slower than none), capped near what such a tail can stream (the head's
// 5% would be 100 MB, twice the L2).
constexpr double kTailPrefetch = 0.05;
constexpr double kTailPrefetchBytes = 10e6;

ops::WeightRef tail_prefetch(const ops::WeightRef& next) {
  const double bytes = static_cast<double>(next.rows * next.cols * dtype_size(next.dtype));
  return ops::leading_rows(next,
                           bytes > 0 ? std::min(kTailPrefetch, kTailPrefetchBytes / bytes) : 0.0);
}

bool is_float(DType t) {
  return t == DType::F32 || t == DType::BF16 || t == DType::F16;
}

// Looks up a tensor and checks its shape and dtype, naming both on mismatch.
ops::WeightRef expect(const WeightStore& store, const std::string& name,
                      const std::vector<int64_t>& shape) {
  const TensorView& t = store.get(name);
  if (t.shape != shape)
    fail("tensor '", name, "' in ", store.dir(), ": expected shape ", shape_str(shape), ", got ",
         shape_str(t.shape));
  if (!is_float(t.dtype))
    fail("tensor '", name, "' in ", store.dir(), ": dtype ", dtype_name(t.dtype),
         " is not supported (expected F32, BF16 or F16)");
  return ops::weight_ref(t);
}

}  // namespace

std::unique_ptr<Qwen35Model> Qwen35Model::load(const std::string& dir, const LoadOptions& opts) {
  std::unique_ptr<Qwen35Model> m(new Qwen35Model());
  m->context_ = ops::Context::for_new_model();
  const ops::ContextScope scope(*m->context_);
  m->cfg_ = load_qwen35_config(dir);
  if (m->cfg_.attention_bias)
    fail(dir, "/config.json: attention_bias=true is not supported for qwen3_5");
  if (m->cfg_.linear_conv_kernel_dim < 1 || m->cfg_.linear_conv_kernel_dim > 16)
    fail(dir, "/config.json: linear_conv_kernel_dim must be in 1..16, got ",
         m->cfg_.linear_conv_kernel_dim);
  m->store_ = WeightStore::open(dir, opts.prefault);
  const WeightStore& store = m->store_;
  std::string prefix;
  if (store.find("model.language_model.embed_tokens.weight"))
    prefix = "model.language_model.";
  else if (store.find("model.embed_tokens.weight"))
    prefix = "model.";
  else
    fail("no embedding tensor in ", store.dir(),
         ": expected 'model.language_model.embed_tokens.weight' or 'model.embed_tokens.weight'");
  if (!m->cfg_.tie_word_embeddings && !store.find("lm_head.weight"))
    fail("tensor 'lm_head.weight' not found in ", store.dir(),
         " (config says tie_word_embeddings=false)");
  if (m->cfg_.moe()) {
    const std::string first = prefix + "layers.0.mlp.experts.";
    m->fused_experts_ = store.find(first + "gate_up_proj") != nullptr;
    if (!m->fused_experts_ && !store.find(first + "0.gate_proj.weight"))
      fail("no experts in ", store.dir(), ": expected '", first,
           "gate_up_proj' (fused, as transformers writes them) or '", first,
           "0.gate_proj.weight' (one tensor per expert)");
  }
  WeightArena& arena = m->arena_;
  m->bind_weights(
      [&](const std::string& name, const std::vector<int64_t>& shape, Role role) {
        const ops::WeightRef stored = expect(store, name, shape);
        return role == Role::Matrix ? arena.matrix(stored) : arena.vector(stored);
      },
      prefix);
  return m;
}

void Qwen35Model::bind_weights(const WeightSource& get, const std::string& prefix) {
  const Qwen35Config& c = cfg_;
  prefix_ = prefix;
  const int64_t H = c.hidden_size;
  embed_ = get(prefix_ + "embed_tokens.weight", {c.vocab_size, H}, Role::Matrix);
  final_norm_ = get(prefix_ + "norm.weight", {H}, Role::Vector);
  lm_head_ =
      c.tie_word_embeddings ? embed_ : get("lm_head.weight", {c.vocab_size, H}, Role::Matrix);
  const int64_t hd = c.head_dim;
  const int64_t nv = c.linear_num_value_heads;
  int n_attn = 0, n_lin = 0;
  layers_.clear();
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = prefix_ + "layers." + std::to_string(i) + ".";
    Layer L;
    L.kind = c.layer_types[static_cast<size_t>(i)];
    L.input_norm = get(p + "input_layernorm.weight", {H}, Role::Vector);
    L.post_norm = get(p + "post_attention_layernorm.weight", {H}, Role::Vector);
    if (c.moe()) {
      L.moe = bind_moe_weights(c, p + "mlp.", fused_experts_,
                               [&](const std::string& name, const std::vector<int64_t>& shape) {
                                 return get(name, shape, Role::Matrix);
                               });
    } else {
      L.gate_proj = get(p + "mlp.gate_proj.weight", {c.intermediate_size, H}, Role::Matrix);
      L.up_proj = get(p + "mlp.up_proj.weight", {c.intermediate_size, H}, Role::Matrix);
      L.down_proj = get(p + "mlp.down_proj.weight", {H, c.intermediate_size}, Role::Matrix);
    }
    if (L.kind == LayerKind::FullAttention) {
      L.index_in_kind = n_attn++;
      const std::string a = p + "self_attn.";
      L.attn.q_proj = get(a + "q_proj.weight", {c.num_attention_heads * hd * 2, H}, Role::Matrix);
      L.attn.k_proj = get(a + "k_proj.weight", {c.num_key_value_heads * hd, H}, Role::Matrix);
      L.attn.v_proj = get(a + "v_proj.weight", {c.num_key_value_heads * hd, H}, Role::Matrix);
      L.attn.o_proj = get(a + "o_proj.weight", {H, c.num_attention_heads * hd}, Role::Matrix);
      L.attn.q_norm = get(a + "q_norm.weight", {hd}, Role::Vector);
      L.attn.k_norm = get(a + "k_norm.weight", {hd}, Role::Vector);
    } else {
      L.index_in_kind = n_lin++;
      const std::string a = p + "linear_attn.";
      L.delta.in_proj_qkv = get(a + "in_proj_qkv.weight", {c.linear_conv_dim(), H}, Role::Matrix);
      L.delta.in_proj_z = get(a + "in_proj_z.weight", {c.linear_value_dim(), H}, Role::Matrix);
      L.delta.in_proj_b = get(a + "in_proj_b.weight", {nv, H}, Role::Matrix);
      L.delta.in_proj_a = get(a + "in_proj_a.weight", {nv, H}, Role::Matrix);
      L.delta.conv1d = get(a + "conv1d.weight", {c.linear_conv_dim(), 1, c.linear_conv_kernel_dim},
                           Role::Vector);
      L.delta.A_log = get(a + "A_log", {nv}, Role::Vector);
      L.delta.dt_bias = get(a + "dt_bias", {nv}, Role::Vector);
      L.delta.norm = get(a + "norm.weight", {c.linear_value_head_dim}, Role::Vector);
      L.delta.out_proj = get(a + "out_proj.weight", {H, c.linear_value_dim()}, Role::Matrix);
    }
    if (ops::backend() == ops::Backend::Cuda) {
      if (c.moe()) stack_moe_experts(arena_, &L.moe);
      if (!c.moe() && c.intermediate_size % ops::kGateUpGroup == 0)
        L.gate_up = arena_.interleave_rows(&L.gate_proj, &L.up_proj, ops::kGateUpGroup);
      if (L.kind == LayerKind::FullAttention)
        L.attn.in_proj = arena_.stack_rows({&L.attn.q_proj, &L.attn.k_proj, &L.attn.v_proj});
      else
        L.delta.in_proj = arena_.stack_rows(
            {&L.delta.in_proj_qkv, &L.delta.in_proj_z, &L.delta.in_proj_b, &L.delta.in_proj_a});
    }
    layers_.push_back(L);
  }
  const std::vector<float> f = rope_inv_freq(c.rope_theta, c.rotary_dim);
  inv_freq_.grow_to(static_cast<int64_t>(f.size()));
  ops::copy_from_host(inv_freq_.data(), f.data(), sizeof(float) * f.size());
}

std::unique_ptr<Qwen35Model> Qwen35Model::random(const Qwen35Config& cfg, uint64_t seed) {
  std::unique_ptr<Qwen35Model> m(new Qwen35Model());
  m->context_ = ops::Context::for_new_model();
  const ops::ContextScope scope(*m->context_);
  m->cfg_ = cfg;
  if (cfg.linear_conv_kernel_dim < 1 || cfg.linear_conv_kernel_dim > 16)
    fail("config: linear_conv_kernel_dim must be in 1..16, got ", cfg.linear_conv_kernel_dim);
  uint64_t tensor = 0;
  WeightArena& arena = m->arena_;
  auto source = [&](const std::string& name, const std::vector<int64_t>& shape, Role role) {
    const uint64_t s = seed * 1000003ull + tensor++;
    auto ends_with = [&](const char* suffix) {
      const std::string x(suffix);
      return name.size() >= x.size() && name.compare(name.size() - x.size(), x.size(), x) == 0;
    };
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    if (role == Role::Matrix) {
      // Embeddings O(1); projections 1/sqrt(fan_in), as write_random_qwen35 draws them.
      const float scale =
          ends_with("embed_tokens.weight") ? 1.0f : 1.0f / std::sqrt(static_cast<float>(shape[1]));
      return arena.random_matrix(shape[0], shape[1], s, scale);
    }
    ops::WeightRef w;
    if (ends_with("A_log"))
      w = arena.random_vector(n, s, 1.35f, 1.35f);
    else if (ends_with("dt_bias"))
      w = arena.random_vector(n, s, 1.0f, 0.5f);
    else if (ends_with("linear_attn.norm.weight"))
      w = arena.random_vector(n, s, 1.0f, 0.1f);
    else if (ends_with("conv1d.weight"))
      w = arena.random_vector(n, s, 0.0f, 0.5f);
    else
      w = arena.random_vector(n, s, 0.0f, 0.1f);  // zero-centred RMSNorm weights
    w.rows = shape[0];
    w.cols = n / shape[0];
    return w;
  };
  m->bind_weights(source, cfg.weight_prefix());
  return m;
}

void Qwen35Model::embed(std::span<const int32_t> ids, float* out) const {
  const ops::ContextScope scope(*context_);
  for (int32_t id : ids)
    if (id < 0 || id >= cfg_.vocab_size)
      fail("embed: token id ", id, " is out of range [0, ", cfg_.vocab_size, ")");
  Workspace& w = *ws_;
  w.embed_ids.grow_to(static_cast<int64_t>(ids.size()));
  ops::copy_from_host(w.embed_ids.data(), ids.data(), sizeof(int32_t) * ids.size());
  ops::embed_rows(embed_, w.embed_ids.data(), static_cast<int64_t>(ids.size()), out);
}

void Qwen35Model::embed_device(const int32_t* ids, int64_t n, float* out) const {
  const ops::ContextScope scope(*context_);
  ops::embed_rows(embed_, ids, n, out);
}

void Qwen35Model::head(const float* hidden, int64_t n, float* out, int64_t rows) const {
  const ops::ContextScope scope(*context_);
  ops::linear(hidden, n, rows > 0 ? ops::leading_rows(lm_head_, rows, "head") : lm_head_, out);
}

void Qwen35Model::for_each_layer_weight(
    const std::function<void(const ops::WeightRef&)>& fn) const {
  fn(final_norm_);
  fn(lm_head_);
  for (const Layer& L : layers_) {
    // On CUDA gate and up live on only as the stacked pair weight (their own refs are released).
    for (const ops::WeightRef* w : {&L.input_norm, &L.post_norm, &L.down_proj}) fn(*w);
    if (L.gate_up.data) {
      fn(L.gate_up);
    } else {
      fn(L.gate_proj);
      fn(L.up_proj);
    }
    if (cfg_.moe()) for_each_moe_matrix(L.moe, fn);
    if (L.kind == LayerKind::FullAttention) {
      for (const ops::WeightRef* w : {&L.attn.q_proj, &L.attn.k_proj, &L.attn.v_proj,
                                      &L.attn.o_proj, &L.attn.q_norm, &L.attn.k_norm})
        fn(*w);
    } else {
      for (const ops::WeightRef* w :
           {&L.delta.in_proj_qkv, &L.delta.in_proj_z, &L.delta.in_proj_b, &L.delta.in_proj_a,
            &L.delta.conv1d, &L.delta.A_log, &L.delta.dt_bias, &L.delta.norm, &L.delta.out_proj})
        fn(*w);
    }
  }
}

uint64_t Qwen35Model::decode_weight_bytes() const {
  uint64_t n = 0;
  for_each_layer_weight([&](const ops::WeightRef& w) { n += w.bytes(); });
  // A token reads top_k of a layer's experts: the others' bytes are not part of its step.
  if (cfg_.moe()) {
    const uint64_t experts = expert_weight_bytes();
    n -= experts - experts / static_cast<uint64_t>(cfg_.num_experts) *
                       static_cast<uint64_t>(cfg_.num_experts_per_tok);
  }
  return n;
}

uint64_t Qwen35Model::expert_weight_bytes() const {
  uint64_t n = 0;
  for (const Layer& L : layers_) n += moe_expert_bytes(L.moe);
  return n;
}

uint64_t Qwen35Model::parameter_count() const {
  uint64_t n = 0;
  if (store_.names().empty()) {  // a random model: count what was bound
    for_each_layer_weight(
        [&](const ops::WeightRef& w) { n += static_cast<uint64_t>(w.rows * w.cols); });
    // The head was counted above; a tied head is the embedding, an untied one adds it.
    if (!cfg_.tie_word_embeddings) n += static_cast<uint64_t>(embed_.rows * embed_.cols);
    return n;
  }
  for (const std::string& name : store_.names()) {
    if (name.rfind(prefix_, 0) == 0 || name == "lm_head.weight") n += store_.get(name).numel();
  }
  return n;
}

int64_t Qwen35Model::prepare_forward(Qwen35State& st, const ForwardRequest& req) const {
  const Qwen35Config& c = cfg_;
  const int64_t T = check_forward_rows(
      req.rows, [&](int slot) { return st.row_open(slot); },
      [&](int slot) {
        return st.window_open(slot)
                   ? std::to_string(st.window_size(slot)) + " tokens from position " +
                         std::to_string(st.window_start(slot))
                   : std::string();
      });
  if (req.tokens_from_argmax) {
    if (!req.tokens.empty())
      fail("forward: tokens_from_argmax takes no host tokens, got ", req.tokens.size());
    if (argmax_state_ != &st)
      fail("forward: tokens_from_argmax needs the previous forward's argmax of this state's rows");
    if (req.rows.size() != argmax_slots_.size())
      fail("forward: tokens_from_argmax needs the previous forward's argmax of these ",
           req.rows.size(), " rows; it computed ", argmax_slots_.size());
    for (size_t i = 0; i < req.rows.size(); ++i) {
      if (req.rows[i].n_tokens != 1)
        fail("forward: tokens_from_argmax takes one token per row; row slot ", req.rows[i].slot,
             " has ", req.rows[i].n_tokens);
      if (req.rows[i].slot != argmax_slots_[i])
        fail("forward: tokens_from_argmax: row ", i, " is slot ", req.rows[i].slot,
             ", but the previous forward's argmax row ", i, " is slot ", argmax_slots_[i]);
    }
  } else if (T != static_cast<int64_t>(req.tokens.size())) {
    fail("forward: rows cover ", T, " tokens but ", req.tokens.size(), " were given");
  }
  if (req.defer_argmax && !req.want_argmax) fail("forward: defer_argmax without want_argmax");
  if (req.after_reads && (req.prompt || req.defer_argmax))
    fail("forward: after_reads in a prompt forward or with defer_argmax");
  if (!req.draft_from.empty()) {
    if (req.tokens_from_argmax || req.prompt)
      fail("forward: draft_from with tokens_from_argmax or in a prompt forward");
    if (req.draft_from.size() != static_cast<size_t>(T))
      fail("forward: ", req.draft_from.size(), " draft_from entries for ", T, " tokens");
    if (req.draft_ids == nullptr) fail("forward: draft_from without draft_ids");
  }
  check_sample_rows(req, T);
  if (req.want_index_selection)
    fail("forward: want_index_selection on a model without a DSA indexer (qwen3_5)");
  check_tap_layers(req.tap_layers, static_cast<int64_t>(layers_.size()));
  if (req.defer_argmax && deferred_count_ == kMaxDeferred)
    fail("forward: ", kMaxDeferred, " deferred argmax copies are pending; collect_argmax first");
  for (size_t i = 0; i < req.tokens.size(); ++i)
    if (req.tokens[i] < 0 || req.tokens[i] >= c.vocab_size)
      fail("token id ", req.tokens[i], " at input position ", i, " is out of range [0, ",
           c.vocab_size, ")");
  // Replay rollback: a speculative forward's DeltaNet inputs go to the state's recording (the
  // commit replays the kept tokens from them). Its checks come before anything changes.
  const bool recording = st.rollback() == RecurrentRollback::Replay && st.linear_layers() > 0 &&
                         std::any_of(req.rows.begin(), req.rows.end(),
                                     [](const RowInput& r) { return r.speculative; });
  // Rows with commits settled on the device sit up to unresolved_tokens() past their lengths:
  // their KV reserves that much more, and the body moves their positions on first.
  bool shifted = false;
  for (const RowInput& r : req.rows)
    if (st.unresolved_commits(r.slot) > 0) {
      if (req.prompt)
        fail("forward: row slot ", r.slot, " has ", st.unresolved_commits(r.slot),
             " commit(s) settled on the device and not resolved; a prompt forward needs its "
             "length");
      shifted = true;
    }
  ws_->verified = {};
  if (recording) st.begin_recording(T);
  for (const RowInput& r : req.rows)
    st.reserve(r.slot, st.length(r.slot) + st.unresolved_tokens(r.slot) + r.n_tokens);
  {
    int64_t first = 0;
    for (const RowInput& r : req.rows) {
      if (r.speculative) st.begin_window(r.slot, r.n_tokens, first);
      first += r.n_tokens;
    }
  }

  Workspace& w = *ws_;
  w.recording = recording;
  w.shifted = shifted;
  const int64_t R = static_cast<int64_t>(req.rows.size());
  reserve_workspace(T, req.all_logits ? T : R, req.all_logits);
  grow_to(w.taps, T * static_cast<int64_t>(req.tap_layers.size()) * c.hidden_size);
  // Host-side metadata, uploaded once per forward: ids, positions and KV slots, block tables.
  // pos holds [T] positions, then [T] physical KV slots (the attention layers' key/value
  // writes, ops::QkNormRope), then [T] each token's row for the attention of all rows at once
  // (ops::attention_rows; -1 for a prompt's first chunk, which attention_prompt serves).
  w.pos_host.resize(static_cast<size_t>(3 * T));
  // Block tables go into fixed-stride slots (stride = the largest position bound in blocks), so
  // a row's table address changes only when a bound does, not with every new block: decode
  // graphs stay valid for kPositionBoundStep positions.
  std::vector<int64_t>& bounds = w.bounds_host;
  bounds.clear();
  int64_t stride = 1;
  {
    int64_t t = 0;
    for (size_t i = 0; i < req.rows.size(); ++i) {
      const RowInput& r = req.rows[i];
      const std::vector<int32_t>& bt = st.block_table(r.slot);
      const bool prompt_start = served_by_prompt_attention(req.prompt, st.length(r.slot));
      for (int64_t j = 0; j < r.n_tokens; ++j, ++t) {
        const int64_t p = st.length(r.slot) + j;
        w.pos_host[t] = p;
        // A model without attention layers keeps no KV blocks (and writes no slot).
        w.pos_host[T + t] =
            bt.empty() ? -1 : ops::kv_slot_of(bt.data(), Qwen35State::kBlockSize, p);
        w.pos_host[2 * T + t] = prompt_start ? -1 : static_cast<int64_t>(i);
      }
      const int64_t capacity = static_cast<int64_t>(bt.size()) * Qwen35State::kBlockSize;
      bounds.push_back(attention_position_bound(capacity));
      stride = std::max(stride, bounds.back() / Qwen35State::kBlockSize);
    }
  }
  w.tables_host.assign(static_cast<size_t>(R * stride), 0);
  w.table_stride = stride;
  for (size_t i = 0; i < req.rows.size(); ++i) {
    const std::vector<int32_t>& bt = st.block_table(req.rows[i].slot);
    std::copy(bt.begin(), bt.end(), w.tables_host.begin() + static_cast<int64_t>(i) * stride);
  }

  // Recurrent-state descriptors of every DeltaNet layer's rows, [linear layer][row] (device
  // memory stays put, so captured graphs read the fresh contents).
  const int64_t nl = st.linear_layers();
  std::vector<ops::RecurrentRow>& desc = w.recurrent_host;
  desc.assign(static_cast<size_t>(std::max<int64_t>(1, nl * R)), ops::RecurrentRow{});
  w.max_row_tokens = 0;
  for (int64_t li = 0; li < nl; ++li) {
    int64_t t0 = 0;
    for (int64_t i = 0; i < R; ++i) {
      const RowInput& r = req.rows[static_cast<size_t>(i)];
      const int l = static_cast<int>(li);
      ops::RecurrentRow& d = desc[static_cast<size_t>(li * R + i)];
      d.first_token = t0;
      d.n = r.n_tokens;
      d.conv_state = st.conv_state(r.slot, l);
      d.state = st.recurrent_state(r.slot, l);
      if (r.speculative && st.rollback() == RecurrentRollback::PerPositionStates) {
        d.conv_after = st.window_conv_after(r.slot, l);
        d.state_after = st.window_recurrent_after(r.slot, l);
      }
      // Replay: a window's state keeps its first token only (every commit keeps it), so the
      // commit replays just the kept tokens after it.
      if (r.speculative && st.rollback() == RecurrentRollback::Replay) d.settled = 1;
      t0 += r.n_tokens;
      w.max_row_tokens = std::max(w.max_row_tokens, r.n_tokens);
    }
  }

  // All of it in one block, one upload: ids, positions and slots, block tables, descriptors.
  {
    const size_t ids_bytes = sizeof(int32_t) * static_cast<size_t>(T);
    const size_t pos_bytes = sizeof(int64_t) * w.pos_host.size();
    const size_t tables_bytes = sizeof(int32_t) * w.tables_host.size();
    const size_t desc_bytes = sizeof(ops::RecurrentRow) * desc.size();
    const size_t sample_bytes = sizeof(ops::SampleRow) * req.sample_rows.size();
    const size_t from_bytes = sizeof(int32_t) * req.draft_from.size();
    const size_t slots_bytes = sizeof(int32_t) * static_cast<size_t>(R);
    const size_t known_bytes = sizeof(int64_t) * static_cast<size_t>(R);
    const size_t bounds_bytes = sizeof(int32_t) * static_cast<size_t>(R + 1);
    const size_t o_pos = upload_part_bytes(ids_bytes);
    const size_t o_tables = o_pos + upload_part_bytes(pos_bytes);
    const size_t o_desc = o_tables + upload_part_bytes(tables_bytes);
    const size_t o_sample = o_desc + upload_part_bytes(desc_bytes);
    const size_t o_from = o_sample + upload_part_bytes(sample_bytes);
    const size_t o_slots = o_from + upload_part_bytes(from_bytes);
    const size_t o_known = o_slots + upload_part_bytes(slots_bytes);
    const size_t o_bounds = o_known + upload_part_bytes(known_bytes);
    const size_t total = o_bounds + bounds_bytes;
    w.meta.grow_to(static_cast<int64_t>(total));
    uint8_t* base = w.meta.data();
    w.ids = reinterpret_cast<int32_t*>(base);
    w.pos = reinterpret_cast<int64_t*>(base + o_pos);
    w.tables = reinterpret_cast<int32_t*>(base + o_tables);
    w.recurrent_rows = reinterpret_cast<ops::RecurrentRow*>(base + o_desc);
    w.sample_rows =
        req.sample_rows.empty() ? nullptr : reinterpret_cast<ops::SampleRow*>(base + o_sample);
    w.draft_from = req.draft_from.empty() ? nullptr : reinterpret_cast<int32_t*>(base + o_from);
    w.row_slots = reinterpret_cast<int32_t*>(base + o_slots);
    w.row_known = reinterpret_cast<int64_t*>(base + o_known);
    w.row_bounds = reinterpret_cast<int32_t*>(base + o_bounds);
    uint8_t* h = w.meta_upload.host(total);
    if (!req.tokens_from_argmax) std::memcpy(h, req.tokens.data(), ids_bytes);
    std::memcpy(h + o_pos, w.pos_host.data(), pos_bytes);
    std::memcpy(h + o_tables, w.tables_host.data(), tables_bytes);
    std::memcpy(h + o_desc, desc.data(), desc_bytes);
    if (sample_bytes > 0) std::memcpy(h + o_sample, req.sample_rows.data(), sample_bytes);
    if (from_bytes > 0) std::memcpy(h + o_from, req.draft_from.data(), from_bytes);
    auto* slots = reinterpret_cast<int32_t*>(h + o_slots);
    auto* known = reinterpret_cast<int64_t*>(h + o_known);
    auto* row_bounds = reinterpret_cast<int32_t*>(h + o_bounds);
    row_bounds[0] = 0;
    for (int64_t i = 0; i < R; ++i) {
      const RowInput& r = req.rows[static_cast<size_t>(i)];
      slots[i] = r.slot;
      known[i] = st.known_shift(r.slot);
      row_bounds[i + 1] = row_bounds[i] + static_cast<int32_t>(r.n_tokens);
    }
    w.meta_upload.start(base, total);
  }
  w.segments.clear();
  for (size_t i = 0; i < req.rows.size(); ++i) {
    const RowInput& r = req.rows[i];
    w.segments.push_back(
        {w.tables + static_cast<int64_t>(i) * stride, st.length(r.slot), r.n_tokens, bounds[i]});
  }
  return T;
}

void Qwen35Model::forward(Qwen35State& st, const ForwardRequest& req, ForwardOutput* out) const {
  const ops::ContextScope scope(*context_);
  const int64_t T = prepare_forward(st, req);
  Workspace& w = *ws_;
  const int64_t R = static_cast<int64_t>(req.rows.size());
  if (req.want_routing) {
    if (!cfg_.moe()) fail("forward: want_routing on a model without experts");
    out->routing.clear();
    w.routing = &out->routing;
    try {
      forward_body(st, req, T);
    } catch (...) {
      w.routing = nullptr;
      throw;
    }
    w.routing = nullptr;
  } else if (req.prompt) {
    // Prompts come in every length: running them directly is cheaper than capturing.
    forward_body(st, req, T);
  } else {
    // Everything the captured launches bake in: shapes, flags, and every address they touch.
    GraphKey key;
    key.add(T).add(R).add(req.all_logits).add(req.want_hidden).add(req.want_argmax);
    key.add(req.tokens_from_argmax);
    key.add(static_cast<uint64_t>(req.tap_layers.size())).add(w.taps.data());
    for (int l : req.tap_layers) key.add(l);
    key.add(static_cast<uint64_t>(st.rollback())).add(&st);
    // Which slots the rows are, their block tables and their lengths reach the launches only
    // through device memory (the uploaded positions, tables and recurrent descriptors), so rows
    // that come and go reuse the graphs of their shape. The attention's grid is sized by the
    // batched bound alone; the tables' stride follows it.
    for (const RowInput& r : req.rows) key.add(r.n_tokens).add(r.speculative);
    key.add(batched_position_bound(w.segments, false)).add(w.tables).add(w.table_stride);
    key.add(w.row_known);
    for (int64_t l = 0; l < st.attention_layers(); ++l)
      key.add(st.kv_layer(static_cast<int>(l)).pool);
    key.add(w.recording).add(w.recording ? st.recorded_conv_input(0) : nullptr);
    for (const float* p :
         {w.x.data(), w.h.data(), w.a0.data(), w.a1.data(), w.a2.data(), w.a3.data(), w.a5.data(),
          w.mlp_g.data(), w.mlp_u.data(), w.last.data(), w.out.data(), w.attn.qg.data(),
          w.attn.q.data(), w.attn.gate.data(), w.attn.k.data(), w.attn.v.data(), w.attn.o.data()})
      key.add(p);
    key.add(w.ids).add(w.pos).add(w.argmax.data()).add(w.recurrent_rows).add(w.sample_rows);
    key.add(w.draft_from).add(w.draft_from ? req.draft_ids : nullptr);
    key.add(w.max_row_tokens);
    key.add(w.shifted).add(w.shifted ? st.settled_shift() : nullptr).add(w.row_slots);
    graphs_.run(key, [&] { forward_body(st, req, T); });
  }
  // What accept_windows reads: set before finish_forward, whose after_reads may walk it.
  if (!req.prompt && !req.tokens_from_argmax && req.all_logits && req.want_argmax)
    w.verified = {true, R, w.draft_from ? req.draft_ids : nullptr};
  finish_forward(st, req, T, out, true);
  w.meta_upload.consumed();  // every reader of w.meta is queued (after_reads' walk included)
}

void Qwen35Model::finish_forward(Qwen35State& st, const ForwardRequest& req, int64_t T,
                                 ForwardOutput* out, bool track_argmax) const {
  const Qwen35Config& c = cfg_;
  const int64_t H = c.hidden_size;
  const int64_t R = static_cast<int64_t>(req.rows.size());
  Workspace& w = *ws_;
  for (const RowInput& r : req.rows) st.set_length(r.slot, st.length(r.slot) + r.n_tokens);

  // Every host copy of the forward's outputs waits once, together with its greedy tokens.
  std::vector<ops::HostRead>& reads = host_reads_;
  reads.clear();
  auto to_host = [&reads](std::vector<float>& dst, const float* src, int64_t n) {
    dst.resize(static_cast<size_t>(n));
    reads.push_back({dst.data(), src, sizeof(float) * static_cast<size_t>(n)});
  };
  if (req.want_prenorm_hidden && !req.hidden_on_device)
    to_host(out->prenorm_hidden, w.x.data(), T * H);
  else
    out->prenorm_hidden.clear();
  if (req.want_hidden && !req.hidden_on_device)
    to_host(out->hidden, w.h.data(), T * H);
  else
    out->hidden.clear();
  if (!req.tap_layers.empty())
    to_host(out->layer_taps, w.taps.data(), T * static_cast<int64_t>(req.tap_layers.size()) * H);
  else
    out->layer_taps.clear();
  const int64_t V = c.vocab_size;
  out->logits_rows = req.all_logits ? T : R;
  if (req.want_logits)
    to_host(out->logits, w.out.data(), out->logits_rows * V);
  else
    out->logits.clear();
  out->argmax.clear();
  if (track_argmax) {
    argmax_slots_.clear();
    argmax_state_ = &st;
    if (req.want_argmax && !req.all_logits)
      for (const RowInput& r : req.rows) argmax_slots_.push_back(r.slot);
  }
  if (req.want_argmax && req.defer_argmax) {
    DeferredArgmax& d = deferred_[(deferred_first_ + deferred_count_) % kMaxDeferred];
    d.rows = out->logits_rows;
    d.copy.start(w.argmax.data(), sizeof(int32_t) * static_cast<size_t>(d.rows));
    ++deferred_count_;
  } else if (req.want_argmax) {
    out->argmax.resize(static_cast<size_t>(out->logits_rows));
    reads.push_back({out->argmax.data(), w.argmax.data(), sizeof(int32_t) * out->argmax.size()});
  }
  ops::copy_to_host(reads.data(), reads.size(), req.after_reads);
  if (req.want_argmax && !req.defer_argmax) {
    for (size_t r = 0; r < out->argmax.size(); ++r)
      if (out->argmax[r] < 0)
        fail("forward: logits row ", r, " holds NaN or +inf, or only -inf",
             req.sample_rows.empty() ? "" : ", or its sampling parameters are invalid");
  }
}

void Qwen35Model::drop_deferred_argmax() const {
  const ops::ContextScope scope(*context_);
  for (; deferred_count_ > 0; --deferred_count_) {
    deferred_[deferred_first_].copy.wait();
    deferred_first_ = (deferred_first_ + 1) % kMaxDeferred;
  }
}

void Qwen35Model::collect_argmax(std::vector<int32_t>* argmax) const {
  const ops::ContextScope scope(*context_);
  if (deferred_count_ == 0) fail("collect_argmax: no forward with defer_argmax is pending");
  DeferredArgmax& d = deferred_[deferred_first_];
  deferred_first_ = (deferred_first_ + 1) % kMaxDeferred;
  --deferred_count_;
  const auto* ids = static_cast<const int32_t*>(d.copy.wait());
  argmax->assign(ids, ids + d.rows);
  for (size_t r = 0; r < argmax->size(); ++r)
    if ((*argmax)[r] < 0)
      fail("collect_argmax: logits row ", r, " holds NaN or +inf, or only -inf");
}

void Qwen35Model::reserve_workspace(int64_t T, int64_t R, bool all_logits) const {
  const Qwen35Config& c = cfg_;
  Workspace& w = *ws_;
  const int64_t H = c.hidden_size, I = c.intermediate_size, V = c.vocab_size;
  const int64_t conv_dim = c.linear_conv_dim(), vd = c.linear_value_dim(),
                nv = c.linear_num_value_heads;
  grow_to(w.x, T * H);
  grow_to(w.h, T * H);
  if (!layers_.empty() && !layers_.front().gate_up.data) {
    grow_to(w.mlp_g, T * I);
    grow_to(w.mlp_u, T * I);
  }
  grow_to(w.a0, T * conv_dim);
  grow_to(w.a1, T * conv_dim);
  grow_to(w.a2, T * vd);
  grow_to(w.a3, T * nv * 2);
  grow_to(w.a5, T * vd);
  grow_to(w.last, R * H);
  grow_to(w.out, (all_logits ? T : R) * V);
  w.argmax.grow_to(std::max(T, R));
  w.attn.reserve(T, gated_attention_shape(c));
}

void Qwen35Model::forward_body(Qwen35State& st, const ForwardRequest& req, int64_t T) const {
  Workspace& w = *ws_;
  if (w.shifted) {
    ops::PositionShift s;
    s.shift = st.settled_shift();
    s.row_slot = w.row_slots;
    s.known = w.row_known;
    s.token_row = w.pos + 2 * T;
    s.tokens = T;
    s.rows = static_cast<int64_t>(req.rows.size());
    s.tables = w.tables;
    s.table_stride = w.table_stride;
    s.block_size = Qwen35State::kBlockSize;
    s.sample = w.sample_rows;
    s.sample_per_token = req.all_logits;
    ops::shift_positions(s, w.pos, st.attention_layers() > 0 ? w.pos + T : nullptr);
  }
  body_embed(req, T);
  body_layers(st, req, T, 0, layers_.size());
  body_head(req, T);
}

void Qwen35Model::body_embed(const ForwardRequest& req, int64_t T) const {
  Workspace& w = *ws_;
  // tokens_from_argmax: the previous forward's greedy tokens, where its argmax left them (this
  // forward's argmax overwrites them only at its end, queued after this read).
  if (w.draft_from)
    ops::embed_rows_selected(embed_, w.ids, req.draft_ids, w.draft_from, T, w.x.data());
  else
    ops::embed_rows(embed_, req.tokens_from_argmax ? w.argmax.data() : w.ids, T, w.x.data());
}

void Qwen35Model::body_layers(Qwen35State& st, const ForwardRequest& req, int64_t T, size_t first,
                              size_t end) const {
  const ops::PrefillScope prefill(req.prompt, req.prompt_gemm_rows);
  // Every sublayer reads the residual stream x through its input norm (folded into its first
  // projection where the weights are stacked) and adds its output projection into x.
  // The stacked input projection a layer starts with (empty where the checkpoint's weights are
  // not stacked: then nothing is prefetched).
  auto first_projection = [](const Layer& L) -> const ops::WeightRef& {
    return L.kind == LayerKind::FullAttention ? L.attn.in_proj : L.delta.in_proj;
  };
  const int64_t H = cfg_.hidden_size, n_taps = static_cast<int64_t>(req.tap_layers.size());
  for (size_t i = first; i < end; ++i) {
    const Layer& L = layers_[i];
    // Layer taps: the residual stream as it enters layer i, into its column of every token's
    // [n_taps · H] row (a device copy; the host reads all taps once, in finish_forward).
    for (int64_t j = 0; j < n_taps; ++j)
      if (req.tap_layers[static_cast<size_t>(j)] == static_cast<int>(i))
        ops::copy_rows(ws_->taps.data() + j * H, n_taps * H, ws_->x.data(), H, T, H);
    if (L.kind == LayerKind::FullAttention)
      attention_layer(L, st, T, req.prompt);
    else
      delta_layer(L, st, req, T);
    mlp(L, T, i + 1 < layers_.size() ? first_projection(layers_[i + 1]) : lm_head_);
  }
}

void Qwen35Model::body_head(const ForwardRequest& req, int64_t T) const {
  const Qwen35Config& c = cfg_;
  const int64_t H = c.hidden_size;
  const float eps = static_cast<float>(c.rms_norm_eps);
  Workspace& w = *ws_;
  // Final norm: every token when hidden states or all logits are wanted (into h), else only each
  // row's last token, gathered into `last` for one head GEMM.
  if (req.want_hidden || req.all_logits)
    ops::rms_norm(w.x.data(), T, H, final_norm_, true, eps, w.h.data());
  const int64_t V = c.vocab_size;
  int64_t rows = T;
  if (req.all_logits) {
    ops::linear(w.h.data(), T, lm_head_, w.out.data());
  } else {
    rows = static_cast<int64_t>(req.rows.size());
    float* last = w.last.data();
    const float* from = req.want_hidden ? w.h.data() : w.x.data();
    if (T == rows) {
      // One token per row (a decode step): the last tokens are all the tokens, in one call
      // (the norm's rows are independent, so its bits are the per-row calls').
      if (req.want_hidden)
        ops::copy(last, from, sizeof(float) * T * H);
      else
        ops::rms_norm(from, T, H, final_norm_, true, eps, last);
    } else {
      int64_t t = 0;
      for (int64_t r = 0; r < rows; ++r) {
        t += req.rows[r].n_tokens;
        const float* src = from + (t - 1) * H;
        if (req.want_hidden)
          ops::copy(last + r * H, src, sizeof(float) * H);
        else
          ops::rms_norm(src, 1, H, final_norm_, true, eps, last + r * H);
      }
    }
    ops::linear(last, rows, lm_head_, w.out.data());
  }
  if (req.want_argmax && w.sample_rows)
    ops::sample_rows(w.out.data(), rows, V, w.sample_rows, w.argmax.data());
  else if (req.want_argmax)
    ops::argmax_rows(w.out.data(), rows, V, w.argmax.data());
}

// --- Layer-sliced prompt forwards ----------------------------------------------------------------

struct Qwen35Model::PromptForward::Workspace {
  Qwen35Model::Workspace ws;
};

Qwen35Model::PromptForward::PromptForward() = default;
Qwen35Model::PromptForward::~PromptForward() = default;

namespace {
// Points the model's body at another workspace for one call (restored on exit, also on throw).
template <class W>
class WorkspaceSwap {
 public:
  WorkspaceSwap(W*& slot, W* other) : slot_(slot), saved_(slot) { slot_ = other; }
  ~WorkspaceSwap() { slot_ = saved_; }
  WorkspaceSwap(const WorkspaceSwap&) = delete;
  WorkspaceSwap& operator=(const WorkspaceSwap&) = delete;

 private:
  W*& slot_;
  W* saved_;
};
}  // namespace

void Qwen35Model::begin_prompt(Qwen35State& st, const ForwardRequest& req,
                               PromptForward* pf) const {
  const ops::ContextScope scope(*context_);
  if (pf->active_)
    fail("begin_prompt: this prompt forward is still running (layer ", pf->next_layer_, " of ",
         layers_.size(), " is next)");
  if (!req.prompt) fail("begin_prompt: the request is not a prompt forward (prompt = false)");
  if (req.defer_argmax || req.tokens_from_argmax)
    fail("begin_prompt: a sliced prompt forward takes host tokens and returns its argmax at once");
  for (const RowInput& r : req.rows)
    if (r.speculative) fail("begin_prompt: row slot ", r.slot, " is a speculative window");
  if (!pf->ws_) pf->ws_ = std::make_unique<PromptForward::Workspace>();
  pf->tokens_.assign(req.tokens.begin(), req.tokens.end());
  pf->rows_.assign(req.rows.begin(), req.rows.end());
  pf->tap_layers_.assign(req.tap_layers.begin(), req.tap_layers.end());
  pf->req_ = req;
  pf->req_.tokens = pf->tokens_;
  pf->req_.rows = pf->rows_;
  pf->req_.tap_layers = pf->tap_layers_;
  WorkspaceSwap<Workspace> use(ws_, &pf->ws_->ws);
  pf->tokens_total_ = prepare_forward(st, pf->req_);
  body_embed(pf->req_, pf->tokens_total_);
  pf->next_layer_ = 0;
  pf->active_ = true;
}

bool Qwen35Model::continue_prompt(Qwen35State& st, PromptForward& pf, int max_layers,
                                  ForwardOutput* out) const {
  const ops::ContextScope scope(*context_);
  if (!pf.active_) fail("continue_prompt: no prompt forward is running (begin_prompt first)");
  if (max_layers < 0) fail("continue_prompt: max_layers must be >= 0, got ", max_layers);
  for (const RowInput& r : pf.rows_)
    if (!st.row_open(r.slot))
      fail("continue_prompt: row slot ", r.slot, " was closed while its prompt forward ran");
  WorkspaceSwap<Workspace> use(ws_, &pf.ws_->ws);
  const size_t n = layers_.size();
  const size_t first = static_cast<size_t>(pf.next_layer_);
  const size_t end = max_layers == 0 ? n : std::min(n, first + static_cast<size_t>(max_layers));
  body_layers(st, pf.req_, pf.tokens_total_, first, end);
  pf.next_layer_ = static_cast<int>(end);
  if (end < n) return false;
  pf.active_ = false;
  body_head(pf.req_, pf.tokens_total_);
  // The argmax stays in the slice workspace: nothing may chain tokens_from_argmax off it.
  finish_forward(st, pf.req_, pf.tokens_total_, out, false);
  return true;
}

const float* Qwen35Model::prompt_hidden(const PromptForward& pf, bool prenorm) const {
  if (!pf.ws_) return nullptr;
  return prenorm ? pf.ws_->ws.x.data() : pf.ws_->ws.h.data();
}

Qwen35Model::SublayerInput Qwen35Model::sublayer_input(const ops::WeightRef& norm, int64_t T,
                                                       bool stacked) const {
  const Qwen35Config& c = cfg_;
  Workspace& w = *ws_;
  SublayerInput in{w.x.data(), {norm, true, static_cast<float>(c.rms_norm_eps)}, stacked};
  if (!stacked) {
    ops::rms_norm(w.x.data(), T, c.hidden_size, norm, true, in.norm.eps, w.h.data());
    in.x = w.h.data();
  }
  return in;
}

void Qwen35Model::mlp(const Layer& L, int64_t T, const ops::WeightRef& next) const {
  const Qwen35Config& c = cfg_;
  Workspace& w = *ws_;
  if (c.moe()) {
    // The post-attention norm inside the mixture: its router folds it at one token.
    const ops::MoeInputNorm norm{{L.post_norm, true, static_cast<float>(c.rms_norm_eps)},
                                 w.h.data()};
    std::vector<int32_t> ids;
    ops::moe_mlp_add(w.x.data(), T, L.moe, w.x.data(), w.routing ? &ids : nullptr, nullptr, &norm);
    if (w.routing) w.routing->insert(w.routing->end(), ids.begin(), ids.end());
    return;
  }
  const bool stacked = L.gate_up.data != nullptr;
  const SublayerInput in = sublayer_input(L.post_norm, T, stacked);
  const ops::WeightRef tail = tail_prefetch(next);
  if (stacked)
    return ops::swiglu_mlp_add(in.x, T, L.gate_up, L.down_proj, w.x.data(), in.fold(), &tail);
  ops::linear(in.x, T, L.gate_proj, w.mlp_g.data());
  ops::linear(in.x, T, L.up_proj, w.mlp_u.data());
  ops::swiglu(w.mlp_g.data(), w.mlp_u.data(), T * c.intermediate_size, w.mlp_g.data());
  ops::linear_add(w.mlp_g.data(), T, L.down_proj, w.x.data());
}

void Qwen35Model::attention_layer(const Layer& L, Qwen35State& st, int64_t T, bool prompt) const {
  const Qwen35Config& c = cfg_;
  Workspace& w = *ws_;
  GatedAttentionShape shape = gated_attention_shape(c);
  shape.prompt = prompt;
  GatedAttentionScratch& x = w.attn;  // sized by reserve_workspace
  const bool stacked = L.attn.in_proj.data != nullptr;
  const SublayerInput in = sublayer_input(L.input_norm, T, stacked);
  if (stacked) {
    const ops::OutputSlice out[] = {{x.qg.data(), L.attn.q_proj.rows},
                                    {x.k.data(), L.attn.k_proj.rows},
                                    {x.v.data(), L.attn.v_proj.rows}};
    const ops::WeightRef next = ops::leading_rows(L.attn.o_proj, kOutputPrefetch);
    ops::linear_split(in.x, T, L.attn.in_proj, out, 3, in.fold(), &next);
  } else {
    ops::linear(in.x, T, L.attn.q_proj, x.qg.data());
    ops::linear(in.x, T, L.attn.k_proj, x.k.data());
    ops::linear(in.x, T, L.attn.v_proj, x.v.data());
  }
  const AttentionRows rows{w.tables, w.table_stride, w.pos + 2 * T};
  gated_attention(shape, L.attn.q_norm, L.attn.k_norm, inv_freq_.data(), w.pos, w.segments,
                  st.kv_layer(L.index_in_kind), x, w.pos + T, &rows);
  const ops::WeightRef tail = tail_prefetch(L.gate_up);
  ops::linear_add(x.o.data(), T, L.attn.o_proj, w.x.data(), nullptr, &tail);
}

void Qwen35Model::delta_layer(const Layer& L, Qwen35State& st, const ForwardRequest& req,
                              int64_t T) const {
  const Qwen35Config& c = cfg_;
  Workspace& w = *ws_;
  const int64_t conv_dim = c.linear_conv_dim(), kd = c.linear_key_dim(), vd = c.linear_value_dim(),
                nv = c.linear_num_value_heads;
  const int li = L.index_in_kind;
  // A recording forward (Replay rollback) projects the recurrence inputs straight into the
  // state's recording, laid out as the workspace would hold them.
  float *qkv = w.recording ? st.recorded_conv_input(li) : w.a0.data(), *conv = w.a1.data(),
        *z = w.a2.data(), *b = w.recording ? st.recorded_b(li) : w.a3.data(),
        *a = w.recording ? st.recorded_a(li) : w.a3.data() + T * nv, *core = w.a5.data();
  const bool stacked = L.delta.in_proj.data != nullptr;
  const SublayerInput in = sublayer_input(L.input_norm, T, stacked);
  // All rows in one launch per op; each row's numbers equal the single-row ops' for it alone.
  const int64_t R = static_cast<int64_t>(req.rows.size());
  const ops::RecurrentRow* rows = w.recurrent_rows + li * R;
  if (stacked) {
    // One stacked projection, its column slices written straight into the four buffers, the
    // q|k|v slice also through the conv (in the projection's epilogue on CUDA's decode steps).
    const ops::OutputSlice out[] = {{qkv, conv_dim}, {z, vd}, {b, nv}, {a, nv}};
    const ops::WeightRef next = ops::leading_rows(L.delta.out_proj, kOutputPrefetch);
    const ops::SliceConv qkv_conv{
        L.delta.conv1d, c.linear_conv_kernel_dim, rows, R, w.max_row_tokens, conv};
    ops::linear_split(in.x, T, L.delta.in_proj, out, 4, in.fold(), &next, &qkv_conv);
  } else {
    ops::linear(in.x, T, L.delta.in_proj_qkv, qkv);
    ops::linear(in.x, T, L.delta.in_proj_z, z);
    ops::linear(in.x, T, L.delta.in_proj_b, b);
    ops::linear(in.x, T, L.delta.in_proj_a, a);
    ops::causal_conv_silu_rows(qkv, conv_dim, c.linear_conv_kernel_dim, L.delta.conv1d, rows, R,
                               w.max_row_tokens, conv);
  }
  // The conv output per token is [q (kd) | k (kd) | v (vd)]: the recurrence reads the three in
  // place, conv_dim floats apart from one token to the next.
  ops::gated_delta_rule_rows(conv, conv + kd, conv + 2 * kd, a, b, L.delta.A_log, L.delta.dt_bias,
                             rows, R, w.max_row_tokens, delta_heads(), core);
  // The gated norm is the output projection's input norm (folded into it on CUDA's decode path).
  const ops::GatedNorm gated{z, L.delta.norm, static_cast<float>(c.rms_norm_eps)};
  const ops::WeightRef tail = tail_prefetch(L.gate_up);
  ops::linear_add(core, T, L.delta.out_proj, w.x.data(), &gated, &tail);
}

ops::DeltaHeads Qwen35Model::delta_heads() const {
  const Qwen35Config& c = cfg_;
  ops::DeltaHeads h{c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                    c.linear_value_head_dim};
  h.qkv_token_stride = c.linear_conv_dim();  // tokens of the conv output are [q | k | v] rows
  return h;
}

namespace {
// A commit's checks, before any state changes (all-or-nothing): every row open, with a window,
// 1 <= kept <= its size, listed once. `who` names the call in the error.
void check_commit_rows(const Qwen35State& st, std::span<const RowKeep> rows, const char* who) {
  for (size_t i = 0; i < rows.size(); ++i) {
    const RowKeep& r = rows[i];
    if (!st.row_open(r.slot)) fail(who, ": row slot ", r.slot, " is not open");
    if (!st.window_open(r.slot))
      fail(who, ": row slot ", r.slot,
           " has no speculative window to commit (forward it with RowInput::speculative first)");
    const int64_t n = st.window_size(r.slot);
    if (r.kept < 1 || r.kept > n)
      fail(who, ": row slot ", r.slot, " keeps ", r.kept, " tokens of a ", n,
           "-token window (must be 1..", n, ")");
    for (size_t j = 0; j < i; ++j)
      if (rows[j].slot == r.slot) fail(who, ": row slot ", r.slot, " is listed twice");
  }
}
}  // namespace

void Qwen35Model::accept_windows(int32_t* accepted, int32_t* next, const int32_t* limits) const {
  const ops::ContextScope scope(*context_);
  const Workspace& w = *ws_;
  if (!w.verified.ready)
    fail(
        "accept_windows: the last forward of this model was not a verify forward with "
        "all_logits and want_argmax (or another forward ran since)");
  ops::accept_windows(w.argmax.data(), w.ids, w.verified.draft_ids, w.draft_from, w.row_bounds,
                      limits, w.verified.rows, accepted, next);
  ws_->meta_upload.consumed();  // the walk read the forward's ids, sources and bounds
}

void Qwen35Model::settle_windows(Qwen35State& st, std::span<const ops::SettledRow> rows,
                                 const int32_t* accepted) const {
  const ops::ContextScope scope(*context_);
  // The host's bound for each row: its whole window.
  std::vector<RowKeep> bound;
  for (const ops::SettledRow& r : rows) {
    if (r.row < 0 || r.row >= ws_->verified.rows)
      fail("settle_windows: row slot ", r.slot, " reads accepted entry ", r.row, " of ",
           ws_->verified.rows, " (the last verify forward's rows)");
    bound.push_back(
        {r.slot, st.row_open(r.slot) && st.window_open(r.slot) ? st.window_size(r.slot) : 1});
  }
  check_commit_rows(st, bound, "settle_windows");
  if (rows.empty()) return;
  if (st.linear_layers() > 0 && st.rollback() != RecurrentRollback::Replay)
    fail(
        "settle_windows: commits settled on the device need the Replay rollback; this state "
        "keeps per-position states");
  replay_windows(st, bound, rows, accepted);
  for (const ops::SettledRow& r : rows) st.settle_window(r.slot);
}

void Qwen35Model::commit_windows(Qwen35State& st, std::span<const RowKeep> rows) const {
  const ops::ContextScope scope(*context_);
  check_commit_rows(st, rows, "commit_windows");

  if (st.rollback() == RecurrentRollback::Replay) {
    replay_windows(st, rows);
  } else {
    const int64_t conv_floats = st.conv_state_floats(), rec_floats = st.recurrent_state_floats();
    for (const RowKeep& r : rows) {
      const int64_t kept = r.kept;
      // Keeping the whole window: the live state already is the state after token n-1.
      if (kept == st.window_size(r.slot)) continue;
      for (int li = 0; li < st.linear_layers(); ++li) {
        ops::copy(st.conv_state(r.slot, li),
                  st.window_conv_after(r.slot, li) + (kept - 1) * conv_floats,
                  sizeof(float) * conv_floats);
        ops::copy(st.recurrent_state(r.slot, li),
                  st.window_recurrent_after(r.slot, li) + (kept - 1) * rec_floats,
                  sizeof(float) * rec_floats);
      }
    }
  }
  for (const RowKeep& r : rows) st.end_window(r.slot, r.kept);
}

namespace {
// A replay's scratch bound in floats: layers replay in groups whose conv and recurrence outputs fit
// it (all of a small model's layers at once; the 9B shape's 32 × 4 windows ten layers at a time).
constexpr int64_t kReplayScratchFloats = int64_t{16} << 20;
}  // namespace

void Qwen35Model::replay_windows(Qwen35State& st, std::span<const RowKeep> rows,
                                 std::span<const ops::SettledRow> settled,
                                 const int32_t* accepted) const {
  const Qwen35Config& c = cfg_;
  const int64_t nl = st.linear_layers(), R = static_cast<int64_t>(rows.size());
  if (R == 0 || (nl == 0 && accepted == nullptr)) return;
  Workspace& w = *ws_;
  std::vector<ops::RecurrentRow>& desc = w.replay_host;
  desc.assign(static_cast<size_t>(nl * R), ops::RecurrentRow{});
  int64_t max_n = 0;
  for (int64_t li = 0; li < nl; ++li)
    for (int64_t i = 0; i < R; ++i) {
      const RowKeep& r = rows[static_cast<size_t>(i)];
      const int l = static_cast<int>(li);
      ops::RecurrentRow& d = desc[static_cast<size_t>(li * R + i)];
      // The forward settled the window's first token; the kept ones after it are replayed.
      d.first_token = st.window_first(r.slot) + 1;
      d.n = r.kept - 1;
      d.conv_state = st.conv_state(r.slot, l);
      d.state = st.recurrent_state(r.slot, l);
      max_n = std::max(max_n, d.n);
    }
  // Every row kept its first token only: nothing to replay (known on the host only).
  if (max_n == 0 && accepted == nullptr) return;

  // Each linear layer replays into scratch of its own over the recorded forward's token places
  // (the replayed tokens land where that forward's would), so that a group of layers goes in one
  // conv and one recurrence launch. Groups are as many layers as kReplayScratchFloats holds.
  const int64_t T = st.recorded_tokens();
  const int64_t conv_dim = c.linear_conv_dim(), value_dim = c.linear_value_dim();
  const int64_t per_layer = std::max<int64_t>(1, T * (conv_dim + value_dim));
  const int64_t group =
      std::clamp<int64_t>(kReplayScratchFloats / per_layer, 1, std::max<int64_t>(nl, 1));
  grow_to(w.a1, group * T * conv_dim);
  grow_to(w.a5, group * T * value_dim);
  float *conv = w.a1.data(), *core = w.a5.data();
  std::vector<ops::RecurrentLayer>& table = w.replay_layers;
  table.clear();
  for (const Layer& L : layers_) {
    if (L.kind != LayerKind::LinearAttention) continue;
    const int li = L.index_in_kind;
    const int64_t slot = static_cast<int64_t>(table.size()) % group;
    ops::RecurrentLayer e;
    e.conv_input = st.recorded_conv_input(li);
    e.conv_weight = L.delta.conv1d;
    e.a = st.recorded_a(li);
    e.b = st.recorded_b(li);
    e.A_log = L.delta.A_log;
    e.dt_bias = L.delta.dt_bias;
    e.conv_out = conv + slot * T * conv_dim;
    e.out = core + slot * T * value_dim;
    table.push_back(e);
  }
  TANDEM_CHECK(static_cast<int64_t>(table.size()) == nl, "replay_windows: linear layer count");

  // One upload: the descriptors, the layer table, then (settled) the rows ops::settle_windows
  // reads.
  const size_t bytes = sizeof(ops::RecurrentRow) * desc.size();
  const size_t o_layers = upload_part_bytes(bytes);
  const size_t layer_bytes = sizeof(ops::RecurrentLayer) * table.size();
  const size_t o_settled = o_layers + upload_part_bytes(layer_bytes);
  const size_t settled_bytes = sizeof(ops::SettledRow) * settled.size();
  const size_t total = accepted ? o_settled + settled_bytes : o_layers + layer_bytes;
  w.replay_meta.grow_to(static_cast<int64_t>(total));
  uint8_t* h = w.replay_upload.host(total);
  std::memcpy(h, desc.data(), bytes);
  if (!table.empty()) std::memcpy(h + o_layers, table.data(), layer_bytes);
  if (accepted) std::memcpy(h + o_settled, settled.data(), settled_bytes);
  w.replay_upload.start(w.replay_meta.data(), total);
  auto* dev = reinterpret_cast<ops::RecurrentRow*>(w.replay_meta.data());
  const auto* layers_dev =
      reinterpret_cast<const ops::RecurrentLayer*>(w.replay_meta.data() + o_layers);
  const auto* settled_dev =
      reinterpret_cast<const ops::SettledRow*>(w.replay_meta.data() + o_settled);

  auto body = [&] {
    if (accepted)
      ops::settle_windows(accepted, settled_dev, R, st.settled_shift(), nl > 0 ? dev : nullptr, nl);
    if (max_n == 0) return;
    for (int64_t l0 = 0; l0 < nl; l0 += group) {
      const ops::RecurrentLayers layers{table.data() + l0, layers_dev + l0,
                                        std::min(group, nl - l0)};
      ops::recurrent_layers_rows(layers, conv_dim, c.linear_conv_kernel_dim, dev + l0 * R, R, max_n,
                                 delta_heads());
    }
  };
  // Two launches per group of linear layers, as a graph: the rows' states, first tokens and kept
  // counts are the uploaded descriptors, so only the shape and the buffers' addresses name it (the
  // first word tells it from the forwards' keys).
  GraphKey key;
  key.add(uint64_t{0x7265706c6179}).add(&st).add(R).add(max_n).add(T);
  key.add(nl > 0 ? st.recorded_conv_input(0) : nullptr).add(w.replay_meta.data()).add(conv);
  key.add(core).add(accepted).add(accepted ? st.settled_shift() : nullptr).add(group);
  graphs_.run(key, body);
}

}  // namespace tandem
