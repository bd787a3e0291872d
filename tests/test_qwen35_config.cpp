#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "tandem/core/error.h"
#include "tandem/model/qwen3_5_config.h"
#include "test_util.h"

namespace tandem {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

#define EXPECT_HAS(haystack, needle) \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << "in: " << (haystack)

constexpr const char* kSrc = "/models/q/config.json";

// The shape of a published Qwen3.5 checkpoint's config.json (small layer count).
json nested_config() {
  return json::parse(R"({
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "image_token_id": 248056,
    "tie_word_embeddings": false,
    "text_config": {
      "model_type": "qwen3_5_text",
      "vocab_size": 248320,
      "hidden_size": 1024,
      "intermediate_size": 3584,
      "num_hidden_layers": 8,
      "num_attention_heads": 8,
      "num_key_value_heads": 2,
      "head_dim": 256,
      "hidden_act": "silu",
      "max_position_embeddings": 262144,
      "rms_norm_eps": 1e-06,
      "attention_bias": false,
      "attn_output_gate": true,
      "linear_conv_kernel_dim": 4,
      "linear_key_head_dim": 128,
      "linear_value_head_dim": 128,
      "linear_num_key_heads": 16,
      "linear_num_value_heads": 32,
      "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention",
                      "linear_attention", "linear_attention", "linear_attention", "full_attention"],
      "full_attention_interval": 4,
      "mtp_num_hidden_layers": 1,
      "tie_word_embeddings": true,
      "eos_token_id": 248044,
      "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                          "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                          "mrope_interleaved": true}
    },
    "vision_config": {"depth": 12, "hidden_size": 768}
  })");
}

// The same model as a flat text-only export with the older top-level rope fields.
json flat_config() {
  json t = nested_config()["text_config"];
  t.erase("rope_parameters");
  t["rope_theta"] = 5000000.0;
  t["partial_rotary_factor"] = 0.5;
  return t;
}

Qwen35Config parse(const json& j) {
  return parse_qwen35_config(j.dump(), kSrc);
}

std::string parse_error(const json& j) {
  try {
    parse(j);
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no error for " << j.dump();
  return "";
}

std::vector<LayerKind> pattern(int n, int interval) {
  std::vector<LayerKind> v;
  for (int i = 0; i < n; ++i) {
    v.push_back((i + 1) % interval == 0 ? LayerKind::FullAttention : LayerKind::LinearAttention);
  }
  return v;
}

TEST(Qwen35Config, Nested) {
  const Qwen35Config c = parse(nested_config());
  EXPECT_EQ(c.model_type, "qwen3_5");
  EXPECT_EQ(c.vocab_size, 248320);
  EXPECT_EQ(c.hidden_size, 1024);
  EXPECT_EQ(c.intermediate_size, 3584);
  EXPECT_EQ(c.num_hidden_layers, 8);
  EXPECT_EQ(c.num_attention_heads, 8);
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_EQ(c.rope_theta, 1e7);
  EXPECT_EQ(c.partial_rotary_factor, 0.25);
  EXPECT_EQ(c.rotary_dim, 64);
  EXPECT_EQ(c.mrope_section, (std::vector<int64_t>{11, 11, 10}));
  EXPECT_TRUE(c.mrope_interleaved);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_EQ(c.linear_num_key_heads, 16);
  EXPECT_EQ(c.linear_num_value_heads, 32);
  EXPECT_EQ(c.linear_key_head_dim, 128);
  EXPECT_EQ(c.linear_value_head_dim, 128);
  EXPECT_EQ(c.linear_conv_kernel_dim, 4);
  EXPECT_EQ(c.linear_conv_dim(), 2 * 16 * 128 + 32 * 128);
  EXPECT_EQ(c.layer_types, pattern(8, 4));
  EXPECT_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.hidden_act, "silu");
  EXPECT_TRUE(c.tie_word_embeddings);  // text_config wins over the outer false
  EXPECT_EQ(c.max_position_embeddings, 262144);
  EXPECT_EQ(c.mtp_num_hidden_layers, 1);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{248044});
}

TEST(Qwen35Config, FlatWithLegacyRope) {
  const Qwen35Config c = parse(flat_config());
  EXPECT_EQ(c.model_type, "qwen3_5_text");
  EXPECT_EQ(c.hidden_size, 1024);
  EXPECT_EQ(c.rope_theta, 5e6);
  EXPECT_EQ(c.partial_rotary_factor, 0.5);
  EXPECT_EQ(c.rotary_dim, 128);
  EXPECT_TRUE(c.mrope_section.empty());
  EXPECT_TRUE(c.tie_word_embeddings);
}

TEST(Qwen35Config, DefaultsAndDerivations) {
  json j = flat_config();
  for (const char* k :
       {"head_dim", "layer_types", "full_attention_interval", "rms_norm_eps", "hidden_act",
        "attention_bias", "linear_conv_kernel_dim", "mtp_num_hidden_layers", "tie_word_embeddings",
        "eos_token_id", "rope_theta", "partial_rotary_factor"}) {
    j.erase(k);
  }
  j["num_hidden_layers"] = 6;
  Qwen35Config c = parse(j);
  EXPECT_EQ(c.head_dim, 1024 / 8);
  EXPECT_EQ(c.layer_types, pattern(6, 4));
  EXPECT_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.rope_theta, 1e7);
  EXPECT_EQ(c.partial_rotary_factor, 0.25);
  EXPECT_EQ(c.rotary_dim, 32);
  EXPECT_EQ(c.linear_conv_kernel_dim, 4);
  EXPECT_EQ(c.mtp_num_hidden_layers, 0);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_TRUE(c.eos_token_ids.empty());

  j["full_attention_interval"] = 2;
  j["head_dim"] = nullptr;  // null counts as absent
  c = parse(j);
  EXPECT_EQ(c.layer_types, pattern(6, 2));
  EXPECT_EQ(c.head_dim, 128);

  // Without linear layers the DeltaNet sizes are optional.
  j["full_attention_interval"] = 1;
  for (const char* k : {"linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                        "linear_num_value_heads"}) {
    j.erase(k);
  }
  c = parse(j);
  EXPECT_EQ(c.layer_types, pattern(6, 1));
  EXPECT_EQ(c.linear_num_key_heads, 0);
}

TEST(Qwen35Config, TieAndEosFromOuterConfig) {
  json j = nested_config();
  j["text_config"].erase("tie_word_embeddings");
  j["tie_word_embeddings"] = true;
  j["eos_token_id"] = {248046, 248044};
  const Qwen35Config c = parse(j);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{248044, 248046}));  // text first, deduped
}

TEST(Qwen35Config, RopeScalingLegacyObject) {
  json j = flat_config();
  j["rope_scaling"] = {{"type", "yarn"}, {"factor", 4.0}};
  std::string msg = parse_error(j);
  EXPECT_HAS(msg, "rope_scaling.type: unsupported rope type 'yarn' (supported: default)");
  j["rope_scaling"] = nullptr;
  EXPECT_EQ(parse(j).rope_theta, 5e6);
}

TEST(Qwen35Config, LoadWithGenerationConfig) {
  const testing::ScratchDir scratch("cfg");
  const fs::path& dir = scratch.path();
  std::ofstream(dir / "config.json") << nested_config().dump(2);
  Qwen35Config c = load_qwen35_config(dir.string());
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{248044});

  std::ofstream(dir / "generation_config.json") << R"({"eos_token_id": [248046, 248044, 7]})";
  c = load_qwen35_config(dir.string());
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{248044, 248046, 7}));

  std::ofstream(dir / "generation_config.json") << R"({"eos_token_id": 9})";
  EXPECT_EQ(load_qwen35_config(dir.string()).eos_token_ids, (std::vector<int64_t>{248044, 9}));

  std::ofstream(dir / "generation_config.json") << R"({"eos_token_id": "x"})";
  try {
    load_qwen35_config(dir.string());
    ADD_FAILURE() << "no throw";
  } catch (const Error& e) {
    EXPECT_HAS(e.what(), (dir / "generation_config.json").string());
    EXPECT_HAS(e.what(), "eos_token_id: expected an integer");
  }
  std::ofstream(dir / "generation_config.json") << "{";
  try {
    load_qwen35_config(dir.string());
    ADD_FAILURE() << "no throw";
  } catch (const Error& e) {
    EXPECT_HAS(e.what(), (dir / "generation_config.json").string() + ": not valid JSON");
  }

  fs::remove(dir / "config.json");
  try {
    load_qwen35_config(dir.string());
    ADD_FAILURE() << "no throw";
  } catch (const Error& e) {
    EXPECT_HAS(e.what(), "cannot read " + (dir / "config.json").string());
  }
}

TEST(Qwen35Config, MalformedJson) {
  try {
    parse_qwen35_config("{\"model_type\": ", kSrc);
    ADD_FAILURE() << "no throw";
  } catch (const Error& e) {
    EXPECT_HAS(e.what(), std::string(kSrc) + ": not valid JSON: ");
    EXPECT_HAS(e.what(), "parse error");
  }
  EXPECT_HAS(parse_error(json::array()), "expected a JSON object at the top level, got array");
}

TEST(Qwen35Config, ModelTypeErrors) {
  json j = nested_config();
  j["model_type"] = "glm_moe_dsa";
  EXPECT_HAS(parse_error(j), std::string("unsupported model_type 'glm_moe_dsa' in ") + kSrc +
                                 " (expected qwen3_5, qwen3_5_text, qwen3_5_moe or "
                                 "qwen3_5_moe_text)");
  // A MoE outer config around a dense text config is another model.
  j["model_type"] = "qwen3_5_moe";
  EXPECT_HAS(parse_error(j), "text_config.model_type: unsupported text model 'qwen3_5_text' "
                             "(expected qwen3_5_moe_text)");
  j.erase("model_type");
  EXPECT_HAS(parse_error(j), "missing required field model_type");

  j = nested_config();
  j["text_config"]["model_type"] = "llama";
  EXPECT_HAS(parse_error(j), "text_config.model_type: unsupported text model 'llama'");

  j = nested_config();
  j.erase("text_config");
  EXPECT_HAS(parse_error(j), "needs a text_config object");
  j["text_config"] = 5;
  EXPECT_HAS(parse_error(j), "text_config: expected an object, got 5");
}

struct Case {
  const char* field;  // set in text_config (nested form)
  json value;         // nullptr = erase the field
  const char* expect;
};

TEST(Qwen35Config, ValidationErrors) {
  const Case cases[] = {
      {"hidden_size", nullptr, "missing required field text_config.hidden_size"},
      {"vocab_size", "248320", "text_config.vocab_size: expected an integer, got \"248320\""},
      {"intermediate_size", 3584.5, "text_config.intermediate_size: expected an integer"},
      {"num_hidden_layers", 0, "text_config.num_hidden_layers: must be positive, got 0"},
      {"num_attention_heads", -8, "text_config.num_attention_heads: must be positive, got -8"},
      {"num_key_value_heads", 3,
       "text_config.num_attention_heads: 8 is not a multiple of num_key_value_heads (3)"},
      {"linear_num_value_heads", 24,
       "text_config.linear_num_value_heads: 24 is not a multiple of linear_num_key_heads (16)"},
      {"linear_key_head_dim", nullptr, "missing required field text_config.linear_key_head_dim"},
      {"linear_conv_kernel_dim", 0, "text_config.linear_conv_kernel_dim: must be positive"},
      {"layer_types", json::array({"full_attention"}),
       "text_config.layer_types: has 1 entries, but num_hidden_layers is 8"},
      {"layer_types", json(std::vector<std::string>(8, "sliding_attention")),
       "text_config.layer_types: entry 0 is \"sliding_attention\" (expected \"linear_attention\""},
      {"layer_types", "full", "text_config.layer_types: expected a list of strings"},
      {"hidden_act", "gelu", "text_config.hidden_act: only silu is supported, got 'gelu'"},
      {"head_dim", 12,
       "rotary_dim = int(head_dim 12 * partial_rotary_factor 0.25) = 3 must be even"},
      {"rms_norm_eps", "1e-6", "text_config.rms_norm_eps: expected a number"},
      {"attention_bias", 0, "text_config.attention_bias: expected true or false, got 0"},
      {"attn_output_gate", false, "text_config.attn_output_gate: false is not supported"},
      {"tie_word_embeddings", "yes", "text_config.tie_word_embeddings: expected true or false"},
      {"mtp_num_hidden_layers", -1, "text_config.mtp_num_hidden_layers: must be >= 0, got -1"},
      {"eos_token_id", json::array({1, "2"}), "text_config.eos_token_id: expected an integer"},
      {"eos_token_id", -5, "text_config.eos_token_id: token ids must be non-negative"},
      {"rope_parameters", 3, "text_config.rope_parameters: expected an object, got 3"},
      {"max_position_embeddings", nullptr,
       "missing required field text_config.max_position_embeddings"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(c.field) + " = " + c.value.dump());
    json j = nested_config();
    if (c.value.is_null()) {
      j["text_config"].erase(c.field);
    } else {
      j["text_config"][c.field] = c.value;
    }
    const std::string msg = parse_error(j);
    EXPECT_HAS(msg, kSrc);
    EXPECT_HAS(msg, c.expect);
  }
}

TEST(Qwen35Config, RopeErrors) {
  const Case cases[] = {
      {"rope_type", "yarn",
       "text_config.rope_parameters.rope_type: unsupported rope type 'yarn' (supported: default)"},
      {"rope_theta", "big", "text_config.rope_parameters.rope_theta: expected a number"},
      {"rope_theta", 0, "text_config.rope_parameters.rope_theta: must be positive, got 0"},
      {"partial_rotary_factor", 1.5,
       "rope_parameters.partial_rotary_factor: must be in (0, 1], got 1.5"},
      {"partial_rotary_factor", 0, "partial_rotary_factor: must be in (0, 1], got 0"},
      {"mrope_section", json::array({11, 11, 11}),
       "text_config.rope_parameters.mrope_section: [11,11,11] sums to 33, expected rotary_dim / "
       "2 = 32"},
      {"mrope_section", 32, "mrope_section: expected a list of integers"},
      {"mrope_interleaved", "yes", "mrope_interleaved: expected true or false"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(c.field) + " = " + c.value.dump());
    json j = nested_config();
    j["text_config"]["rope_parameters"][c.field] = c.value;
    const std::string msg = parse_error(j);
    EXPECT_HAS(msg, kSrc);
    EXPECT_HAS(msg, c.expect);
  }
}

}  // namespace
}  // namespace tandem
