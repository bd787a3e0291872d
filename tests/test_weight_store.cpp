#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "tandem/core/error.h"
#include "tandem/io/weight_store.h"
#include "test_util.h"

namespace tandem {
namespace {

namespace fs = std::filesystem;
using testing::ScratchDir;
using testing::write_text;

#define EXPECT_HAS(haystack, needle) \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << "in: " << (haystack)

// Writes one F32 tensor per name, each of `n` elements filled with its index in `names` + 1.
void write_f32s(const std::string& path, const std::vector<std::string>& names, int64_t n = 4) {
  std::vector<std::vector<float>> data;
  for (size_t i = 0; i < names.size(); ++i) data.emplace_back(n, static_cast<float>(i + 1));
  std::vector<TensorToWrite> t;
  for (size_t i = 0; i < names.size(); ++i) {
    t.push_back({names[i], DType::F32, {n}, std::as_bytes(std::span<const float>(data[i]))});
  }
  write_safetensors(path, t);
}

std::string open_error(const std::string& dir) {
  try {
    WeightStore::open(dir);
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "opening " << dir << " did not throw";
  return "";
}

TEST(WeightStore, SingleFile) {
  ScratchDir tmp("ws");
  write_f32s(tmp.file("model.safetensors"),
             {"model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight",
              "model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.up_proj.weight",
              "lm_head.weight"});
  WeightStore ws = WeightStore::open(tmp.str());
  EXPECT_EQ(ws.dir(), tmp.str());
  EXPECT_EQ(ws.size(), 5u);
  EXPECT_EQ(ws.total_bytes(), 5u * 16);
  EXPECT_EQ(ws.files(), std::vector<std::string>{tmp.file("model.safetensors")});
  EXPECT_EQ(ws.names().front(), "lm_head.weight");  // sorted
  EXPECT_EQ(ws.names_with_prefix("model.layers.0."),
            (std::vector<std::string>{"model.layers.0.mlp.down_proj.weight",
                                      "model.layers.0.mlp.up_proj.weight"}));
  EXPECT_TRUE(ws.names_with_prefix("vision.").empty());
  EXPECT_EQ(to_f32(ws.get("lm_head.weight")), std::vector<float>(4, 5.0f));
  EXPECT_EQ(ws.find("nope"), nullptr);
}

TEST(WeightStore, NotFoundSuggestsNames) {
  ScratchDir tmp("ws");
  write_f32s(tmp.file("model.safetensors"),
             {"model.language_model.layers.0.mlp.up_proj.weight", "model.norm.weight"});
  WeightStore ws = WeightStore::open(tmp.str(), /*prefault=*/false);
  try {
    ws.get("model.layers.0.mlp.up_proj.weight");
    ADD_FAILURE() << "no throw";
  } catch (const Error& e) {
    EXPECT_HAS(e.what(), "tensor 'model.layers.0.mlp.up_proj.weight' not found in " + tmp.str());
    EXPECT_HAS(e.what(), "(2 tensors; did you mean 'model.language_model.layers.0.mlp.up_proj");
  }
  try {
    ws.get("zzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzz");
    ADD_FAILURE() << "no throw";
  } catch (const Error& e) {
    EXPECT_HAS(e.what(), "(2 tensors)");
  }
}

TEST(WeightStore, MovesAndCopiesKeepViewsValid) {
  ScratchDir tmp("ws");
  write_f32s(tmp.file("model.safetensors"), {"a", "b"});
  const TensorView* view = nullptr;
  WeightStore copy;
  {
    WeightStore ws = WeightStore::open(tmp.str());
    view = &ws.get("b");
    WeightStore moved = std::move(ws);
    EXPECT_EQ(&moved.get("b"), view);
    copy = moved;
  }
  EXPECT_EQ(&copy.get("b"), view);
  EXPECT_EQ(to_f32(*view), std::vector<float>(4, 2.0f));
}

TEST(WeightStore, ShardedWithIndex) {
  ScratchDir tmp("ws");
  write_f32s(tmp.file("model-00001-of-00002.safetensors"), {"a", "b"});
  write_f32s(tmp.file("model-00002-of-00002.safetensors"), {"c"}, 8);
  write_text(tmp.file("model.safetensors.index.json"), R"({
    "metadata": {"total_size": 64},
    "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
                   "c": "model-00002-of-00002.safetensors"}})");
  WeightStore ws = WeightStore::open(tmp.str());
  EXPECT_EQ(ws.names(), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_EQ(ws.total_bytes(), 16u + 16 + 32);
  EXPECT_EQ(ws.files(), (std::vector<std::string>{tmp.file("model-00001-of-00002.safetensors"),
                                                  tmp.file("model-00002-of-00002.safetensors")}));
  EXPECT_EQ(ws.get("c").shape, std::vector<int64_t>{8});
}

TEST(WeightStore, IndexErrors) {
  ScratchDir tmp("ws");
  write_f32s(tmp.file("s1.safetensors"), {"a", "b"});
  const std::string idx = tmp.file("model.safetensors.index.json");

  write_text(idx, R"({"weight_map": {"a": "s1.safetensors", "x": "s2.safetensors"}})");
  std::string msg = open_error(tmp.str());
  EXPECT_HAS(msg, idx);
  EXPECT_HAS(msg, "shard 's2.safetensors' (holding tensor 'x') does not exist");

  write_text(idx, R"({"weight_map": {"a": "s1.safetensors", "q": "s1.safetensors"}})");
  msg = open_error(tmp.str());
  EXPECT_HAS(msg, idx);
  EXPECT_HAS(msg, "maps tensor 'q' to " + tmp.file("s1.safetensors") + ", which has no such");

  write_text(idx, R"({"weight_map": {"a": "../s1.safetensors"}})");
  EXPECT_HAS(open_error(tmp.str()), "must be a file name relative to the model directory");

  write_text(idx, R"({"weight_map": {"a": 3}})");
  EXPECT_HAS(open_error(tmp.str()), "weight_map['a'] must be a shard file name");

  write_text(idx, R"({"metadata": {}})");
  EXPECT_HAS(open_error(tmp.str()), "missing 'weight_map'");

  write_text(idx, R"({"weight_map": )");
  msg = open_error(tmp.str());
  EXPECT_HAS(msg, idx);
  EXPECT_HAS(msg, "not valid JSON");

  // A name in two shards is ambiguous even if the index picks one.
  write_f32s(tmp.file("s2.safetensors"), {"b"});
  write_text(idx, R"({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}})");
  msg = open_error(tmp.str());
  EXPECT_HAS(msg, "tensor 'b' appears in both");

  // A bad shard reports the shard file.
  write_text(tmp.file("s2.safetensors"), "garbage!!");
  msg = open_error(tmp.str());
  EXPECT_HAS(msg, tmp.file("s2.safetensors"));
}

TEST(WeightStore, DirectoryDiscovery) {
  ScratchDir tmp("ws");
  EXPECT_HAS(open_error(tmp.file("missing")), "does not exist");

  std::string msg = open_error(tmp.str());
  EXPECT_HAS(msg, "no weights in " + tmp.str());

  write_f32s(tmp.file("consolidated.safetensors"), {"only"});
  WeightStore ws = WeightStore::open(tmp.str());
  EXPECT_EQ(ws.names(), std::vector<std::string>{"only"});

  write_f32s(tmp.file("other.safetensors"), {"x"});
  msg = open_error(tmp.str());
  EXPECT_HAS(msg, "2 *.safetensors files (consolidated.safetensors, other.safetensors)");

  // model.safetensors takes precedence over everything else.
  write_f32s(tmp.file("model.safetensors"), {"main"});
  EXPECT_EQ(WeightStore::open(tmp.str()).names(), std::vector<std::string>{"main"});

  write_text(tmp.file("model.safetensors"), "");
  msg = open_error(tmp.str());
  EXPECT_HAS(msg, tmp.file("model.safetensors"));
  EXPECT_HAS(msg, "too short");
}

TEST(WeightStore, PrefaultManyChunks) {
  // Larger than one prefault chunk (64 MB) so several threads share the work; stays quiet below
  // the 256 MB progress threshold.
  ScratchDir tmp("ws");
  write_f32s(tmp.file("model.safetensors"), {"big", "small"}, (40 << 20) / 4);
  ::testing::internal::CaptureStderr();
  WeightStore ws = WeightStore::open(tmp.str(), /*prefault=*/true);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  EXPECT_EQ(ws.total_bytes(), 2u * (40 << 20));
}

}  // namespace
}  // namespace tandem
