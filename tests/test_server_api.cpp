// The server's request parsing and stop-string text, below HTTP: what the end-to-end tests
// (tests/server/) and the request-body fuzz target rely on.
#include <gtest/gtest.h>

#include "demo_model.h"
#include "tandem/server/api_error.h"
#include "tandem/server/api_request.h"
#include "tandem/server/stop_text.h"

namespace tandem::server {
namespace {

using json = nlohmann::ordered_json;

int status_of(const json& body, bool chat = true) {
  try {
    chat ? parse_chat_request(body) : parse_completion_request(body);
  } catch (const ApiError& e) {
    return e.status();
  }
  return 200;
}

TEST(ApiRequest, ChatDefaultsAndFields) {
  const json body = {
      {"model", "m"},
      {"messages",
       {{{"role", "user"},
         {"content", {{{"type", "text"}, {"text", "a"}}, {{"type", "text"}, {"text", "b"}}}}}}},
      {"max_completion_tokens", 7},
      {"temperature", 0},
      {"top_k", -1},
      {"seed", -3},
      {"stop", "x"},
      {"logprobs", true},
      {"top_logprobs", 4},
      {"chat_template_kwargs", {{"enable_thinking", false}}}};
  const ApiRequest r = parse_chat_request(body);
  EXPECT_EQ(r.messages[0]["content"], "ab");
  EXPECT_EQ(*r.max_tokens, 7);
  EXPECT_TRUE(r.sampling.greedy());
  EXPECT_EQ(r.sampling.top_k, 0);
  EXPECT_TRUE(r.seed_given);
  EXPECT_EQ(r.sampling.seed, static_cast<uint64_t>(-3));
  EXPECT_EQ(r.stop, std::vector<std::string>{"x"});
  EXPECT_EQ(r.top_logprobs, 4);
  EXPECT_EQ(r.template_kwargs["enable_thinking"], false);
  // OpenAI's default temperature is 1.
  EXPECT_EQ(
      parse_chat_request({{"model", "m"}, {"messages", {{{"role", "user"}, {"content", "x"}}}}})
          .sampling.temperature,
      1.0f);
}

TEST(ApiRequest, CompletionPromptForms) {
  EXPECT_EQ(*parse_completion_request({{"model", "m"}, {"prompt", "hi"}}).prompt_text, "hi");
  EXPECT_EQ(*parse_completion_request({{"model", "m"}, {"prompt", {"hi"}}}).prompt_text, "hi");
  EXPECT_EQ(parse_completion_request({{"model", "m"}, {"prompt", {1, 2}}}).prompt_ids,
            (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(parse_completion_request({{"model", "m"}, {"prompt", {{3, 4}}}}).prompt_ids,
            (std::vector<int32_t>{3, 4}));
  EXPECT_EQ(*parse_completion_request({{"model", "m"}, {"prompt", "x"}}).max_tokens, 16);
}

TEST(ApiRequest, BadValuesAre400NamingTheParameter) {
  const json msgs = {{{"role", "user"}, {"content", "x"}}};
  for (const json& extra :
       {json{{"temperature", -1}}, json{{"temperature", nullptr}, {"top_p", 1.5}},
        json{{"max_tokens", 1e30}}, json{{"max_tokens", -5}}, json{{"seed", 1.5}},
        json{{"stop", json::array({"a", 7})}}, json{{"n", 3}}, json{{"logit_bias", {{"1", 5}}}},
        json{{"top_k", "x"}}, json{{"min_p", 2}}, json{{"stream_options", 1}},
        json{{"max_tokens", 3}, {"max_completion_tokens", 4}}}) {
    json body = {{"model", "m"}, {"messages", msgs}};
    body.update(extra);
    EXPECT_EQ(status_of(body), 400) << extra.dump();
  }
  try {
    parse_chat_request({{"model", "m"}, {"messages", msgs}, {"top_p", 0}});
    FAIL();
  } catch (const ApiError& e) {
    EXPECT_EQ(e.param(), "top_p");
  }
  // null means "not given".
  EXPECT_EQ(status_of({{"model", "m"}, {"messages", msgs}, {"temperature", nullptr}}), 200);
  // Invalid UTF-8 that reached a json value some other way than the parser.
  EXPECT_EQ(status_of({{"model", "m"}, {"messages", {{{"role", "user"}, {"content", "\xff"}}}}}),
            400);
}

class StopTextTest : public ::testing::Test {
 protected:
  static test::DemoModel& demo() {
    static test::DemoModel* d = test::load_demo_model().release();
    return *d;
  }
  // The text StopText sends for `text`'s tokens, and whether it stopped.
  static std::pair<std::string, bool> run(const std::string& text, std::vector<std::string> stop) {
    const Tokenizer& tok = *demo().tok;
    StopText st(tok, std::move(stop));
    std::string out;
    bool stopped = false;
    for (int32_t id : tok.encode(text)) {
      const auto p = st.push(id);
      out += p.text;
      if (p.stopped) {
        stopped = true;
        break;
      }
    }
    if (!stopped) out += st.finish();
    return {out, stopped};
  }
};

TEST_F(StopTextTest, CutsBeforeTheFirstStopAcrossTokens) {
  EXPECT_EQ(run("def f(x):\n    return x\n", {"return"}),
            std::make_pair(std::string("def f(x):\n    "), true));
  EXPECT_EQ(run("def f(x):\n    return x\n", {"urn x", "f("}),
            std::make_pair(std::string("def "), true));
  // A prefix of a stop string that never completes is released at the end.
  EXPECT_EQ(run("abc ret", {"return"}), std::make_pair(std::string("abc ret"), false));
  EXPECT_EQ(run("plain text", {}), std::make_pair(std::string("plain text"), false));
  // Multi-byte text survives the holding back.
  EXPECT_EQ(run("caf\xc3\xa9 \xe2\x82\xac!", {"\xe2\x82\xac"}),
            std::make_pair(std::string("caf\xc3\xa9 "), true));
}

TEST_F(StopTextTest, NeverSendsTextItTakesBack) {
  const Tokenizer& tok = *demo().tok;
  StopText st(tok, {"ABCD"});
  std::string sent;
  for (int32_t id : tok.encode("xx ABC ABCD yy")) {
    const auto p = st.push(id);
    sent += p.text;
    ASSERT_EQ(sent.find("ABCD"), std::string::npos);
    if (p.stopped) break;
  }
  EXPECT_EQ(sent, "xx ABC ");
}

}  // namespace
}  // namespace tandem::server
