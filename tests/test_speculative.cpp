// Lossless speculative decoding: with `match` verification, output equals non-speculative
// decoding token for token — every drafter, depth, temperature and seed, alone and mixed in
// batches whose rows differ in length, acceptance and finish time.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "demo_model.h"
#include "tandem/engine/generator.h"
#include "tandem/engine/speculative.h"
#include "tandem/io/tokenizer.h"
#include "tandem/spec/ngram.h"
#include "tandem/spec/qwen_mtp.h"
#include "test_util.h"

namespace tandem {
namespace {

const std::string& kDemo = test::kDemoDir;
const std::vector<std::string>& kPrompts = test::kDemoPrompts;
using Fixture = test::DemoModel;

Fixture& demo() {
  static Fixture* f = test::load_demo_model().release();  // lives for the whole test run
  return *f;
}

struct Case {
  const char* drafter;
  int depth;
  float temperature;
};

class Lossless : public ::testing::TestWithParam<Case> {};

TEST_P(Lossless, SpeculativeEqualsPlainAloneAndBatched) {
  const Case c = GetParam();
  Fixture& f = demo();
  // "mtp_shared": the MTP block in the target's own backend context, as the CLI and the server
  // open it: its chains run whole and the verify reads their proposals in place (draft_queued).
  // "mtp_settled": the same, its rounds settled on the device (SpecOptions::settled_rounds);
  // "ngram_settled": the n-gram drafter's rounds settled there.
  static const auto shared = [&] {
    const ops::ContextScope scope(f.model->context());
    return spec::QwenMtpProvider::from_target(*f.target);
  }();
  const std::string name = c.drafter;
  const spec::DraftProvider* drafter = name == "mtp"               ? f.mtp.get()
                                       : name.starts_with("ngram") ? f.ngram.get()
                                                                   : shared.get();
  SpecOptions opts{c.depth, spec::VerifyMode::Match};
  opts.settled_rounds = name.ends_with("_settled");
  SpeculativeGenerator spec_gen(*f.model, drafter, "demo-target", opts);
  std::vector<GenerateRequest> reqs;
  for (size_t p = 0; p < kPrompts.size(); ++p)
    for (uint64_t seed : {1u, 2u})
      reqs.push_back(test::demo_request(demo(), kPrompts[p], c.temperature, seed * 7 + p,
                                        12 + 5 * (p + seed)));
  const auto want = test::plain_tokens(*demo().model, reqs);
  // Alone.
  for (size_t i = 0; i < reqs.size(); ++i) {
    const auto got = spec_gen.run({reqs[i]});
    ASSERT_EQ(got.at(0).tokens, want[i])
        << c.drafter << " depth " << c.depth << " T " << c.temperature << " request " << i;
  }
  // All together: rows of different prompt lengths and max_tokens finish at different rounds.
  std::vector<SpecStats> st;
  const auto got = spec_gen.run(reqs, {}, nullptr, &st);
  int64_t accepted = 0;
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(got[i].tokens, want[i]) << "batched request " << i;
    accepted += st[i].accepted;
    EXPECT_EQ(st[i].emitted, static_cast<int64_t>(want[i].size()));
  }
  EXPECT_GT(accepted, 0) << "no proposal was ever accepted: the test would not exercise rollback";
}

std::vector<Case> cases() {
  std::vector<Case> v;
  for (const char* d : {"mtp", "mtp_shared", "mtp_settled", "ngram", "ngram_settled"})
    for (int depth : {1, 2, 3, 4})
      for (float t : {0.0f, 0.7f, 1.0f}) v.push_back({d, depth, t});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Drafters, Lossless, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& i) {
                           return std::string(i.param.drafter) + "_depth" +
                                  std::to_string(i.param.depth) + "_T" +
                                  std::to_string(static_cast<int>(i.param.temperature * 10));
                         });

// A reduced draft vocabulary (the MTP drafter scores token ids below 1,024 of the demo's 4,096)
// changes what is proposed, never the output: greedy and sampled, alone and batched. Proposals
// that the cut would have ranked first are still accepted where the target agrees.
TEST(LosslessDraftVocabulary, ReducedDraftVocabularyKeepsTheOutput) {
  Fixture& f = demo();
  auto mtp = spec::QwenMtpProvider::from_target(*f.target);
  mtp->set_draft_vocabulary(1024);
  EXPECT_EQ(mtp->draft_vocabulary(), 1024);
  for (const float t : {0.0f, 0.7f}) {
    std::vector<GenerateRequest> reqs;
    for (size_t p = 0; p < kPrompts.size(); ++p)
      reqs.push_back(test::demo_request(demo(), kPrompts[p], t, 3 * p + 1, 20 + 4 * p));
    const auto want = test::plain_tokens(*f.model, reqs);
    SpeculativeGenerator spec_gen(*f.model, mtp.get(), "demo-target", {3, spec::VerifyMode::Match});
    std::vector<SpecStats> st;
    const auto got = spec_gen.run(reqs, {}, nullptr, &st);
    int64_t accepted = 0;
    for (size_t i = 0; i < reqs.size(); ++i) {
      EXPECT_EQ(got[i].tokens, want[i]) << "T " << t << " request " << i;
      accepted += st[i].accepted;
    }
    EXPECT_GT(accepted, 0) << "T " << t << ": nothing drafted from the reduced vocabulary was kept";
  }
  EXPECT_THROW(mtp->set_draft_vocabulary(f.model->config().vocab_size + 1), Error);
  EXPECT_THROW(mtp->set_draft_vocabulary(-1), Error);
}

// fp32 KV storage (--kv-dtype f32) is as lossless as the bf16 default: speculative rounds read
// the keys and values plain decoding stored, whatever their storage.
TEST(LosslessFp32Kv, SpeculativeEqualsPlainWithFp32Kv) {
  Fixture& f = demo();
  std::vector<GenerateRequest> reqs;
  for (size_t p = 0; p < kPrompts.size(); ++p)
    reqs.push_back(test::demo_request(demo(), kPrompts[p], 0.7f, p, 24));
  Generator plain_gen(*f.model, kPrefillChunkTokens, DType::F32);
  const std::vector<const spec::DraftProvider*> drafters = {f.mtp.get(), f.ngram.get()};
  for (const spec::DraftProvider* drafter : drafters) {
    SpeculativeGenerator spec_gen(*f.model, drafter, "demo-target", {3, spec::VerifyMode::Match},
                                  DType::F32);
    const auto got = spec_gen.run(reqs);
    for (size_t i = 0; i < reqs.size(); ++i)
      EXPECT_EQ(got[i].tokens, plain_gen.run({reqs[i]}).at(0).tokens)
          << drafter->id() << " request " << i;
  }
}

// Runs of one generator share its engine (SpeculativeGenerator::set_keep_engine): the rows, KV
// blocks and drafter rows a run leaves behind change nothing a later run emits or counts. Each
// run's figures are its own, equal to what a fresh engine reports for the same requests.
TEST(LosslessKeptEngine, RunsOnOneEngineEqualRunsOnFreshEngines) {
  Fixture& f = demo();
  std::vector<GenerateRequest> reqs;
  for (size_t p = 0; p < kPrompts.size(); ++p)
    reqs.push_back(test::demo_request(demo(), kPrompts[p], p % 2 ? 0.7f : 0.0f, 5 + p, 14 + 3 * p));
  const auto want = test::plain_tokens(*f.model, reqs);
  for (const spec::DraftProvider* drafter : {f.mtp.get(), f.ngram.get()}) {
    SpeculativeGenerator kept(*f.model, drafter, "demo-target", {3, spec::VerifyMode::Match});
    SpeculativeGenerator fresh(*f.model, drafter, "demo-target", {3, spec::VerifyMode::Match});
    fresh.set_keep_engine(false);
    // A batch, its rows alone, then the batch again: the later runs find the earlier runs'
    // freed blocks and drafter rows in the kept engine.
    std::vector<std::vector<GenerateRequest>> runs = {reqs};
    for (const GenerateRequest& r : reqs) runs.push_back({r});
    runs.push_back(reqs);
    for (size_t k = 0; k < runs.size(); ++k) {
      GenerateStats ks, fs;
      std::vector<SpecStats> kst, fst;
      const auto got = kept.run(runs[k], {}, &ks, &kst);
      const auto ref = fresh.run(runs[k], {}, &fs, &fst);
      for (size_t i = 0; i < got.size(); ++i) {
        const size_t w = runs[k].size() == 1 ? k - 1 : i;
        EXPECT_EQ(got[i].tokens, want[w]) << drafter->id() << " run " << k << " request " << i;
        EXPECT_EQ(got[i].tokens, ref[i].tokens) << drafter->id() << " run " << k;
        EXPECT_EQ(kst[i].rounds, fst[i].rounds) << drafter->id() << " run " << k;
        EXPECT_EQ(kst[i].accepted, fst[i].accepted) << drafter->id() << " run " << k;
      }
      EXPECT_EQ(ks.decode_steps, fs.decode_steps) << drafter->id() << " run " << k;
      // Each run counts its own rounds by depth: all at the fixed depth 3.
      EXPECT_EQ(ks.rounds_by_depth, fs.rounds_by_depth) << drafter->id() << " run " << k;
      ASSERT_EQ(ks.rounds_by_depth.size(), 4u) << drafter->id() << " run " << k;
      EXPECT_EQ(ks.rounds_by_depth[3], ks.decode_steps) << drafter->id() << " run " << k;
      // No prefix cache: the commits ran on the device (SpecOptions::device_commit), every one
      // of MTP's rounds (each row proposes 3); n-gram rounds where no row found a proposal have
      // no window to commit.
      if (drafter == f.mtp.get()) {
        EXPECT_EQ(ks.device_commit_rounds, ks.decode_steps) << "run " << k;
      }
      EXPECT_GT(ks.device_commit_rounds, 0) << drafter->id() << " run " << k;
      EXPECT_LE(ks.device_commit_rounds, ks.decode_steps) << drafter->id() << " run " << k;
      EXPECT_EQ(ks.decode_tokens, fs.decode_tokens) << drafter->id() << " run " << k;
      EXPECT_GT(ks.decode_seconds, 0.0) << drafter->id() << " run " << k;
    }
  }
}

// Rows that stop on EOS mid-window: a model whose generation_config makes a frequent token EOS.
TEST(LosslessEos, RowsStoppingOnEosMidWindowMatchPlainDecoding) {
  testing::ScratchDir dir("spec-eos");
  namespace fs = std::filesystem;
  const fs::path m = dir.path() / "m";
  fs::create_directories(m);
  for (const char* f : {"config.json", "model.safetensors", "tokenizer.json"})
    fs::create_symlink(fs::path(kDemo) / f, m / f);
  const int32_t newline = demo().tok->encode("\n").at(0);
  testing::write_text((m / "generation_config.json").string(),
                      "{\"eos_token_id\": [0, " + std::to_string(newline) + "]}");
  auto model = Qwen35Model::load(m.string());
  spec::QwenTargetView target(*model, "eos-target");
  auto mtp = spec::QwenMtpProvider::from_target(target);
  std::vector<GenerateRequest> reqs;
  for (size_t p = 0; p < kPrompts.size(); ++p) {
    GenerateRequest r = test::demo_request(demo(), kPrompts[p] + "    x = ", 0.0f, 1, 40);
    reqs.push_back(r);
    r.sampling.temperature = 1.0f;
    r.sampling.seed = 99 + p;
    reqs.push_back(r);
  }
  Generator plain_gen(*model);
  SpeculativeGenerator spec_gen(*model, mtp.get(), "eos-target", {4, spec::VerifyMode::Match});
  const auto got = spec_gen.run(reqs);
  int stopped = 0;
  for (size_t i = 0; i < reqs.size(); ++i) {
    const auto want = plain_gen.run({reqs[i]}).at(0);
    EXPECT_EQ(got[i].tokens, want.tokens) << i;
    EXPECT_EQ(got[i].finish, want.finish) << i;
    stopped += want.finish == FinishReason::Stop;
  }
  EXPECT_GT(stopped, 0) << "no request stopped on EOS";
}

// The acceptance the engine measures on held-out-style code agrees with the teacher-forced MTP
// agreement of the model card (0.717 at depth 1) within a few points.
TEST(MtpAcceptance, DepthOneGreedyAcceptanceMatchesTeacherForcedAgreement) {
  Fixture& f = demo();
  std::ifstream in(kDemo + "/heldout_sample.py");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto ids = f.tok->encode(text);
  SpeculativeGenerator gen(*f.model, f.mtp.get(), "demo-target", {1, spec::VerifyMode::Match});
  int64_t drafted = 0, accepted = 0;
  // Several prompts cut from the held-out file, greedy continuations.
  std::vector<GenerateRequest> reqs;
  for (size_t cut = 64; cut + 64 <= ids.size() && reqs.size() < 8; cut += 200) {
    GenerateRequest r;
    r.prompt.assign(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(cut));
    r.max_tokens = 64;
    r.ignore_eos = true;
    reqs.push_back(r);
  }
  std::vector<SpecStats> st;
  gen.run(reqs, {}, nullptr, &st);
  for (const auto& s : st) {
    drafted += s.drafted;
    accepted += s.accepted;
  }
  const double rate = static_cast<double>(accepted) / static_cast<double>(drafted);
  RecordProperty("depth1_acceptance", std::to_string(rate));
  EXPECT_GT(rate, 0.62) << accepted << "/" << drafted;
  EXPECT_LT(rate, 0.95) << accepted << "/" << drafted;
}

}  // namespace
}  // namespace tandem

namespace tandem {
namespace {

// Teacher-forced MTP agreement measured through the engine's own kernels on held-out text: at
// each row p, does argmax(MTP(x[p+1], h[p])) equal the target's argmax at p+1? The model card
// reports 0.717 over its whole held-out split; this file alone must land within a few points.
TEST(MtpAcceptance, TeacherForcedAgreementOnHeldOutTextMatchesTheModelCard) {
  Fixture& f = demo();
  std::ifstream in(kDemo + "/heldout_sample.py");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto ids = f.tok->encode(text);
  if (ids.size() > 1024) ids.resize(1024);
  const int64_t L = static_cast<int64_t>(ids.size()), H = f.model->config().hidden_size,
                V = f.model->config().vocab_size;
  Qwen35State st(f.model->config());
  const RowInput row{st.open_row(), L};
  ForwardOutput out;
  f.model->forward(st, {ids, {&row, 1}, true, true}, &out);

  const auto& provider = dynamic_cast<const spec::QwenMtpProvider&>(*f.mtp);
  const spec::QwenMtpBlock& block = provider.block();
  const auto& c = block.config();
  const int64_t rows = L - 1;
  spec::DraftKvPool pool(c.num_key_value_heads, c.head_dim);
  std::vector<int32_t> table;
  pool.reserve(table, rows);
  std::vector<float> emb(static_cast<size_t>(rows * H)), mtp_out(emb.size()),
      logits(static_cast<size_t>(rows * V));
  f.target->embed(std::span(ids).subspan(1), emb.data());
  const std::vector<int32_t>* tables[] = {&table};
  const int64_t start[] = {0}, count[] = {rows};
  const AttentionBatch batch = pool.batch(tables, start, count);
  spec::QwenMtpBlock::Workspace ws;
  block.forward(emb.data(), out.hidden.data(), batch, pool.view(), ws, mtp_out.data());
  f.target->logits(mtp_out.data(), rows, logits.data());
  int64_t agree = 0;
  for (int64_t p = 0; p + 1 < L; ++p) {
    const int32_t d = argmax({logits.data() + p * V, static_cast<size_t>(V)});
    const int32_t t = argmax({out.logits.data() + (p + 1) * V, static_cast<size_t>(V)});
    agree += d == t;
  }
  const double rate = static_cast<double>(agree) / static_cast<double>(rows);
  RecordProperty("teacher_forced_agreement", std::to_string(rate));
  EXPECT_NEAR(rate, 0.717, 0.06) << agree << " of " << rows;
}

}  // namespace
}  // namespace tandem
