#include "tandem/model/glm5_config.h"

#include <algorithm>
#include <filesystem>

#include "tandem/core/error.h"
#include "tandem/io/json_file.h"
#include "tandem/model/config_fields.h"

namespace tandem {

using config::Fields;
using config::json;

namespace {

// Which decoder layers are mixtures: transformers' mlp_layer_types ("dense" / "sparse" per
// layer) when given, else the published checkpoints' first_k_dense_replace (transformers'
// default when neither is given: the first three dense).
std::vector<bool> sparse_layers(const Fields& f, int64_t layers) {
  std::vector<bool> sparse(static_cast<size_t>(layers), true);
  if (const json* types = f.get("mlp_layer_types")) {
    if (!types->is_array() || static_cast<int64_t>(types->size()) != layers)
      f.bad("mlp_layer_types", "expected a list of ", layers, " entries, got ", types->dump());
    for (size_t i = 0; i < types->size(); ++i) {
      const json& t = (*types)[i];
      if (t != "dense" && t != "sparse")
        f.bad("mlp_layer_types", "entry ", i, " must be \"dense\" or \"sparse\", got ", t.dump());
      sparse[i] = t == "sparse";
    }
    return sparse;
  }
  const json* k = f.get("first_k_dense_replace");
  const int64_t dense = k ? f.as_int("first_k_dense_replace", *k) : std::min<int64_t>(3, layers);
  if (dense < 0 || dense > layers)
    f.bad("first_k_dense_replace", "must be in 0..", layers, ", got ", dense);
  for (int64_t i = 0; i < dense; ++i) sparse[static_cast<size_t>(i)] = false;
  return sparse;
}

// Which layers run the DSA indexer ("full") and which reuse the previous layer's choice
// ("shared"), as transformers derives them: indexer_types, else index_topk_pattern ("FSS..."),
// else every layer i with max(i - index_skip_topk_offset + 1, 0) % index_topk_freq == 0 runs it
// (freq 1 by default: all). Layer 0 has nothing to reuse and always runs it.
std::vector<bool> shared_index_layers(const Fields& f, int64_t layers) {
  std::vector<bool> shared(static_cast<size_t>(layers), false);
  auto from_list = [&](const char* key, const json& list) {
    if (static_cast<int64_t>(list.size()) != layers)
      f.bad(key, "expected ", layers, " entries, got ", list.size());
    for (size_t i = 0; i < list.size(); ++i) {
      const json& t = list[i];
      if (t == "full" || t == "F") continue;
      if (t != "shared" && t != "S")
        f.bad(key, "entry ", i, " must be \"full\" or \"shared\", got ", t.dump());
      shared[i] = true;
    }
  };
  if (const json* types = f.get("indexer_types")) {
    if (!types->is_array()) f.bad("indexer_types", "expected a list, got ", types->dump());
    from_list("indexer_types", *types);
  } else if (const json* pattern = f.get("index_topk_pattern")) {
    json list = json::array();
    if (pattern->is_string()) {
      for (char ch : pattern->get<std::string>()) list.push_back(std::string(1, ch));
    } else if (pattern->is_array()) {
      list = *pattern;
    } else {
      f.bad("index_topk_pattern", "expected a string or a list, got ", pattern->dump());
    }
    from_list("index_topk_pattern", list);
  } else {
    const int64_t freq = std::max<int64_t>(f.opt_pos_int("index_topk_freq", 1), 1);
    const json* off = f.get("index_skip_topk_offset");
    const int64_t offset = off ? f.as_int("index_skip_topk_offset", *off) : 2;
    for (int64_t i = 0; i < layers; ++i)
      shared[static_cast<size_t>(i)] = std::max<int64_t>(i - offset + 1, 0) % freq != 0;
  }
  if (layers > 0) shared[0] = false;
  return shared;
}

}  // namespace

Glm5Config parse_glm5_config(const std::string& json_text, const std::string& source_name) {
  const json root = config::parse_json(json_text, source_name);
  if (!root.is_object())
    fail(source_name, ": expected a JSON object at the top level, got ", root.type_name());
  const Fields f(root, source_name, "");
  Glm5Config c;
  c.model_type = f.opt_string("model_type", "");
  if (c.model_type != "glm_moe_dsa")
    fail("unsupported model_type '", c.model_type, "' in ", source_name, " (expected glm_moe_dsa)");
  c.vocab_size = f.req_pos_int("vocab_size");
  c.hidden_size = f.req_pos_int("hidden_size");
  c.intermediate_size = f.req_pos_int("intermediate_size");
  c.moe_intermediate_size = f.req_pos_int("moe_intermediate_size");
  c.num_hidden_layers = f.req_pos_int("num_hidden_layers");
  c.num_attention_heads = f.req_pos_int("num_attention_heads");
  c.num_key_value_heads = f.opt_pos_int("num_key_value_heads", c.num_attention_heads);
  if (const json* q = f.get("q_lora_rank"))
    c.q_lora_rank = f.positive("q_lora_rank", f.as_int("q_lora_rank", *q));
  c.kv_lora_rank = f.req_pos_int("kv_lora_rank");
  c.qk_nope_head_dim = f.req_pos_int("qk_nope_head_dim");
  c.qk_rope_head_dim = f.req_pos_int("qk_rope_head_dim");
  if (c.qk_rope_head_dim % 2 != 0)
    f.bad("qk_rope_head_dim", "rotary dimensions come in pairs, got ", c.qk_rope_head_dim);
  c.v_head_dim = f.req_pos_int("v_head_dim");

  c.n_routed_experts = f.req_pos_int("n_routed_experts");
  c.num_experts_per_tok = f.req_pos_int("num_experts_per_tok");
  c.n_shared_experts =
      f.has("n_shared_experts") ? f.as_int("n_shared_experts", f.require("n_shared_experts")) : 1;
  if (c.n_shared_experts < 0) f.bad("n_shared_experts", "must be >= 0, got ", c.n_shared_experts);
  c.n_group = f.opt_pos_int("n_group", 1);
  c.topk_group = f.opt_pos_int("topk_group", 1);
  if (c.n_routed_experts % c.n_group != 0)
    f.bad("n_group", c.n_routed_experts, " routed experts do not split into ", c.n_group,
          " groups");
  const int64_t per_group = c.n_routed_experts / c.n_group;
  if (c.n_group > 1 && per_group < 2)
    f.bad("n_group", "a group scores its best two experts; ", c.n_group, " groups of ", per_group,
          " expert");
  if (c.topk_group > c.n_group)
    f.bad("topk_group", c.topk_group, " exceeds n_group (", c.n_group, ")");
  if (c.num_experts_per_tok > c.topk_group * per_group)
    f.bad("num_experts_per_tok", c.num_experts_per_tok, " exceeds the ", c.topk_group * per_group,
          " experts of ", c.topk_group, " groups");
  c.routed_scaling_factor = f.opt_number("routed_scaling_factor", 1.0);
  if (!(c.routed_scaling_factor > 0))
    f.bad("routed_scaling_factor", "must be positive, got ", c.routed_scaling_factor);
  c.norm_topk_prob = f.opt_bool("norm_topk_prob", true);
  if (f.opt_string("topk_method", "noaux_tc") != "noaux_tc")
    f.bad("topk_method", "only noaux_tc routing is supported, got ",
          f.require("topk_method").dump());
  if (f.opt_string("scoring_func", "sigmoid") != "sigmoid")
    f.bad("scoring_func", "only sigmoid scores are supported, got ",
          f.require("scoring_func").dump());
  c.sparse_layers = sparse_layers(f, c.num_hidden_layers);

  c.index_topk = f.req_pos_int("index_topk");
  c.index_head_dim = f.req_pos_int("index_head_dim");
  c.index_n_heads = f.req_pos_int("index_n_heads");
  c.shared_index_layers = shared_index_layers(f, c.num_hidden_layers);
  c.indexer_rope_interleave = f.opt_bool("indexer_rope_interleave", true);
  if (c.q_lora_rank == 0)
    f.bad("q_lora_rank", "the DSA indexer reads the query LoRA's normed latent; a model without ",
          "one (q_lora_rank null) is not supported");
  if (c.index_head_dim < c.qk_rope_head_dim)
    f.bad("index_head_dim", c.index_head_dim, " is smaller than its rotary part (",
          c.qk_rope_head_dim, ")");

  c.rms_norm_eps = f.opt_number("rms_norm_eps", 1e-5);
  c.max_position_embeddings = f.opt_pos_int("max_position_embeddings", 202752);
  const json* rope = f.opt_object("rope_parameters");
  const json empty = json::object();
  const Fields r(rope ? *rope : empty, source_name, "rope_parameters.");
  c.rope_theta =
      r.has("rope_theta") ? r.opt_number("rope_theta", 0) : f.opt_number("rope_theta", 10000.0);
  if (!(c.rope_theta > 0)) fail(source_name, ": rope_theta must be positive, got ", c.rope_theta);
  const std::string rope_type = r.opt_string("rope_type", "default");
  if (rope_type != "default")
    r.bad("rope_type", "only \"default\" rotary embeddings are supported, got \"", rope_type, "\"");
  c.rope_interleave = f.opt_bool("rope_interleave", true);
  c.num_nextn_predict_layers =
      f.has("num_nextn_predict_layers")
          ? f.as_int("num_nextn_predict_layers", f.require("num_nextn_predict_layers"))
          : 0;
  if (c.num_nextn_predict_layers < 0)
    f.bad("num_nextn_predict_layers", "must be >= 0, got ", c.num_nextn_predict_layers);
  c.tie_word_embeddings = f.opt_bool("tie_word_embeddings", false);
  config::append_eos(f, &c.eos_token_ids);

  if (const json* q = f.opt_object("quantization_config")) {
    const Fields qf(*q, source_name, "quantization_config.");
    const std::string method = qf.opt_string("quant_method", "");
    if (method != "fp8")
      qf.bad("quant_method", "only the published fp8 block quantization is supported, got \"",
             method, "\"");
    const std::string fmt = qf.opt_string("fmt", "e4m3");
    if (fmt != "e4m3") qf.bad("fmt", "only e4m3 fp8 weights are supported, got \"", fmt, "\"");
    const json& block = qf.require("weight_block_size");
    if (!block.is_array() || block.size() != 2)
      qf.bad("weight_block_size", "expected [rows, cols], got ", block.dump());
    c.fp8_block_rows = qf.positive("weight_block_size", qf.as_int("weight_block_size", block[0]));
    c.fp8_block_cols = qf.positive("weight_block_size", qf.as_int("weight_block_size", block[1]));
  }
  return c;
}

Glm5Config load_glm5_config(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / "config.json").string();
  Glm5Config c = parse_glm5_config(read_text_file(path), path);
  config::append_generation_eos(dir, &c.eos_token_ids);
  return c;
}

}  // namespace tandem
