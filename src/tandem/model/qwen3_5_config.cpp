#include "tandem/model/qwen3_5_config.h"

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "tandem/core/error.h"
#include "tandem/io/json_file.h"
#include "tandem/model/config_fields.h"

namespace tandem {
namespace {

using json = nlohmann::json;
using config::append_eos;
using config::Fields;
using config::parse_json;

}  // namespace

Qwen35Config parse_qwen35_config(const std::string& json_text, const std::string& source_name) {
  const json root = parse_json(json_text, source_name);
  if (!root.is_object()) {
    fail(source_name, ": expected a JSON object at the top level, got ", root.type_name());
  }
  Qwen35Config c;
  const Fields outer(root, source_name, "");
  c.model_type = outer.opt_string("model_type", "");
  if (c.model_type.empty()) fail(source_name, ": missing required field model_type");
  const bool nested = c.model_type == "qwen3_5" || c.model_type == "qwen3_5_moe";
  const bool moe = c.model_type == "qwen3_5_moe" || c.model_type == "qwen3_5_moe_text";
  if (!nested && !moe && c.model_type != "qwen3_5_text") {
    fail("unsupported model_type '", c.model_type, "' in ", source_name,
         " (expected qwen3_5, qwen3_5_text, qwen3_5_moe or qwen3_5_moe_text)");
  }
  const json* text_obj = &root;
  std::string prefix;
  if (nested) {
    text_obj = outer.opt_object("text_config");
    if (text_obj == nullptr) {
      fail(source_name, ": model_type ", c.model_type,
           " needs a text_config object with the text model");
    }
    prefix = "text_config.";
  }
  const Fields t(*text_obj, source_name, prefix);
  if (nested) {
    const std::string want = c.model_type + "_text";
    const std::string inner = t.opt_string("model_type", want);
    if (inner != want) {
      t.bad("model_type", "unsupported text model '", inner, "' (expected ", want, ")");
    }
  }

  c.vocab_size = t.req_pos_int("vocab_size");
  c.hidden_size = t.req_pos_int("hidden_size");
  if (moe) {
    c.num_experts = t.req_pos_int("num_experts");
    c.num_experts_per_tok = t.req_pos_int("num_experts_per_tok");
    if (c.num_experts_per_tok > c.num_experts) {
      t.bad("num_experts_per_tok", c.num_experts_per_tok, " exceeds num_experts (", c.num_experts,
            ")");
    }
    c.moe_intermediate_size = t.req_pos_int("moe_intermediate_size");
    // 0: no shared expert (transformers' module then has no features and adds zero).
    c.shared_expert_intermediate_size =
        t.as_int("shared_expert_intermediate_size", t.require("shared_expert_intermediate_size"));
    if (c.shared_expert_intermediate_size < 0)
      t.bad("shared_expert_intermediate_size", "must be >= 0, got ",
            c.shared_expert_intermediate_size);
    // norm_topk_prob is not read: transformers' qwen3_5_moe router renormalises the chosen
    // experts' probabilities whatever the config says (moe_weights.cpp), and so does tandem.
    // Every layer is sparse in Qwen3.5-MoE; a config that keeps dense layers describes another
    // graph.
    if (const json* dense = t.get("mlp_only_layers");
        dense && !(dense->is_array() && dense->empty()))
      t.bad("mlp_only_layers", "dense layers in a Qwen3.5-MoE model are not supported, got ",
            dense->dump());
    if (t.opt_pos_int("decoder_sparse_step", 1) != 1)
      t.bad("decoder_sparse_step", "only 1 (every layer sparse) is supported");
    c.intermediate_size = t.opt_pos_int("intermediate_size", c.moe_intermediate_size);
  } else {
    c.intermediate_size = t.req_pos_int("intermediate_size");
  }
  c.num_hidden_layers = t.req_pos_int("num_hidden_layers");
  c.max_position_embeddings = t.req_pos_int("max_position_embeddings");
  c.num_attention_heads = t.req_pos_int("num_attention_heads");
  c.num_key_value_heads = t.req_pos_int("num_key_value_heads");
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    t.bad("num_attention_heads", c.num_attention_heads,
          " is not a multiple of num_key_value_heads (", c.num_key_value_heads, ")");
  }
  c.head_dim = t.opt_pos_int("head_dim", c.hidden_size / c.num_attention_heads);
  if (c.head_dim <= 0) {
    t.bad("head_dim", "absent, and hidden_size / num_attention_heads = 0 cannot stand in for it");
  }
  c.attention_bias = t.opt_bool("attention_bias", false);
  // Qwen3.5 attention always gates its output; a config that turns the gate off describes a
  // different graph than the one tandem implements.
  if (!t.opt_bool("attn_output_gate", true)) {
    t.bad("attn_output_gate", "false is not supported (Qwen3.5 attention is output-gated)");
  }

  c.hidden_act = t.opt_string("hidden_act", "silu");
  if (c.hidden_act != "silu") {
    t.bad("hidden_act", "only silu is supported, got '", c.hidden_act, "'");
  }
  c.rms_norm_eps = t.opt_number("rms_norm_eps", 1e-6);
  if (!(c.rms_norm_eps > 0)) t.bad("rms_norm_eps", "must be positive, got ", c.rms_norm_eps);

  // RoPE: current transformers nests it in rope_parameters; older exports use rope_scaling (with
  // "type" for "rope_type") and keep rope_theta / partial_rotary_factor at the top level.
  const char* rope_key = t.has("rope_parameters") ? "rope_parameters" : "rope_scaling";
  const json* rope_obj = t.opt_object(rope_key);
  const json empty = json::object();
  const Fields r(rope_obj ? *rope_obj : empty, source_name, t.name(rope_key) + ".");
  const char* type_key = r.has("rope_type") ? "rope_type" : "type";
  const std::string rope_type = r.opt_string(type_key, "default");
  if (rope_type != "default") {
    r.bad(type_key, "unsupported rope type '", rope_type, "' (supported: default)");
  }
  const Fields& theta_src = r.has("rope_theta") ? r : t;
  c.rope_theta = theta_src.opt_number("rope_theta", c.rope_theta);
  if (!(c.rope_theta > 0)) theta_src.bad("rope_theta", "must be positive, got ", c.rope_theta);
  const Fields& prf_src = r.has("partial_rotary_factor") ? r : t;
  c.partial_rotary_factor = prf_src.opt_number("partial_rotary_factor", 0.25);
  if (!(c.partial_rotary_factor > 0 && c.partial_rotary_factor <= 1)) {
    prf_src.bad("partial_rotary_factor", "must be in (0, 1], got ", c.partial_rotary_factor);
  }
  // Python's int(): truncation toward zero.
  c.rotary_dim = static_cast<int64_t>(static_cast<double>(c.head_dim) * c.partial_rotary_factor);
  if (c.rotary_dim <= 0 || c.rotary_dim % 2 != 0 || c.rotary_dim > c.head_dim) {
    fail(source_name, ": rotary_dim = int(head_dim ", c.head_dim, " * partial_rotary_factor ",
         c.partial_rotary_factor, ") = ", c.rotary_dim, " must be even, positive and <= head_dim");
  }
  if (const json* ms = r.get("mrope_section")) {
    if (!ms->is_array()) r.bad("mrope_section", "expected a list of integers, got ", ms->dump());
    int64_t sum = 0;
    for (const json& x : *ms) {
      const int64_t v = r.as_int("mrope_section", x);
      if (v < 0) r.bad("mrope_section", "entries must be non-negative, got ", ms->dump());
      c.mrope_section.push_back(v);
      sum += v;
    }
    if (sum != c.rotary_dim / 2) {
      r.bad("mrope_section", ms->dump(), " sums to ", sum,
            ", expected rotary_dim / 2 = ", c.rotary_dim / 2);
    }
  }
  c.mrope_interleaved = r.opt_bool("mrope_interleaved", false);

  if (const json* lt = t.get("layer_types")) {
    if (!lt->is_array()) t.bad("layer_types", "expected a list of strings, got ", lt->dump());
    if (static_cast<int64_t>(lt->size()) != c.num_hidden_layers) {
      t.bad("layer_types", "has ", lt->size(), " entries, but num_hidden_layers is ",
            c.num_hidden_layers);
    }
    for (size_t i = 0; i < lt->size(); ++i) {
      const json& e = (*lt)[i];
      if (e == "linear_attention") {
        c.layer_types.push_back(LayerKind::LinearAttention);
      } else if (e == "full_attention") {
        c.layer_types.push_back(LayerKind::FullAttention);
      } else {
        t.bad("layer_types", "entry ", i, " is ", e.dump(),
              " (expected \"linear_attention\" or \"full_attention\")");
      }
    }
  } else {
    const int64_t interval = t.opt_pos_int("full_attention_interval", 4);
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      c.layer_types.push_back((i + 1) % interval == 0 ? LayerKind::FullAttention
                                                      : LayerKind::LinearAttention);
    }
  }

  // Gated DeltaNet sizes are required only when some layer uses them.
  const bool any_linear =
      std::count(c.layer_types.begin(), c.layer_types.end(), LayerKind::LinearAttention) > 0;
  auto linear_dim = [&](const char* key) {
    return any_linear ? t.req_pos_int(key) : t.opt_pos_int(key, 0);
  };
  c.linear_num_key_heads = linear_dim("linear_num_key_heads");
  c.linear_num_value_heads = linear_dim("linear_num_value_heads");
  c.linear_key_head_dim = linear_dim("linear_key_head_dim");
  c.linear_value_head_dim = linear_dim("linear_value_head_dim");
  c.linear_conv_kernel_dim = t.opt_pos_int("linear_conv_kernel_dim", 4);
  if (c.linear_num_key_heads > 0 && c.linear_num_value_heads % c.linear_num_key_heads != 0) {
    t.bad("linear_num_value_heads", c.linear_num_value_heads,
          " is not a multiple of linear_num_key_heads (", c.linear_num_key_heads, ")");
  }

  const json* mtp = t.get("mtp_num_hidden_layers");
  c.mtp_num_hidden_layers = mtp ? t.as_int("mtp_num_hidden_layers", *mtp) : 0;
  if (c.mtp_num_hidden_layers < 0) {
    t.bad("mtp_num_hidden_layers", "must be >= 0, got ", c.mtp_num_hidden_layers);
  }

  // The text config's value wins; the outer qwen3_5 config carries its own (default false).
  c.tie_word_embeddings = t.has("tie_word_embeddings")
                              ? t.opt_bool("tie_word_embeddings", false)
                              : outer.opt_bool("tie_word_embeddings", false);
  append_eos(t, &c.eos_token_ids);
  if (text_obj != &root) append_eos(outer, &c.eos_token_ids);
  return c;
}

Qwen35Config load_qwen35_config(const std::string& dir) {
  const std::filesystem::path d(dir);
  const std::string config_path = (d / "config.json").string();
  Qwen35Config c = parse_qwen35_config(read_text_file(config_path), config_path);
  config::append_generation_eos(dir, &c.eos_token_ids);
  return c;
}

}  // namespace tandem
