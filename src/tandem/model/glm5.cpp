#include "tandem/model/glm5.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "tandem/backend/cpu/weight_element.h"
#include "tandem/core/error.h"
#include "tandem/model/gated_attention.h"

namespace tandem {

namespace {

// transformers builds the MLA's inner norms (q_a_layernorm, kv_a_layernorm) with GlmMoeDsaRMSNorm's
// default eps and the indexer's key norm with its own; neither reads rms_norm_eps.
constexpr float kLatentNormEps = 1e-6f;
constexpr float kIndexKeyNormEps = 1e-6f;

bool is_float(DType t) {
  return t == DType::F32 || t == DType::BF16 || t == DType::F16;
}

std::vector<float> zeros(int64_t n) {
  return std::vector<float>(static_cast<size_t>(n), 0.0f);
}

}  // namespace

// The tokens of one forward: rows in request order, each a run of consecutive tokens.
struct Glm5Model::Batch {
  struct Row {
    int slot = 0;
    int64_t first = 0;  // index of the row's first token in the forward
    int64_t n = 0;
    int64_t start = 0;  // the row's length before the forward (its first token's position)
  };
  std::vector<Row> rows;
  std::vector<int64_t> pos;  // [T] each token's position in its row
  int64_t T = 0;
  bool prompt = false;
};

std::unique_ptr<Glm5Model> Glm5Model::load(const std::string& dir, const LoadOptions& opts) {
  if (ops::backend() != ops::Backend::Cpu)
    fail("GLM-5 (", dir, ") runs on the CPU backend only so far (use --backend cpu)");
  std::unique_ptr<Glm5Model> m(new Glm5Model());
  m->cfg_ = load_glm5_config(dir);
  m->store_ = WeightStore::open(dir, opts.prefault);
  m->bind_weights();
  return m;
}

ops::WeightRef Glm5Model::tensor(const std::string& name, const std::vector<int64_t>& shape) {
  const TensorView& t = store_.get(name);
  if (t.shape != shape)
    fail("tensor '", name, "' in ", store_.dir(), ": expected shape ", shape_str(shape), ", got ",
         shape_str(t.shape));
  ops::WeightRef w = ops::weight_ref(t);
  parameters_ += static_cast<uint64_t>(t.numel());
  if (is_float(t.dtype)) return w;
  if (t.dtype != DType::F8_E4M3 || shape.size() != 2)
    fail("tensor '", name, "' in ", store_.dir(), ": dtype ", dtype_name(t.dtype),
         " is not supported (expected F32, BF16 or F16, or F8_E4M3 for a matrix)");
  if (!cfg_.fp8())
    fail("tensor '", name, "' in ", store_.dir(),
         " is fp8 (F8_E4M3) but config.json has no fp8 quantization_config");
  const std::string scale_name = name.substr(0, name.rfind(".weight")) + ".weight_scale_inv";
  const TensorView* s = store_.find(scale_name);
  if (!s)
    fail("tensor '", name, "' in ", store_.dir(), " is fp8 but its scales '", scale_name,
         "' are missing");
  const std::vector<int64_t> grid = {(shape[0] + cfg_.fp8_block_rows - 1) / cfg_.fp8_block_rows,
                                     (shape[1] + cfg_.fp8_block_cols - 1) / cfg_.fp8_block_cols};
  if (s->shape != grid)
    fail("tensor '", scale_name, "' in ", store_.dir(), ": expected shape ", shape_str(grid),
         " (blocks of ", cfg_.fp8_block_rows, " x ", cfg_.fp8_block_cols, " over ",
         shape_str(shape), "), got ", shape_str(s->shape));
  if (s->dtype != DType::F32 && s->dtype != DType::BF16)
    fail("tensor '", scale_name, "' in ", store_.dir(), ": dtype ", dtype_name(s->dtype),
         " is not supported (expected F32 or BF16)");
  w.scales.data = s->data;
  w.scales.dtype = s->dtype;
  w.scales.block_rows = cfg_.fp8_block_rows;
  w.scales.block_cols = cfg_.fp8_block_cols;
  return w;
}

ops::MoeWeights Glm5Model::bind_mixture(const std::string& p) {
  const Glm5Config& c = cfg_;
  const int64_t H = c.hidden_size, E = c.n_routed_experts, I = c.moe_intermediate_size;
  ops::MoeWeights m;
  m.router = tensor(p + "gate.weight", {E, H});
  const ops::WeightRef bias = tensor(p + "gate.e_score_correction_bias", {E});
  std::vector<float>& b = score_biases_.emplace_back(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) b[static_cast<size_t>(e)] = ops::weight_element(bias, e);
  m.score_bias.dtype = DType::F32;
  m.score_bias.data = b.data();
  m.score_bias.rows = 1;
  m.score_bias.cols = E;
  m.routing = ops::MoeRouting::NoauxTc;
  m.top_k = c.num_experts_per_tok;
  m.renormalise = c.norm_topk_prob;
  m.n_group = c.n_group;
  m.topk_group = c.topk_group;
  m.routed_scale = static_cast<float>(c.routed_scaling_factor);
  const std::string ex = p + "experts.";
  if (store_.find(ex + "gate_up_proj")) {
    const ops::WeightRef gu = tensor(ex + "gate_up_proj", {E, 2 * I, H});
    const ops::WeightRef dn = tensor(ex + "down_proj", {E, H, I});
    if (gu.dtype == DType::F8_E4M3 || dn.dtype == DType::F8_E4M3)
      fail("tensor '", ex, "gate_up_proj' in ", store_.dir(),
           ": fp8 experts must come one tensor per expert and projection, as the published "
           "checkpoints store them");
    const size_t es = dtype_size(gu.dtype);
    auto rows_of = [&](const ops::WeightRef& w, int64_t row0, int64_t rows, int64_t cols) {
      ops::WeightRef v = w;
      v.data = static_cast<const uint8_t*>(w.data) + static_cast<size_t>(row0 * cols) * es;
      v.rows = rows;
      v.cols = cols;
      return v;
    };
    for (int64_t e = 0; e < E; ++e) {
      m.gate.push_back(rows_of(gu, e * 2 * I, I, H));
      m.up.push_back(rows_of(gu, e * 2 * I + I, I, H));
      m.down.push_back(rows_of(dn, e * H, H, I));
    }
  } else {
    if (!store_.find(ex + "0.gate_proj.weight"))
      fail("no experts in ", store_.dir(), ": expected '", ex,
           "gate_up_proj' (fused, as transformers writes them) or '", ex,
           "0.gate_proj.weight' (one tensor per expert)");
    for (int64_t e = 0; e < E; ++e) {
      const std::string q = ex + std::to_string(e) + ".";
      m.gate.push_back(tensor(q + "gate_proj.weight", {I, H}));
      m.up.push_back(tensor(q + "up_proj.weight", {I, H}));
      m.down.push_back(tensor(q + "down_proj.weight", {H, I}));
    }
  }
  if (c.n_shared_experts > 0) {
    const int64_t Is = I * c.n_shared_experts;
    m.shared_gate_proj = tensor(p + "shared_experts.gate_proj.weight", {Is, H});
    m.shared_up_proj = tensor(p + "shared_experts.up_proj.weight", {Is, H});
    m.shared_down_proj = tensor(p + "shared_experts.down_proj.weight", {H, Is});
  }
  return m;
}

void Glm5Model::bind_weights() {
  const Glm5Config& c = cfg_;
  const int64_t H = c.hidden_size, nh = c.num_attention_heads;
  const int64_t dn = c.qk_nope_head_dim, dr = c.qk_rope_head_dim, dv = c.v_head_dim;
  const int64_t R = c.kv_lora_rank, Di = c.index_head_dim;
  embed_ = tensor("model.embed_tokens.weight", {c.vocab_size, H});
  final_norm_ = tensor("model.norm.weight", {H});
  if (c.tie_word_embeddings) {
    lm_head_ = embed_;
  } else {
    if (!store_.find("lm_head.weight"))
      fail("tensor 'lm_head.weight' not found in ", store_.dir(),
           " (config says tie_word_embeddings=false)");
    lm_head_ = tensor("lm_head.weight", {c.vocab_size, H});
  }
  score_biases_.reserve(static_cast<size_t>(c.num_hidden_layers));
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    Layer L;
    L.input_norm = tensor(p + "input_layernorm.weight", {H});
    L.post_norm = tensor(p + "post_attention_layernorm.weight", {H});
    const std::string a = p + "self_attn.";
    Attention& A = L.attn;
    A.q_a_proj = tensor(a + "q_a_proj.weight", {c.q_lora_rank, H});
    A.q_a_norm = tensor(a + "q_a_layernorm.weight", {c.q_lora_rank});
    A.q_b_proj = tensor(a + "q_b_proj.weight", {nh * (dn + dr), c.q_lora_rank});
    A.kv_a_proj = tensor(a + "kv_a_proj_with_mqa.weight", {R + dr, H});
    A.kv_a_norm = tensor(a + "kv_a_layernorm.weight", {R});
    A.kv_b_proj = tensor(a + "kv_b_proj.weight", {nh * (dn + dv), R});
    A.o_proj = tensor(a + "o_proj.weight", {H, nh * dv});
    L.shared_index = c.shared_index_layers[static_cast<size_t>(i)];
    if (!L.shared_index) {
      const std::string x = a + "indexer.";
      A.index_wq_b = tensor(x + "wq_b.weight", {c.index_n_heads * Di, c.q_lora_rank});
      A.index_wk = tensor(x + "wk.weight", {Di, H});
      A.index_k_norm = tensor(x + "k_norm.weight", {Di});
      A.index_k_norm_bias = tensor(x + "k_norm.bias", {Di});
      A.index_weights_proj = tensor(x + "weights_proj.weight", {c.index_n_heads, H});
    }
    L.sparse = c.sparse_layers[static_cast<size_t>(i)];
    if (L.sparse) {
      L.moe = bind_mixture(p + "mlp.");
    } else {
      L.gate_proj = tensor(p + "mlp.gate_proj.weight", {c.intermediate_size, H});
      L.up_proj = tensor(p + "mlp.up_proj.weight", {c.intermediate_size, H});
      L.down_proj = tensor(p + "mlp.down_proj.weight", {H, c.intermediate_size});
    }
    layers_.push_back(L);
  }
  inv_freq_ = rope_inv_freq(c.rope_theta, dr);
}

void Glm5Model::embed(std::span<const int32_t> ids, float* out) const {
  for (size_t i = 0; i < ids.size(); ++i)
    if (ids[i] < 0 || ids[i] >= cfg_.vocab_size)
      fail("token id ", ids[i], " at input position ", i, " is out of range [0, ", cfg_.vocab_size,
           ")");
  ops::embed_rows(embed_, ids.data(), static_cast<int64_t>(ids.size()), out);
}

void Glm5Model::head(const float* hidden, int64_t n, float* out) const {
  ops::linear(hidden, n, lm_head_, out);
}

void Glm5Model::forward(Glm5State& st, const ForwardRequest& req, ForwardOutput* out) const {
  if (req.tokens_from_argmax || req.defer_argmax)
    fail("forward: GLM-5 takes host tokens and returns its argmax at once (tokens_from_argmax and ",
         "defer_argmax are not supported)");
  Batch b;
  b.prompt = req.prompt;
  for (size_t i = 0; i < req.rows.size(); ++i) {
    const RowInput& r = req.rows[i];
    if (!st.row_open(r.slot)) fail("forward: row slot ", r.slot, " is not open");
    if (r.n_tokens <= 0) fail("forward: row slot ", r.slot, " has no tokens");
    for (size_t j = 0; j < i; ++j)
      if (req.rows[j].slot == r.slot) fail("forward: row slot ", r.slot, " is listed twice");
    if (st.window(r.slot) > 0)
      fail("forward: row slot ", r.slot, " has an uncommitted speculative window (",
           st.window(r.slot), " tokens); commit_windows first");
    b.rows.push_back({r.slot, b.T, r.n_tokens, st.length(r.slot)});
    b.T += r.n_tokens;
  }
  if (b.T != static_cast<int64_t>(req.tokens.size()))
    fail("forward: rows cover ", b.T, " tokens but ", req.tokens.size(), " were given");
  for (const Batch::Row& r : b.rows)
    for (int64_t j = 0; j < r.n; ++j) b.pos.push_back(r.start + j);
  const int64_t T = b.T, H = cfg_.hidden_size, V = cfg_.vocab_size;
  std::vector<float> x(static_cast<size_t>(T * H));
  embed(req.tokens, x.data());  // checks the ids before any state changes

  out->routing.clear();
  out->index_selection.clear();
  std::vector<int32_t> selection;  // [T, index_topk] of the last layer that ran its indexer
  for (size_t l = 0; l < layers_.size(); ++l) {
    attention(layers_[l], l, st, b, selection, x, req.want_index_selection, out);
    mlp(layers_[l], b, x, out, req.want_routing);
  }
  for (size_t i = 0; i < req.rows.size(); ++i) {
    Glm5State::Row& row = st.row(req.rows[i].slot);
    row.length += req.rows[i].n_tokens;
    row.window = req.rows[i].speculative ? req.rows[i].n_tokens : 0;
  }

  if (req.want_prenorm_hidden) out->prenorm_hidden = x;
  std::vector<float> normed(x.size());
  ops::rms_norm(x.data(), T, H, final_norm_, false, static_cast<float>(cfg_.rms_norm_eps),
                normed.data());
  if (req.want_hidden) out->hidden = normed;
  std::vector<float> last;
  const float* head_in = normed.data();
  int64_t rows = T;
  if (!req.all_logits) {
    rows = static_cast<int64_t>(b.rows.size());
    last.resize(static_cast<size_t>(rows * H));
    for (int64_t i = 0; i < rows; ++i) {
      const Batch::Row& r = b.rows[static_cast<size_t>(i)];
      std::memcpy(last.data() + i * H, normed.data() + (r.first + r.n - 1) * H,
                  sizeof(float) * static_cast<size_t>(H));
    }
    head_in = last.data();
  }
  out->logits_rows = rows;
  out->argmax.clear();
  if (!req.want_logits && !req.want_argmax) {
    out->logits.clear();
    return;
  }
  out->logits.resize(static_cast<size_t>(rows * V));
  head(head_in, rows, out->logits.data());
  if (req.want_argmax) {
    out->argmax.resize(static_cast<size_t>(rows));
    ops::argmax_rows(out->logits.data(), rows, V, out->argmax.data());
  }
  if (!req.want_logits) out->logits.clear();
}

void Glm5Model::attention(const Layer& L, size_t layer, Glm5State& st, const Batch& b,
                          std::vector<int32_t>& selection, std::vector<float>& x, bool record,
                          ForwardOutput* out) const {
  const Glm5Config& c = cfg_;
  const Attention& A = L.attn;
  const int64_t T = b.T, H = c.hidden_size, nh = c.num_attention_heads;
  const int64_t dn = c.qk_nope_head_dim, dr = c.qk_rope_head_dim, dv = c.v_head_dim;
  const int64_t R = c.kv_lora_rank, W = R + dr, qr = c.q_lora_rank;
  const int64_t Di = c.index_head_dim, ih = c.index_n_heads, topk = c.index_topk;
  const float eps = static_cast<float>(c.rms_norm_eps);
  const int64_t* pos = b.pos.data();

  std::vector<float> h(static_cast<size_t>(T * H));
  ops::rms_norm(x.data(), T, H, L.input_norm, false, eps, h.data());

  // Queries: the LoRA latent (normed; the indexer reads it too), then per head [nope | rope].
  std::vector<float> qa(static_cast<size_t>(T * qr));
  ops::linear(h.data(), T, A.q_a_proj, qa.data());
  ops::rms_norm(qa.data(), T, qr, A.q_a_norm, false, kLatentNormEps, qa.data());
  std::vector<float> q(static_cast<size_t>(T * nh * (dn + dr)));
  ops::linear(qa.data(), T, A.q_b_proj, q.data());
  ops::rope_slice(q.data(), T, nh, dn + dr, dn, dr, pos, inv_freq_.data(), c.rope_interleave);
  std::vector<float> q_nope(static_cast<size_t>(T * nh * dn)),
      q_pe(static_cast<size_t>(T * nh * dr));
  ops::copy_rows(q_nope.data(), dn, q.data(), dn + dr, T * nh, dn);
  ops::copy_rows(q_pe.data(), dr, q.data() + dn, dn + dr, T * nh, dr);

  // The latent cache entries: [normed latent | rotated rotary key] per token.
  std::vector<float> kv(static_cast<size_t>(T * W));
  ops::linear(h.data(), T, A.kv_a_proj, kv.data());
  for (int64_t t = 0; t < T; ++t)
    ops::rms_norm(kv.data() + t * W, 1, R, A.kv_a_norm, false, kLatentNormEps, kv.data() + t * W);
  ops::rope_slice(kv.data(), T, 1, W, R, dr, pos, inv_freq_.data(), c.rope_interleave);
  for (const Batch::Row& r : b.rows) {
    std::vector<float>& cache = st.row(r.slot).latent[layer];
    cache.insert(cache.end(), kv.begin() + r.first * W, kv.begin() + (r.first + r.n) * W);
  }

  // The DSA choice: this layer's own indexer, or the previous layer's choice.
  if (!L.shared_index) {
    std::vector<float> qi(static_cast<size_t>(T * ih * Di)), ki(static_cast<size_t>(T * Di));
    ops::linear(qa.data(), T, A.index_wq_b, qi.data());
    ops::rope_slice(qi.data(), T, ih, Di, 0, dr, pos, inv_freq_.data(), c.indexer_rope_interleave);
    ops::linear(h.data(), T, A.index_wk, ki.data());
    ops::layer_norm(ki.data(), T, Di, A.index_k_norm, A.index_k_norm_bias, kIndexKeyNormEps,
                    ki.data());
    ops::rope_slice(ki.data(), T, 1, Di, 0, dr, pos, inv_freq_.data(), c.indexer_rope_interleave);
    std::vector<float> w(static_cast<size_t>(T * ih));
    ops::linear(h.data(), T, A.index_weights_proj, w.data());
    const float head_scale = 1.0f / std::sqrt(static_cast<float>(ih));
    for (float& v : w) v *= head_scale;
    selection.assign(static_cast<size_t>(T * topk), -1);
    for (const Batch::Row& r : b.rows) {
      std::vector<float>& keys = st.row(r.slot).index_keys[layer];
      keys.insert(keys.end(), ki.begin() + r.first * Di, ki.begin() + (r.first + r.n) * Di);
      ops::dsa_select(qi.data() + r.first * ih * Di, w.data() + r.first * ih, r.n, ih, Di,
                      keys.data(), r.start + r.n, pos + r.first, topk,
                      selection.data() + r.first * topk);
    }
  }
  if (record)
    out->index_selection.insert(out->index_selection.end(), selection.begin(), selection.end());

  std::vector<float> attn(static_cast<size_t>(T * nh * dv));
  const float scale = 1.0f / std::sqrt(static_cast<float>(dn + dr));
  for (const Batch::Row& r : b.rows) {
    const std::vector<float>& cache = st.row(r.slot).latent[layer];
    ops::mla_attention(q_nope.data() + r.first * nh * dn, q_pe.data() + r.first * nh * dr, r.n, nh,
                       dn, dr, dv, cache.data(), r.start + r.n, R, A.kv_b_proj, pos + r.first,
                       selection.data() + r.first * topk, topk, scale, /*absorbed=*/!b.prompt,
                       attn.data() + r.first * nh * dv);
  }
  ops::linear_add(attn.data(), T, A.o_proj, x.data());
}

void Glm5Model::mlp(const Layer& L, const Batch& b, std::vector<float>& x, ForwardOutput* out,
                    bool record) const {
  const int64_t T = b.T, H = cfg_.hidden_size;
  std::vector<float> h(static_cast<size_t>(T * H));
  ops::rms_norm(x.data(), T, H, L.post_norm, false, static_cast<float>(cfg_.rms_norm_eps),
                h.data());
  if (L.sparse) {
    std::vector<int32_t> ids;
    ops::moe_mlp_add(h.data(), T, L.moe, x.data(), record ? &ids : nullptr);
    if (record) out->routing.insert(out->routing.end(), ids.begin(), ids.end());
    return;
  }
  const int64_t I = cfg_.intermediate_size;
  std::vector<float> g = zeros(T * I), u = zeros(T * I);
  ops::linear(h.data(), T, L.gate_proj, g.data());
  ops::linear(h.data(), T, L.up_proj, u.data());
  ops::swiglu(g.data(), u.data(), T * I, g.data());
  ops::linear_add(g.data(), T, L.down_proj, x.data());
}

void Glm5Model::commit_windows(Glm5State& st, std::span<const RowKeep> rows) const {
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
