#include "tandem/io/tokenizer.h"

#include <pcre2.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>
#include <utility>

#include "tandem/core/error.h"
#include "tandem/io/unicode_nfc.h"
#include "tandem/io/utf8.h"

namespace tandem {
namespace {

using json = nlohmann::json;

// Unicode White_Space: what \s means in Oniguruma and in Rust's regex crate. (PCRE2's \s also
// matches U+180E, which left White_Space in Unicode 6.3.)
bool is_white_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

// ---- Byte-level alphabet (GPT-2 bytes_to_unicode) -------------------------------------------

// Printable Latin-1 bytes stand for themselves; the other 68 bytes map to U+0100.. in order.
struct ByteLevelAlphabet {
  std::array<std::string, 256> byte_to_char;  // UTF-8 of the stand-in character
  std::array<int16_t, 512> char_to_byte;      // stand-in code point -> byte, -1 if none

  ByteLevelAlphabet() {
    char_to_byte.fill(-1);
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      const uint32_t cp = printable ? b : next++;
      utf8::append(cp, byte_to_char[b]);
      char_to_byte[cp] = static_cast<int16_t>(b);
    }
  }
};

const ByteLevelAlphabet& byte_level() {
  static const ByteLevelAlphabet alphabet;
  return alphabet;
}

// tokenizers' ByteLevel decoder: a token made only of alphabet characters stands for those
// bytes; any other token (an added token such as "<think>\n") stands for its own UTF-8.
std::string byte_level_decode(std::string_view token) {
  const ByteLevelAlphabet& alphabet = byte_level();
  std::string bytes;
  for (size_t i = 0; i < token.size();) {
    uint32_t cp = 0;
    const size_t n = utf8::decode(token, i, cp);
    if (n == 0 || cp >= alphabet.char_to_byte.size() || alphabet.char_to_byte[cp] < 0)
      return std::string(token);
    bytes.push_back(static_cast<char>(alphabet.char_to_byte[cp]));
    i += n;
  }
  return bytes;
}

// ---- Regex --------------------------------------------------------------------------------------

// tokenizers compiles patterns with Oniguruma (default syntax, UTF-8, no options); tandem runs
// them on PCRE2 (UTF + UCP). The two agree on \p{..} classes, \d, \R, \X, '.', lookaround and
// case folding, but not on these, which are rewritten (each checked code point by code point
// against Oniguruma 6.9.8):
//   \s \S  Unicode White_Space (PCRE2 adds U+180E)
//   \w \W  Alphabetic, marks, Nd, Pc (PCRE2: L, N, _); Oniguruma's own \w is inconsistent
//          for U+00B2 U+00B3 U+00B9 U+00BC..U+00BE (word alone, not inside [...])
//   \h \H  hex digits (PCRE2: horizontal space);  \v  U+000B only (PCRE2: vertical space)
//   [:space:] [:alpha:]  as \s and Alphabetic;  a nested set [a[bc]] is the union [abc]
//   ^ $    line anchors in Oniguruma;  (?m)  dot-all in Oniguruma, (?s) in PCRE2
// Constructs whose meaning differs in ways not worth translating are refused.
constexpr std::string_view kWhiteSpaceMembers =
    R"(\t-\r\x{20}\x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})";
struct ClassEscape {
  char letter;
  std::string_view members;  // to be put inside [...] or [^...]
};
constexpr ClassEscape kClassEscapes[] = {
    {'s', kWhiteSpaceMembers},
    {'w', R"(\p{Alphabetic}\p{M}\p{Nd}\p{Pc})"},
    {'h', "0-9a-fA-F"},
};

std::string oniguruma_to_pcre2(std::string_view pattern, const std::string& where) {
  const auto refuse = [&](std::string_view what) {
    fail(where, ": regex \"", pattern, "\": ", what, " is not supported");
  };
  std::string out;
  bool in_class = false;
  int nested = 0;  // depth of nested sets inside the current class
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char e = pattern[++i];
      const char lower = static_cast<char>(std::tolower(static_cast<unsigned char>(e)));
      const auto* escape = std::find_if(std::begin(kClassEscapes), std::end(kClassEscapes),
                                        [&](const ClassEscape& ce) { return ce.letter == lower; });
      if (escape != std::end(kClassEscapes)) {
        const bool negated = e != lower;
        if (in_class && negated) refuse(std::string("\\") + e + " inside a character class");
        if (in_class) {
          out += escape->members;
        } else {
          out += negated ? "[^" : "[";
          out += escape->members;
          out += ']';
        }
      } else if (e == 'v') {
        out += R"(\x{0B})";
      } else if (e == 'Q') {
        const size_t end = pattern.find("\\E", i + 1);
        const size_t stop = end == std::string_view::npos ? pattern.size() : end + 2;
        out += pattern.substr(i - 1, stop - (i - 1));
        i = stop - 1;
      } else {
        out += c;
        out += e;
      }
      continue;
    }
    if (in_class) {
      if (c == '[' && pattern.substr(i, 2) == "[:") {
        const size_t end = pattern.find(":]", i + 2);
        if (end == std::string_view::npos) refuse("an unterminated POSIX class");
        const std::string_view name = pattern.substr(i + 2, end - i - 2);
        if (name == "space") {
          out += kWhiteSpaceMembers;
        } else if (name == "alpha") {
          out += R"(\p{Alphabetic})";
        } else if (name == "digit" || name == "cntrl" || name == "xdigit") {
          out += pattern.substr(i, end + 2 - i);
        } else {
          refuse("POSIX class [:" + std::string(name) + ":]");
        }
        i = end + 1;
        continue;
      }
      if (c == '[') {  // a nested set is a union: its members join the enclosing class
        if (pattern.substr(i, 2) == "[^") refuse("a negated nested character class");
        ++nested;
        continue;
      }
      if (c == '&' && pattern.substr(i, 2) == "&&") refuse("character class intersection");
      if (c == ']') {
        if (nested > 0) {
          --nested;
          continue;
        }
        in_class = false;
      }
      out += c;
      continue;
    }
    if (c == '^' || c == '$') {
      out += c == '^' ? "(?m:^)" : "(?m:$)";
      continue;
    }
    if (c == '(' && pattern.substr(i, 2) == "(?" && i + 2 < pattern.size() &&
        (std::isalpha(static_cast<unsigned char>(pattern[i + 2])) || pattern[i + 2] == '-')) {
      out += "(?";
      for (i += 2; i < pattern.size() && pattern[i] != ':' && pattern[i] != ')'; ++i) {
        const char flag = pattern[i];
        if (flag == 'i' || flag == 'x' || flag == '-')
          out += flag;
        else if (flag == 'm')
          out += 's';
        else
          refuse(std::string("option (?") + flag + ")");
      }
      if (i < pattern.size()) out += pattern[i];
      continue;
    }
    out += c;
    if (c == '[') {
      in_class = true;
      // A ']' right after '[' or '[^' is a literal member, not the end of the class.
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out += pattern[++i];
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') out += pattern[++i];
    }
  }
  return out;
}

struct CodeDeleter {
  void operator()(pcre2_code* code) const { pcre2_code_free(code); }
};
struct MatchDataDeleter {
  void operator()(pcre2_match_data* md) const { pcre2_match_data_free(md); }
};
using MatchData = std::unique_ptr<pcre2_match_data, MatchDataDeleter>;

// A compiled pattern; immutable, so one instance serves every thread (each brings MatchData).
class Regex {
 public:
  // literal: the pattern is a plain string (Split's String pattern).
  Regex(std::string_view pattern, bool literal, const std::string& where) {
    const std::string source = literal ? std::string(pattern) : oniguruma_to_pcre2(pattern, where);
    int error = 0;
    PCRE2_SIZE offset = 0;
    uint32_t options = PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF;
    if (literal) options |= PCRE2_LITERAL;
    code_.reset(pcre2_compile(reinterpret_cast<PCRE2_SPTR>(source.data()), source.size(), options,
                              &error, &offset, nullptr));
    if (!code_) {
      std::array<PCRE2_UCHAR, 256> message{};
      pcre2_get_error_message(error, message.data(), message.size());
      fail(where, ": cannot compile regex \"", pattern,
           "\": ", reinterpret_cast<const char*>(message.data()), " at offset ", offset);
    }
    // Without JIT (not built in, or no executable memory) the interpreter gives the same matches.
    pcre2_jit_compile(code_.get(), PCRE2_JIT_COMPLETE);
  }

  static MatchData make_match_data() {
    MatchData md(pcre2_match_data_create(1, nullptr));
    TANDEM_CHECK(md != nullptr, "pcre2_match_data_create");
    return md;
  }

  // Finds the first match starting at or after `from` (exactly at `from` when anchored): true
  // with [start, end) set.
  bool find(std::string_view text, size_t from, pcre2_match_data* md, size_t& start, size_t& end,
            bool anchored = false) const {
    const auto subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    const uint32_t options = anchored ? PCRE2_ANCHORED : 0;
    int rc = pcre2_match(code_.get(), subject, text.size(), from, options, md, nullptr);
    // The JIT's stack is small and fixed; the interpreter keeps its backtracking on the heap.
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT)
      rc =
          pcre2_match(code_.get(), subject, text.size(), from, options | PCRE2_NO_JIT, md, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) return false;
    if (rc < 0) {
      std::array<PCRE2_UCHAR, 256> message{};
      pcre2_get_error_message(rc, message.data(), message.size());
      fail("tokenizer: regex match failed: ", reinterpret_cast<const char*>(message.data()));
    }
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(md);
    start = ovector[0];
    end = ovector[1];
    return true;
  }

  // Split behaviour Isolated: every match and every gap between matches is a piece, in order.
  // Empty matches split nothing but still end the gap before them, as Oniguruma's iterator
  // reports them.
  template <class Emit>
  void split_isolated(std::string_view text, pcre2_match_data* md, const Emit& emit) const {
    size_t gap = 0, pos = 0, start = 0, end = 0;
    while (pos <= text.size() && find(text, pos, md, start, end)) {
      if (start > gap) emit(text.substr(gap, start - gap));
      if (end > start) {
        emit(text.substr(start, end - start));
        pos = end;
      } else {
        if (start >= text.size()) break;
        uint32_t cp = 0;
        const size_t n = utf8::decode(text, start, cp);
        pos = start + (n == 0 ? 1 : n);
      }
      gap = end;
    }
    if (gap < text.size()) emit(text.substr(gap));
  }

 private:
  std::unique_ptr<pcre2_code, CodeDeleter> code_;
};

// tokenizers' ByteLevel pre-tokenizer pattern (use_regex true).
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Rust regex's \w, which tokenizers uses for an added token's single_word check.
constexpr std::string_view kWordCharPattern =
    R"([\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\p{Join_Control}])";

// ---- Added tokens -----------------------------------------------------------------------------

struct AddedToken {
  int32_t id = 0;
  std::string content;
  std::string pattern;  // what is matched: content, NFC-normalized when `normalized`
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = false;
  bool special = false;
};

// Leftmost-longest search over a set of strings (tokenizers uses an Aho-Corasick automaton
// with the same match kind). Added tokens are few, so candidates are bucketed by first byte.
class AddedTokenMatcher {
 public:
  void add(const AddedToken* token) {
    if (token->pattern.empty()) return;
    auto& bucket = by_first_byte_[static_cast<uint8_t>(token->pattern[0])];
    bucket.push_back(token);
    std::stable_sort(bucket.begin(), bucket.end(), [](const AddedToken* a, const AddedToken* b) {
      return a->pattern.size() > b->pattern.size();
    });
  }
  // The leftmost match at or after `from`, longest among those; nullptr if none.
  const AddedToken* find(std::string_view text, size_t from, size_t& start) const {
    for (size_t i = from; i < text.size(); ++i) {
      for (const AddedToken* token : by_first_byte_[static_cast<uint8_t>(text[i])]) {
        if (text.substr(i, token->pattern.size()) == token->pattern) {
          start = i;
          return token;
        }
      }
    }
    return nullptr;
  }

 private:
  std::array<std::vector<const AddedToken*>, 256> by_first_byte_;
};

// ---- BPE ----------------------------------------------------------------------------------------

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using Vocab = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

struct MergeRule {
  int32_t rank;
  int32_t merged_id;
};

uint64_t pair_key(int32_t left, int32_t right) {
  return static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32 | static_cast<uint32_t>(right);
}

// Per-call working memory for encode(), so concurrent calls share nothing mutable.
struct EncodeScratch {
  struct Symbol {
    int32_t id;
    int32_t prev;  // index of the previous live symbol, -1 at the start
    int32_t next;  // index of the next live symbol, -1 at the end
    int32_t len;   // 0 once merged into its left neighbour
  };
  struct QueuedMerge {
    int32_t rank;
    int32_t pos;
    int32_t merged_id;
  };
  std::vector<Symbol> symbols;
  std::vector<QueuedMerge> queue;  // a heap: lowest rank first, then leftmost
  std::string text;                // a word's byte-level form (ignore_merges lookups)
  MatchData match_data = Regex::make_match_data();
};

enum class PreTokenizerKind { kSplit, kByteLevel };

struct PreTokenizerStep {
  PreTokenizerKind kind;
  std::shared_ptr<const Regex> regex;  // Split pattern; GPT-2 pattern for ByteLevel use_regex
  bool add_prefix_space = false;
};

std::string describe_type(const json& node) {
  if (node.is_object()) {
    auto it = node.find("type");
    if (it != node.end() && it->is_string()) {
      std::string quoted(1, '\'');
      quoted += it->get_ref<const std::string&>();
      quoted += '\'';
      return quoted;
    }
    return "(object without a string \"type\")";
  }
  return node.type_name();
}

}  // namespace

// ---- Impl ---------------------------------------------------------------------------------------

struct Tokenizer::Impl {
  std::string context;  // "tokenizer <file>": how every message about this tokenizer starts

  // Model.
  Vocab vocab;
  std::unordered_map<uint64_t, MergeRule> merges;
  std::array<int32_t, 256> byte_token{};  // id of each single-byte token, -1 if absent
  bool ignore_merges = false;
  std::optional<int32_t> unk_id;
  bool fuse_unk = false;

  // Pipeline.
  bool nfc = false;
  std::vector<PreTokenizerStep> pre_tokenizer;
  std::vector<AddedToken> added;         // sorted by id
  AddedTokenMatcher raw_matcher;         // added tokens with normalized = false
  AddedTokenMatcher normalized_matcher;  // added tokens with normalized = true
  std::shared_ptr<const Regex> word_char;

  // By id: what token_text() returns, the bytes decode() emits, and what kind of token it is.
  enum : uint8_t { kNone = 0, kModel = 1, kAdded = 2, kSpecial = 3 };
  std::vector<std::string> text_by_id;
  std::vector<std::string> bytes_by_id;
  std::vector<uint8_t> kind_by_id;
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> added_by_content;

  void check_id(int32_t id) const {
    if (id < 0 || id >= static_cast<int32_t>(kind_by_id.size()))
      fail(context, ": token id ", id, " is out of range (vocab size ", kind_by_id.size(), ")");
    if (kind_by_id[static_cast<size_t>(id)] == kNone)
      fail(context, ": token id ", id, " has no token (vocab size ", kind_by_id.size(), ")");
  }

  bool word_char_at(std::string_view s, size_t pos, EncodeScratch& scratch) const {
    size_t start = 0, end = 0;
    return word_char->find(s, pos, scratch.match_data.get(), start, end, /*anchored=*/true);
  }

  // tokenizers' AddedVocabulary::find_matches: emit(piece, token) for each gap (token null)
  // and each accepted match, in order. Skipped matches (special text when !parse_special, a
  // single_word token inside a word) stay part of the surrounding text.
  template <class Emit>
  void split_added(std::string_view text, const AddedTokenMatcher& matcher, bool parse_special,
                   EncodeScratch& scratch, const Emit& emit) const {
    size_t emitted = 0, pos = 0, start = 0;
    while (const AddedToken* token = matcher.find(text, pos, start)) {
      size_t stop = start + token->pattern.size();
      pos = stop;
      if (token->special && !parse_special) continue;
      if (token->single_word) {
        const bool word_before =
            start > 0 && word_char_at(text, utf8::previous_start(text, start), scratch);
        const bool word_after = stop < text.size() && word_char_at(text, stop, scratch);
        if (word_before || word_after) continue;
      }
      if (token->lstrip) {
        size_t new_start = start;
        while (new_start > 0) {
          const size_t prev = utf8::previous_start(text, new_start);
          uint32_t cp = 0;
          if (utf8::decode(text, prev, cp) == 0 || !is_white_space(cp)) break;
          new_start = prev;
        }
        start = std::max(new_start, emitted);
      }
      if (token->rstrip) {
        uint32_t cp = 0;
        while (stop < text.size()) {
          const size_t n = utf8::decode(text, stop, cp);
          if (n == 0 || !is_white_space(cp)) break;
          stop += n;
        }
      }
      if (start > emitted) emit(text.substr(emitted, start - emitted), nullptr);
      emit(text.substr(start, stop - start), token);
      emitted = stop;
    }
    if (emitted < text.size()) emit(text.substr(emitted), nullptr);
  }

  // Runs pre-tokenizer steps [step, end) on a piece; emit() receives the final words.
  template <class Emit>
  void pre_tokenize(std::string_view piece, size_t step, EncodeScratch& scratch,
                    const Emit& emit) const {
    if (piece.empty()) return;
    if (step == pre_tokenizer.size()) {
      emit(piece);
      return;
    }
    const PreTokenizerStep& s = pre_tokenizer[step];
    if (s.kind == PreTokenizerKind::kByteLevel && s.add_prefix_space && piece[0] != ' ') {
      std::string spaced(1, ' ');
      spaced += piece;
      run_step(s, spaced, step, scratch, emit);
    } else {
      run_step(s, piece, step, scratch, emit);
    }
  }

  template <class Emit>
  void run_step(const PreTokenizerStep& s, std::string_view piece, size_t step,
                EncodeScratch& scratch, const Emit& emit) const {
    if (!s.regex) {
      pre_tokenize(piece, step + 1, scratch, emit);
      return;
    }
    // Deeper steps may use the match data, so collect this level's pieces first.
    std::vector<std::string_view> parts;
    s.regex->split_isolated(piece, scratch.match_data.get(),
                            [&](std::string_view p) { parts.push_back(p); });
    for (std::string_view p : parts) pre_tokenize(p, step + 1, scratch, emit);
  }

  // BPE on one pre-tokenized word (raw bytes), appending its ids. Mirrors tokenizers'
  // Word::merge_all: repeatedly apply the lowest-ranked merge present, leftmost first.
  void bpe(std::string_view word, EncodeScratch& scratch, std::vector<int32_t>& out) const {
    if (word.empty()) return;
    if (word.size() == 1 && byte_token[static_cast<uint8_t>(word[0])] >= 0) {
      out.push_back(byte_token[static_cast<uint8_t>(word[0])]);
      return;
    }
    if (ignore_merges) {
      std::string& form = scratch.text;
      form.clear();
      for (char c : word) form += byte_level().byte_to_char[static_cast<uint8_t>(c)];
      if (auto it = vocab.find(form); it != vocab.end()) {
        out.push_back(it->second);
        return;
      }
    }

    auto& symbols = scratch.symbols;
    symbols.clear();
    const auto add_symbol = [&](int32_t id, int32_t len) {
      const auto index = static_cast<int32_t>(symbols.size());
      if (!symbols.empty()) symbols.back().next = index;
      symbols.push_back({id, index - 1, -1, len});
    };
    // Bytes without a token become unk (fused when fuse_unk) or, with no unk, are dropped.
    int32_t unk_len = 0;  // bytes covered by the unk not yet added, 0 if none
    for (char c : word) {
      const int32_t id = byte_token[static_cast<uint8_t>(c)];
      if (id >= 0) {
        if (unk_len > 0) add_symbol(*unk_id, unk_len);
        unk_len = 0;
        add_symbol(id, 1);
      } else if (unk_id) {
        if (unk_len > 0 && !fuse_unk) {
          add_symbol(*unk_id, unk_len);
          unk_len = 0;
        }
        ++unk_len;
      }
    }
    if (unk_len > 0) add_symbol(*unk_id, unk_len);

    auto& queue = scratch.queue;
    queue.clear();
    const auto later = [](const EncodeScratch::QueuedMerge& a,
                          const EncodeScratch::QueuedMerge& b) {
      return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
    };
    const auto push = [&](int32_t pos, int32_t left, int32_t right) {
      if (auto it = merges.find(pair_key(left, right)); it != merges.end()) {
        queue.push_back({it->second.rank, pos, it->second.merged_id});
        std::push_heap(queue.begin(), queue.end(), later);
      }
    };
    for (size_t i = 0; i + 1 < symbols.size(); ++i)
      push(static_cast<int32_t>(i), symbols[i].id, symbols[i + 1].id);

    while (!queue.empty()) {
      std::pop_heap(queue.begin(), queue.end(), later);
      const EncodeScratch::QueuedMerge top = queue.back();
      queue.pop_back();
      auto& left = symbols[static_cast<size_t>(top.pos)];
      if (left.len == 0 || left.next == -1) continue;
      const auto right = symbols[static_cast<size_t>(left.next)];
      // The queue entry is stale if either side has changed since it was pushed.
      auto it = merges.find(pair_key(left.id, right.id));
      if (it == merges.end() || it->second.merged_id != top.merged_id) continue;
      symbols[static_cast<size_t>(left.next)].len = 0;
      left.id = top.merged_id;
      left.len += right.len;
      left.next = right.next;
      if (right.next >= 0) symbols[static_cast<size_t>(right.next)].prev = top.pos;
      const auto& current = left;
      if (current.prev >= 0)
        push(current.prev, symbols[static_cast<size_t>(current.prev)].id, current.id);
      if (current.next >= 0)
        push(top.pos, current.id, symbols[static_cast<size_t>(current.next)].id);
    }
    for (const auto& s : symbols)
      if (s.len != 0) out.push_back(s.id);
  }

  std::vector<int32_t> encode(std::string_view text, bool parse_special) const {
    std::vector<int32_t> ids;
    ids.reserve(text.size() / 3 + 4);
    EncodeScratch scratch;
    const auto model = [&](std::string_view normalized) {
      pre_tokenize(normalized, 0, scratch, [&](std::string_view word) { bpe(word, scratch, ids); });
    };
    // As tokenizers does: split on raw-text added tokens, normalize the rest, split that on
    // normalized added tokens, and run the pre-tokenizer and the model on what remains.
    split_added(text, raw_matcher, parse_special, scratch,
                [&](std::string_view piece, const AddedToken* token) {
                  if (token) {
                    ids.push_back(token->id);
                    return;
                  }
                  const std::string normalized = nfc ? nfc_normalize(piece) : std::string();
                  const std::string_view view = nfc ? std::string_view(normalized) : piece;
                  split_added(view, normalized_matcher, parse_special, scratch,
                              [&](std::string_view rest, const AddedToken* t) {
                                if (t)
                                  ids.push_back(t->id);
                                else
                                  model(rest);
                              });
                });
    return ids;
  }

  // Bytes of one id for decoding; empty when skipped. Ids with no token (past the tokenizer's
  // vocabulary, as in a model's padded embedding rows, or holes) decode to nothing, exactly as
  // `tokenizers` drops them: a sampled padding id must not end a stream.
  const std::string& decode_bytes(int32_t id, bool skip_special) const {
    static const std::string kEmpty;
    if (id < 0 || id >= static_cast<int32_t>(kind_by_id.size())) return kEmpty;
    const auto i = static_cast<size_t>(id);
    if (kind_by_id[i] == kNone) return kEmpty;
    if (skip_special && kind_by_id[i] == kSpecial) return kEmpty;
    return bytes_by_id[i];
  }

  // ---- Loading ----

  void load_model(const json& model);
  void load_added_tokens(const json& tokens);
  void load_normalizer(const json& node);
  void load_pre_tokenizer(const json& node, bool top_level);
  void load_decoder(const json& node);
  void finish();
};

namespace {

bool optional_bool(const json& obj, const char* key, bool fallback, const std::string& where) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) fail(where, ": \"", key, "\" must be a boolean");
  return it->get<bool>();
}

// Token ids beyond this are refused: they would make the id-indexed tables huge.
constexpr int64_t kMaxTokenId = (int64_t{1} << 24) - 1;

int32_t token_id_value(const json& v, const std::string& where, std::string_view what) {
  if (!v.is_number_integer()) fail(where, ": id of ", what, " must be an integer");
  const auto id = v.get<int64_t>();
  if (id < 0 || id > kMaxTokenId)
    fail(where, ": id ", id, " of ", what, " is out of range [0, ", kMaxTokenId, "]");
  return static_cast<int32_t>(id);
}

}  // namespace

void Tokenizer::Impl::load_model(const json& model) {
  const std::string where = context + ": model";
  if (!model.is_object()) fail(where, " must be an object");
  if (auto t = model.find("type"); t != model.end() && *t != "BPE")
    fail(where, " type ", describe_type(model), " is not supported (only BPE)");
  if (auto it = model.find("dropout");
      it != model.end() && !it->is_null() && !(it->is_number() && it->get<double>() == 0.0))
    fail(where, ": BPE dropout is not supported");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (auto it = model.find(key);
        it != model.end() && !it->is_null() && !(it->is_string() && it->get<std::string>().empty()))
      fail(where, ": BPE ", key, " is not supported");
  }
  if (optional_bool(model, "byte_fallback", false, where))
    fail(where, ": BPE byte_fallback is not supported");
  ignore_merges = optional_bool(model, "ignore_merges", false, where);
  fuse_unk = optional_bool(model, "fuse_unk", false, where);

  auto vocab_it = model.find("vocab");
  if (vocab_it == model.end()) fail(where, " has no \"vocab\"");
  if (!vocab_it->is_object()) fail(where, ": \"vocab\" must be an object of token -> id");
  vocab.reserve(vocab_it->size());
  for (const auto& [token, id] : vocab_it->items())
    vocab.emplace(token, token_id_value(id, where, "vocab token \"" + token + "\""));

  if (auto it = model.find("unk_token"); it != model.end() && !it->is_null()) {
    if (!it->is_string()) fail(where, ": \"unk_token\" must be a string");
    auto v = vocab.find(it->get<std::string>());
    if (v == vocab.end())
      fail(where, ": unk_token \"", it->get<std::string>(), "\" is not in the vocab");
    unk_id = v->second;
  }

  auto merges_it = model.find("merges");
  if (merges_it == model.end()) fail(where, " has no \"merges\"");
  if (!merges_it->is_array()) fail(where, ": \"merges\" must be an array");
  merges.reserve(merges_it->size());
  int32_t rank = 0;
  for (size_t i = 0; i < merges_it->size(); ++i) {
    const json& m = (*merges_it)[i];
    std::string left, right;
    if (m.is_string()) {
      const std::string& line = m.get_ref<const std::string&>();
      if (line.starts_with("#version")) continue;  // merges.txt header, skipped by tokenizers
      const size_t space = line.find(' ');
      if (space == std::string::npos || line.find(' ', space + 1) != std::string::npos)
        fail(where, ": merge #", i, " \"", line, "\" is not two tokens separated by a space");
      left = line.substr(0, space);
      right = line.substr(space + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      left = m[0].get<std::string>();
      right = m[1].get<std::string>();
    } else {
      fail(where, ": merge #", i, " must be \"a b\" or [\"a\", \"b\"]");
    }
    const auto lookup = [&](const std::string& token) {
      auto it = vocab.find(token);
      if (it == vocab.end())
        fail(where, ": merge #", i, " (\"", left, "\", \"", right, "\") uses token \"", token,
             "\" which is not in the vocab");
      return it->second;
    };
    const int32_t a = lookup(left), b = lookup(right), merged = lookup(left + right);
    // Later duplicates win, as when tokenizers collects the merges into a map.
    merges[pair_key(a, b)] = MergeRule{rank++, merged};
  }

  const ByteLevelAlphabet& alphabet = byte_level();
  for (size_t b = 0; b < 256; ++b) {
    auto it = vocab.find(alphabet.byte_to_char[b]);
    byte_token[b] = it == vocab.end() ? -1 : it->second;
  }
}

void Tokenizer::Impl::load_added_tokens(const json& tokens) {
  const std::string where = context + ": added_tokens";
  if (tokens.is_null()) return;
  if (!tokens.is_array()) fail(where, " must be an array");
  for (size_t i = 0; i < tokens.size(); ++i) {
    const json& t = tokens[i];
    const std::string at = where + "[" + std::to_string(i) + "]";
    if (!t.is_object()) fail(at, " must be an object");
    auto content = t.find("content");
    if (content == t.end() || !content->is_string()) fail(at, " has no string \"content\"");
    auto id = t.find("id");
    if (id == t.end()) fail(at, " has no \"id\"");
    AddedToken token;
    token.content = content->get<std::string>();
    token.id = token_id_value(*id, at, "added token \"" + token.content + "\"");
    token.special = optional_bool(t, "special", false, at);
    token.single_word = optional_bool(t, "single_word", false, at);
    token.lstrip = optional_bool(t, "lstrip", false, at);
    token.rstrip = optional_bool(t, "rstrip", false, at);
    token.normalized = optional_bool(t, "normalized", !token.special, at);
    if (token.content.empty()) continue;  // tokenizers ignores empty added tokens
    added.push_back(std::move(token));
  }
  std::stable_sort(added.begin(), added.end(),
                   [](const AddedToken& a, const AddedToken& b) { return a.id < b.id; });
}

void Tokenizer::Impl::load_normalizer(const json& node) {
  if (node.is_null()) return;
  const std::string type = node.is_object() && node.contains("type") && node["type"].is_string()
                               ? node["type"].get<std::string>()
                               : "";
  if (type == "NFC") {
    nfc = true;
  } else if (type == "Sequence" && node.contains("normalizers") && node["normalizers"].is_array()) {
    for (const json& n : node["normalizers"]) load_normalizer(n);
  } else {
    fail(context, ": normalizer type ", describe_type(node), " is not supported (NFC only)");
  }
}

void Tokenizer::Impl::load_pre_tokenizer(const json& node, bool top_level) {
  if (node.is_null() && top_level) fail(context, ": a ByteLevel pre_tokenizer is required");
  const std::string type = node.is_object() && node.contains("type") && node["type"].is_string()
                               ? node["type"].get<std::string>()
                               : "";
  const std::string where = context + ": pre_tokenizer " + type;
  if (!pre_tokenizer.empty() && pre_tokenizer.back().kind == PreTokenizerKind::kByteLevel)
    fail(where, " after ByteLevel is not supported (ByteLevel must come last)");
  if (type == "Sequence") {
    auto it = node.find("pretokenizers");
    if (it == node.end() || !it->is_array()) fail(where, " has no \"pretokenizers\" array");
    for (const json& p : *it) load_pre_tokenizer(p, false);
  } else if (type == "ByteLevel") {
    PreTokenizerStep step{PreTokenizerKind::kByteLevel, nullptr, false};
    step.add_prefix_space = optional_bool(node, "add_prefix_space", true, where);
    if (optional_bool(node, "use_regex", true, where))
      step.regex = std::make_shared<const Regex>(kGpt2Pattern, false, where);
    pre_tokenizer.push_back(std::move(step));
  } else if (type == "Split") {
    auto behavior = node.find("behavior");
    if (behavior == node.end() || *behavior != "Isolated")
      fail(where, ": behavior ", behavior == node.end() ? "(missing)" : behavior->dump(),
           " is not supported (Isolated only)");
    if (optional_bool(node, "invert", false, where)) fail(where, ": invert is not supported");
    auto pattern = node.find("pattern");
    if (pattern == node.end() || !pattern->is_object() || pattern->size() != 1)
      fail(where, ": \"pattern\" must be {\"Regex\": ...} or {\"String\": ...}");
    const auto entry = pattern->begin();  // the only member
    const std::string& kind = entry.key();
    const json& value = entry.value();
    if ((kind != "Regex" && kind != "String") || !value.is_string())
      fail(where, ": \"pattern\" must be {\"Regex\": ...} or {\"String\": ...}");
    pre_tokenizer.push_back(
        {PreTokenizerKind::kSplit,
         std::make_shared<const Regex>(value.get<std::string>(), kind == "String", where), false});
  } else {
    fail(context, ": pre_tokenizer type ", describe_type(node),
         " is not supported (ByteLevel, Split, Sequence)");
  }
  if (top_level &&
      (pre_tokenizer.empty() || pre_tokenizer.back().kind != PreTokenizerKind::kByteLevel))
    fail(context, ": a ByteLevel pre_tokenizer is required (as the last step)");
}

void Tokenizer::Impl::load_decoder(const json& node) {
  const bool byte_level_decoder =
      node.is_object() && node.contains("type") && node["type"] == "ByteLevel";
  if (!byte_level_decoder)
    fail(context, ": decoder type ", describe_type(node), " is not supported (ByteLevel only)");
}

void Tokenizer::Impl::finish() {
  int64_t size = 0;
  for (const auto& [token, id] : vocab) size = std::max<int64_t>(size, int64_t{id} + 1);
  for (const AddedToken& t : added) size = std::max<int64_t>(size, int64_t{t.id} + 1);
  text_by_id.resize(static_cast<size_t>(size));
  bytes_by_id.resize(static_cast<size_t>(size));
  kind_by_id.assign(static_cast<size_t>(size), kNone);
  for (const auto& [token, id] : vocab) {
    const auto i = static_cast<size_t>(id);
    if (kind_by_id[i] != kNone && token > text_by_id[i]) continue;  // duplicate id: keep one
    text_by_id[i] = token;
    bytes_by_id[i] = byte_level_decode(token);
    kind_by_id[i] = kModel;
  }
  // Added tokens take precedence over the model for the same id or text, as in tokenizers.
  for (AddedToken& t : added) {
    const auto i = static_cast<size_t>(t.id);
    t.pattern = t.normalized && nfc ? nfc_normalize(t.content) : t.content;
    text_by_id[i] = t.content;
    bytes_by_id[i] = byte_level_decode(t.pattern);  // tokenizers decodes the normalized form
    kind_by_id[i] = t.special ? kSpecial : kAdded;
    added_by_content[t.content] = t.id;
  }
  for (const AddedToken& t : added) (t.normalized ? normalized_matcher : raw_matcher).add(&t);
  word_char = std::make_shared<const Regex>(kWordCharPattern, false, context);
}

// ---- Tokenizer ----------------------------------------------------------------------------------

Tokenizer::Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}

Tokenizer Tokenizer::load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("tokenizer ", path, ": cannot open file");
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) fail("tokenizer ", path, ": read error");
  return from_json(text.str(), path);
}

Tokenizer Tokenizer::from_json(const std::string& json_text, const std::string& source_name) {
  auto impl = std::make_shared<Impl>();
  impl->context = "tokenizer " + source_name;
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::exception& e) {
    fail(impl->context, ": invalid JSON: ", e.what());
  }
  if (!root.is_object()) fail(impl->context, ": top level must be an object");
  try {
    auto model = root.find("model");
    if (model == root.end()) fail(impl->context, ": no \"model\"");
    impl->load_model(*model);
    impl->load_normalizer(root.value("normalizer", json()));
    impl->load_pre_tokenizer(root.value("pre_tokenizer", json()), true);
    impl->load_decoder(root.value("decoder", json()));
    impl->load_added_tokens(root.value("added_tokens", json()));
    impl->finish();
  } catch (const json::exception& e) {
    fail(impl->context, ": unexpected JSON structure: ", e.what());
  }
  return Tokenizer(std::move(impl));
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool parse_special) const {
  return impl_->encode(text, parse_special);
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special) const {
  std::string bytes;
  for (int32_t id : ids) bytes += impl_->decode_bytes(id, skip_special);
  std::string text;
  text.reserve(bytes.size());
  utf8::append_lossy(bytes, true, text);
  return text;
}

Tokenizer::StreamDecoder::StreamDecoder(std::shared_ptr<const Impl> impl, bool skip_special)
    : impl_(std::move(impl)), skip_special_(skip_special) {}

std::string Tokenizer::StreamDecoder::push(int32_t id) {
  pending_ += impl_->decode_bytes(id, skip_special_);
  std::string text;
  const size_t used = utf8::append_lossy(pending_, false, text);
  pending_.erase(0, used);
  return text;
}

std::string Tokenizer::StreamDecoder::finish() {
  std::string text;
  utf8::append_lossy(pending_, true, text);
  pending_.clear();
  return text;
}

Tokenizer::StreamDecoder Tokenizer::stream_decoder(bool skip_special) const {
  return StreamDecoder(impl_, skip_special);
}

int32_t Tokenizer::vocab_size() const {
  return static_cast<int32_t>(impl_->kind_by_id.size());
}

std::optional<int32_t> Tokenizer::token_id(std::string_view token) const {
  if (auto it = impl_->added_by_content.find(token); it != impl_->added_by_content.end())
    return it->second;
  if (auto it = impl_->vocab.find(token); it != impl_->vocab.end()) return it->second;
  return std::nullopt;
}

std::string_view Tokenizer::token_text(int32_t id) const {
  impl_->check_id(id);
  return impl_->text_by_id[static_cast<size_t>(id)];
}

bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 && id < vocab_size() &&
         impl_->kind_by_id[static_cast<size_t>(id)] == Impl::kSpecial;
}

}  // namespace tandem
