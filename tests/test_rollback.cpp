// Target rollback under speculation (DESIGN.md §5.3): after a speculative verify window and
// commit_windows(kept), a row's state — KV rows, DeltaNet conv and recurrent state — is
// bitwise what a run that only ever saw the kept tokens holds, and so are all later logits.
// Checked for both RecurrentRollback strategies on a random-weight checkpoint.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "settled_rounds.h"
#include "tandem/backend/buffer.h"
#include "tandem/core/error.h"
#include "tandem/core/sampler.h"
#include "tandem/model/qwen3_5.h"
#include "tandem/model/qwen3_5_random.h"
#include "test_util.h"

namespace tandem {
namespace {

using tandem::testing::ScratchDir;
using tandem::testing::write_text;

// Two DeltaNet layers around two attention layers; more value heads than key heads so the
// grouped-head path of the recurrence is covered.
const char* kConfig = R"({
  "model_type": "qwen3_5",
  "tie_word_embeddings": false,
  "text_config": {
    "model_type": "qwen3_5_text", "vocab_size": 89, "hidden_size": 40, "intermediate_size": 72,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
    "linear_value_head_dim": 12, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6,
    "hidden_act": "silu", "max_position_embeddings": 4096, "eos_token_id": 1,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                        "partial_rotary_factor": 0.5}
  }
})";
constexpr int32_t kVocab = 89;

std::string strategy_name(RecurrentRollback r) {
  return r == RecurrentRollback::PerPositionStates ? "PerPositionStates" : "Replay";
}

class Rollback : public ::testing::TestWithParam<RecurrentRollback> {
 protected:
  static void SetUpTestSuite() {
    dir_ = new ScratchDir("rollback");
    write_text(dir_->file("source_config.json"), kConfig);
    write_random_qwen35(dir_->file("source_config.json"), dir_->file("model"), DType::BF16, 11);
    model_ = Qwen35Model::load(dir_->file("model")).release();
  }
  static void TearDownTestSuite() {
    delete model_;
    delete dir_;
  }
  static ScratchDir* dir_;
  static Qwen35Model* model_;

  int64_t V() const { return model_->config().vocab_size; }
  Qwen35State make_state() const { return Qwen35State(model_->config(), GetParam()); }

  // One row's forward; returns the logits of every token.
  std::vector<float> feed(Qwen35State& s, int slot, const std::vector<int32_t>& ids,
                          bool speculative = false) const {
    const RowInput r{slot, static_cast<int64_t>(ids.size()), speculative};
    ForwardOutput o;
    model_->forward(s, {ids, {&r, 1}, true, false}, &o);
    return o.logits;
  }
};
ScratchDir* Rollback::dir_ = nullptr;
Qwen35Model* Rollback::model_ = nullptr;

std::vector<int32_t> tokens(int n, int seed) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) v[i] = (seed * 37 + i * 23 + 5) % kVocab;
  return v;
}

std::vector<int32_t> prefix_of(const std::vector<int32_t>& v, int64_t n) {
  return {v.begin(), v.begin() + n};
}

// Row `sa` of `a` and row `sb` of `b` hold bitwise the same state: length, every DeltaNet layer's
// conv and recurrent state, and every attention layer's K and V rows below the length.
void expect_same_state(Qwen35State& a, int sa, Qwen35State& b, int sb, const std::string& what) {
  ASSERT_EQ(a.length(sa), b.length(sb)) << what;
  for (int l = 0; l < a.linear_layers(); ++l) {
    EXPECT_EQ(0, std::memcmp(a.conv_state(sa, l), b.conv_state(sb, l),
                             sizeof(float) * a.conv_state_floats()))
        << what << ": conv state of linear layer " << l;
    EXPECT_EQ(0, std::memcmp(a.recurrent_state(sa, l), b.recurrent_state(sb, l),
                             sizeof(float) * a.recurrent_state_floats()))
        << what << ": recurrent state of linear layer " << l;
  }
  for (int l = 0; l < a.attention_layers(); ++l) {
    const ops::KVLayerView ka = a.kv_layer(l), kb = b.kv_layer(l);
    const size_t row = ka.row_bytes();
    const auto& ta = a.block_table(sa);
    const auto& tb = b.block_table(sb);
    for (int64_t p = 0; p < a.length(sa); ++p) {
      const int32_t ba = ta[p / ka.block_size], bb = tb[p / kb.block_size];
      const int64_t o = p % ka.block_size;
      EXPECT_EQ(0, std::memcmp(ka.key(ba, o), kb.key(bb, o), row))
          << what << ": key of attention layer " << l << " position " << p;
      EXPECT_EQ(0, std::memcmp(ka.value(ba, o), kb.value(bb, o), row))
          << what << ": value of attention layer " << l << " position " << p;
    }
  }
}

TEST_P(Rollback, EveryKeptPrefixOfEveryWindowEqualsNeverSpeculating) {
  const auto prompt = tokens(13, 1);  // windows of up to 5 cross the KV block boundary at 16
  const auto after = tokens(4, 2);    // what the row sees after the commit
  for (int64_t n = 1; n <= 5; ++n) {
    const auto window = tokens(static_cast<int>(n), 3 + static_cast<int>(n));
    for (int64_t kept = 1; kept <= n; ++kept) {
      const std::string what = "window " + std::to_string(n) + " kept " + std::to_string(kept);
      Qwen35State s = make_state(), ref = make_state();
      const int a = s.open_row(), b = ref.open_row();
      feed(s, a, prompt);
      const auto spec = feed(s, a, window, /*speculative=*/true);
      EXPECT_TRUE(s.window_open(a));
      const RowKeep keep{a, kept};
      model_->commit_windows(s, {&keep, 1});
      EXPECT_FALSE(s.window_open(a));

      feed(ref, b, prompt);
      const auto ref_window = feed(ref, b, prefix_of(window, kept));
      // Speculation does not change the numbers of the kept positions ...
      ASSERT_EQ(0, std::memcmp(spec.data(), ref_window.data(), sizeof(float) * kept * V())) << what;
      // ... and the committed state is the never-speculated state, byte for byte.
      expect_same_state(s, a, ref, b, what);
      // Later tokens (one chunk, then one at a time) see no trace of the rejected ones.
      EXPECT_EQ(feed(s, a, prefix_of(after, 2)), feed(ref, b, prefix_of(after, 2))) << what;
      for (size_t i = 2; i < after.size(); ++i) {
        const auto x = feed(s, a, {after[i]}), y = feed(ref, b, {after[i]});
        ASSERT_EQ(0, std::memcmp(x.data(), y.data(), sizeof(float) * V())) << what;
      }
      expect_same_state(s, a, ref, b, what + ", after continuing");
    }
  }
}

TEST_P(Rollback, MixedRowsCommitInOneCall) {
  struct Case {
    int prompt_len;
    int window;
    bool speculative;
    int kept;  // for non-speculative rows: the whole window
  };
  const std::vector<Case> cases = {
      {5, 3, true, 2}, {12, 5, true, 1}, {9, 2, false, 2}, {16, 4, true, 4}, {3, 5, true, 3}};
  const int R = static_cast<int>(cases.size());
  Qwen35State s = make_state();
  std::vector<int> slots;
  for (int r = 0; r < R; ++r) slots.push_back(s.open_row());
  std::vector<std::vector<int32_t>> prompts, windows;
  for (int r = 0; r < R; ++r) {
    prompts.push_back(tokens(cases[r].prompt_len, 10 + r));
    windows.push_back(tokens(cases[r].window, 20 + r));
  }
  // Prompts in one forward, then every row's window in one forward (the verify round).
  {
    std::vector<int32_t> flat;
    std::vector<RowInput> rows;
    for (int r = 0; r < R; ++r) {
      flat.insert(flat.end(), prompts[r].begin(), prompts[r].end());
      rows.push_back({slots[r], cases[r].prompt_len, false});
    }
    ForwardOutput o;
    model_->forward(s, {flat, rows, false, false}, &o);
  }
  {
    std::vector<int32_t> flat;
    std::vector<RowInput> rows;
    for (int r = 0; r < R; ++r) {
      flat.insert(flat.end(), windows[r].begin(), windows[r].end());
      rows.push_back({slots[r], cases[r].window, cases[r].speculative});
    }
    ForwardOutput o;
    model_->forward(s, {flat, rows, true, false}, &o);
  }
  // One commit for every speculative row, listed in a different order than the forward.
  std::vector<RowKeep> keeps;
  for (int r = R - 1; r >= 0; --r)
    if (cases[r].speculative) keeps.push_back({slots[r], cases[r].kept});
  model_->commit_windows(s, keeps);
  // One more step for all rows together.
  const std::vector<int32_t> next = {7, 8, 9, 10, 11};
  std::vector<RowInput> step;
  for (int r = 0; r < R; ++r) step.push_back({slots[r], 1, false});
  ForwardOutput together;
  model_->forward(s, {next, step, false, false}, &together);

  for (int r = 0; r < R; ++r) {
    const std::string what = "row " + std::to_string(r);
    Qwen35State ref = make_state();
    const int b = ref.open_row();
    feed(ref, b, prompts[r]);
    feed(ref, b, prefix_of(windows[r], cases[r].kept));
    const auto alone = feed(ref, b, {next[r]});
    EXPECT_EQ(0, std::memcmp(together.logits.data() + r * V(), alone.data(), sizeof(float) * V()))
        << what;
    expect_same_state(s, slots[r], ref, b, what);
  }
}

TEST_P(Rollback, RepeatedRoundsMatchTheNeverRejectedReference) {
  std::mt19937 rng(1234);
  Qwen35State s = make_state(), ref = make_state();
  const int a = s.open_row(), b = ref.open_row();
  const auto prompt = tokens(6, 4);
  feed(s, a, prompt);
  feed(ref, b, prompt);
  for (int round = 0; round < 10; ++round) {
    const std::string what = "round " + std::to_string(round);
    const int n = std::uniform_int_distribution<int>(1, 5)(rng);
    const int kept = std::uniform_int_distribution<int>(1, n)(rng);
    std::vector<int32_t> window(static_cast<size_t>(n));
    for (auto& t : window) t = std::uniform_int_distribution<int32_t>(0, kVocab - 1)(rng);
    const auto spec = feed(s, a, window, true);
    const RowKeep keep{a, kept};
    model_->commit_windows(s, {&keep, 1});
    const auto ref_logits = feed(ref, b, prefix_of(window, kept));
    ASSERT_EQ(0, std::memcmp(spec.data(), ref_logits.data(), sizeof(float) * kept * V())) << what;
    expect_same_state(s, a, ref, b, what);
  }
  const auto x = feed(s, a, {3}), y = feed(ref, b, {3});
  EXPECT_EQ(0, std::memcmp(x.data(), y.data(), sizeof(float) * V()));
}

// Expects `f` to throw an Error whose message contains `needle`.
template <typename F>
void expect_error(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected an error containing '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST_P(Rollback, MisuseIsRefusedWithoutChangingState) {
  Qwen35State s = make_state();
  const int a = s.open_row(), c = s.open_row();
  feed(s, a, tokens(5, 1));
  feed(s, c, tokens(4, 2));
  const RowKeep k1{a, 1};
  expect_error([&] { model_->commit_windows(s, {&k1, 1}); }, "has no speculative window");

  {
    // Both windows in one forward (the verify round): Replay records one forward's windows.
    const auto wa = tokens(3, 3), wc = tokens(2, 4);
    std::vector<int32_t> flat(wa);
    flat.insert(flat.end(), wc.begin(), wc.end());
    const RowInput rows[] = {{a, 3, true}, {c, 2, true}};
    ForwardOutput o;
    model_->forward(s, {flat, rows, true, false}, &o);
  }
  // A plain forward of another row while the windows are open leaves them intact; under Replay a
  // second speculative forward is refused until they are committed, changing nothing.
  const int d = s.open_row();
  feed(s, d, tokens(3, 6));
  if (GetParam() == RecurrentRollback::Replay) {
    expect_error([&] { feed(s, d, tokens(2, 7), true); }, "is not committed yet");
    EXPECT_EQ(s.length(d), 3);
    EXPECT_FALSE(s.window_open(d));
  }
  for (int64_t bad : {int64_t{0}, int64_t{4}, int64_t{-1}}) {
    const RowKeep k{a, bad};
    expect_error([&] { model_->commit_windows(s, {&k, 1}); }, "must be 1..3");
  }
  // A bad row anywhere in the list leaves every row untouched (all-or-nothing).
  const std::vector<RowKeep> mixed = {{c, 1}, {a, 7}};
  expect_error([&] { model_->commit_windows(s, mixed); }, "row slot " + std::to_string(a));
  EXPECT_TRUE(s.window_open(c));
  EXPECT_EQ(s.length(c), 6);
  const std::vector<RowKeep> twice = {{a, 1}, {a, 2}};
  expect_error([&] { model_->commit_windows(s, twice); }, "listed twice");
  EXPECT_TRUE(s.window_open(a));
  const RowKeep closed{99, 1};
  expect_error([&] { model_->commit_windows(s, {&closed, 1}); }, "not open");

  // No forward on a row whose window is still open, speculative or not.
  expect_error([&] { feed(s, a, tokens(2, 5), true); }, "uncommitted speculative window");
  expect_error([&] { feed(s, a, tokens(1, 5)); }, "uncommitted speculative window");
  EXPECT_EQ(s.length(a), 8);

  // The refused calls changed nothing: committing now equals never having speculated.
  const std::vector<RowKeep> ok = {{a, 2}, {c, 1}};
  model_->commit_windows(s, ok);
  Qwen35State ref = make_state();
  const int ra = ref.open_row(), rc = ref.open_row();
  feed(ref, ra, tokens(5, 1));
  feed(ref, ra, prefix_of(tokens(3, 3), 2));
  feed(ref, rc, tokens(4, 2));
  feed(ref, rc, prefix_of(tokens(2, 4), 1));
  expect_same_state(s, a, ref, ra, "row a");
  expect_same_state(s, c, ref, rc, "row c");
  expect_error([&] { model_->commit_windows(s, {&k1, 1}); }, "has no speculative window");
}

TEST_P(Rollback, ClosingARowDiscardsItsWindow) {
  Qwen35State s = make_state();
  const int a = s.open_row();
  feed(s, a, tokens(4, 1));
  feed(s, a, tokens(3, 2), true);
  s.close_row(a);
  const int again = s.open_row();
  ASSERT_EQ(again, a);
  EXPECT_FALSE(s.window_open(again));
  Qwen35State ref = make_state();
  const int b = ref.open_row();
  EXPECT_EQ(feed(s, again, tokens(5, 3)), feed(ref, b, tokens(5, 3)));
}

// --- Commits settled on the device (Qwen35Model::accept_windows / settle_windows) -------------
// A round whose accept walk and commit stay where the tokens are: the next rounds' forwards are
// queued before the host learns what was kept, and must compute exactly what they would after a
// host commit (logits, drawn tokens, and the state once resolved).

TEST_P(Rollback, SettledCommitsEqualHostCommits) {
  if (GetParam() != RecurrentRollback::Replay) {
    // Per-position states cannot pick the kept state on the device: refused by name.
    Qwen35State s = make_state();
    const int a = s.open_row();
    feed(s, a, tokens(4, 1));
    const auto w = tokens(3, 2);
    const RowInput in{a, 3, true};
    ForwardRequest req{w, {&in, 1}, true, false};
    req.want_argmax = true;
    ForwardOutput o;
    model_->forward(s, req, &o);
    Buffer<int32_t> accepted(1), next(1);
    model_->accept_windows(accepted.data(), next.data());
    const ops::SettledRow row{a, 0};
    expect_error([&] { model_->settle_windows(s, {&row, 1}, accepted.data()); }, "Replay");
    EXPECT_TRUE(s.window_open(a));
    return;
  }
  std::vector<std::vector<int32_t>> prompts;
  for (int r = 0; r < 3; ++r) prompts.push_back(tokens(5 + 4 * r, 40 + r));
  for (bool sampled : {false, true})
    for (int lag : {1, 2, 3})
      test::settled_rounds(*model_, GetParam(), {sampled, lag}, prompts, expect_same_state);
}

TEST_P(Rollback, SettledCommitMisuseIsRefused) {
  Qwen35State s = make_state();
  const int a = s.open_row(), c = s.open_row();
  feed(s, a, tokens(4, 1));
  feed(s, c, tokens(3, 2));
  Buffer<int32_t> accepted(2), next(2);
  // The last forward was not a verify with its tokens on the device.
  expect_error([&] { model_->accept_windows(accepted.data(), next.data()); },
               "not a verify forward");
  expect_error([&] { s.resolve_settled(a, 1); }, "no commit settled on the device");
  if (GetParam() != RecurrentRollback::Replay) return;
  const auto w = tokens(5, 3);
  const RowInput rows[] = {{a, 3, true}, {c, 2, true}};
  ForwardRequest req{w, rows, true, false};
  req.want_argmax = true;
  ForwardOutput o;
  model_->forward(s, req, &o);
  model_->accept_windows(accepted.data(), next.data());
  const ops::SettledRow beyond{a, 2};
  expect_error(
      [&] {
        model_->settle_windows(s, {&beyond, 1}, accepted.data());
      },
      "accepted entry 2 of 2");
  const ops::SettledRow twice[] = {{a, 0}, {a, 0}};
  expect_error([&] { model_->settle_windows(s, twice, accepted.data()); }, "listed twice");
  EXPECT_TRUE(s.window_open(a));
  const ops::SettledRow both[] = {{a, 0}, {c, 1}};
  model_->settle_windows(s, both, accepted.data());
  EXPECT_EQ(s.length(a), 5);
  EXPECT_EQ(s.unresolved_tokens(a), 2);
  expect_error([&] { model_->settle_windows(s, both, accepted.data()); }, "no speculative window");
  // Unresolved rows take decode forwards, not prompt forwards.
  const RowInput one{a, 1, false};
  ForwardRequest prompt{{w.data(), 1}, {&one, 1}, false, false};
  prompt.prompt = true;
  expect_error([&] { model_->forward(s, prompt, &o); }, "settled on the device");
  for (int64_t bad : {int64_t{0}, int64_t{4}})
    expect_error([&] { s.resolve_settled(a, bad); }, "must be 1..3");
  s.resolve_settled(a, 3);
  EXPECT_EQ(s.length(a), 7);
  EXPECT_EQ(s.unresolved_commits(a), 0);
  expect_error([&] { s.resolve_settled(a, 1); }, "no commit settled on the device");
  // Closing a row drops what it had not resolved.
  s.close_row(c);
  EXPECT_EQ(s.unresolved_commits(s.open_row()), 0);
}

INSTANTIATE_TEST_SUITE_P(Strategies, Rollback,
                         ::testing::Values(RecurrentRollback::PerPositionStates,
                                           RecurrentRollback::Replay),
                         [](const ::testing::TestParamInfo<RecurrentRollback>& info) {
                           return strategy_name(info.param);
                         });

}  // namespace
}  // namespace tandem
