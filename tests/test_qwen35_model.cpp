// Qwen3.5 forward properties that hold for any weights, checked on random-weight checkpoints:
// prefill == token-by-token decode (bitwise), a row's numbers do not depend on the other rows
// of the batch (bitwise), and bad checkpoints / inputs are refused with clear errors.
#include <gtest/gtest.h>

#include <cstring>

#include "tandem/core/error.h"
#include "tandem/io/safetensors.h"
#include "tandem/model/qwen3_5.h"
#include "tandem/model/qwen3_5_random.h"
#include "test_util.h"

namespace tandem {
namespace {

using tandem::testing::ScratchDir;
using tandem::testing::write_text;

const char* kConfig = R"({
  "model_type": "qwen3_5",
  "tie_word_embeddings": false,
  "text_config": {
    "model_type": "qwen3_5_text", "vocab_size": 97, "hidden_size": 48, "intermediate_size": 80,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
    "linear_value_head_dim": 12, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6,
    "hidden_act": "silu", "max_position_embeddings": 4096, "eos_token_id": 1,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                        "partial_rotary_factor": 0.5}
  }
})";

class RandomModel : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new ScratchDir("qwen35-random");
    write_text(dir_->file("source_config.json"), kConfig);
    write_random_qwen35(dir_->file("source_config.json"), dir_->file("model"), DType::BF16, 7);
    model_ = Qwen35Model::load(dir_->file("model")).release();
  }
  static void TearDownTestSuite() {
    delete model_;
    delete dir_;
  }
  static ScratchDir* dir_;
  static Qwen35Model* model_;
};
ScratchDir* RandomModel::dir_ = nullptr;
Qwen35Model* RandomModel::model_ = nullptr;

std::vector<int32_t> sequence(int n, int seed) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) v[i] = (seed * 31 + i * 17) % 97;
  return v;
}

TEST_F(RandomModel, PrefillEqualsTokenByTokenDecodeBitwise) {
  const auto ids = sequence(21, 3);  // crosses a KV block boundary (block size 16)
  const int64_t V = model_->config().vocab_size;
  Qwen35State a(model_->config()), b(model_->config());
  const int sa = a.open_row(), sb = b.open_row();
  ForwardOutput all;
  const RowInput row{sa, static_cast<int64_t>(ids.size())};
  model_->forward(a, {ids, {&row, 1}, true, true}, &all);
  ASSERT_EQ(all.logits_rows, static_cast<int64_t>(ids.size()));
  // Decode: a 5-token prefill, then windows of 1, 3 and 1 tokens, then single tokens.
  size_t t = 0;
  for (int64_t n : {5, 1, 3, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}) {
    ForwardOutput part;
    const RowInput r{sb, n};
    model_->forward(b, {std::span(ids).subspan(t, static_cast<size_t>(n)), {&r, 1}, true, false},
                    &part);
    ASSERT_EQ(0, std::memcmp(part.logits.data(), all.logits.data() + t * V, sizeof(float) * n * V))
        << "window starting at " << t;
    t += static_cast<size_t>(n);
  }
  ASSERT_EQ(t, ids.size());
  EXPECT_EQ(a.length(sa), b.length(sb));
}

TEST_F(RandomModel, RowsOfDifferentLengthsDoNotInfluenceEachOther) {
  const int64_t V = model_->config().vocab_size;
  const std::vector<std::vector<int32_t>> prompts = {sequence(9, 1), sequence(3, 2),
                                                     sequence(17, 4)};
  // Alone.
  std::vector<std::vector<float>> alone;
  for (const auto& p : prompts) {
    Qwen35State s(model_->config());
    const RowInput r{s.open_row(), static_cast<int64_t>(p.size())};
    ForwardOutput o;
    model_->forward(s, {p, {&r, 1}, false, false}, &o);
    alone.push_back(o.logits);
  }
  // Together, in one forward; slots opened in a different order than the rows are listed.
  Qwen35State s(model_->config());
  const int s0 = s.open_row(), s1 = s.open_row(), s2 = s.open_row();
  std::vector<int32_t> flat;
  for (int i : {2, 0, 1}) flat.insert(flat.end(), prompts[i].begin(), prompts[i].end());
  const std::vector<RowInput> rows = {{s2, 17}, {s0, 9}, {s1, 3}};
  ForwardOutput o;
  model_->forward(s, {flat, rows, false, false}, &o);
  ASSERT_EQ(o.logits_rows, 3);
  const int order[3] = {2, 0, 1};
  for (int r = 0; r < 3; ++r)
    EXPECT_EQ(0, std::memcmp(o.logits.data() + r * V, alone[order[r]].data(), sizeof(float) * V))
        << "row " << r;
  // One more decode step together equals one more decode step alone.
  Qwen35State solo(model_->config());
  const RowInput r0{solo.open_row(), 9};
  ForwardOutput so;
  model_->forward(solo, {prompts[0], {&r0, 1}, false, false}, &so);
  const std::vector<int32_t> next = {5, 6, 7};
  const std::vector<RowInput> step = {{s2, 1}, {s0, 1}, {s1, 1}};
  model_->forward(s, {next, step, false, false}, &o);
  const RowInput r1{r0.slot, 1};
  const int32_t six = 6;
  model_->forward(solo, {{&six, 1}, {&r1, 1}, false, false}, &so);
  EXPECT_EQ(0, std::memcmp(o.logits.data() + 1 * V, so.logits.data(), sizeof(float) * V));
}

// Layer-sliced prefill: a prompt forward run one or two layers at a time, with another row's
// prompt and decode forwards on the same state between its slices, gives forward()'s logits,
// hidden states and state bit for bit; misuse is refused with the reason.
TEST_F(RandomModel, SlicedPromptForwardEqualsOneForward) {
  const int64_t V = model_->config().vocab_size, H = model_->config().hidden_size;
  const std::vector<std::vector<int32_t>> prompts = {sequence(19, 5), sequence(7, 6)};
  const std::vector<int32_t> flat = [&] {
    std::vector<int32_t> f = prompts[0];
    f.insert(f.end(), prompts[1].begin(), prompts[1].end());
    return f;
  }();
  // Reference: one forward, then one decode step per row.
  Qwen35State ref(model_->config());
  const std::vector<RowInput> ref_rows = {{ref.open_row(), 19}, {ref.open_row(), 7}};
  ForwardRequest req{flat, ref_rows, false, true};
  req.prompt = true;
  ForwardOutput want;
  model_->forward(ref, req, &want);
  const std::vector<int32_t> next = {11, 12};
  const std::vector<RowInput> ref_step = {{ref_rows[0].slot, 1}, {ref_rows[1].slot, 1}};
  ForwardOutput want_next;
  model_->forward(ref, {next, ref_step, false, false}, &want_next);

  for (int slice : {1, 2, 3}) {
    Qwen35State s(model_->config());
    const int other = s.open_row();
    const std::vector<RowInput> rows = {{s.open_row(), 19}, {s.open_row(), 7}};
    Qwen35Model::PromptForward pf;
    ForwardRequest sliced{flat, rows, false, true};
    sliced.prompt = true;
    model_->begin_prompt(s, sliced, &pf);
    EXPECT_THROW(model_->begin_prompt(s, sliced, &pf), Error) << "begun twice";
    ForwardOutput got, busy;
    int slices = 0;
    const int32_t tok = 9;
    const RowInput other_prompt{other, 4}, other_step{other, 1};
    const auto other_ids = sequence(4, 8);
    for (bool done = false; !done; ++slices) {
      done = model_->continue_prompt(s, pf, slice, &got);
      // Another row of the same state runs between slices: a prompt, then decode steps.
      if (slices == 0)
        model_->forward(s, {other_ids, {&other_prompt, 1}, false, false}, &busy);
      else
        model_->forward(s, {{&tok, 1}, {&other_step, 1}, false, false}, &busy);
    }
    EXPECT_EQ(slices, (model_->layer_count() + slice - 1) / slice) << "slice " << slice;
    EXPECT_FALSE(pf.active());
    ASSERT_EQ(got.logits.size(), want.logits.size());
    EXPECT_EQ(0, std::memcmp(got.logits.data(), want.logits.data(), sizeof(float) * 2 * V))
        << "slice " << slice;
    ASSERT_EQ(got.hidden.size(), want.hidden.size());
    EXPECT_EQ(0, std::memcmp(got.hidden.data(), want.hidden.data(), sizeof(float) * 26 * H))
        << "slice " << slice;
    EXPECT_EQ(s.length(rows[0].slot), 19);
    // The rows' state continues exactly as the one-forward rows' does.
    const std::vector<RowInput> step = {{rows[0].slot, 1}, {rows[1].slot, 1}};
    ForwardOutput got_next;
    model_->forward(s, {next, step, false, false}, &got_next);
    EXPECT_EQ(0,
              std::memcmp(got_next.logits.data(), want_next.logits.data(), sizeof(float) * 2 * V))
        << "slice " << slice;
  }

  // Misuse.
  Qwen35State s(model_->config());
  const RowInput r{s.open_row(), 3};
  const auto ids = sequence(3, 9);
  Qwen35Model::PromptForward pf;
  ForwardOutput o;
  EXPECT_THROW(model_->continue_prompt(s, pf, 1, &o), Error) << "not begun";
  ForwardRequest plain{ids, {&r, 1}, false, false};
  EXPECT_THROW(model_->begin_prompt(s, plain, &pf), Error) << "not a prompt forward";
  plain.prompt = true;
  model_->begin_prompt(s, plain, &pf);
  EXPECT_THROW(model_->continue_prompt(s, pf, -1, &o), Error);
  s.close_row(r.slot);
  try {
    model_->continue_prompt(s, pf, 1, &o);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("was closed"), std::string::npos) << e.what();
  }
}

// bf16 KV (the default) holds half the bytes of fp32 KV per block; other storage is refused.
TEST_F(RandomModel, Bf16KvBlocksHoldHalfTheBytesOfFp32Ones) {
  const Qwen35Config& cfg = model_->config();
  EXPECT_EQ(2 * Qwen35State::block_bytes(cfg), Qwen35State::block_bytes(cfg, DType::F32));
  Qwen35State bf16(cfg), f32(cfg, RecurrentRollback::PerPositionStates, DType::F32);
  EXPECT_EQ(bf16.kv_dtype(), DType::BF16);
  EXPECT_NE(bf16.kv_scheme(), f32.kv_scheme());
  EXPECT_EQ(2 * bf16.kv_token_bytes(), f32.kv_token_bytes());
  for (Qwen35State* s : {&bf16, &f32}) {
    s->open_row();
    s->reserve(0, 40);
  }
  EXPECT_LT(bf16.bytes(), f32.bytes());
  EXPECT_THROW(Qwen35State(cfg, RecurrentRollback::PerPositionStates, DType::F16), Error);
  EXPECT_THROW(Qwen35State::block_bytes(cfg, DType::I32), Error);
}

TEST_F(RandomModel, OutOfRangeTokenIsRefusedBeforeStateChanges) {
  Qwen35State s(model_->config());
  const RowInput r{s.open_row(), 2};
  const std::vector<int32_t> ids = {3, 97};
  ForwardOutput o;
  try {
    model_->forward(s, {ids, {&r, 1}, false, false}, &o);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("token id 97"), std::string::npos) << e.what();
  }
  EXPECT_EQ(s.length(r.slot), 0);
}

// The window hint of the batched attention call: the length the attending segments share when
// each starts at a multiple of it; 1 for ragged or misaligned segments. A prompt's first chunk
// (served by attention_prompt) takes query indices but attends in no group.
TEST(GatedAttention, BatchedWindowIsTheAlignedLengthTheSegmentsShare) {
  auto window = [](std::vector<std::pair<int64_t, int64_t>> start_n, bool prompt) {
    std::vector<AttentionSegment> segs;
    for (const auto& [start, n] : start_n) segs.push_back({nullptr, start, n, 1024});
    return batched_window(segs, prompt);
  };
  EXPECT_EQ(window({{10, 4}, {20, 4}, {7, 4}}, false), 4);
  EXPECT_EQ(window({{10, 1}, {20, 1}}, false), 1);
  EXPECT_EQ(window({{10, 8}, {3, 8}}, false), 8);
  EXPECT_EQ(window({{10, 4}, {20, 3}}, false), 1);          // ragged
  EXPECT_EQ(window({{10, 4}, {20, 0}, {5, 4}}, false), 4);  // an empty segment takes no queries
  EXPECT_EQ(window({{0, 8}, {20, 4}, {9, 4}}, true), 4);    // a prompt of 8, then windows of 4
  EXPECT_EQ(window({{0, 6}, {20, 4}}, true), 1);            // the window starts at query 6
  EXPECT_EQ(window({{0, 6}}, true), 1);                     // nothing attends over the cache
  EXPECT_EQ(window({}, false), 1);
}

TEST(Qwen35Load, MissingAndMisshapenTensorsAreNamed) {
  ScratchDir dir("qwen35-bad");
  write_text(dir.file("c.json"), kConfig);
  write_random_qwen35(dir.file("c.json"), dir.file("m"), DType::F32, 1);
  // Same weights, config claiming a larger intermediate size: the first MLP weight mismatches.
  std::string cfg = kConfig;
  cfg.replace(cfg.find("\"intermediate_size\": 80"), 23, "\"intermediate_size\": 96");
  write_text(dir.file("m/config.json"), cfg);
  try {
    Qwen35Model::load(dir.file("m"));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("mlp.gate_proj.weight"), std::string::npos) << msg;
    EXPECT_NE(msg.find("expected shape [96, 48]"), std::string::npos) << msg;
  }
  // Untied config but the checkpoint has no lm_head.
  ScratchDir dir2("qwen35-nohead");
  std::string tied = kConfig;
  tied.replace(tied.find("\"tie_word_embeddings\": false"), 28, "\"tie_word_embeddings\": true ");
  write_text(dir2.file("c.json"), tied);
  write_random_qwen35(dir2.file("c.json"), dir2.file("m"), DType::F32, 1);
  write_text(dir2.file("m/config.json"), kConfig);
  try {
    Qwen35Model::load(dir2.file("m"));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("lm_head.weight"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tandem
