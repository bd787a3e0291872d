// Tokenizer tests. Unit tests build tiny tokenizer.json documents here, with the byte alphabet
// at ids 0..255 (id == byte value) so expected ids can be written by hand; the fixture test
// compares against ids recorded from Hugging Face tokenizers (tools/make_tokenizer_fixture.py).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <thread>

#include "tandem/core/error.h"
#include "tandem/io/tokenizer.h"
#include "tandem/io/unicode_nfc.h"

namespace tandem {
namespace {

using json = nlohmann::json;
using Ids = std::vector<int32_t>;

constexpr const char* kQwen2Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|)"
    R"(\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kQwen35Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|)"
    R"( ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// GPT-2 bytes_to_unicode, written out independently of the implementation under test.
std::string byte_char(uint8_t b) {
  uint32_t cp = b;
  if (!((b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE)) {
    uint32_t n = 0;
    for (uint32_t x = 0; x < b; ++x)
      if (!((x >= 0x21 && x <= 0x7E) || (x >= 0xA1 && x <= 0xAC) || x >= 0xAE)) ++n;
    cp = 256 + n;
  }
  std::string s;
  if (cp < 0x80) {
    s.push_back(static_cast<char>(cp));
  } else {
    s.push_back(static_cast<char>(0xC0 | cp >> 6));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
  return s;
}

// Byte-level form of raw bytes, as it appears in vocab and merges.
std::string bl(std::string_view raw) {
  std::string s;
  for (char c : raw) s += byte_char(static_cast<uint8_t>(c));
  return s;
}

json qwen_pre_tokenizer(const char* pattern = kQwen2Pattern) {
  return {{"type", "Sequence"},
          {"pretokenizers",
           {{{"type", "Split"},
             {"pattern", {{"Regex", pattern}}},
             {"behavior", "Isolated"},
             {"invert", false}},
            {{"type", "ByteLevel"},
             {"add_prefix_space", false},
             {"trim_offsets", false},
             {"use_regex", false}}}}};
}

json added_token(int id, const std::string& content, bool special, bool normalized = false,
                 bool lstrip = false, bool rstrip = false, bool single_word = false) {
  return {{"id", id},          {"content", content}, {"single_word", single_word},
          {"lstrip", lstrip},  {"rstrip", rstrip},   {"normalized", normalized},
          {"special", special}};
}

// A tokenizer.json in Qwen's layout. Byte b has id b; merge i (raw bytes) creates id 256 + i.
struct Spec {
  std::vector<std::pair<std::string, std::string>> merges;
  json normalizer = {{"type", "NFC"}};
  json pre_tokenizer = qwen_pre_tokenizer();
  json added_tokens = json::array();
  json extra_vocab = json::object();  // byte-level form -> id
  bool legacy_merges = false;
  bool ignore_merges = false;

  json to_json() const {
    json vocab = json::object();
    for (int b = 0; b < 256; ++b) vocab[byte_char(static_cast<uint8_t>(b))] = b;
    json merge_list = json::array();
    int next = 256;
    for (const auto& [a, b] : merges) {
      if (!vocab.contains(bl(a + b))) vocab[bl(a + b)] = next++;
      if (legacy_merges)
        merge_list.push_back(bl(a) + " " + bl(b));
      else
        merge_list.push_back({bl(a), bl(b)});
    }
    for (const auto& [k, v] : extra_vocab.items()) vocab[k] = v;
    return {{"version", "1.0"},
            {"truncation", nullptr},
            {"padding", nullptr},
            {"added_tokens", added_tokens},
            {"normalizer", normalizer},
            {"pre_tokenizer", pre_tokenizer},
            {"post_processor",
             {{"type", "ByteLevel"},
              {"add_prefix_space", false},
              {"trim_offsets", false},
              {"use_regex", false}}},
            {"decoder",
             {{"type", "ByteLevel"},
              {"add_prefix_space", true},
              {"trim_offsets", true},
              {"use_regex", true}}},
            {"model",
             {{"type", "BPE"},
              {"dropout", nullptr},
              {"unk_token", nullptr},
              {"continuing_subword_prefix", ""},
              {"end_of_word_suffix", ""},
              {"fuse_unk", false},
              {"byte_fallback", false},
              {"ignore_merges", ignore_merges},
              {"vocab", vocab},
              {"merges", merge_list}}}};
  }
  Tokenizer build() const { return Tokenizer::from_json(to_json().dump(), "test.json"); }
};

// Ids of raw byte strings: each must be a single token of the tokenizer.
Ids ids_of(const Tokenizer& tok, std::initializer_list<std::string_view> pieces) {
  Ids ids;
  for (std::string_view p : pieces) {
    auto id = tok.token_id(bl(p));
    EXPECT_TRUE(id.has_value()) << "no token for \"" << p << "\"";
    ids.push_back(id.value_or(-1));
  }
  return ids;
}

std::string stream_decode(const Tokenizer& tok, const Ids& ids, bool skip_special = false,
                          std::vector<std::string>* chunks = nullptr) {
  auto stream = tok.stream_decoder(skip_special);
  std::string text;
  for (int32_t id : ids) {
    std::string chunk = stream.push(id);
    if (chunks) chunks->push_back(chunk);
    text += chunk;
  }
  text += stream.finish();
  return text;
}

bool well_formed_utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<uint8_t>(s[i]);
    size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (len == 0 || i + len > s.size()) return false;
    for (size_t k = 1; k < len; ++k)
      if ((static_cast<uint8_t>(s[i + k]) & 0xC0) != 0x80) return false;
    i += len;
  }
  return true;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// A general-purpose spec: a few English merges, special and non-special added tokens.
Spec chat_spec() {
  Spec s;
  s.merges = {{"h", "e"},   {"l", "l"},   {"he", "ll"},   {"hell", "o"}, {" ", "w"},
              {"o", "r"},   {" w", "or"}, {" wor", "ld"}, {"l", "d"},    {" ", " "},
              {"\n", "\n"}, {"u", "s"},   {"us", "e"},    {"use", "r"}};
  s.added_tokens = json::array(
      {added_token(300, "<|endoftext|>", true), added_token(301, "<|im_start|>", true),
       added_token(302, "<|im_end|>", true),
       added_token(303, "<think>", false, /*normalized=*/true), added_token(304, "<|im", true)});
  return s;
}

// ---- Loading and lookup ---------------------------------------------------------------------

TEST(Tokenizer, LoadsVocabMergesAndAddedTokens) {
  Tokenizer tok = chat_spec().build();
  EXPECT_EQ(tok.vocab_size(), 305);
  EXPECT_EQ(tok.token_id(bl("hello")), std::optional<int32_t>(259));
  EXPECT_EQ(tok.token_id("<|im_end|>"), std::optional<int32_t>(302));
  EXPECT_EQ(tok.token_id("nope"), std::nullopt);
  EXPECT_EQ(tok.token_text(259), "hello");
  EXPECT_EQ(tok.token_text(32), "\xC4\xA0");  // byte ' ' is 'Ġ'
  EXPECT_EQ(tok.token_text(301), "<|im_start|>");
  EXPECT_TRUE(tok.is_special(301));
  EXPECT_FALSE(tok.is_special(303));
  EXPECT_FALSE(tok.is_special(5));
  EXPECT_FALSE(tok.is_special(-1));
  EXPECT_FALSE(tok.is_special(100000));
  EXPECT_NE(error_of([&] { tok.token_text(299); }).find("299"), std::string::npos);
}

TEST(Tokenizer, LegacyAndPairMergeFormatsAgree) {
  Spec pairs = chat_spec();
  Spec legacy = chat_spec();
  legacy.legacy_merges = true;
  const std::string text = "hello world, user\n\nhello";
  EXPECT_EQ(pairs.build().encode(text), legacy.build().encode(text));
  // " user" is one piece (no merge joins ' ' to "user"); "\n\n" is one piece and one merge.
  EXPECT_EQ(pairs.build().encode(text),
            ids_of(pairs.build(), {"hello", " world", ",", " ", "user", "\n\n", "hello"}));
}

// ---- BPE ----------------------------------------------------------------------------------------

TEST(Tokenizer, MergesApplyInRankOrder) {
  Spec bc_first;
  bc_first.merges = {{"b", "c"}, {"a", "b"}};
  Tokenizer t1 = bc_first.build();
  EXPECT_EQ(t1.encode("abc"), ids_of(t1, {"a", "bc"}));

  Spec ab_first;
  ab_first.merges = {{"a", "b"}, {"b", "c"}};
  Tokenizer t2 = ab_first.build();
  EXPECT_EQ(t2.encode("abc"), ids_of(t2, {"ab", "c"}));
}

TEST(Tokenizer, EqualRankMergesGoLeftmostFirst) {
  Spec s;
  s.merges = {{"a", "a"}, {"aa", "aa"}};
  Tokenizer tok = s.build();
  EXPECT_EQ(tok.encode("aaa"), ids_of(tok, {"aa", "a"}));
  EXPECT_EQ(tok.encode("aaaa"), ids_of(tok, {"aaaa"}));
  EXPECT_EQ(tok.encode("aaaaa"), ids_of(tok, {"aaaa", "a"}));
}

TEST(Tokenizer, MergedTokensKeepMerging) {
  Spec s;
  s.merges = {{"l", "l"}, {"e", "ll"}, {"h", "ell"}, {"hell", "o"}};
  Tokenizer tok = s.build();
  EXPECT_EQ(tok.encode("hello"), ids_of(tok, {"hello"}));
  EXPECT_EQ(tok.encode("hellx"), ids_of(tok, {"hell", "x"}));
}

TEST(Tokenizer, IgnoreMergesTakesWholeWordsFromTheVocab) {
  Spec s;
  s.merges = {{"a", "b"}};
  s.extra_vocab = {{bl("abc"), 400}};
  EXPECT_EQ(s.build().encode("abc"), (Ids{256, 'c'}));
  s.ignore_merges = true;
  EXPECT_EQ(s.build().encode("abc"), (Ids{400}));
  EXPECT_EQ(s.build().encode("abd"), (Ids{256, 'd'}));
}

// ---- Pre-tokenizer ------------------------------------------------------------------------------

TEST(Tokenizer, RegexSplitKeepsMergesInsidePieces) {
  Spec s;
  // Merges that would fire across the Qwen pattern's piece boundaries if the text were one word.
  s.merges = {{"a", " "}, {" ", "b"}, {"1", "2"}, {"'", "M"}, {"I", "'"}, {" ", " "}};
  Tokenizer tok = s.build();
  EXPECT_EQ(tok.encode("a b"), ids_of(tok, {"a", " b"}));
  EXPECT_EQ(tok.encode("123"), ids_of(tok, {"1", "2", "3"}));  // \p{N} takes one digit
  EXPECT_EQ(tok.encode("I'M"), ids_of(tok, {"I", "'M"}));      // (?i:'m)
  // \s+(?!\S) leaves the last space to start the next word.
  EXPECT_EQ(tok.encode("a   b"), ids_of(tok, {"a", "  ", " b"}));
  EXPECT_EQ(tok.encode("a  "), ids_of(tok, {"a", "  "}));
}

TEST(Tokenizer, WhitespaceMeansUnicodeWhiteSpaceAsInOniguruma) {
  // U+180E left White_Space in Unicode 6.3; PCRE2's own \s still includes it, Oniguruma's
  // does not. With Oniguruma's \s, "\u180E\u180Ex" splits as ["\u180E\u180E", "x"].
  const std::string mvs = "\xE1\xA0\x8E";
  Spec s;
  s.merges = {{"\xE1", "\xA0"}, {"\xE1\xA0", "\x8E"}, {mvs, mvs}};
  Tokenizer tok = s.build();
  EXPECT_EQ(tok.encode(mvs + mvs + "x"), ids_of(tok, {mvs + mvs, "x"}));
  // U+3000 (ideographic space) is White_Space in both.
  EXPECT_EQ(tok.encode("\xE3\x80\x80x").size(), 4u);
}

TEST(Tokenizer, OnigurumaEscapesKeepTheirMeaning) {
  // In Oniguruma \h is a hex digit (PCRE2: horizontal space), so "abg" splits as "ab", "g".
  Spec s;
  s.merges = {{"b", "g"}};
  s.pre_tokenizer = qwen_pre_tokenizer(R"(\h+|\H+)");
  Tokenizer tok = s.build();
  EXPECT_EQ(tok.encode("abg"), ids_of(tok, {"a", "b", "g"}));
  // A nested set is a union, as in BLOOM-style patterns: "." and "!" are both members.
  s.merges = {{"a", "."}, {"!", "b"}};
  s.pre_tokenizer = qwen_pre_tokenizer(R"([^\s[.!]]+|[.!])");
  Tokenizer nested = s.build();
  EXPECT_EQ(nested.encode("a.!b"), ids_of(nested, {"a", ".", "!", "b"}));
}

TEST(Tokenizer, Qwen35PatternKeepsMarksWithLetters) {
  Spec s;
  s.normalizer = nullptr;  // keep "e" + U+0301 decomposed
  s.merges = {{"e", "\xCC"}, {"e\xCC", "\x81"}};
  s.pre_tokenizer = qwen_pre_tokenizer(kQwen35Pattern);
  Tokenizer marks = s.build();
  EXPECT_EQ(marks.encode("e\xCC\x81"), ids_of(marks, {"e\xCC\x81"}));
  s.pre_tokenizer = qwen_pre_tokenizer(kQwen2Pattern);
  Tokenizer letters = s.build();
  EXPECT_EQ(letters.encode("e\xCC\x81"), ids_of(letters, {"e", "\xCC", "\x81"}));
}

TEST(Tokenizer, ByteLevelWithGpt2RegexAndPrefixSpace) {
  Spec s;
  s.merges = {{" ", "H"}, {" H", "i"}, {" ", "y"}, {" y", "o"}};
  s.pre_tokenizer = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"use_regex", true}};
  Tokenizer tok = s.build();
  EXPECT_EQ(tok.encode("Hi yo"), ids_of(tok, {" Hi", " yo"}));
  EXPECT_EQ(tok.encode(" Hi"), ids_of(tok, {" Hi"}));
}

// ---- Normalizer ---------------------------------------------------------------------------------

TEST(Tokenizer, NfcComposesBeforeBpe) {
  Spec s;
  s.merges = {{"\xC3", "\xA9"}};  // "é" precomposed, U+00E9
  Tokenizer tok = s.build();
  EXPECT_EQ(tok.encode("e\xCC\x81"), ids_of(tok, {"\xC3\xA9"}));
  EXPECT_EQ(tok.encode("\xC3\xA9"), ids_of(tok, {"\xC3\xA9"}));
  EXPECT_EQ(tok.decode(tok.encode("caf"
                                  "e\xCC\x81")),
            "caf\xC3\xA9");
}

TEST(TokenizerNfc, MatchesUnicodeNormalizationForms) {
  EXPECT_EQ(nfc_normalize("plain ascii"), "plain ascii");
  EXPECT_EQ(nfc_normalize("e\xCC\x81"), "\xC3\xA9");                  // e + acute
  EXPECT_EQ(nfc_normalize("a\xCC\xA3\xCC\x82"), "\xE1\xBA\xAD");      // a + dot below + circ.
  EXPECT_EQ(nfc_normalize("a\xCC\x82\xCC\xA3"), "\xE1\xBA\xAD");      // reordered first
  EXPECT_EQ(nfc_normalize("a\xCC\x81\xCC\x81"), "\xC3\xA1\xCC\x81");  // second acute blocked
  EXPECT_EQ(nfc_normalize("\xE1\x84\x80\xE1\x85\xA1\xE1\x86\xA8"), "\xEA\xB0\x81");  // Hangul
  EXPECT_EQ(nfc_normalize("\xE2\x84\xAB"), "\xC3\x85");                  // Angstrom sign
  EXPECT_EQ(nfc_normalize("\xEF\xA4\x80"), "\xE8\xB1\x88");              // CJK compat. U+F900
  EXPECT_EQ(nfc_normalize("\xE0\xA5\x98"), "\xE0\xA4\x95\xE0\xA4\xBC");  // excluded U+0958
  EXPECT_EQ(nfc_normalize("e\xFF\xCC\x81"), "e\xFF\xCC\x81");            // bad byte blocks
  EXPECT_EQ(nfc_normalize("\xCC\x81"
                          "e"),
            "\xCC\x81"
            "e");  // leading mark stays
}

// ---- Added tokens -------------------------------------------------------------------------------

TEST(Tokenizer, SplitsOnSpecialTokensFirst) {
  Tokenizer tok = chat_spec().build();
  Ids expected = {301};
  for (int32_t id : ids_of(tok, {"user", "\n", "h", "i"})) expected.push_back(id);
  expected.push_back(302);
  EXPECT_EQ(tok.encode("<|im_start|>user\nhi<|im_end|>"), expected);
  // Longest match wins over the shorter added token "<|im".
  EXPECT_EQ(tok.encode("<|im_end|><|im"), (Ids{302, 304}));
  // Special text next to spaces stays apart from them.
  EXPECT_EQ(tok.encode(" <|endoftext|> "), (Ids{' ', 300, ' '}));
}

TEST(Tokenizer, ParseSpecialFalseTreatsSpecialTextAsText) {
  Tokenizer tok = chat_spec().build();
  const Ids plain = tok.encode("<|endoftext|>", false);
  EXPECT_EQ(std::count(plain.begin(), plain.end(), 300), 0);
  EXPECT_EQ(tok.decode(plain), "<|endoftext|>");
  // Non-special added tokens are still matched.
  EXPECT_EQ(tok.encode("<think>", false), (Ids{303}));
}

TEST(Tokenizer, NormalizedAddedTokensMatchAfterNfc) {
  Spec s;
  s.added_tokens = json::array({added_token(400, "e\xCC\x81!", false, /*normalized=*/true),
                                added_token(401, "\xC3\xB1", false, /*normalized=*/false)});
  Tokenizer tok = s.build();
  EXPECT_EQ(tok.encode("x\xC3\xA9!"), (Ids{'x', 400}));   // composed text
  EXPECT_EQ(tok.encode("xe\xCC\x81!"), (Ids{'x', 400}));  // decomposed text
  EXPECT_EQ(tok.encode("\xC3\xB1"), (Ids{401}));          // raw match of "ñ"
  // Decomposed "n" + U+0303 is not the raw text of token 401; NFC makes it "ñ" for BPE.
  EXPECT_EQ(tok.encode("n\xCC\x83"), (Ids{0xC3, 0xB1}));
  // tokenizers decodes an added token through the ByteLevel decoder too: "é!" consists of
  // byte-level alphabet characters, so it stands for the bytes E9 21, which are not UTF-8.
  EXPECT_EQ(tok.decode({{400}}), "\xEF\xBF\xBD!");
}

TEST(Tokenizer, AddedTokenStripAndSingleWord) {
  Spec s;
  s.added_tokens = json::array({added_token(400, "<mask>", true, false, /*lstrip=*/true),
                                added_token(401, "<r>", true, false, false, /*rstrip=*/true),
                                added_token(402, "cat", false, false, false, false,
                                            /*single_word=*/true)});
  Tokenizer tok = s.build();
  EXPECT_EQ(tok.encode("a   <mask>b"), (Ids{'a', 400, 'b'}));
  EXPECT_EQ(tok.encode("a<r> \t b"), (Ids{'a', 401, 'b'}));
  EXPECT_EQ(tok.encode("a cat"), (Ids{'a', ' ', 402}));
  EXPECT_EQ(tok.encode("concat"), (Ids{'c', 'o', 'n', 'c', 'a', 't'}));
  EXPECT_EQ(tok.encode("cats"), (Ids{'c', 'a', 't', 's'}));
}

// ---- Decoding -----------------------------------------------------------------------------------

TEST(Tokenizer, ByteLevelRoundTripOfUtf8) {
  Tokenizer tok = chat_spec().build();
  const std::vector<std::string> texts = {
      "",
      " ",
      "hello world",
      "def f(x):\n\treturn x  # comment \n\n  \n",
      "\xE4\xBD\xA0\xE5\xA5\xBD\xEF\xBC\x8C\xE4\xB8\x96\xE7\x95\x8C",  // 你好，世界
      "\xF0\x9F\x91\xA9\xE2\x80\x8D\xF0\x9F\x92\xBB \xF0\x9F\x91\x8D\xF0\x9F\x8F\xBD",  // emoji
      "I'M they'LL 12345678901234567890 ...!!! ???",
      "\r\n\r\n\x01\x7F\xC2\xA0",
  };
  for (const auto& text : texts) {
    const Ids ids = tok.encode(text);
    EXPECT_EQ(tok.decode(ids), text);
    EXPECT_EQ(stream_decode(tok, ids), text);
  }
  std::mt19937 rng(7);
  for (int round = 0; round < 200; ++round) {
    std::string text;
    const int n = static_cast<int>(rng() % 40);
    for (int i = 0; i < n; ++i) {
      static const char* pieces[] = {
          "a",       " ",          "\n",           "\t",           "Z",
          "9",       "'s",         "\xC3\xA9",     "\xE4\xB8\x96", "\xF0\x9F\x98\x80",
          "<think>", "<|im_end|>", "\xE2\x80\x83", "\xD9\x85"};
      text += pieces[rng() % (sizeof(pieces) / sizeof(pieces[0]))];
    }
    EXPECT_EQ(tok.decode(tok.encode(text)), text) << text;
  }
}

TEST(Tokenizer, IllFormedBytesEncodeAsBytesAndDecodeLossy) {
  Tokenizer tok = chat_spec().build();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"\xFF", "\xEF\xBF\xBD"},
      {"a\xF0\x9F\x98", "a\xEF\xBF\xBD"},  // truncated 4-byte sequence: one U+FFFD
      {"\xF0\x9F\x98"
       "A",
       "\xEF\xBF\xBD"
       "A"},
      {"\xC0\x80", "\xEF\xBF\xBD\xEF\xBF\xBD"},  // overlong: each byte replaced
      {"\xE0\x80", "\xEF\xBF\xBD\xEF\xBF\xBD"},
      {"\xED\xA0\x80", "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"},  // surrogate
      {"\xF4\x90\x80\x80", "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"},
      {"hi\x80xyz", "hi\xEF\xBF\xBDxyz"},
  };
  for (const auto& [raw, expected] : cases) {
    const Ids ids = tok.encode(raw);
    std::string bytes;
    for (int32_t id : ids) {
      ASSERT_LT(id, 256);
      bytes.push_back(static_cast<char>(id));
    }
    EXPECT_EQ(bytes, raw) << "every byte is kept as its byte token";
    EXPECT_EQ(tok.decode(ids), expected);
    EXPECT_EQ(stream_decode(tok, ids), expected);
  }
}

TEST(Tokenizer, DecodeSkipsSpecialTokensOnRequest) {
  Tokenizer tok = chat_spec().build();
  const Ids ids = tok.encode("<|im_start|>user\nhi<|im_end|><think>");
  EXPECT_EQ(tok.decode(ids), "<|im_start|>user\nhi<|im_end|><think>");
  EXPECT_EQ(tok.decode(ids, true), "user\nhi<think>");
  EXPECT_EQ(stream_decode(tok, ids, true), "user\nhi<think>");
}

// Like `tokenizers`, decoding drops ids that have no token (a model's padded vocabulary rows,
// holes in the id space); token_text() still refuses them.
TEST(Tokenizer, DecodeDropsIdsWithoutTokens) {
  Tokenizer tok = chat_spec().build();
  EXPECT_EQ(tok.decode(Ids{'a', 305, 'b', 299, -1, 'c'}), tok.decode(Ids{'a', 'b', 'c'}));
  auto stream = tok.stream_decoder();
  EXPECT_EQ(stream.push(1000), "");
  EXPECT_EQ(stream.push('a'), tok.decode(Ids{'a'}));
  const std::string too_big = error_of([&] { tok.token_text(305); });
  EXPECT_NE(too_big.find("305"), std::string::npos) << too_big;
  EXPECT_NE(too_big.find("vocab size 305"), std::string::npos) << too_big;
  EXPECT_NE(error_of([&] { tok.token_text(299); }).find("299"), std::string::npos);  // a hole
}

TEST(Tokenizer, StreamingNeverSplitsACharacterAndMatchesFullDecode) {
  Tokenizer tok = chat_spec().build();
  // The bytes of "é世😀" one token at a time: only complete characters come out.
  const Ids bytes = {0xC3, 0xA9, 0xE4, 0xB8, 0x96, 0xF0, 0x9F, 0x98, 0x80};
  std::vector<std::string> chunks;
  EXPECT_EQ(stream_decode(tok, bytes, false, &chunks), "\xC3\xA9\xE4\xB8\x96\xF0\x9F\x98\x80");
  EXPECT_EQ(chunks, (std::vector<std::string>{"", "\xC3\xA9", "", "", "\xE4\xB8\x96", "", "", "",
                                              "\xF0\x9F\x98\x80"}));
  // A held prefix that turns out invalid is replaced as soon as that is known.
  auto stream = tok.stream_decoder();
  EXPECT_EQ(stream.push(0xF0), "");
  EXPECT_EQ(stream.push('x'), "\xEF\xBF\xBDx");
  EXPECT_EQ(stream.push(0xE4), "");
  EXPECT_EQ(stream.finish(), "\xEF\xBF\xBD");
  EXPECT_EQ(stream.finish(), "");

  std::mt19937 rng(11);
  const Ids others = {256, 259, 263, 269, 300, 301, 302, 303, 304};  // merges, added tokens
  for (int round = 0; round < 300; ++round) {
    Ids ids;
    const int n = static_cast<int>(rng() % 30);
    for (int i = 0; i < n; ++i) {
      const uint32_t r = rng() % 100;
      ids.push_back(r < 60   ? static_cast<int32_t>(0x80 + rng() % 0x80)  // high bytes
                    : r < 90 ? static_cast<int32_t>(rng() % 0x80)         // ASCII
                             : others[rng() % others.size()]);
    }
    for (bool skip : {false, true}) {
      std::vector<std::string> parts;
      EXPECT_EQ(stream_decode(tok, ids, skip, &parts), tok.decode(ids, skip));
      for (const auto& p : parts) EXPECT_TRUE(well_formed_utf8(p));
    }
  }
}

// ---- Bad input ----------------------------------------------------------------------------------

std::string load_error(const json& doc) {
  return error_of([&] { Tokenizer::from_json(doc.dump(), "bad.json"); });
}

void expect_contains(const std::string& message, std::initializer_list<std::string_view> parts) {
  for (std::string_view part : parts)
    EXPECT_NE(message.find(part), std::string::npos) << "\"" << message << "\" lacks " << part;
}

TEST(Tokenizer, RejectsMalformedInput) {
  expect_contains(error_of([] { Tokenizer::load("/nonexistent/tokenizer.json"); }),
                  {"/nonexistent/tokenizer.json", "cannot open"});
  expect_contains(error_of([] { Tokenizer::from_json("{\"model\": ", "broken.json"); }),
                  {"broken.json", "invalid JSON"});
  expect_contains(error_of([] { Tokenizer::from_json("[1, 2]", "array.json"); }),
                  {"array.json", "object"});

  json doc = chat_spec().to_json();
  json no_model = doc;
  no_model.erase("model");
  expect_contains(load_error(no_model), {"bad.json", "model"});

  json no_vocab = doc;
  no_vocab["model"].erase("vocab");
  expect_contains(load_error(no_vocab), {"bad.json", "vocab"});

  json bad_merge = doc;
  bad_merge["model"]["merges"].push_back({"zz", "q"});
  expect_contains(load_error(bad_merge), {"bad.json", "merge #14", "\"zz\"", "not in the vocab"});

  json bad_merge_result = doc;
  bad_merge_result["model"]["merges"].push_back({"q", "q"});
  expect_contains(load_error(bad_merge_result), {"bad.json", "\"qq\"", "not in the vocab"});

  json legacy_bad = doc;
  legacy_bad["model"]["merges"] = json::array({"a b c"});
  expect_contains(load_error(legacy_bad), {"bad.json", "merge #0"});

  json unigram = doc;
  unigram["model"]["type"] = "Unigram";
  expect_contains(load_error(unigram), {"bad.json", "'Unigram'", "not supported"});

  json metaspace = doc;
  metaspace["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "_"}};
  expect_contains(load_error(metaspace), {"bad.json", "pre_tokenizer", "'Metaspace'"});

  json nested = doc;
  nested["pre_tokenizer"]["pretokenizers"][0] = {{"type", "Digits"}};
  expect_contains(load_error(nested), {"bad.json", "'Digits'"});

  json lowercase = doc;
  lowercase["normalizer"] = {{"type", "Lowercase"}};
  expect_contains(load_error(lowercase), {"bad.json", "normalizer", "'Lowercase'"});

  json wordpiece = doc;
  wordpiece["decoder"] = {{"type", "WordPiece"}};
  expect_contains(load_error(wordpiece), {"bad.json", "decoder", "'WordPiece'"});

  json fallback = doc;
  fallback["model"]["byte_fallback"] = true;
  expect_contains(load_error(fallback), {"bad.json", "byte_fallback"});

  json removed = doc;
  removed["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Removed";
  expect_contains(load_error(removed), {"bad.json", "Removed", "not supported"});

  json bad_regex = doc;
  bad_regex["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed";
  expect_contains(load_error(bad_regex), {"bad.json", "cannot compile regex", "(unclosed"});

  json posix = doc;
  posix["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "[[:punct:]]+";
  expect_contains(load_error(posix), {"bad.json", "[:punct:]", "not supported"});

  json bad_id = doc;
  bad_id["added_tokens"][0]["id"] = "x";
  expect_contains(load_error(bad_id), {"bad.json", "added_tokens[0]", "integer"});

  json no_byte_level = doc;
  no_byte_level["pre_tokenizer"] = doc["pre_tokenizer"]["pretokenizers"][0];
  expect_contains(load_error(no_byte_level), {"bad.json", "ByteLevel"});
}

// ---- Scale and concurrency ----------------------------------------------------------------------

std::string mixed_text(size_t bytes) {
  const std::vector<std::string> pieces = {
      "def encode(self, text):\n    return [self.vocab[t] for t in text]\n",
      "The quick brown fox jumps over the lazy dog. ",
      "\xE4\xBD\xA0\xE5\xA5\xBD\xE4\xB8\x96\xE7\x95\x8C\xEF\xBC\x81",
      "    \n\n\t  ",
      "12345 + 67890 = 80235; ",
      "\xF0\x9F\x98\x80\xF0\x9F\x91\x8D ",
      "caf\xC3\xA9 na\xC3\xAFve r\xC3\xA9sum\xC3\xA9 ",
      "<|im_start|>user\n",
      "<|im_end|>\n"};
  std::string text;
  for (size_t i = 0; text.size() < bytes; ++i) text += pieces[(i * 7) % pieces.size()];
  return text;
}

// Speed is measured by benchmarks, not here; this checks a large mixed input and degenerate runs
// (one huge word, one huge whitespace run) round-trip.
TEST(Tokenizer, RoundTripsAMegabyteAndDegenerateRuns) {
  Spec s = chat_spec();
  s.merges = {{"h", "e"},   {"t", "he"},   {" ", "the"}, {" ", "t"}, {"e", "n"},    {"o", "d"},
              {"c", "od"},  {"en", "cod"}, {"s", "e"},   {"l", "f"}, {"se", "lf"},  {" ", " "},
              {"  ", "  "}, {"r", "e"},    {"re", "t"},  {"u", "r"}, {"ret", "ur"}, {"retur", "n"}};
  Tokenizer tok = s.build();
  const std::string text = mixed_text(1 << 20);
  const Ids ids = tok.encode(text);
  EXPECT_LT(ids.size(), text.size());  // merges applied
  EXPECT_EQ(tok.decode(ids), text);

  // Degenerate inputs: one huge word, one huge whitespace run.
  EXPECT_EQ(tok.decode(tok.encode(std::string(200000, 'a'))), std::string(200000, 'a'));
  EXPECT_EQ(tok.decode(tok.encode(std::string(200000, ' ') + "x")), std::string(200000, ' ') + "x");
}

TEST(Tokenizer, ConcurrentEncodesAgree) {
  Tokenizer tok = chat_spec().build();
  const std::string text = mixed_text(50000);
  const Ids expected = tok.encode(text);
  std::vector<Ids> results(4);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < results.size(); ++i)
    threads.emplace_back([&, i] { results[i] = tok.encode(text); });
  for (auto& t : threads) t.join();
  for (const Ids& r : results) EXPECT_EQ(r, expected);
}

// ---- Oracle fixture -----------------------------------------------------------------------------

TEST(TokenizerFixture, MatchesHuggingFaceTokenizers) {
  const std::filesystem::path dir = std::filesystem::path(TANDEM_FIXTURES_DIR) / "tokenizer";
  ASSERT_TRUE(std::filesystem::exists(dir))
      << dir << " is missing: run tools/make_tokenizer_fixture.py (needs tokenizers)";
  Tokenizer tok = Tokenizer::load((dir / "tokenizer.json").string());
  std::ifstream in(dir / "cases.json");
  ASSERT_TRUE(in) << "cannot open " << (dir / "cases.json");
  const json cases = json::parse(in);
  ASSERT_TRUE(cases.is_array());
  ASSERT_GT(cases.size(), 10u);
  size_t encodes = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const json& c = cases[i];
    const bool skip_special = c.value("skip_special", false);
    const std::string expected = c.at("decoded").get<std::string>();
    Ids ids;
    if (c.contains("text")) {
      const std::string text = c.at("text").get<std::string>();
      const bool parse_special = c.value("parse_special", true);
      ids = c.at("ids").get<Ids>();
      EXPECT_EQ(tok.encode(text, parse_special), ids) << "case " << i << ": " << c.at("text");
      ++encodes;
    } else {
      ids = c.at("decode_ids").get<Ids>();
    }
    EXPECT_EQ(tok.decode(ids, skip_special), expected) << "case " << i;
    EXPECT_EQ(stream_decode(tok, ids, skip_special), expected) << "case " << i;
  }
  EXPECT_GT(encodes, 30u);
}

}  // namespace
}  // namespace tandem
