// Hugging Face tokenizer.json, byte-level BPE as the Qwen family ships it: text <-> token ids.
//
// Supported components (anything else is refused at load with an Error naming it):
//   normalizer     null, NFC, or a Sequence of those
//   pre_tokenizer  ByteLevel (add_prefix_space, use_regex = GPT-2 pattern), Split with a Regex or
//                  String pattern (behavior Isolated, invert false), or a Sequence of those in
//                  which ByteLevel comes last
//   model          BPE: vocab, merges ("a b" strings or [a, b] pairs), ignore_merges, unk_token,
//                  fuse_unk; byte_fallback, dropout, subword prefix/suffix are refused
//   added_tokens   special and non-special; lstrip, rstrip, single_word, normalized honoured
//   decoder        ByteLevel
// post_processor, truncation and padding are ignored: encode() adds no special tokens.
//
// Regexes run on PCRE2 (UTF + UCP, JIT when available). tokenizers uses Oniguruma, so patterns
// are translated where the two differ (\s is White_Space without U+180E, \w, \h, \v, ^, $,
// (?m), POSIX and nested classes); the rare constructs left are refused at load.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace tandem {

class Tokenizer {
  struct Impl;

 public:
  // Reads tokenizer.json. Throws Error naming the file and the problem.
  static Tokenizer load(const std::string& path);
  // Parses tokenizer.json text; source_name is used in error messages.
  static Tokenizer from_json(const std::string& json_text, const std::string& source_name);

  // The ids tokenizers' encode(text, add_special_tokens=False) returns. With parse_special false
  // the text of special added tokens is tokenized as plain text (tokenizers'
  // encode_special_tokens = True); non-special added tokens are still matched. Bytes that are not
  // well-formed UTF-8 are encoded as their byte tokens. Thread-safe.
  std::vector<int32_t> encode(std::string_view text, bool parse_special = true) const;

  // The text tokenizers' decode(ids, skip_special_tokens) returns: token bytes concatenated,
  // ill-formed UTF-8 replaced by U+FFFD (one per maximal invalid subpart). Throws Error for an id
  // that has no token. Thread-safe.
  std::string decode(std::span<const int32_t> ids, bool skip_special = false) const;

  // Incremental decoding for streaming. The concatenation of every push() and finish() equals
  // decode() of all pushed ids. push() returns the text that became complete: the bytes of a
  // UTF-8 sequence still missing bytes are held until it completes (or proves invalid).
  // Keeps the tokenizer's data alive; one decoder per stream, not shared between threads.
  class StreamDecoder {
   public:
    std::string push(int32_t id);
    // Flushes held bytes (an incomplete sequence becomes U+FFFD) and resets the decoder.
    std::string finish();

   private:
    friend class Tokenizer;
    StreamDecoder(std::shared_ptr<const Impl> impl, bool skip_special);
    std::shared_ptr<const Impl> impl_;
    bool skip_special_;
    std::string pending_;  // a UTF-8 prefix that may still complete
  };
  StreamDecoder stream_decoder(bool skip_special = false) const;

  // Max id + 1 over the vocab and added tokens.
  int32_t vocab_size() const;
  // Id of a token string (byte-level form for vocab entries, e.g. "Ġthe"); added tokens first.
  std::optional<int32_t> token_id(std::string_view token) const;
  // The raw token string of an id (added token content or byte-level vocab form). Throws Error
  // for an id that has no token.
  std::string_view token_text(int32_t id) const;
  // True for added tokens marked special (false for any other id, including invalid ones).
  bool is_special(int32_t id) const;

 private:
  explicit Tokenizer(std::shared_ptr<const Impl> impl);
  std::shared_ptr<const Impl> impl_;
};

}  // namespace tandem
