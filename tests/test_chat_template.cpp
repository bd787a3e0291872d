// ChatTemplate against Python: every case of tests/fixtures/chat_templates/*.cases.json (made by
// tools/make_chat_template_fixtures.py with jinja2 in transformers' rendering environment) must
// render to the same bytes, or fail with the same exception type and message. Plus loading from a
// model directory (chat_template.jinja, tokenizer_config.json forms, the demo model).
#include <gtest/gtest.h>

#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "tandem/core/error.h"
#include "tandem/io/chat_template.h"
#include "test_util.h"

namespace tandem {
namespace {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;
using tandem::testing::ScratchDir;
using tandem::testing::write_text;

const fs::path kFixtures = fs::path(TANDEM_FIXTURES_DIR) / "chat_templates";

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The fixtures' strftime_now() instant (their "strftime_now" field), as local time.
jinja::RenderOptions fixture_options(const ojson& when) {
  jinja::RenderOptions o;
  o.clock = [when] {
    jinja::LocalTime t;
    t.tm.tm_year = when[0].get<int>() - 1900;
    t.tm.tm_mon = when[1].get<int>() - 1;
    t.tm.tm_mday = when[2].get<int>();
    t.tm.tm_hour = when[3].get<int>();
    t.tm.tm_min = when[4].get<int>();
    t.tm.tm_sec = when[5].get<int>();
    timegm(&t.tm);  // fills tm_wday and tm_yday
    t.microsecond = when[6].get<int>();
    return t;
  };
  return o;
}

std::optional<std::string> token(const ojson& tokens, const char* key) {
  if (!tokens.contains(key)) return std::nullopt;
  return tokens[key].get<std::string>();
}

// Renders every case of one fixture file; returns how many there were.
size_t check_fixture(const fs::path& cases_path) {
  // ordered_json: the conversations' key order is part of the expected output (|tojson).
  const ojson doc = ojson::parse(read_file(cases_path));
  const fs::path template_path = kFixtures / doc["template"].get<std::string>();
  const ojson& tokens = doc["special_tokens"];
  ChatTemplate ct =
      ChatTemplate::from_source(read_file(template_path), token(tokens, "bos_token"),
                                token(tokens, "eos_token"), doc["template"].get<std::string>());
  ct.set_options(fixture_options(doc["strftime_now"]));
  size_t n = 0;
  for (const ojson& c : doc["cases"]) {
    SCOPED_TRACE(doc["template"].get<std::string>() + " / " + c["name"].get<std::string>());
    const ojson& conv = doc["conversations"][c["conversation"].get<std::string>()];
    ++n;
    try {
      const std::string out = ct.render(conv["messages"], c["add_generation_prompt"].get<bool>(),
                                        conv["tools"], c["extra"]);
      if (c.contains("output"))
        EXPECT_EQ(out, c["output"].get<std::string>());
      else
        ADD_FAILURE() << "expected " << c["error"].dump() << ", got output:\n" << out;
    } catch (const Error& e) {
      if (!c.contains("error")) {
        ADD_FAILURE() << "unexpected error: " << e.what();
        continue;
      }
      const std::string expected =
          c["error"]["type"].get<std::string>() + ": " + c["error"]["message"].get<std::string>();
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos)
          << "expected '" << expected << "' in: " << e.what();
    }
  }
  return n;
}

TEST(ChatTemplateFixtures, RenderLikeTransformers) {
  size_t files = 0, cases = 0;
  for (const auto& entry : fs::directory_iterator(kFixtures)) {
    const std::string name = entry.path().filename().string();
    if (name.size() < 11 || name.substr(name.size() - 11) != ".cases.json") continue;
    const size_t n = check_fixture(entry.path());
    EXPECT_GE(n, 40u) << name;
    ++files;
    cases += n;
  }
  // Qwen3.5, GLM-5.1, Qwen3, Qwen3-Coder, GLM-4.6 and the demo model.
  EXPECT_EQ(files, 6u);
  EXPECT_GE(cases, 270u);
}

TEST(ChatTemplateLoad, DemoModelTemplate) {
  // models/qwen35-demo keeps its template in tokenizer_config.json (bos_token null, eos_token a
  // string); it renders like the fixture made from the same text.
  const auto ct = ChatTemplate::load(std::string(TANDEM_SOURCE_DIR) + "/models/qwen35-demo");
  ASSERT_TRUE(ct.has_value());
  EXPECT_EQ(ct->source(), read_file(kFixtures / "qwen35_demo.jinja"));
  ASSERT_EQ(ct->special_tokens().size(), 2u);  // eos_token, pad_token
  EXPECT_EQ(ct->special_tokens()[0].first, "eos_token");
  const ojson messages = ojson::parse(R"([{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Hi"}])");
  EXPECT_EQ(ct->render(messages, true),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\n");
  EXPECT_EQ(ct->render(messages, false),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n");
}

TEST(ChatTemplateLoad, SourcesAndTokenForms) {
  ScratchDir dir("chat-template");
  // No template anywhere.
  EXPECT_FALSE(ChatTemplate::load(dir.str()).has_value());
  write_text(dir.file("tokenizer_config.json"), R"({"bos_token": null,
      "eos_token": {"content": "</s>", "lstrip": false}, "pad_token": "<pad>"})");
  EXPECT_FALSE(ChatTemplate::load(dir.str()).has_value());

  // Named templates: "default" is used.
  write_text(dir.file("tokenizer_config.json"), R"({"bos_token": "<s>",
      "eos_token": {"content": "</s>", "lstrip": false},
      "chat_template": [{"name": "tool_use", "template": "tools"},
                        {"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"}]})");
  auto ct = ChatTemplate::load(dir.str());
  ASSERT_TRUE(ct.has_value());
  EXPECT_EQ(ct->render(ojson::parse(R"([{"role": "user", "content": "x"}])"), false), "<s>x</s>");

  // chat_template.jinja wins over tokenizer_config.json; the tokens still come from the config.
  write_text(dir.file("chat_template.jinja"), "J{{ bos_token }}{{ eos_token }}{{ pad_token }}\n");
  ct = ChatTemplate::load(dir.str());
  ASSERT_TRUE(ct.has_value());
  EXPECT_EQ(ct->render(ojson::array(), false), "J<s></s>");  // this config has no pad_token
  EXPECT_NE(ct->name().find("chat_template.jinja"), std::string::npos);

  // Named templates without a default.
  fs::remove(dir.file("chat_template.jinja"));
  write_text(dir.file("tokenizer_config.json"),
             R"({"chat_template": [{"name": "rag", "template": "r"}]})");
  try {
    ChatTemplate::load(dir.str());
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("none named \"default\""), std::string::npos) << e.what();
  }
}

TEST(ChatTemplateLoad, ParseErrorsNameTheFile) {
  ScratchDir dir("chat-template-bad");
  write_text(dir.file("chat_template.jinja"), "ok\n{% for m in messages %}{{ m.content }");
  try {
    ChatTemplate::load(dir.str());
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(dir.file("chat_template.jinja")), std::string::npos) << what;
    EXPECT_NE(what.find("line 2"), std::string::npos) << what;
    EXPECT_NE(what.find("TemplateSyntaxError"), std::string::npos) << what;
  }
  write_text(dir.file("chat_template.jinja"), "\xff\xfe bad bytes");
  EXPECT_THROW(ChatTemplate::load(dir.str()), Error);
}

TEST(ChatTemplateRender, VariablesAndErrors) {
  const ChatTemplate ct = ChatTemplate::from_source(
      "{% if messages|length == 0 %}{{ raise_exception('Conversation is empty: ' ~ "
      "messages|length) }}"
      "{% endif %}{{ bos_token is defined }} {{ tools is none }} {{ documents is none }} "
      "{{ add_generation_prompt }} {{ enable_thinking | default('unset') }} "
      "{{ tools|tojson if tools else '' }}",
      std::nullopt, "<eos>", "inline");
  const ojson msgs = ojson::parse(R"([{"role": "user", "content": "hi"}])");
  EXPECT_EQ(ct.render(msgs, true), "False True True True unset ");
  EXPECT_EQ(ct.render(msgs, false, ojson::parse(R"([{"b": 1, "a": 2}])"),
                      ojson::parse(R"({"enable_thinking": false})")),
            R"(False False True False False [{"b": 1, "a": 2}])");
  // raise_exception becomes an Error carrying the template's message.
  try {
    ct.render(ojson::array(), true);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("TemplateError: Conversation is empty: 0"),
              std::string::npos)
        << e.what();
  }
  // Reserved names cannot be overridden through extra variables (Python: TypeError).
  EXPECT_THROW(ct.render(msgs, true, nullptr, ojson::parse(R"({"messages": []})")), Error);
  EXPECT_THROW(ct.render(ojson::object(), true), Error);
  EXPECT_THROW(ct.render(msgs, true, ojson::object()), Error);
}

TEST(ChatTemplateRender, StrftimeNowUsesTheClock) {
  ChatTemplate ct = ChatTemplate::from_source("{{ strftime_now('%d %b %Y') }}", std::nullopt,
                                              std::nullopt, "date");
  ct.set_options(fixture_options(ojson::parse("[2025, 7, 4, 10, 0, 0, 0]")));
  EXPECT_EQ(ct.render(ojson::array(), false), "04 Jul 2025");
  // Without a clock it is today's date: just check the shape.
  ChatTemplate now =
      ChatTemplate::from_source("{{ strftime_now('%Y') }}", std::nullopt, std::nullopt, "now");
  EXPECT_EQ(now.render(ojson::array(), false).size(), 4u);
}

TEST(ChatTemplateRender, LongConversationsFitTheDefaultLimits) {
  // The step budget must leave ample room for real conversations: 6000 messages with reasoning,
  // tool calls and tool results through the Qwen3.5 template (Python takes about 0.1 s).
  ChatTemplate ct = ChatTemplate::from_source(read_file(kFixtures / "qwen3_5.jinja"), std::nullopt,
                                              "<|im_end|>", "qwen3_5");
  ojson messages = ojson::array();
  messages.push_back({{"role", "system"}, {"content", "You are helpful."}});
  for (int i = 0; i < 2000; ++i) {
    messages.push_back({{"role", "user"}, {"content", "Question " + std::to_string(i)}});
    messages.push_back(
        {{"role", "assistant"},
         {"content", "<think>\nstep " + std::to_string(i) + "\n</think>\n\nAnswer."},
         {"tool_calls",
          {{{"type", "function"},
            {"function",
             {{"name", "get_weather"}, {"arguments", {{"city", "Paris"}, {"days", i}}}}}}}}});
    messages.push_back({{"role", "tool"}, {"content", "result " + std::to_string(i)}});
  }
  const ojson tools =
      ojson::parse(R"([{"type": "function", "function": {"name": "get_weather"}}])");
  const std::string out = ct.render(messages, true, tools);
  EXPECT_GT(out.size(), 400000u);
  const std::string tail = "<|im_start|>assistant\n<think>\n";
  EXPECT_EQ(out.substr(out.size() - tail.size()), tail);
}

TEST(ChatTemplateRender, PlainJsonArgumentsConvert) {
  // A server holding nlohmann::json (sorted keys) can pass it directly.
  const ChatTemplate ct =
      ChatTemplate::from_source("{{ messages[0].content }}", std::nullopt, std::nullopt, "plain");
  const nlohmann::json msgs = nlohmann::json::parse(R"([{"role": "user", "content": "ok"}])");
  EXPECT_EQ(ct.render(msgs, false), "ok");
}

}  // namespace
}  // namespace tandem
