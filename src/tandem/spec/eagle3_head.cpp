#include "tandem/spec/eagle3_head.h"

#include <cstring>
#include <filesystem>

#include "tandem/core/error.h"
#include "tandem/io/json_file.h"
#include "tandem/model/config_fields.h"

namespace tandem::spec {

namespace {

using json = nlohmann::json;

bool is_float(DType t) {
  return t == DType::F32 || t == DType::BF16 || t == DType::F16;
}

ops::WeightRef bind(const WeightStore& s, const std::string& name,
                    const std::vector<int64_t>& shape) {
  const TensorView* t = s.find(name);
  if (!t)
    fail("eagle3 head ", s.dir(), ": tensor '", name, "' is missing (expected shape ",
         shape_str(shape), ")");
  if (t->shape != shape)
    fail("eagle3 head ", s.dir(), ": tensor '", name, "' has shape ", shape_str(t->shape),
         ", expected ", shape_str(shape));
  if (!is_float(t->dtype))
    fail("eagle3 head ", s.dir(), ": tensor '", name, "' has dtype ", dtype_name(t->dtype),
         ", expected F32, BF16 or F16");
  return ops::weight_ref(*t);
}

// d2t [Vd] (I64, or I32) applied: the target id of every draft id.
std::vector<int32_t> read_draft_to_target(const WeightStore& s, const Eagle3Config& c) {
  const TensorView* t = s.find("d2t");
  if (!t)
    fail("eagle3 head ", s.dir(), ": tensor 'd2t' is missing: the map from the ",
         c.draft_vocab_size, " draft ids to target ids (target id = draft id + d2t[draft id])");
  if (t->shape != std::vector<int64_t>{c.draft_vocab_size})
    fail("eagle3 head ", s.dir(), ": tensor 'd2t' has shape ", shape_str(t->shape), ", expected ",
         shape_str({c.draft_vocab_size}), " (draft_vocab_size)");
  if (t->dtype != DType::I64 && t->dtype != DType::I32)
    fail("eagle3 head ", s.dir(), ": tensor 'd2t' has dtype ", dtype_name(t->dtype),
         ", expected I64");
  std::vector<int32_t> out(static_cast<size_t>(c.draft_vocab_size));
  std::vector<bool> taken(static_cast<size_t>(c.vocab_size), false);
  const auto* bytes = static_cast<const std::byte*>(t->data);
  for (int64_t d = 0; d < c.draft_vocab_size; ++d) {
    int64_t off = 0;
    if (t->dtype == DType::I64) {
      std::memcpy(&off, bytes + d * 8, 8);  // safetensors data may be unaligned
    } else {
      int32_t o32 = 0;
      std::memcpy(&o32, bytes + d * 4, 4);
      off = o32;
    }
    const int64_t target = d + off;
    if (target < 0 || target >= c.vocab_size)
      fail("eagle3 head ", s.dir(), ": d2t maps draft id ", d, " to target id ", target,
           ", outside the vocabulary [0, ", c.vocab_size, ")");
    if (taken[static_cast<size_t>(target)])
      fail("eagle3 head ", s.dir(), ": d2t maps two draft ids to target id ", target);
    taken[static_cast<size_t>(target)] = true;
    out[static_cast<size_t>(d)] = static_cast<int32_t>(target);
  }
  // t2d [V] (BOOL, or U8) must mark exactly the target ids d2t reaches.
  const TensorView* m = s.find("t2d");
  if (!m)
    fail("eagle3 head ", s.dir(), ": tensor 't2d' is missing: the ", c.vocab_size,
         " target ids' membership in the draft vocabulary");
  if (m->shape != std::vector<int64_t>{c.vocab_size})
    fail("eagle3 head ", s.dir(), ": tensor 't2d' has shape ", shape_str(m->shape), ", expected ",
         shape_str({c.vocab_size}), " (vocab_size)");
  if (m->dtype != DType::BOOL && m->dtype != DType::U8)
    fail("eagle3 head ", s.dir(), ": tensor 't2d' has dtype ", dtype_name(m->dtype),
         ", expected BOOL");
  const auto* flags = static_cast<const uint8_t*>(m->data);
  for (int64_t v = 0; v < c.vocab_size; ++v)
    if ((flags[v] != 0) != taken[static_cast<size_t>(v)])
      fail("eagle3 head ", s.dir(), ": d2t and t2d disagree at target id ", v, ": t2d says ",
           flags[v] ? "in" : "not in", " the draft vocabulary, d2t ",
           taken[static_cast<size_t>(v)] ? "maps a draft id to it" : "maps no draft id to it");
  return out;
}

}  // namespace

Eagle3Config parse_eagle3_config(const json& config, const std::string& path) {
  if (!config.is_object()) fail(path, ": expected a JSON object");
  const config::Fields f(config, path, "");
  const json& arch = f.require("architectures");
  bool known = false;
  if (arch.is_array())
    for (const json& a : arch)
      known = known || (a.is_string() && (a.get<std::string>() == "LlamaForCausalLMEagle3" ||
                                          a.get<std::string>() == "Eagle3LlamaForCausalLM"));
  if (!known)
    f.bad("architectures", "expected a list naming LlamaForCausalLMEagle3 (an EAGLE-3 head), got ",
          arch.dump());
  Eagle3Config c;
  c.hidden_size = f.req_pos_int("hidden_size");
  c.intermediate_size = f.req_pos_int("intermediate_size");
  c.num_attention_heads = f.req_pos_int("num_attention_heads");
  c.num_key_value_heads = f.opt_pos_int("num_key_value_heads", c.num_attention_heads);
  if (c.hidden_size % c.num_attention_heads != 0 && !f.has("head_dim"))
    f.bad("num_attention_heads", c.num_attention_heads, " does not divide hidden_size ",
          c.hidden_size, " and there is no head_dim");
  c.head_dim = f.opt_pos_int("head_dim", c.hidden_size / c.num_attention_heads);
  if (c.head_dim % 2 != 0) f.bad("head_dim", "must be even for rotary, got ", c.head_dim);
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    f.bad("num_key_value_heads", c.num_key_value_heads, " does not divide num_attention_heads ",
          c.num_attention_heads);
  c.rms_norm_eps = f.opt_number("rms_norm_eps", 1e-6);
  c.rope_theta = f.opt_number("rope_theta", 10000.0);
  if (const json* s = f.get("rope_scaling"))
    f.bad("rope_scaling", "is not supported (only Llama's default rotary is), got ", s->dump());
  if (const json* rp = f.opt_object("rope_parameters")) {
    const config::Fields r(*rp, path, "rope_parameters.");
    const std::string type = r.opt_string("rope_type", "default");
    if (type != "default")
      r.bad("rope_type", "is not supported (only Llama's default rotary is), got '", type, "'");
    c.rope_theta = r.opt_number("rope_theta", c.rope_theta);
  }
  c.max_position_embeddings = f.opt_pos_int("max_position_embeddings", 0);
  c.vocab_size = f.req_pos_int("vocab_size");
  c.draft_vocab_size = f.opt_pos_int("draft_vocab_size", c.vocab_size);
  if (c.draft_vocab_size > c.vocab_size)
    f.bad("draft_vocab_size", c.draft_vocab_size, " exceeds vocab_size ", c.vocab_size);
  c.target_hidden_size = f.opt_pos_int("target_hidden_size", c.hidden_size);
  const int64_t layers = f.opt_pos_int("num_hidden_layers", 1);
  if (layers != 1)
    f.bad("num_hidden_layers", "an EAGLE-3 head has one decoder layer, got ", layers);
  const std::string act = f.opt_string("hidden_act", "silu");
  if (act != "silu") f.bad("hidden_act", "only silu is supported, got '", act, "'");
  if (const json* e = f.opt_object("eagle_config")) {
    const config::Fields ef(*e, path, "eagle_config.");
    if (const json* ids = ef.get("eagle_aux_hidden_state_layer_ids")) {
      if (!ids->is_array() || ids->empty())
        ef.bad("eagle_aux_hidden_state_layer_ids", "expected a non-empty list of layer ids, got ",
               ids->dump());
      for (const json& id : *ids) {
        const int64_t l = ef.as_int("eagle_aux_hidden_state_layer_ids", id);
        if (l < 0 || l > INT32_MAX)
          ef.bad("eagle_aux_hidden_state_layer_ids", "layer id ", l, " is negative or too large");
        c.tap_layers.push_back(static_cast<int>(l));
      }
    }
  }
  return c;
}

std::vector<int> eagle3_default_tap_layers(int64_t target_layers) {
  const int64_t L = target_layers;
  return {2, static_cast<int>(L / 2), static_cast<int>(L - 3)};
}

uint64_t Eagle3Weights::bytes() const {
  uint64_t n = 0;
  for (const ops::WeightRef* w : {&fc, &input_layernorm, &hidden_norm, &q_proj, &k_proj, &v_proj,
                                  &o_proj, &post_attention_layernorm, &gate_proj, &up_proj,
                                  &down_proj, &norm, &lm_head, &embed_tokens})
    n += w->bytes();
  return n;
}

Eagle3Weights load_eagle3_head(const std::string& dir) {
  const std::string config_path = (std::filesystem::path(dir) / "config.json").string();
  Eagle3Weights w;
  w.cfg = parse_eagle3_config(read_json_file(config_path), config_path);
  w.store = WeightStore::open(dir, false);
  const Eagle3Config& c = w.cfg;
  const WeightStore& s = w.store;
  const int64_t H = c.hidden_size, I = c.intermediate_size, hd = c.head_dim;
  w.fc = bind(s, "fc.weight", {H, c.tap_count() * c.target_hidden_size});
  w.input_layernorm = bind(s, "midlayer.input_layernorm.weight", {H});
  w.hidden_norm = bind(s, "midlayer.hidden_norm.weight", {H});
  w.q_proj = bind(s, "midlayer.self_attn.q_proj.weight", {c.num_attention_heads * hd, 2 * H});
  w.k_proj = bind(s, "midlayer.self_attn.k_proj.weight", {c.num_key_value_heads * hd, 2 * H});
  w.v_proj = bind(s, "midlayer.self_attn.v_proj.weight", {c.num_key_value_heads * hd, 2 * H});
  w.o_proj = bind(s, "midlayer.self_attn.o_proj.weight", {H, c.num_attention_heads * hd});
  w.post_attention_layernorm = bind(s, "midlayer.post_attention_layernorm.weight", {H});
  w.gate_proj = bind(s, "midlayer.mlp.gate_proj.weight", {I, H});
  w.up_proj = bind(s, "midlayer.mlp.up_proj.weight", {I, H});
  w.down_proj = bind(s, "midlayer.mlp.down_proj.weight", {H, I});
  w.norm = bind(s, "norm.weight", {H});
  w.lm_head = bind(s, "lm_head.weight", {c.draft_vocab_size, H});
  if (s.find("embed_tokens.weight"))
    w.embed_tokens = bind(s, "embed_tokens.weight", {c.vocab_size, H});
  w.draft_to_target = read_draft_to_target(s, c);
  return w;
}

}  // namespace tandem::spec
