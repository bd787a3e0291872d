// The prefix cache's disk tier (engine/prefix_disk.h): files that round-trip a boundary exactly,
// a restarted engine that finds them and gets a cold engine's tokens, and every file that cannot
// be trusted (corrupt, truncated, foreign, written under another target identity) treated as a
// miss and removed.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include "demo_model.h"
#include "recording_sink.h"
#include "tandem/engine/batch_engine.h"
#include "tandem/engine/prefix_disk.h"
#include "tandem/spec/qwen_mtp_split.h"
#include "test_util.h"

namespace tandem {
namespace {

namespace fs = std::filesystem;

test::DemoModel& demo() {
  static test::DemoModel* f = test::load_demo_model().release();
  return *f;
}

const PrefixDiskKey kKey{"target-a", "tok-1", "kv=bf16 block=16 test", DType::BF16};

// n bf16 KV elements of value x, as the KV stores them.
std::vector<std::byte> bf16_elements(size_t n, float x) {
  std::vector<std::byte> out(2 * n);
  const uint16_t h = f32_to_bf16(x);
  for (size_t i = 0; i < n; ++i) std::memcpy(out.data() + 2 * i, &h, 2);
  return out;
}

PrefixRecord sample_record(size_t tokens) {
  PrefixRecord r;
  for (size_t i = 0; i < tokens; ++i) r.tokens.push_back(static_cast<int32_t>(7 * i + 3));
  r.kv_dtype = DType::BF16;
  r.keys = {bf16_elements(tokens * 4, 1.5f), bf16_elements(tokens * 4, -2.0f)};
  r.values = {bf16_elements(tokens * 4, 0.25f), bf16_elements(tokens * 4, 3.0f)};
  r.linear = {1, 2, 3, 4, 5};
  auto c = std::make_shared<spec::Checkpoint>();
  c->processed_tokens = static_cast<int64_t>(tokens);
  c->schema = "qwen-mtp-v1";
  c->ns = "mtp-ns";
  c->metadata = {{"hidden_size", 8}};
  c->tensors["h_true"] = spec::CheckpointTensor{{2, 2}, {0.5f, 1.5f, 2.5f, 3.5f}};
  c->tokens = {9, 8, 7};
  r.draft = c;
  return r;
}

std::vector<fs::path> files_in(const std::string& dir) {
  std::vector<fs::path> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path());
  return out;
}

TEST(PrefixDisk, RecordsRoundTripAndARestartFindsThem) {
  const testing::ScratchDir dir_scratch("roundtrip");
  const std::string dir = dir_scratch.file("cache");
  int64_t written = 0;
  {
    PrefixDisk disk(dir, kKey);
    EXPECT_EQ(disk.files(), 0);
    ASSERT_TRUE(disk.write(sample_record(20)));
    ASSERT_TRUE(disk.write(sample_record(32)));
    written = disk.bytes();
  }
  PrefixDisk disk(dir, kKey);  // a restart: found by their headers
  EXPECT_EQ(disk.files(), 2);
  int64_t on_disk = 0;
  for (const auto& f : fs::directory_iterator(dir)) on_disk += static_cast<int64_t>(f.file_size());
  EXPECT_EQ(disk.bytes(), on_disk);
  EXPECT_EQ(written, on_disk);
  std::vector<int32_t> prompt = sample_record(40).tokens;
  const auto found = disk.find(prompt, 0);
  EXPECT_EQ(found.tokens, 32);
  EXPECT_EQ(disk.find(prompt, 32).tokens, 0);  // nothing longer than what memory has
  EXPECT_EQ(disk.find(std::span(prompt).first(32), 0).tokens, 20);  // leaves one token
  const auto r = disk.read(found.path);
  ASSERT_TRUE(r.has_value());
  const PrefixRecord want = sample_record(32);
  EXPECT_EQ(r->tokens, want.tokens);
  EXPECT_EQ(r->keys, want.keys);
  EXPECT_EQ(r->values, want.values);
  EXPECT_EQ(r->linear, want.linear);
  ASSERT_TRUE(r->draft);
  EXPECT_EQ(r->draft->processed_tokens, 32);
  EXPECT_EQ(r->draft->schema, "qwen-mtp-v1");
  EXPECT_EQ(r->draft->ns, "mtp-ns");
  EXPECT_EQ(r->draft->metadata, want.draft->metadata);
  EXPECT_EQ(r->draft->tensors.at("h_true").shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(r->draft->tensors.at("h_true").data, want.draft->tensors.at("h_true").data);
  EXPECT_EQ(r->draft->tokens, want.draft->tokens);
}

TEST(PrefixDisk, CorruptTruncatedAndForeignFilesAreMissesAndRemoved) {
  const testing::ScratchDir dir_scratch("corrupt");
  const std::string dir = dir_scratch.file("cache");
  std::string path;
  {
    PrefixDisk disk(dir, kKey);
    ASSERT_TRUE(disk.write(sample_record(20)));
    path = disk.find(sample_record(21).tokens, 0).path;
  }
  // A flipped byte near the end (inside a section): found by its header, refused when read.
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-3, std::ios::end);
    f.put('\x7f');
  }
  {
    PrefixDisk disk(dir, kKey);  // the header scan checks the token section only
    const auto found = disk.find(sample_record(21).tokens, 0);
    if (found.tokens > 0) {
      EXPECT_FALSE(disk.read(found.path).has_value());
      EXPECT_EQ(disk.files(), 0);
    }
    EXPECT_FALSE(fs::exists(path)) << "a corrupt file is removed";
  }
  // Truncated, another target's, garbage: all removed by the scan; other files are left alone.
  {
    PrefixDisk disk(dir, kKey);
    ASSERT_TRUE(disk.write(sample_record(20)));
    ASSERT_TRUE(disk.write(sample_record(24)));
  }
  // Written elsewhere under another target identity (e.g. the same config with one weight byte
  // changed), then copied in: a folder serves one model, another's files are removed.
  PrefixDiskKey other = kKey;
  other.target_identity = "target-b";
  const testing::ScratchDir elsewhere_scratch("corrupt_other");
  const std::string elsewhere = elsewhere_scratch.file("cache");
  {
    PrefixDisk disk(elsewhere, other);
    ASSERT_TRUE(disk.write(sample_record(28)));
  }
  for (const auto& f : files_in(elsewhere)) fs::copy_file(f, fs::path(dir) / f.filename());
  const auto files = files_in(dir);
  ASSERT_EQ(files.size(), 3u);
  for (const auto& f : files)
    if (f.filename().string().find("-24.tpc") != std::string::npos)
      fs::resize_file(f, fs::file_size(f) / 2);
  std::ofstream(fs::path(dir) / "garbage.tpc") << "not a prefix";
  std::ofstream(fs::path(dir) / "notes.txt") << "someone else's";
  PrefixDisk disk(dir, kKey);
  EXPECT_EQ(disk.files(), 1);  // the 20-token file
  EXPECT_EQ(disk.removed(), 3);
  EXPECT_EQ(disk.find(sample_record(40).tokens, 0).tokens, 20);
  EXPECT_TRUE(fs::exists(fs::path(dir) / "notes.txt"));
  EXPECT_EQ(files_in(dir).size(), 2u);
}

TEST(PrefixDisk, ConcurrentWritersLeaveWholeFiles) {
  const testing::ScratchDir dir_scratch("writers");
  const std::string dir = dir_scratch.file("cache");
  std::vector<std::thread> writers;
  for (int w = 0; w < 4; ++w)
    writers.emplace_back([&] {
      PrefixDisk disk(dir, kKey);
      for (int i = 0; i < 10; ++i) EXPECT_TRUE(disk.write(sample_record(16 + (i % 2) * 16)));
    });
  for (auto& t : writers) t.join();
  PrefixDisk disk(dir, kKey);
  EXPECT_EQ(disk.files(), 2);
  EXPECT_EQ(disk.removed(), 0);
  EXPECT_EQ(files_in(dir).size(), 2u) << "no temporary file is left behind";
  const auto found = disk.find(sample_record(40).tokens, 0);
  ASSERT_EQ(found.tokens, 32);
  EXPECT_TRUE(disk.read(found.path).has_value());
}

// --- A restarted engine ------------------------------------------------------------------------

std::vector<int32_t> sample_tokens(size_t n) {
  std::ifstream in(test::kDemoDir + "/heldout_sample.py");
  std::stringstream ss;
  ss << in.rdbuf();
  auto ids = demo().tok->encode(ss.str());
  ids.resize(n);
  return ids;
}

RequestOutcome serve(BatchEngine& engine, const std::vector<int32_t>& prompt, float temperature,
                     std::vector<int32_t>* tokens) {
  GenerateRequest r;
  r.prompt = prompt;
  r.sampling.temperature = temperature;
  r.sampling.top_p = temperature > 0 ? 0.9f : 1.0f;
  r.sampling.seed = 3;
  r.max_tokens = 12;
  return test::serve_alone(engine, r, tokens);
}

EngineOptions disk_options(const std::string& dir, bool persist) {
  EngineOptions o;
  o.spec.depth = 3;
  o.spec.prefill_chunk = 64;
  o.max_rows = 4;
  o.kv_blocks = 200;
  o.prefix_cache_bytes = size_t{1} << 30;
  o.prefix_cache_dir = dir;
  o.tokenizer_hash = "demo-tokenizer";
  o.prefix_cache_persist = persist;
  return o;
}

TEST(PrefixDiskEngine, ARestartedEngineResumesFromTheDiskWithEveryDrafter) {
  auto& d = demo();
  const auto text = sample_tokens(450);
  const std::vector<int32_t> first(text.begin(), text.begin() + 300);
  // Other drafter namespaces for the same checkpoint: the MTP layer tapping the pre-norm hidden,
  // and the same layer split out as a companion directory.
  const testing::ScratchDir companion_dir("companion");
  const std::string companion_path = companion_dir.file("mtp");
  spec::write_mtp_companion(test::kDemoDir, companion_path);
  const auto prenorm = spec::QwenMtpProvider::from_target(*d.target, spec::HiddenTap::PreNorm);
  const auto companion = spec::QwenMtpProvider::from_companion(companion_path);
  const std::map<std::string, const spec::DraftProvider*> drafters = {
      {"mtp", d.mtp.get()},
      {"ngram", d.ngram.get()},
      {"mtp-prenorm", prenorm.get()},
      {"companion", companion.get()}};
  const std::vector<std::pair<std::string, std::string>> pairs = {
      {"mtp", "mtp"},         {"mtp", "ngram"},     {"ngram", "ngram"},  {"ngram", "mtp"},
      {"mtp", "mtp-prenorm"}, {"mtp", "companion"}, {"companion", "mtp"}};
  std::vector<int32_t> cold_tokens, hot_tokens, ignored;
  EngineOptions cold = disk_options("", false);
  cold.prefix_cache_bytes = 0;
  for (const auto& [writer, reader] : pairs) {
    for (const spec::VerifyMode mode : {spec::VerifyMode::Match, spec::VerifyMode::Rejection}) {
      const bool match = mode == spec::VerifyMode::Match;
      SCOPED_TRACE(writer + " -> " + reader + (match ? " (match)" : " (rejection)"));
      const testing::ScratchDir dir_scratch("engine_" + writer + "_" + reader);
      const std::string dir = dir_scratch.file("cache");
      EngineOptions wo = disk_options(dir, /*persist=*/true), ro = disk_options(dir, false);
      EngineOptions co = cold;
      wo.spec.verify = ro.spec.verify = co.spec.verify = mode;
      {
        BatchEngine a(*d.model, drafters.at(writer), "demo-target", wo);
        serve(a, first, 0.8f, &ignored);
      }  // a clean shutdown writes every entry
      BatchEngine b(*d.model, drafters.at(reader), "demo-target", ro);
      const RequestOutcome oh = serve(b, text, 0.8f, &hot_tokens);
      BatchEngine c(*d.model, drafters.at(reader), "demo-target", co);
      const RequestOutcome oc = serve(c, text, 0.8f, &cold_tokens);
      EXPECT_EQ(hot_tokens, cold_tokens);
      // The prompt's end (300) is the longest boundary the longer prompt shares. Its attachment
      // serves the same drafter. Another namespace's is adopted from the tokens: exactly by
      // n-gram; by MTP with its history starting there, which match verification allows and
      // rejection sampling (whose output follows the proposals) does not.
      const bool same = writer == reader;
      const bool usable = same || reader == "ngram" || match;
      EXPECT_EQ(oh.cached_tokens, usable ? 300 : 0);
      EXPECT_EQ(b.counters().prefix_disk_hits, usable ? 1 : 0);
      if (same || reader == "ngram") {
        EXPECT_EQ(oh.speculation.accepted_by_position, oc.speculation.accepted_by_position);
        EXPECT_EQ(oh.speculation.rounds, oc.speculation.rounds);
      } else if (usable) {
        // The adopted MTP row drafts from the boundary on (the demo MTP layer accepts ~60%).
        EXPECT_GT(oh.speculation.accepted, 0);
      }
    }
  }
}

TEST(PrefixDiskEngine, AnotherTargetIdentityFindsNothingAndEvictedEntriesSpillToDisk) {
  auto& d = demo();
  const auto text = sample_tokens(450);
  const testing::ScratchDir dir_scratch("identity");
  const std::string dir = dir_scratch.file("cache");
  std::vector<int32_t> ignored, hot, cold_tokens;
  {
    BatchEngine a(*d.model, d.ngram.get(), "demo-target", disk_options(dir, true));
    serve(a, std::vector<int32_t>(text.begin(), text.begin() + 300), 0.0f, &ignored);
  }
  {
    // Same config, other weights (one byte changed gives another artifact identity): its files
    // are removed, never used.
    BatchEngine other(*d.model, d.ngram.get(), "demo-target-changed", disk_options(dir, false));
    const RequestOutcome o = serve(other, text, 0.0f, &hot);
    EXPECT_EQ(o.cached_tokens, 0);
    EXPECT_GT(other.counters().prefix_disk_removed, 0);
  }
  {
    // The same model with fp32 KV: the files hold bf16 keys and values (the default), another
    // state layout under the key's KV scheme, so they are removed, never read as fp32.
    {
      BatchEngine a(*d.model, d.ngram.get(), "demo-target", disk_options(dir, true));
      serve(a, std::vector<int32_t>(text.begin(), text.begin() + 300), 0.0f, &ignored);
    }
    EngineOptions f32 = disk_options(dir, false);
    f32.kv_dtype = DType::F32;
    BatchEngine other(*d.model, d.ngram.get(), "demo-target", f32);
    const RequestOutcome o = serve(other, text, 0.0f, &hot);
    EXPECT_EQ(o.cached_tokens, 0);
    EXPECT_GT(other.counters().prefix_disk_removed, 0);
  }
  // A tiny memory budget: entries evicted from memory are written to the folder (no persist),
  // and a later request reads the longest one back.
  fs::remove_all(dir);
  EngineOptions o = disk_options(dir, false);
  o.prefix_cache_bytes = 3 * Qwen35State::row_bytes(d.model->config(), 1) +
                         40 * Qwen35State::block_bytes(d.model->config());
  BatchEngine e(*d.model, d.ngram.get(), "demo-target", o);
  serve(e, std::vector<int32_t>(text.begin(), text.begin() + 300), 0.0f, &ignored);
  serve(e, std::vector<int32_t>(text.begin() + 100, text.begin() + 420), 0.0f, &ignored);
  EXPECT_GT(e.counters().prefix_disk_writes, 0);
  EXPECT_GT(e.counters().prefix_evictions, 0);
  const RequestOutcome oh = serve(e, text, 0.0f, &hot);
  EngineOptions cold = disk_options("", false);
  cold.prefix_cache_bytes = 0;
  BatchEngine c(*d.model, d.ngram.get(), "demo-target", cold);
  serve(c, text, 0.0f, &cold_tokens);
  EXPECT_EQ(hot, cold_tokens);
  EXPECT_GE(oh.cached_tokens, 256);
}

}  // namespace
}  // namespace tandem
