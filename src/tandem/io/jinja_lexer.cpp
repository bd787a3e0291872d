#include "tandem/io/jinja_lexer.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>

#include "tandem/core/error.h"
#include "tandem/io/jinja_unicode.h"
#include "tandem/io/utf8.h"

namespace tandem::jinja {
namespace {

struct Operator {
  std::string_view text;
  Tok type;
};
// Longest first, so that "**" wins over "*".
constexpr Operator kOperators[] = {
    {"//", Tok::kFloorDiv}, {"**", Tok::kPow},      {"==", Tok::kEq},    {"!=", Tok::kNe},
    {">=", Tok::kGe},       {"<=", Tok::kLe},       {"+", Tok::kAdd},    {"-", Tok::kSub},
    {"/", Tok::kDiv},       {"*", Tok::kMul},       {"%", Tok::kMod},    {"~", Tok::kTilde},
    {"[", Tok::kLBracket},  {"]", Tok::kRBracket},  {"(", Tok::kLParen}, {")", Tok::kRParen},
    {"{", Tok::kLBrace},    {"}", Tok::kRBrace},    {">", Tok::kGt},     {"<", Tok::kLt},
    {"=", Tok::kAssign},    {".", Tok::kDot},       {":", Tok::kColon},  {"|", Tok::kPipe},
    {",", Tok::kComma},     {";", Tok::kSemicolon},
};

bool is_digit(char c) {
  return c >= '0' && c <= '9';
}
bool is_name_start(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}
bool is_name_char(char c) {
  return is_name_start(c) || is_digit(c);
}

// Length of the Python-whitespace code point at s[i], or 0 when there is none.
size_t space_at(std::string_view s, size_t i) {
  const auto c = static_cast<uint8_t>(s[i]);
  if (c < 0x80) return unicode::is_space(c) ? 1 : 0;
  uint32_t cp = 0;
  const size_t n = utf8::decode(s, i, cp);
  return n != 0 && unicode::is_space(cp) ? n : 0;
}

size_t skip_space(std::string_view s, size_t i) {
  while (i < s.size()) {
    const size_t n = space_at(s, i);
    if (n == 0) break;
    i += n;
  }
  return i;
}

// Python's str.rstrip() with no argument.
std::string_view rstrip(std::string_view s) {
  const std::u32string cps = unicode::decode(s);
  size_t keep = cps.size();
  while (keep > 0 && unicode::is_space(cps[keep - 1])) --keep;
  if (keep == cps.size()) return s;
  // Re-measure the kept prefix in bytes.
  size_t bytes = 0;
  for (size_t k = 0; k < keep; ++k) {
    uint32_t cp = 0;
    const size_t n = utf8::decode(s, bytes, cp);
    bytes += n == 0 ? 1 : n;
  }
  return s.substr(0, bytes);
}

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// What jinja2 does to a string literal's body: value.encode("ascii", "backslashreplace")
// .decode("unicode-escape"). Non-ASCII characters first become \x/\u/\U escapes (so a
// backslash before one yields the escape's text), then Python's escape sequences are decoded.
// Returns false with `error` set (jinja2's message) for a malformed escape.
bool decode_string_literal(std::string_view body, std::string& out, std::string& error) {
  std::string ascii;
  ascii.reserve(body.size());
  for (char32_t c : unicode::decode(body)) {
    if (c < 0x80) {
      ascii.push_back(static_cast<char>(c));
      continue;
    }
    char buf[16];
    if (c <= 0xFF)
      std::snprintf(buf, sizeof(buf), "\\x%02x", static_cast<unsigned>(c));
    else if (c <= 0xFFFF)
      std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
    else
      std::snprintf(buf, sizeof(buf), "\\U%08x", static_cast<unsigned>(c));
    ascii += buf;
  }
  out.clear();
  size_t i = 0;
  const size_t n = ascii.size();
  auto hex_escape = [&](size_t digits, const char* name) -> bool {
    uint32_t v = 0;
    for (size_t k = 0; k < digits; ++k) {
      const int h = i + k < n ? hex_value(ascii[i + k]) : -1;
      if (h < 0) {
        error = std::string("truncated \\") + name + " escape";
        return false;
      }
      v = v << 4 | static_cast<uint32_t>(h);
    }
    i += digits;
    if (v > 0x10FFFF) {
      error = "illegal Unicode character";
      return false;
    }
    if (v >= 0xD800 && v <= 0xDFFF) {
      // Python keeps a lone surrogate in the str; it could never be encoded as UTF-8 output.
      error = "surrogate code points are not supported in string literals";
      return false;
    }
    unicode::append(v, out);
    return true;
  };
  while (i < n) {
    const char c = ascii[i++];
    if (c != '\\') {
      out.push_back(c);
      continue;
    }
    if (i >= n) {
      error = "\\ at end of string";
      return false;
    }
    const char e = ascii[i++];
    switch (e) {
      case '\n':
        break;  // line continuation
      case '\\':
      case '\'':
      case '"':
        out.push_back(e);
        break;
      case 'a':
        out.push_back('\a');
        break;
      case 'b':
        out.push_back('\b');
        break;
      case 'f':
        out.push_back('\f');
        break;
      case 'n':
        out.push_back('\n');
        break;
      case 'r':
        out.push_back('\r');
        break;
      case 't':
        out.push_back('\t');
        break;
      case 'v':
        out.push_back('\v');
        break;
      case 'x':
        if (!hex_escape(2, "xXX")) return false;
        break;
      case 'u':
        if (!hex_escape(4, "uXXXX")) return false;
        break;
      case 'U':
        if (!hex_escape(8, "UXXXXXXXX")) return false;
        break;
      case 'N':
        error = "\\N{...} escapes (character names) are not supported";
        return false;
      default:
        if (e >= '0' && e <= '7') {
          uint32_t v = static_cast<uint32_t>(e - '0');
          for (int k = 0; k < 2 && i < n && ascii[i] >= '0' && ascii[i] <= '7'; ++k)
            v = v * 8 + static_cast<uint32_t>(ascii[i++] - '0');
          unicode::append(v, out);
        } else {
          // Unknown escapes keep their backslash.
          out.push_back('\\');
          out.push_back(e);
        }
    }
  }
  return true;
}

class Lexer {
 public:
  Lexer(const std::string& src, const std::string& name) : src_(src), name_(name) {}

  std::vector<Token> run() {
    while (pos_ < src_.size()) root();
    push(Tok::kEof, static_cast<uint32_t>(src_.size()));
    return std::move(tokens_);
  }

 private:
  enum class TagKind { kVariable, kBlock, kComment, kRaw };

  [[noreturn]] void fail(size_t offset, const std::string& message) {
    syntax_error(name_, src_, static_cast<uint32_t>(offset), message);
  }

  Token& push(Tok type, uint32_t offset) {
    tokens_.push_back(Token{});
    tokens_.back().type = type;
    tokens_.back().offset = offset;
    return tokens_.back();
  }

  // jinja2's OptionalLStrip: the data before a tag loses all trailing whitespace when the tag
  // opens with "-"; with lstrip_blocks it loses the whitespace after its last newline (or all of
  // it, at the start of a line) when that is all whitespace and the tag is a block or comment
  // not opened with "+".
  void emit_data(size_t begin, size_t end, char sign, bool is_variable) {
    std::string_view text(src_.data() + begin, end - begin);
    if (sign == '-') {
      text = rstrip(text);
    } else if (sign != '+' && !is_variable) {
      const size_t nl = text.rfind('\n');
      const size_t l_pos = nl == std::string_view::npos ? 0 : nl + 1;
      if (l_pos > 0 || line_starting_) {
        // jinja2 3.1: whitespace_re.fullmatch(text, l_pos), i.e. Python whitespace (U+3000
        // included) from the line start to the tag.
        const std::string_view tail = text.substr(l_pos);
        if (skip_space(tail, 0) == tail.size()) text = text.substr(0, l_pos);
      }
    }
    if (!text.empty()) push(Tok::kData, static_cast<uint32_t>(begin)).text = std::string(text);
  }

  // The raw-block opener "{%[-+]? raw [-]?%}" at i; its end offset, or 0.
  size_t match_raw_begin(size_t i) const {
    size_t j = i + 2;
    if (j < src_.size() && (src_[j] == '-' || src_[j] == '+')) ++j;
    j = skip_space(src_, j);
    if (src_.compare(j, 3, "raw") != 0) return 0;
    j += 3;
    if (j < src_.size() && is_name_char(src_[j])) return 0;  // "rawx" is not raw
    j = skip_space(src_, j);
    if (src_.compare(j, 3, "-%}") == 0) return skip_space(src_, j + 3);
    if (src_.compare(j, 2, "%}") == 0) return j + 2;
    return 0;
  }

  // One step of the root state: data up to the next tag, then the tag.
  void root() {
    size_t p = pos_;
    while (true) {
      p = src_.find('{', p);
      if (p == std::string::npos || p + 1 >= src_.size()) {
        push(Tok::kData, static_cast<uint32_t>(pos_)).text = src_.substr(pos_);
        pos_ = src_.size();
        return;
      }
      const char k = src_[p + 1];
      if (k == '{' || k == '%' || k == '#') break;
      ++p;
    }
    const char k = src_[p + 1];
    const char sign =
        p + 2 < src_.size() && (src_[p + 2] == '-' || src_[p + 2] == '+') ? src_[p + 2] : 0;
    size_t raw_end = k == '%' ? match_raw_begin(p) : 0;
    const TagKind kind = raw_end    ? TagKind::kRaw
                         : k == '{' ? TagKind::kVariable
                         : k == '%' ? TagKind::kBlock
                                    : TagKind::kComment;
    emit_data(pos_, p, sign, kind == TagKind::kVariable);
    const size_t after = p + 2 + (sign ? 1 : 0);
    switch (kind) {
      case TagKind::kComment:
        comment(p, after);
        return;
      case TagKind::kRaw:
        line_starting_ = src_[raw_end - 1] == '\n';
        raw(p, raw_end);
        return;
      case TagKind::kVariable:
        push(Tok::kVariableBegin, static_cast<uint32_t>(p));
        line_starting_ = false;
        pos_ = after;
        tag(false);
        return;
      case TagKind::kBlock:
        push(Tok::kBlockBegin, static_cast<uint32_t>(p));
        line_starting_ = false;
        pos_ = after;
        tag(true);
        return;
    }
  }

  // After a closing "-%}"/"-#}" (strip following whitespace), "+%}" (keep it) or "%}"
  // (trim_blocks: drop one newline); sets pos_ and line_starting_.
  void close_block_like(size_t end_of_marker, char sign) {
    size_t e = end_of_marker;
    if (sign == '-')
      e = skip_space(src_, e);
    else if (sign == 0 && e < src_.size() && src_[e] == '\n')
      ++e;
    line_starting_ = e > 0 && src_[e - 1] == '\n';
    pos_ = e;
  }

  // The comment ends at the first "#}"; a "-" or "+" right before it (inside the comment) is
  // its whitespace control.
  void comment(size_t start, size_t body) {
    const size_t h = src_.find("#}", body);
    if (h == std::string::npos) fail(start, "Missing end of comment tag");
    char sign = 0;
    if (h > body && (src_[h - 1] == '-' || src_[h - 1] == '+')) sign = src_[h - 1];
    close_block_like(h + 2, sign);
  }

  void raw(size_t start, size_t body) {
    size_t q = body;
    while (true) {
      q = src_.find("{%", q);
      if (q == std::string::npos) fail(start, "Missing end of raw directive");
      size_t j = q + 2;
      char sign = 0;
      if (j < src_.size() && (src_[j] == '-' || src_[j] == '+')) sign = src_[j++];
      j = skip_space(src_, j);
      if (src_.compare(j, 6, "endraw") == 0) {
        j = skip_space(src_, j + 6);
        char end_sign = 0;
        size_t marker = 0;
        if (src_.compare(j, 3, "+%}") == 0 || src_.compare(j, 3, "-%}") == 0) {
          end_sign = src_[j];
          marker = j + 3;
        } else if (src_.compare(j, 2, "%}") == 0) {
          marker = j + 2;
        }
        if (marker) {
          emit_data(body, q, sign, false);
          close_block_like(marker, end_sign);
          return;
        }
      }
      q += 2;
    }
  }

  // Tokens inside {{ ... }} or {% ... %} up to and including the closing delimiter. Closing
  // delimiters only count with brackets balanced, so "{{ {'a': {}} }}" works.
  void tag(bool block) {
    std::vector<char> balance;
    while (true) {
      if (pos_ >= src_.size()) return;  // the parser reports the missing end
      const size_t i = pos_;
      if (balance.empty()) {
        if (block) {
          if (src_.compare(i, 3, "-%}") == 0 || src_.compare(i, 3, "+%}") == 0) {
            push(Tok::kBlockEnd, static_cast<uint32_t>(i));
            close_block_like(i + 3, src_[i]);
            return;
          }
          if (src_.compare(i, 2, "%}") == 0) {
            push(Tok::kBlockEnd, static_cast<uint32_t>(i));
            close_block_like(i + 2, 0);
            return;
          }
        } else {
          if (src_.compare(i, 3, "-}}") == 0) {
            push(Tok::kVariableEnd, static_cast<uint32_t>(i));
            pos_ = skip_space(src_, i + 3);
            line_starting_ = pos_ > 0 && src_[pos_ - 1] == '\n';
            return;
          }
          if (src_.compare(i, 2, "}}") == 0) {
            push(Tok::kVariableEnd, static_cast<uint32_t>(i));
            pos_ = i + 2;
            line_starting_ = false;
            return;
          }
        }
      }
      if (space_at(src_, i)) {
        pos_ = skip_space(src_, i);
        continue;
      }
      if (number(i) || name(i) || string(i)) continue;
      op(i, balance);
    }
  }

  // Python-style digits with single underscores between digits ("1_000"): length at i, or 0.
  size_t digits(size_t i, bool (*ok)(char)) const {
    size_t j = i;
    if (j >= src_.size() || !ok(src_[j])) return 0;
    ++j;
    while (j < src_.size()) {
      if (ok(src_[j])) {
        ++j;
      } else if (src_[j] == '_' && j + 1 < src_.size() && ok(src_[j + 1])) {
        j += 2;
      } else {
        break;
      }
    }
    return j - i;
  }

  bool number(size_t i) {
    if (!is_digit(src_[i])) return false;
    // jinja2's float_re: (?<!\.)\d+(\.\d+)?e[+-]?\d+ | \d+\.\d+ (underscores allowed); not
    // right after a dot, so that "foo.0.1" is two integer subscripts.
    const bool after_dot = i > 0 && src_[i - 1] == '.';
    const size_t int_len = digits(i, is_digit);
    size_t j = i + int_len;
    bool is_float = false;
    if (!after_dot) {
      size_t k = j;
      bool frac = false;
      if (k < src_.size() && src_[k] == '.') {
        const size_t f = digits(k + 1, is_digit);
        if (f) {
          k += 1 + f;
          frac = true;
        }
      }
      size_t e = k;
      bool expo = false;
      if (e < src_.size() && (src_[e] == 'e' || src_[e] == 'E')) {
        size_t s = e + 1;
        if (s < src_.size() && (src_[s] == '+' || src_[s] == '-')) ++s;
        const size_t d = digits(s, is_digit);
        if (d) {
          e = s + d;
          expo = true;
        }
      }
      if (expo) {
        j = e;
        is_float = true;
      } else if (frac) {
        j = k;
        is_float = true;
      }
    }
    if (is_float) {
      std::string text;
      for (size_t k = i; k < j; ++k)
        if (src_[k] != '_') text.push_back(src_[k]);
      Token& t = push(Tok::kFloat, static_cast<uint32_t>(i));
      t.float_value = std::strtod(text.c_str(), nullptr);  // overflow gives inf, as Python
      pos_ = j;
      return true;
    }
    // jinja2's integer_re: 0b.., 0o.., 0x.., [1-9](_?\d)*, 0(_?0)*.
    int base = 10;
    size_t start = i;
    size_t len = 0;
    if (src_[i] == '0' && i + 1 < src_.size() &&
        std::string_view("bBoOxX").find(src_[i + 1]) != std::string_view::npos) {
      const char b = static_cast<char>(src_[i + 1] | 0x20);
      base = b == 'b' ? 2 : b == 'o' ? 8 : 16;
      size_t k = i + 2;
      // (_?digit)+
      size_t count = 0;
      while (k < src_.size()) {
        size_t m = k;
        if (src_[m] == '_') ++m;
        if (m < src_.size() && hex_value(src_[m]) >= 0 && hex_value(src_[m]) < base) {
          k = m + 1;
          ++count;
        } else {
          break;
        }
      }
      if (count == 0) {
        base = 10;  // just "0", then a name such as "b"
        len = 1;
      } else {
        start = i + 2;
        len = k - i;
      }
    } else if (src_[i] == '0') {
      size_t k = i + 1;
      while (k < src_.size()) {
        size_t m = k;
        if (src_[m] == '_') ++m;
        if (m < src_.size() && src_[m] == '0')
          k = m + 1;
        else
          break;
      }
      len = k - i;
    } else {
      len = int_len;
    }
    uint64_t v = 0;
    const size_t end = i + len;
    for (size_t k = start; k < end; ++k) {
      if (src_[k] == '_') continue;
      const auto d = static_cast<uint64_t>(hex_value(src_[k]));
      if (v > (static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) - d) /
                  static_cast<uint64_t>(base))
        fail(i, "integer literal too large (tandem's Jinja integers are 64-bit)");
      v = v * static_cast<uint64_t>(base) + d;
    }
    Token& t = push(Tok::kInteger, static_cast<uint32_t>(i));
    t.int_value = static_cast<int64_t>(v);
    pos_ = end;
    return true;
  }

  bool name(size_t i) {
    if (!is_name_start(src_[i])) return false;
    size_t j = i + 1;
    while (j < src_.size() && is_name_char(src_[j])) ++j;
    push(Tok::kName, static_cast<uint32_t>(i)).text = src_.substr(i, j - i);
    pos_ = j;
    return true;
  }

  bool string(size_t i) {
    const char q = src_[i];
    if (q != '\'' && q != '"') return false;
    size_t j = i + 1;
    while (j < src_.size() && src_[j] != q) j += src_[j] == '\\' ? 2 : 1;
    if (j >= src_.size()) return false;  // unterminated: reported as an unexpected char
    std::string value, error;
    if (!decode_string_literal(std::string_view(src_).substr(i + 1, j - i - 1), value, error))
      fail(i, error);
    push(Tok::kString, static_cast<uint32_t>(i)).text = std::move(value);
    pos_ = j + 1;
    return true;
  }

  void op(size_t i, std::vector<char>& balance) {
    for (const Operator& o : kOperators) {
      if (src_.compare(i, o.text.size(), o.text) != 0) continue;
      const char c = o.text[0];
      if (o.text.size() == 1 && (c == '(' || c == '[' || c == '{')) {
        balance.push_back(c == '(' ? ')' : c == '[' ? ']' : '}');
      } else if (o.text.size() == 1 && (c == ')' || c == ']' || c == '}')) {
        if (balance.empty()) fail(i, std::string("unexpected '") + c + "'");
        if (balance.back() != c)
          fail(i, std::string("unexpected '") + c + "', expected '" + balance.back() + "'");
        balance.pop_back();
      }
      push(o.type, static_cast<uint32_t>(i));
      pos_ = i + o.text.size();
      return;
    }
    uint32_t cp = static_cast<uint8_t>(src_[i]);
    const size_t n = utf8::decode(src_, i, cp);
    std::string ch = n ? src_.substr(i, n) : src_.substr(i, 1);
    fail(i, "unexpected char " + (ch == "'" ? std::string("\"'\"") : "'" + ch + "'") + " at " +
                std::to_string(i));
  }

  const std::string& src_;
  const std::string& name_;
  size_t pos_ = 0;
  bool line_starting_ = true;
  std::vector<Token> tokens_;
};

}  // namespace

std::string describe_token(const Token& t) {
  switch (t.type) {
    case Tok::kData:
      return "template data / text";
    case Tok::kVariableBegin:
      return "begin of print statement";
    case Tok::kVariableEnd:
      return "end of print statement";
    case Tok::kBlockBegin:
      return "begin of statement block";
    case Tok::kBlockEnd:
      return "end of statement block";
    case Tok::kName:
      return t.text;
    case Tok::kString:
      return "string";
    case Tok::kInteger:
      return "integer";
    case Tok::kFloat:
      return "float";
    case Tok::kEof:
      return "end of template";
    default:
      for (const Operator& o : kOperators)
        if (o.type == t.type) return std::string(o.text);
      return "operator";
  }
}

std::string normalize_source(std::string_view source) {
  std::string out;
  out.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      out.push_back('\n');
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      out.push_back(source[i]);
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();  // keep_trailing_newline=False
  return out;
}

void line_col(std::string_view normalized, uint32_t offset, uint32_t& line, uint32_t& col) {
  offset = std::min<uint32_t>(offset, static_cast<uint32_t>(normalized.size()));
  line = 1;
  size_t line_start = 0;
  for (size_t i = 0; i < offset; ++i) {
    if (normalized[i] == '\n') {
      ++line;
      line_start = i + 1;
    }
  }
  col = static_cast<uint32_t>(unicode::length(normalized.substr(line_start, offset - line_start)) +
                              1);
}

void syntax_error(const std::string& template_name, std::string_view normalized, uint32_t offset,
                  const std::string& message, const char* type) {
  uint32_t line = 0, col = 0;
  line_col(normalized, offset, line, col);
  fail("template '", template_name, "' line ", line, " col ", col, ": ", type, ": ", message);
}

std::vector<Token> tokenize(const std::string& normalized, const std::string& template_name) {
  if (!unicode::is_valid(normalized))
    syntax_error(template_name, normalized, 0, "the template is not valid UTF-8");
  return Lexer(normalized, template_name).run();
}

}  // namespace tandem::jinja
