// Replays, in the normal test suite (g++, no libFuzzer), every saved input of the fuzz targets:
// the seed corpora (fuzz/corpus/<target>/) and every input that once crashed a target
// (fuzz/regressions/<target>/). The target files themselves are compiled here with
// TANDEM_FUZZ_REPLAY, so the checks are exactly the fuzzer's, and a broken invariant or an
// unexpected exception fails the test naming the file instead of aborting.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#define TANDEM_FUZZ_REPLAY 1
#include "../fuzz/fuzz_api_request.cpp"
#include "../fuzz/fuzz_chat_messages.cpp"
#include "../fuzz/fuzz_chat_template.cpp"
#include "../fuzz/fuzz_prefix_file.cpp"
#include "../fuzz/fuzz_safetensors.cpp"
#include "../fuzz/fuzz_tokenizer.cpp"

namespace tandem::fuzz {
namespace {

namespace fs = std::filesystem;

const fs::path kFuzzDir = fs::path(TANDEM_SOURCE_DIR) / "fuzz";

std::vector<uint8_t> read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// The files of fuzz/<kind>/<target>/, sorted (none when the folder does not exist).
std::vector<fs::path> inputs(const std::string& kind, const std::string& target) {
  std::vector<fs::path> files;
  const fs::path dir = kFuzzDir / kind / target;
  if (fs::is_directory(dir))
    for (const auto& entry : fs::directory_iterator(dir))
      if (entry.is_regular_file()) files.push_back(entry.path());
  std::sort(files.begin(), files.end());
  return files;
}

// Runs every seed and regression input of `target` through `run_one`; returns how many ran.
template <class RunOne>
size_t replay(const std::string& target, RunOne run_one) {
  size_t count = 0;
  for (const char* kind : {"corpus", "regressions"}) {
    for (const fs::path& file : inputs(kind, target)) {
      SCOPED_TRACE(file.string());
      const std::vector<uint8_t> bytes = read_bytes(file);
      EXPECT_NO_THROW(run_one(bytes.data(), bytes.size()));
      ++count;
    }
  }
  return count;
}

TEST(FuzzRegressions, ApiRequest) {
  EXPECT_GT(replay("fuzz_api_request", api_request::run_one), 0u);
}

TEST(FuzzRegressions, Tokenizer) {
  EXPECT_GT(replay("fuzz_tokenizer", tokenizer::run_one), 0u);
}

TEST(FuzzRegressions, Safetensors) {
  EXPECT_GT(replay("fuzz_safetensors", safetensors::run_one), 0u);
}

TEST(FuzzRegressions, ChatTemplate) {
  EXPECT_GT(replay("fuzz_chat_template", chat_template::run_one), 0u);
}

TEST(FuzzRegressions, ChatMessages) {
  EXPECT_GT(replay("fuzz_chat_messages", chat_messages::run_one), 0u);
}

TEST(FuzzRegressions, PrefixFile) {
  EXPECT_GT(replay("fuzz_prefix_file", prefix_file::run_one), 0u);
}

// The status and parameter a request body is refused with; 200 if both parsers accept it.
std::pair<int, std::string> refusal(const std::string& text) {
  try {
    const nlohmann::ordered_json body = server::parse_request_body(text);
    server::parse_chat_request(body);
    server::parse_completion_request(body);
  } catch (const server::ApiError& e) {
    return {e.status(), e.param()};
  }
  return {200, ""};
}

// What the api_request regressions were, stated as the answers they now get.
TEST(FuzzRegressions, ApiRequestAnswers) {
  // A number beyond a double's range is nlohmann's out_of_range, not parse_error: it escaped
  // the server's catch and became a 500.
  EXPECT_EQ(refusal("1e400{").first, 400);
  EXPECT_EQ(refusal(R"({"model": "m", "prompt": "x", "max_tokens": 1e400})").first, 400);
  // 2^63 as a double passed the range check of an int64 parameter into an overflowing cast.
  EXPECT_EQ(refusal(R"({"model": "m", "prompt": "x", "seed": 9223372036854775808.0})"),
            (std::pair<int, std::string>{400, "seed"}));
  EXPECT_EQ(refusal(R"({"model": "m", "messages": [{"role": "user", "content": "x"}],
                        "prompt": "x", "seed": 9223372036854775807.0})")
                .first,
            400);
  EXPECT_EQ(refusal(R"({"model": "m", "messages": [{"role": "user", "content": "x"}],
                        "prompt": "x", "seed": -9223372036854775808.0})")
                .first,
            200);
}

// A body of nested brackets: copying the messages recursed once per level and overflowed the
// stack. 200,000 levels (400 KB, well under the server's 8 MB body limit) overflow an 8 MB stack
// in any build; the parsers must refuse the body before copying anything.
TEST(FuzzRegressions, DeeplyNestedBodies) {
  const auto nested = [](size_t levels) {
    return std::string(levels, '[') + std::string(levels, ']');
  };
  const std::string deep = nested(200'000);
  const std::string chat = R"({"model": "m", "messages": [{"role": "user", "content": "x")";
  EXPECT_EQ(refusal(chat + R"(, "extra": )" + deep + "}]}").first, 400);
  EXPECT_EQ(refusal(chat + R"(}], "tools": )" + deep + "}").first, 400);
  // The limit: the body object is level 1, so 255 more levels pass and 256 do not.
  const auto with_depth = [](const std::string& extra) {
    return R"({"model": "m", "prompt": "x", "messages": [{"role": "user", "content": "x"}],
              "extra": )" +
           extra + "}";
  };
  EXPECT_EQ(refusal(with_depth(nested(255))).first, 200);
  EXPECT_EQ(refusal(with_depth(nested(256))), (std::pair<int, std::string>{400, ""}));
}

// A shape whose leading dims overflow int64 before a zero dim empties it: the byte count is 0,
// so it passed, and TensorView::numel() then overflowed.
TEST(FuzzRegressions, SafetensorsElementCount) {
  const fs::path file =
      kFuzzDir / "regressions/fuzz_safetensors/numel_overflow_behind_zero_dim.safetensors";
  try {
    SafetensorsFile::open(file.string());
    ADD_FAILURE() << "opened " << file;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("has more than 2^63 - 1 elements"), std::string::npos)
        << e.what();
  }
}

// The checks themselves must be able to fail, or the replays above prove nothing.
TEST(FuzzRegressions, ChecksCatchBrokenInvariants) {
  EXPECT_THROW(fail("x"), Failure);
  EXPECT_EQ(tokenizer::expected_bytes("a<|im_end|>e\xCC\x81", true, false,
                                      {"<|im_end|>", "<|im_start|>"}),
            "a<|im_end|>\xC3\xA9");
  EXPECT_EQ(tokenizer::expected_bytes("a<|im_end|>b", true, true, {"<|im_end|>"}), "ab");
  EXPECT_EQ(tokenizer::expected_bytes("a<|im_end|>b", false, false, {"<|im_end|>"}),
            "a<|im_end|>b");
}

}  // namespace
}  // namespace tandem::fuzz
