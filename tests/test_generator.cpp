// Plain greedy generation runs its decode steps pipelined (a step is queued before the host has
// seen the previous step's token, which it reads from device memory). These tests hold it to the
// simplest loop that defines it: one forward per token from host tokens, stop rules applied
// after each. Rows stop by EOS and by length at different steps inside one batch.
#include <gtest/gtest.h>

#include <filesystem>

#include "demo_model.h"
#include "tandem/engine/generator.h"
#include "test_util.h"

namespace tandem {
namespace {

// One request alone, one forward per token, tokens through the host.
GenerateResult step_by_step(const Qwen35Model& m, const GenerateRequest& r) {
  Qwen35State st(m.config());
  const int slot = st.open_row();
  ForwardOutput out;
  std::vector<RowInput> rows = {{slot, static_cast<int64_t>(r.prompt.size())}};
  ForwardRequest f{r.prompt, rows, false, false};
  f.prompt = true;
  f.want_logits = false;
  f.want_argmax = true;
  m.forward(st, f, &out);
  GenerateResult res;
  int32_t tok = out.argmax.at(0);
  while (!append_token(r, m.config().eos_token_ids, tok, &res)) {
    rows = {{slot, 1}};
    const std::vector<int32_t> in = {tok};
    ForwardRequest s{in, rows, false, false};
    s.want_logits = false;
    s.want_argmax = true;
    m.forward(st, s, &out);
    tok = out.argmax.at(0);
  }
  return res;
}

// The demo model with a frequent token (newline) made EOS, so requests stop mid-run.
std::unique_ptr<Qwen35Model> demo_with_newline_eos(const testing::ScratchDir& dir,
                                                   const Tokenizer& tok) {
  namespace fs = std::filesystem;
  const fs::path m = dir.path() / "m";
  fs::create_directories(m);
  for (const char* f : {"config.json", "model.safetensors", "tokenizer.json"})
    fs::create_symlink(fs::path(test::kDemoDir) / f, m / f);
  testing::write_text((m / "generation_config.json").string(),
                      "{\"eos_token_id\": [0, " + std::to_string(tok.encode("\n").at(0)) + "]}");
  return Qwen35Model::load(m.string());
}

TEST(PipelinedGreedy, EqualsOneForwardPerTokenWithRowsStoppingAtDifferentSteps) {
  testing::ScratchDir dir("gen-eos");
  const Tokenizer tok = Tokenizer::load(test::kDemoDir + "/tokenizer.json");
  auto model = demo_with_newline_eos(dir, tok);
  std::vector<GenerateRequest> reqs;
  const int64_t max_tokens[] = {1, 2, 7, 40, 40, 25};
  for (size_t i = 0; i < std::size(max_tokens); ++i) {
    GenerateRequest r;
    r.prompt = tok.encode(test::kDemoPrompts[i % test::kDemoPrompts.size()] + "    x = ");
    r.max_tokens = max_tokens[i];
    r.ignore_eos = i == 4;  // runs to its length through the others' EOS
    reqs.push_back(r);
  }
  std::vector<std::pair<size_t, int32_t>> streamed;
  GenerateStats stats;
  const auto got = Generator(*model).run(
      reqs, [&](size_t i, int32_t t) { streamed.emplace_back(i, t); }, &stats);
  int stopped = 0, by_length = 0;
  size_t total = 0;
  for (size_t i = 0; i < reqs.size(); ++i) {
    const GenerateResult want = step_by_step(*model, reqs[i]);
    EXPECT_EQ(got[i].tokens, want.tokens) << "request " << i;
    EXPECT_EQ(got[i].finish, want.finish) << "request " << i;
    stopped += want.finish == FinishReason::Stop;
    by_length += want.finish == FinishReason::Length && want.tokens.size() > 2;
    total += got[i].tokens.size();
    // The callback saw exactly the request's tokens, in order.
    std::vector<int32_t> seen;
    for (const auto& [j, t] : streamed)
      if (j == i) seen.push_back(t);
    EXPECT_EQ(seen, got[i].tokens) << "request " << i;
  }
  EXPECT_GT(stopped, 0) << "no request stopped on EOS";
  EXPECT_GT(by_length, 0) << "no request ran to its length";
  // Dropped tokens (a step past a row's EOS) are not counted as decoded.
  EXPECT_EQ(stats.decode_tokens + static_cast<int64_t>(reqs.size()), static_cast<int64_t>(total));
}

// The forward flags the pipeline uses refuse what they cannot honour, before any state changes.
TEST(PipelinedGreedy, ForwardFlagsCheckTheirPreconditions) {
  auto demo = test::load_demo_model();
  const Qwen35Model& m = *demo->model;
  Qwen35State st(m.config());
  const int a = st.open_row(), b = st.open_row();
  const std::vector<int32_t> prompt = demo->tok->encode("def f(x):\n");
  ForwardOutput out;
  std::vector<int32_t> ids;
  EXPECT_THROW(m.collect_argmax(&ids), Error);  // nothing pending
  const int64_t n = static_cast<int64_t>(prompt.size());
  std::vector<RowInput> rows = {{a, n}};
  ForwardRequest p{prompt, rows, false, false};
  p.want_logits = false;
  p.want_argmax = true;
  m.forward(st, p, &out);
  // From the argmax: another row than the one it was computed for, or host tokens as well.
  std::vector<RowInput> other = {{b, 1}};
  ForwardRequest wrong{{}, other, false, false};
  wrong.want_argmax = true;
  wrong.tokens_from_argmax = true;
  try {
    m.forward(st, wrong, &out);
    ADD_FAILURE() << "tokens_from_argmax accepted another row";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("slot"), std::string::npos) << e.what();
  }
  EXPECT_EQ(st.length(b), 0);
  Qwen35State other_state(m.config());
  const int c = other_state.open_row();
  ASSERT_EQ(c, a);  // the same slot number, in another state
  std::vector<RowInput> same_slot = {{c, 1}};
  ForwardRequest elsewhere{{}, same_slot, false, false};
  elsewhere.tokens_from_argmax = true;
  EXPECT_THROW(m.forward(other_state, elsewhere, &out), Error);
  EXPECT_EQ(other_state.length(c), 0);
  const std::vector<int32_t> one = {prompt[0]};
  std::vector<RowInput> same = {{a, 1}};
  ForwardRequest both{one, same, false, false};
  both.tokens_from_argmax = true;
  EXPECT_THROW(m.forward(st, both, &out), Error);
  ForwardRequest no_argmax{one, same, false, false};
  no_argmax.defer_argmax = true;  // without want_argmax
  EXPECT_THROW(m.forward(st, no_argmax, &out), Error);
  EXPECT_EQ(st.length(a), n);
  // Deferred copies queue up to kMaxDeferred and come back oldest first: the chain of greedy
  // tokens equals the host-fed one.
  ForwardRequest chain{{}, same, false, false};
  chain.want_logits = false;
  chain.want_argmax = true;
  chain.defer_argmax = true;
  chain.tokens_from_argmax = true;
  m.forward(st, chain, &out);
  EXPECT_TRUE(out.argmax.empty());
  m.forward(st, chain, &out);
  EXPECT_THROW(m.forward(st, chain, &out), Error);  // a third one pending
  std::vector<int32_t> first, second;
  m.collect_argmax(&first);
  m.collect_argmax(&second);
  EXPECT_THROW(m.collect_argmax(&ids), Error);
  Qwen35State ref(m.config());
  const int r = ref.open_row();
  rows = {{r, n}};
  ForwardRequest rp{prompt, rows, false, false};
  rp.want_logits = false;
  rp.want_argmax = true;
  m.forward(ref, rp, &out);
  std::vector<int32_t> want;
  for (int k = 0; k < 2; ++k) {
    const std::vector<int32_t> in = {out.argmax.at(0)};
    rows = {{r, 1}};
    ForwardRequest s{in, rows, false, false};
    s.want_logits = false;
    s.want_argmax = true;
    m.forward(ref, s, &out);
    want.push_back(out.argmax.at(0));
  }
  EXPECT_EQ((std::vector<int32_t>{first.at(0), second.at(0)}), want);
}

}  // namespace
}  // namespace tandem
