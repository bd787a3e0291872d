#include "tandem/spec/qwen_mtp_weights.h"

#include <cmath>

#include "tandem/core/error.h"
#include "tandem/model/moe_weights.h"

namespace tandem::spec {

namespace {

using json = nlohmann::json;

bool is_float(DType t) {
  return t == DType::F32 || t == DType::BF16 || t == DType::F16;
}

// Field access on one JSON object with "file: field: problem" errors; null counts as absent.
class Fields {
 public:
  Fields(const json& obj, std::string source, std::string prefix)
      : obj_(obj), source_(std::move(source)), prefix_(std::move(prefix)) {}
  const json* get(const char* key) const {
    auto it = obj_.find(key);
    return it == obj_.end() || it->is_null() ? nullptr : &*it;
  }
  template <class... Parts>
  [[noreturn]] void bad(const char* key, Parts&&... parts) const {
    fail(source_, ": ", prefix_, key, ": ", std::forward<Parts>(parts)...);
  }
  int64_t integer(const char* key, const json& v) const {
    if (!v.is_number_integer()) bad(key, "expected an integer, got ", v.dump());
    return v.get<int64_t>();
  }
  int64_t req_pos_int(const char* key) const {
    const json* v = get(key);
    if (v == nullptr) fail(source_, ": missing required field ", prefix_, key);
    const int64_t x = integer(key, *v);
    if (x <= 0) bad(key, "must be positive, got ", x);
    return x;
  }
  int64_t opt_pos_int(const char* key, int64_t def) const {
    const json* v = get(key);
    if (v == nullptr) return def;
    const int64_t x = integer(key, *v);
    if (x <= 0) bad(key, "must be positive, got ", x);
    return x;
  }
  double opt_number(const char* key, double def) const {
    const json* v = get(key);
    if (v == nullptr) return def;
    if (!v->is_number()) bad(key, "expected a number, got ", v->dump());
    return v->get<double>();
  }

 private:
  const json& obj_;
  std::string source_, prefix_;
};

void check_attention_shape(const QwenMtpConfig& c, const std::string& source) {
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    fail(source, ": unsupported MTP attention shape: num_attention_heads ", c.num_attention_heads,
         " is not a multiple of num_key_value_heads ", c.num_key_value_heads);
  if (c.rotary_dim <= 0 || c.rotary_dim % 2 != 0 || c.rotary_dim > c.head_dim)
    fail(source, ": unsupported MTP attention shape: rotary_dim ", c.rotary_dim, " (head_dim ",
         c.head_dim, " x partial_rotary_factor) must be even, positive and <= ", "head_dim");
}

ops::WeightRef bind_vector(const WeightStore& s, const std::string& name, int64_t n) {
  const TensorView& t = s.get(name);
  if (t.shape != std::vector<int64_t>{n})
    fail("tensor '", name, "' in ", s.dir(), ": expected shape ", shape_str({n}), ", got ",
         shape_str(t.shape));
  if (!is_float(t.dtype))
    fail("tensor '", name, "' in ", s.dir(), ": dtype ", dtype_name(t.dtype),
         " is not supported (expected F32, BF16 or F16)");
  return ops::weight_ref(t);
}

ops::WeightRef bind_matrix(const WeightStore& s, const std::string& name, int64_t rows,
                           int64_t cols, bool float_only) {
  const TensorView& t = s.get(name);
  if (t.shape != std::vector<int64_t>{rows, cols})
    fail("tensor '", name, "' in ", s.dir(), ": expected shape ", shape_str({rows, cols}), ", got ",
         shape_str(t.shape));
  if (float_only && !is_float(t.dtype))
    fail("tensor '", name, "' in ", s.dir(), ": dtype ", dtype_name(t.dtype),
         " is not supported (expected F32, BF16 or F16)");
  return ops::weight_ref(t);
}

MtpLinear bind_linear(const QwenMtpConfig& c, const WeightStore& s, const std::string& path,
                      int64_t out, int64_t in) {
  MtpLinear l;
  if (!s.find(path + ".scales")) {
    l.dense = bind_matrix(s, path + ".weight", out, in, true);
    return l;
  }
  if (c.quant_bits == 0)
    fail("tensor '", path, ".scales' in ", s.dir(),
         ": the projection is quantized but config.json has no quantization {group_size, bits}");
  if (in % c.quant_group_size != 0)
    fail("tensor '", path, "' in ", s.dir(), ": input width ", in,
         " is not a multiple of the quantization group_size ", c.quant_group_size);
  const TensorView& w = s.get(path + ".weight");
  if (w.dtype != DType::U32)
    fail("tensor '", path, ".weight' in ", s.dir(), ": a quantized weight must be U32, got ",
         dtype_name(w.dtype));
  const int64_t words = in * c.quant_bits / 32;
  if (w.shape != std::vector<int64_t>{out, words})
    fail("tensor '", path, ".weight' in ", s.dir(), ": expected packed shape ",
         shape_str({out, words}), " (", c.quant_bits, "-bit, ", in, " inputs), got ",
         shape_str(w.shape));
  const int64_t groups = in / c.quant_group_size;
  if (!s.find(path + ".biases"))
    fail("tensor '", path, ".biases' not found in ", s.dir(),
         " (MLX affine quantization needs scales and biases)");
  ops::QuantWeightRef q;
  q.packed = w.data;
  q.scales = bind_matrix(s, path + ".scales", out, groups, true);
  q.biases = bind_matrix(s, path + ".biases", out, groups, true);
  q.rows = out;
  q.cols = in;
  q.group_size = c.quant_group_size;
  q.bits = c.quant_bits;
  l.quant = q;
  return l;
}

}  // namespace

void MtpLinear::apply(const float* x, int64_t m, float* y) const {
  if (quant)
    ops::linear_quantized(x, m, *quant, y);
  else
    ops::linear(x, m, dense, y);
}

uint64_t MtpLinear::bytes() const {
  if (!quant) return dense.bytes();
  return static_cast<uint64_t>(quant->rows * quant->cols * quant->bits / 8) +
         quant->scales.bytes() + quant->biases.bytes();
}

uint64_t QwenMtpWeights::bytes() const {
  uint64_t n = 0;
  for (const ops::WeightRef* w : {&pre_fc_norm_embedding, &pre_fc_norm_hidden, &input_layernorm,
                                  &post_attention_layernorm, &q_norm, &k_norm, &norm})
    n += w->bytes();
  for (const MtpLinear* l :
       {&fc, &q_proj, &k_proj, &v_proj, &o_proj, &gate_proj, &up_proj, &down_proj})
    n += l->bytes();
  if (cfg.moe.moe()) n += moe_weight_bytes(moe);
  return n;
}

const std::vector<std::string>& mtp_norm_names() {
  static const std::vector<std::string> names = {"pre_fc_norm_embedding.weight",
                                                 "pre_fc_norm_hidden.weight",
                                                 "norm.weight",
                                                 "layers.0.input_layernorm.weight",
                                                 "layers.0.post_attention_layernorm.weight",
                                                 "layers.0.self_attn.q_norm.weight",
                                                 "layers.0.self_attn.k_norm.weight"};
  return names;
}

const std::vector<std::string>& mtp_projection_names() {
  static const std::vector<std::string> names = {"fc",
                                                 "layers.0.self_attn.q_proj",
                                                 "layers.0.self_attn.k_proj",
                                                 "layers.0.self_attn.v_proj",
                                                 "layers.0.self_attn.o_proj",
                                                 "layers.0.mlp.gate_proj",
                                                 "layers.0.mlp.up_proj",
                                                 "layers.0.mlp.down_proj"};
  return names;
}

QwenMtpConfig mtp_config_from_target(const Qwen35Config& t, const std::string& source) {
  if (t.mtp_num_hidden_layers < 1)
    fail(source,
         ": the checkpoint has no MTP layer (mtp_num_hidden_layers = ", t.mtp_num_hidden_layers,
         "); pass --draft-model DIR or use --draft ngram");
  if (t.mtp_num_hidden_layers > 1)
    fail(source, ": mtp_num_hidden_layers = ", t.mtp_num_hidden_layers,
         " is not supported (the qwen-mtp drafter runs exactly one MTP layer)");
  QwenMtpConfig c;
  c.hidden_size = t.hidden_size;
  c.vocab_size = t.vocab_size;
  c.intermediate_size = t.intermediate_size;
  c.num_attention_heads = t.num_attention_heads;
  c.num_key_value_heads = t.num_key_value_heads;
  c.head_dim = t.head_dim;
  c.rotary_dim = t.rotary_dim;
  c.rope_theta = t.rope_theta;
  c.rms_norm_eps = t.rms_norm_eps;
  c.norms_zero_centred = true;
  if (t.moe()) {
    c.moe.num_experts = t.num_experts;
    c.moe.num_experts_per_tok = t.num_experts_per_tok;
    c.moe.moe_intermediate_size = t.moe_intermediate_size;
    c.moe.shared_expert_intermediate_size = t.shared_expert_intermediate_size;
    c.moe.hidden_size = t.hidden_size;
  }
  check_attention_shape(c, source);
  return c;
}

QwenMtpConfig parse_mtp_companion_config(const json& root, const std::string& source) {
  if (!root.is_object()) fail(source, ": expected a JSON object at the top level");
  const Fields outer(root, source, "");
  const json* mt = outer.get("model_type");
  if (mt == nullptr || !mt->is_string() || mt->get<std::string>() != "qwen3_5_mtp")
    fail(source, ": not a Qwen MTP companion drafter (model_type ",
         mt ? mt->dump() : std::string("missing"), ", expected \"qwen3_5_mtp\")");
  const json* text = outer.get("text_config");
  if (text == nullptr || !text->is_object())
    fail(source, ": a qwen3_5_mtp companion needs a text_config object");
  const Fields t(*text, source, "text_config.");
  QwenMtpConfig c;
  c.hidden_size = t.req_pos_int("hidden_size");
  c.vocab_size = t.req_pos_int("vocab_size");
  c.intermediate_size = t.req_pos_int("intermediate_size");
  c.num_attention_heads = t.req_pos_int("num_attention_heads");
  c.num_key_value_heads = t.req_pos_int("num_key_value_heads");
  c.head_dim = t.opt_pos_int("head_dim", c.hidden_size / c.num_attention_heads);
  c.rms_norm_eps = t.opt_number("rms_norm_eps", 1e-6);
  if (!(c.rms_norm_eps > 0)) t.bad("rms_norm_eps", "must be positive, got ", c.rms_norm_eps);
  // RoPE settings live in rope_parameters (current transformers), rope_scaling or the text config.
  const json empty = json::object();
  const json* rope = t.get("rope_parameters") ? t.get("rope_parameters") : t.get("rope_scaling");
  const Fields r(rope && rope->is_object() ? *rope : empty, source, "text_config.rope_parameters.");
  c.rope_theta =
      r.get("rope_theta") ? r.opt_number("rope_theta", 0) : t.opt_number("rope_theta", 10000000.0);
  if (!(c.rope_theta > 0)) fail(source, ": rope_theta must be positive, got ", c.rope_theta);
  const double prf = r.get("partial_rotary_factor") ? r.opt_number("partial_rotary_factor", 0)
                                                    : t.opt_number("partial_rotary_factor", 0.25);
  if (!(prf > 0 && prf <= 1)) fail(source, ": partial_rotary_factor must be in (0, 1], got ", prf);
  c.rotary_dim = static_cast<int64_t>(static_cast<double>(c.head_dim) * prf);
  c.norms_zero_centred = false;  // the companion format stores runtime-layout norms
  c.block_size = outer.opt_pos_int("block_size", 0);
  const json* q = outer.get("quantization");
  if (q == nullptr) q = outer.get("quantization_config");
  if (q != nullptr) {
    if (!q->is_object()) fail(source, ": quantization: expected an object {group_size, bits}");
    const Fields qf(*q, source, "quantization.");
    const int64_t bits = qf.req_pos_int("bits");
    c.quant_group_size = qf.req_pos_int("group_size");
    if (!ops::quant_bits_supported(static_cast<int>(bits)))
      qf.bad("bits", bits, "-bit quantization is not supported (supported: 2, 3, 4, 5, 6, 8)");
    if (c.quant_group_size % 32 != 0)
      qf.bad("group_size", c.quant_group_size, " is not supported (must be a multiple of 32)");
    const json* mode = qf.get("mode");
    if (mode != nullptr && *mode != "affine")
      qf.bad("mode", mode->dump(), " is not supported (only MLX affine quantization)");
    c.quant_bits = static_cast<int>(bits);
  }
  check_attention_shape(c, source);
  return c;
}

QwenMtpWeights bind_mtp_weights(const QwenMtpConfig& c, WeightStore store,
                                const std::string& prefix) {
  QwenMtpWeights w;
  w.cfg = c;
  w.store = std::move(store);
  const WeightStore& s = w.store;
  const int64_t H = c.hidden_size, I = c.intermediate_size, hd = c.head_dim;
  const int64_t nh = c.num_attention_heads, nkv = c.num_key_value_heads;
  const std::string l0 = prefix + "layers.0.";
  w.pre_fc_norm_embedding = bind_vector(s, prefix + "pre_fc_norm_embedding.weight", H);
  w.pre_fc_norm_hidden = bind_vector(s, prefix + "pre_fc_norm_hidden.weight", H);
  w.norm = bind_vector(s, prefix + "norm.weight", H);
  w.input_layernorm = bind_vector(s, l0 + "input_layernorm.weight", H);
  w.post_attention_layernorm = bind_vector(s, l0 + "post_attention_layernorm.weight", H);
  w.q_norm = bind_vector(s, l0 + "self_attn.q_norm.weight", hd);
  w.k_norm = bind_vector(s, l0 + "self_attn.k_norm.weight", hd);
  w.fc = bind_linear(c, s, prefix + "fc", H, 2 * H);
  // Qwen3.5 gated attention: q_proj emits [query | gate] per head.
  w.q_proj = bind_linear(c, s, l0 + "self_attn.q_proj", nh * hd * 2, H);
  w.k_proj = bind_linear(c, s, l0 + "self_attn.k_proj", nkv * hd, H);
  w.v_proj = bind_linear(c, s, l0 + "self_attn.v_proj", nkv * hd, H);
  w.o_proj = bind_linear(c, s, l0 + "self_attn.o_proj", H, nh * hd);
  if (c.moe.moe()) {
    if (c.quant_bits != 0)
      fail(s.dir(), ": a quantized mixture-of-experts MTP layer is not supported");
    const std::string m = l0 + "mlp.";
    const bool fused = s.find(m + "experts.gate_up_proj") != nullptr;
    w.moe = bind_moe_weights(
        c.moe, m, fused, [&](const std::string& name, const std::vector<int64_t>& shape) {
          const TensorView& t = s.get(name);
          if (t.shape != shape)
            fail("tensor '", name, "' in ", s.dir(), ": expected shape ", shape_str(shape),
                 ", got ", shape_str(t.shape));
          if (!is_float(t.dtype))
            fail("tensor '", name, "' in ", s.dir(), ": dtype ", dtype_name(t.dtype),
                 " is not supported (expected F32, BF16 or F16)");
          return ops::weight_ref(t);
        });
    return w;
  }
  w.gate_proj = bind_linear(c, s, l0 + "mlp.gate_proj", I, H);
  w.up_proj = bind_linear(c, s, l0 + "mlp.up_proj", I, H);
  w.down_proj = bind_linear(c, s, l0 + "mlp.down_proj", H, I);
  return w;
}

QwenMtpWeights random_mtp_weights(const QwenMtpConfig& c, uint64_t seed) {
  if (c.quant_bits != 0)
    fail("random MTP weights are dense, but the config asks for ", c.quant_bits,
         "-bit quantized projections");
  if (c.hidden_size <= 0 || c.vocab_size <= 0 || c.intermediate_size <= 0 ||
      c.num_attention_heads <= 0 || c.num_key_value_heads <= 0 || c.head_dim <= 0)
    fail("random MTP weights: every size of the config must be positive (hidden ", c.hidden_size,
         ", vocab ", c.vocab_size, ", intermediate ", c.intermediate_size, ", heads ",
         c.num_attention_heads, "/", c.num_key_value_heads, " x ", c.head_dim, ")");
  check_attention_shape(c, "random MTP weights");
  QwenMtpWeights w;
  w.cfg = c;
  w.placed = true;
  WeightArena& arena = w.arena;
  // Tensor i draws the stream (seed ^ salt) * 1000003 + i: Qwen35Model::random's layout with a
  // salt ("qwen-mtp"), so a target and its drafter built from one seed draw different values.
  constexpr uint64_t kSalt = 0x7177656e2d6d7470ull;
  const uint64_t base = (seed ^ kSalt) * 1000003ull;
  uint64_t tensor = 0;
  auto linear = [&](int64_t out, int64_t in) {
    MtpLinear l;
    l.dense =
        arena.random_matrix(out, in, base + tensor++, 1.0f / std::sqrt(static_cast<float>(in)));
    return l;
  };
  // Qwen3.5 RMSNorm weights near the identity scale of the layout: w ≈ 0 when the scale is
  // 1 + w (zero-centred), w ≈ 1 when it is w.
  const float identity = c.norms_zero_centred ? 0.0f : 1.0f;
  auto norm = [&](int64_t n) { return arena.random_vector(n, base + tensor++, identity, 0.1f); };
  const int64_t H = c.hidden_size, I = c.intermediate_size, hd = c.head_dim;
  const int64_t nh = c.num_attention_heads, nkv = c.num_key_value_heads;
  // A fixed order (bind_mtp_weights'): tensor i draws stream i whatever the shapes are.
  w.pre_fc_norm_embedding = norm(H);
  w.pre_fc_norm_hidden = norm(H);
  w.norm = norm(H);
  w.input_layernorm = norm(H);
  w.post_attention_layernorm = norm(H);
  w.q_norm = norm(hd);
  w.k_norm = norm(hd);
  w.fc = linear(H, 2 * H);
  w.q_proj = linear(nh * hd * 2, H);  // [query | gate] per head
  w.k_proj = linear(nkv * hd, H);
  w.v_proj = linear(nkv * hd, H);
  w.o_proj = linear(H, nh * hd);
  if (c.moe.moe()) {
    w.moe = bind_moe_weights(
        c.moe, "", false, [&](const std::string& name, const std::vector<int64_t>& shape) {
          // Router logits of O(1) spread, as write_random_qwen35 draws them.
          const float scale = name == "gate.weight"
                                  ? 2.0f / std::sqrt(static_cast<float>(shape[1]))
                                  : 1.0f / std::sqrt(static_cast<float>(shape[1]));
          return arena.random_matrix(shape[0], shape[1], base + tensor++, scale);
        });
  } else {
    w.gate_proj = linear(I, H);
    w.up_proj = linear(I, H);
    w.down_proj = linear(H, I);
  }
  return w;
}

}  // namespace tandem::spec
