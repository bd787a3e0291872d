// Fuzz target: the bundled demo model's tokenizer (byte-level BPE with an NFC normalizer, as the
// Qwen family ships it) on arbitrary bytes, as a server sees prompts and sampled ids.
//
// Checked on every input:
//   1. encode(text) then decode() gives the text back, after the normalization tokenizers applies:
//      byte-level BPE loses no byte, so decode(encode(s)) equals NFC of each stretch between
//      special tokens with the special tokens themselves kept verbatim (with parse_special
//      false, NFC of the whole text). Bytes that are not UTF-8 go through as byte tokens and come
//      back as U+FFFD from decode(), so the expectation is made lossy the same way; for valid
//      UTF-8 the comparison is exact.
//   2. A StreamDecoder fed those ids one at a time, then finish(), equals decode().
//   3. The input read as a list of ids (2 bytes each, spread over [-2, vocab_size + 2) so that
//      most are real tokens and a few are not) decodes without crashing, with and without
//      special tokens, and the StreamDecoder agrees with decode() on it.
//
// The tokenizer is found through $TANDEM_FUZZ_TOKENIZER, else the source tree's demo model
// (TANDEM_SOURCE_DIR is compiled in).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_common.h"
#include "tandem/core/error.h"
#include "tandem/io/tokenizer.h"
#include "tandem/io/unicode_nfc.h"
#include "tandem/io/utf8.h"

namespace tandem::fuzz::tokenizer {

struct Fixture {
  tandem::Tokenizer tokenizer;
  // Added tokens, as the oracle splits on them (all of the demo's are special and plain).
  std::vector<std::string> special;
};

Fixture load_fixture() {
  const char* env = std::getenv("TANDEM_FUZZ_TOKENIZER");
  const std::string path =
      env ? env : std::string(TANDEM_SOURCE_DIR) + "/models/qwen35-demo/tokenizer.json";
  std::ifstream in(path);
  if (!in) fail("cannot read " + path + " (set TANDEM_FUZZ_TOKENIZER)");
  std::ostringstream text;
  text << in.rdbuf();
  Fixture f{tandem::Tokenizer::from_json(text.str(), path), {}};
  // The oracle below splits on added tokens by plain search, which is what tokenizers does only
  // for special tokens matched on raw text without stripping or word boundaries; refuse any
  // other tokenizer rather than report false crashes.
  const auto root = nlohmann::json::parse(text.str());
  for (const auto& t : root.at("added_tokens")) {
    if (!t.at("special").get<bool>() || t.at("lstrip").get<bool>() || t.at("rstrip").get<bool>() ||
        t.at("single_word").get<bool>() || t.at("normalized").get<bool>())
      fail("the oracle handles only plain special added tokens: " + t.dump());
    f.special.push_back(t.at("content").get<std::string>());
  }
  return f;
}

const Fixture& fixture() {
  static const Fixture f = load_fixture();
  return f;
}

std::string lossy(std::string_view bytes) {
  std::string out;
  tandem::utf8::append_lossy(bytes, true, out);
  return out;
}

// What decode(encode(text, parse_special)) must return before the lossy step: each stretch
// between special tokens normalized on its own (tokenizers splits first, then normalizes),
// special tokens verbatim unless skipped.
std::string expected_bytes(std::string_view text, bool parse_special, bool skip_special,
                           const std::vector<std::string>& special) {
  if (!parse_special) return tandem::nfc_normalize(text);
  std::string out;
  size_t done = 0;
  while (done <= text.size()) {
    // Leftmost match; the demo's tokens are not prefixes of one another, so it is unique.
    size_t best = std::string_view::npos, best_len = 0;
    for (const std::string& s : special) {
      const size_t at = text.find(s, done);
      if (at < best || (at == best && s.size() > best_len)) {
        best = at;
        best_len = s.size();
      }
    }
    if (best == std::string_view::npos) {
      out += tandem::nfc_normalize(text.substr(done));
      break;
    }
    out += tandem::nfc_normalize(text.substr(done, best - done));
    if (!skip_special) out += text.substr(best, best_len);
    done = best + best_len;
  }
  return out;
}

std::string stream_decode(const tandem::Tokenizer& tok, const std::vector<int32_t>& ids,
                          bool skip_special) {
  tandem::Tokenizer::StreamDecoder stream = tok.stream_decoder(skip_special);
  std::string text;
  for (int32_t id : ids) text += stream.push(id);
  text += stream.finish();
  return text;
}

void check_equal(const std::string& got, const std::string& want, const char* what) {
  if (got != want)
    fail(std::string(what) + ": got " + std::to_string(got.size()) + " bytes, want " +
         std::to_string(want.size()));
}

void check_round_trip(const Fixture& f, std::string_view text, bool parse_special) {
  const std::vector<int32_t> ids = f.tokenizer.encode(text, parse_special);
  for (int32_t id : ids)
    if (id < 0 || id >= f.tokenizer.vocab_size()) fail("encode produced id " + std::to_string(id));
  for (bool skip : {false, true}) {
    const std::string decoded = f.tokenizer.decode(ids, skip);
    check_equal(decoded, lossy(expected_bytes(text, parse_special, skip, f.special)),
                "decode(encode(text))");
    check_equal(stream_decode(f.tokenizer, ids, skip), decoded, "StreamDecoder after encode");
  }
}

void check_ids(const Fixture& f, const uint8_t* data, size_t size) {
  const auto span = static_cast<uint32_t>(f.tokenizer.vocab_size()) + 4;
  std::vector<int32_t> ids;
  for (size_t i = 0; i + 1 < size; i += 2) {
    const uint32_t raw = data[i] | static_cast<uint32_t>(data[i + 1]) << 8;
    ids.push_back(static_cast<int32_t>(raw % span) - 2);
  }
  for (bool skip : {false, true}) {
    try {
      const std::string decoded = f.tokenizer.decode(ids, skip);
      check_equal(stream_decode(f.tokenizer, ids, skip), decoded, "StreamDecoder on ids");
    } catch (const tandem::Error&) {
      // An id with no token may be refused; that is an answer, not a crash.
    }
  }
}

inline int run_one(const uint8_t* data, size_t size) {
  const Fixture& f = fixture();
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  check_round_trip(f, text, /*parse_special=*/true);
  check_round_trip(f, text, /*parse_special=*/false);
  check_ids(f, data, size);
  return 0;
}

}  // namespace tandem::fuzz::tokenizer

#ifndef TANDEM_FUZZ_REPLAY
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return tandem::fuzz::tokenizer::run_one(data, size);
}
#endif
