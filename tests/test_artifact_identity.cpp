// Artifact identity: which config fields count, content and name sensitivity, and the memo
// contract (in-process and on-disk, keyed by file metadata).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <xxhash.h>

#include <cstdlib>
#include <fstream>
#include <functional>
#include <optional>

#include "tandem/core/error.h"
#include "tandem/io/artifact_identity.h"
#include "test_util.h"

namespace tandem {
namespace {

using json = nlohmann::json;
using testing::ScratchDir;
using testing::write_text;

json text_config() {
  return json::parse(R"({
    "model_type": "qwen3_5_text", "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "mtp_num_hidden_layers": 1,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                        "partial_rotary_factor": 0.25},
    "max_position_embeddings": 4096, "eos_token_id": 2, "dtype": "bfloat16"
  })");
}

TEST(ConfigFingerprint, NestedAndFlatAgree) {
  json flat = text_config();
  flat["transformers_version"] = "4.57.0";
  json nested = {{"model_type", "qwen3_5"},
                 {"architectures", {"Qwen3_5ForConditionalGeneration"}},
                 {"text_config", text_config()},
                 {"vision_config", {{"depth", 2}}},
                 {"transformers_version", "5.0.0"}};
  const std::string fp = config_fingerprint(flat);
  EXPECT_EQ(fp.size(), 32u);
  EXPECT_EQ(fp.find_first_not_of("0123456789abcdef"), std::string::npos);
  EXPECT_EQ(config_fingerprint(nested), fp);
  // A text_config without its own model_type is read as qwen3_5_text, as the loader does.
  nested["text_config"].erase("model_type");
  EXPECT_EQ(config_fingerprint(nested), fp);
}

TEST(ConfigFingerprint, GraphFieldsCount) {
  const std::string fp = config_fingerprint(text_config());
  auto changed = [&](const std::function<void(json&)>& edit) {
    json c = text_config();
    edit(c);
    return config_fingerprint(c) != fp;
  };
  EXPECT_TRUE(changed([](json& c) { c["hidden_size"] = 128; }));
  EXPECT_TRUE(changed([](json& c) { c["vocab_size"] = 257; }));
  EXPECT_TRUE(changed([](json& c) { c["layer_types"][0] = "full_attention"; }));
  EXPECT_TRUE(changed([](json& c) { c["rope_parameters"]["rope_theta"] = 1000000; }));
  EXPECT_TRUE(changed([](json& c) { c["rms_norm_eps"] = 1e-5; }));
  EXPECT_TRUE(changed([](json& c) { c["tie_word_embeddings"] = true; }));
  EXPECT_TRUE(changed([](json& c) { c["mtp_num_hidden_layers"] = 0; }));
  EXPECT_TRUE(changed([](json& c) { c["quantization"] = {{"group_size", 64}, {"bits", 4}}; }));
}

TEST(ConfigFingerprint, NonGraphFieldsDoNot) {
  const std::string fp = config_fingerprint(text_config());
  json c = text_config();
  c["transformers_version"] = "9.9.9";
  c["dtype"] = "float32";
  c["torch_dtype"] = "float16";
  c["_name_or_path"] = "/somewhere/else";
  c["eos_token_id"] = {2, 3};
  c["max_position_embeddings"] = 262144;
  c["use_cache"] = false;
  c["head_dim"] = 16;  // same value, written again
  EXPECT_EQ(config_fingerprint(c), fp);
  c["tie_word_embeddings"] = nullptr;  // null is absent
  EXPECT_EQ(config_fingerprint(c), fp);
}

// Every identity test runs with its own cache directory, never the user's.
class ArtifactIdentity : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const char* old = std::getenv("TANDEM_CACHE_DIR")) saved_ = old;
    use_cache(cache_.str());
  }
  void TearDown() override {
    if (saved_)
      setenv("TANDEM_CACHE_DIR", saved_->c_str(), 1);
    else
      unsetenv("TANDEM_CACHE_DIR");
  }
  static void use_cache(const std::string& dir) { setenv("TANDEM_CACHE_DIR", dir.c_str(), 1); }
  std::string cache_file() const { return cache_.file("artifact-hashes.json"); }

  // Sets a file's mtime exactly (seconds, nanoseconds).
  static void set_mtime(const std::string& path, time_t sec, long nsec) {
    struct timespec ts[2];
    ts[0].tv_sec = sec;
    ts[0].tv_nsec = nsec;
    ts[1] = ts[0];
    ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), ts, 0), 0);
  }

  ScratchDir cache_{"idcache"};
  ScratchDir data_{"iddata"};
  std::optional<std::string> saved_;
};

TEST_F(ArtifactIdentity, ContentNameFingerprintAndOrderCount) {
  const std::string a = data_.file("model-00001.safetensors");
  const std::string b = data_.file("model-00002.safetensors");
  write_text(a, "first shard bytes");
  write_text(b, "second shard byte");
  const std::string id = artifact_identity("fp", {a, b});
  EXPECT_EQ(id.size(), 32u);
  EXPECT_EQ(artifact_identity("fp", {a, b}), id);
  EXPECT_NE(artifact_identity("fp2", {a, b}), id);
  EXPECT_NE(artifact_identity("fp", {b, a}), id);
  EXPECT_NE(artifact_identity("fp", {a}), id);

  // Same size, different bytes. An in-place rewrite can land in the same mtime tick, so the test
  // moves the mtime on explicitly, as any later write does.
  write_text(b, "second shard BYTE");
  set_mtime(b, 1700000000, 1);
  EXPECT_NE(artifact_identity("fp", {a, b}), id);

  // Same bytes under another name.
  const std::string c = data_.file("model-00003.safetensors");
  write_text(c, "first shard bytes");
  const std::string with_a = artifact_identity("fp", {a});
  EXPECT_NE(artifact_identity("fp", {c}), with_a);
  const std::string d = data_.file("sub/model-00001.safetensors");
  std::filesystem::create_directories(data_.path() / "sub");
  std::filesystem::copy_file(a, d);
  // The directory does not enter the identity, only the name and the content.
  EXPECT_EQ(artifact_identity("fp", {d}), with_a);
}

TEST_F(ArtifactIdentity, MemoizedByMetadata) {
  const std::string a = data_.file("w.safetensors");
  write_text(a, "0123456789");
  set_mtime(a, 1700000000, 123456789);
  const std::string id = artifact_identity("fp", {a});
  // The contract: content is hashed once per (path, size, mtime, inode). Bytes changed in place
  // with size and mtime preserved are not noticed — the same trade every build cache makes.
  write_text(a, "9876543210");
  set_mtime(a, 1700000000, 123456789);
  EXPECT_EQ(artifact_identity("fp", {a}), id);
  // Any metadata change rehashes.
  set_mtime(a, 1700000000, 123456790);
  EXPECT_NE(artifact_identity("fp", {a}), id);
}

TEST_F(ArtifactIdentity, DiskCacheIsWrittenAndRead) {
  const std::string content = "weights weights weights";
  const std::string a = data_.file("one/model.safetensors");
  std::filesystem::create_directories(data_.path() / "one");
  write_text(a, content);
  const std::string id = artifact_identity("fp", {a});

  // The cache file records the content hash under the absolute path.
  std::ifstream in(cache_file());
  ASSERT_TRUE(in.good());
  const json cache = json::parse(in);
  const std::string abs = std::filesystem::canonical(a).string();
  const XXH128_hash_t h = XXH3_128bits(content.data(), content.size());
  char hex[33];
  std::snprintf(hex, sizeof hex, "%016llx%016llx", static_cast<unsigned long long>(h.high64),
                static_cast<unsigned long long>(h.low64));
  EXPECT_EQ(cache["files"][abs]["xxh3_128"], hex);
  EXPECT_EQ(cache["files"][abs]["size"], content.size());

  // A restart (no in-process memo for this path) trusts the disk entry: plant a wrong hash for a
  // new file with the same name and bytes, and the identity follows the planted hash.
  const std::string b = data_.file("two/model.safetensors");
  std::filesystem::create_directories(data_.path() / "two");
  write_text(b, content);
  struct stat sb {};
  ASSERT_EQ(::stat(b.c_str(), &sb), 0);
  json planted = cache;
  planted["files"][std::filesystem::canonical(b).string()] = {
      {"size", content.size()},
      {"mtime_ns", static_cast<int64_t>(sb.st_mtim.tv_sec) * 1000000000 + sb.st_mtim.tv_nsec},
      {"inode", static_cast<uint64_t>(sb.st_ino)},
      {"xxh3_128", std::string(32, '0')}};
  write_text(cache_file(), planted.dump());
  EXPECT_NE(artifact_identity("fp", {b}), id);

  // A corrupt cache is ignored (the file is rehashed) and replaced by a valid one.
  write_text(cache_file(), "{not json");
  const std::string c = data_.file("three/model.safetensors");
  std::filesystem::create_directories(data_.path() / "three");
  write_text(c, content);
  EXPECT_EQ(artifact_identity("fp", {c}), id);
  std::ifstream again(cache_file());
  const json rewritten = json::parse(again);
  EXPECT_EQ(rewritten["files"][std::filesystem::canonical(c).string()]["xxh3_128"], hex);
}

TEST_F(ArtifactIdentity, UnwritableCacheStillHashes) {
  const std::string blocker = data_.file("blocker");
  write_text(blocker, "a file where the cache directory should go");
  use_cache(blocker + "/cache");
  const std::string a = data_.file("m.safetensors");
  write_text(a, "abc");
  const std::string id = artifact_identity("fp", {a});
  EXPECT_EQ(id.size(), 32u);
  EXPECT_FALSE(std::filesystem::exists(blocker + "/cache"));
}

TEST_F(ArtifactIdentity, MissingFileIsAnError) {
  EXPECT_THROW(artifact_identity("fp", {data_.file("absent.safetensors")}), Error);
  EXPECT_THROW(artifact_identity("fp", {data_.str()}), Error);  // a directory
}

}  // namespace
}  // namespace tandem
