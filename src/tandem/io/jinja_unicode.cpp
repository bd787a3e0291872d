#include "tandem/io/jinja_unicode.h"

#include <algorithm>
#include <iterator>

#include "tandem/io/jinja_unicode_tables.h"
#include "tandem/io/utf8.h"

namespace tandem::jinja::unicode {
namespace {

// Property bits of kPropertyRuns (see tools/make_chat_template_fixtures.py).
enum : uint16_t {
  kSpace = 1,
  kPrintable = 2,
  kAlpha = 4,
  kDecimal = 8,
  kDigit = 16,
  kNumeric = 32,
  kCased = 64,
  kCaseIgnorable = 128,
  kLower = 256,
  kUpper = 512,
  kTitle = 1024,
};

uint16_t flags(char32_t c) {
  if (c > 0x10FFFF) return 0;
  const auto& runs = tables::kPropertyRuns;
  // The last run whose first code point is <= c.
  auto it = std::upper_bound(std::begin(runs), std::end(runs), c,
                             [](char32_t v, const tables::PropertyRun& r) { return v < r.first; });
  return it == std::begin(runs) ? 0 : std::prev(it)->flags;
}

// Appends the full case mapping of c from one of the generated tables; returns false when c maps
// to itself.
template <size_t NR, size_t NS>
bool map_case(char32_t c, const tables::CaseRange (&ranges)[NR],
              const tables::CaseSpecial (&specials)[NS], std::u32string& out) {
  auto sp = std::lower_bound(std::begin(specials), std::end(specials), c,
                             [](const tables::CaseSpecial& s, char32_t v) { return s.cp < v; });
  if (sp != std::end(specials) && sp->cp == c) {
    const std::u32string cps = decode(sp->utf8);
    out += cps;
    return true;
  }
  auto it = std::upper_bound(std::begin(ranges), std::end(ranges), c,
                             [](char32_t v, const tables::CaseRange& r) { return v < r.first; });
  if (it == std::begin(ranges)) return false;
  const tables::CaseRange& r = *std::prev(it);
  const char32_t offset = c - r.first;
  if (offset % r.step != 0 || offset / r.step >= r.count) return false;
  out.push_back(static_cast<char32_t>(static_cast<int64_t>(c) + r.delta));
  return true;
}

void to_lower_full(char32_t c, std::u32string& out) {
  if (!map_case(c, tables::kLowerRanges, tables::kLowerSpecials, out)) out.push_back(c);
}
void to_upper_full(char32_t c, std::u32string& out) {
  if (!map_case(c, tables::kUpperRanges, tables::kUpperSpecials, out)) out.push_back(c);
}
void to_title_full(char32_t c, std::u32string& out) {
  if (!map_case(c, tables::kTitleRanges, tables::kTitleSpecials, out)) out.push_back(c);
}

bool is_case_ignorable(char32_t c) {
  return (flags(c) & kCaseIgnorable) != 0;
}

// CPython's lower_ucs4: U+03A3 lowercases to final sigma (U+03C2) when a cased letter precedes
// it and none follows (skipping case-ignorable characters both ways), else to U+03C3.
void lower_at(const std::u32string& s, size_t i, std::u32string& out) {
  const char32_t c = s[i];
  if (c != 0x3A3) {
    to_lower_full(c, out);
    return;
  }
  size_t j = i;
  char32_t prev = 0;
  bool found = false;
  while (j > 0) {
    prev = s[--j];
    if (!is_case_ignorable(prev)) {
      found = true;
      break;
    }
  }
  bool final_sigma = found && is_cased(prev);
  if (final_sigma) {
    size_t k = i + 1;
    while (k < s.size() && is_case_ignorable(s[k])) ++k;
    final_sigma = k == s.size() || !is_cased(s[k]);
  }
  out.push_back(final_sigma ? 0x3C2 : 0x3C3);
}

}  // namespace

std::u32string decode(std::string_view s) {
  std::u32string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    uint32_t cp = 0;
    const size_t n = utf8::decode(s, i, cp);
    if (n == 0) {
      out.push_back(0xFFFD);
      ++i;
    } else {
      out.push_back(cp);
      i += n;
    }
  }
  return out;
}

void append(char32_t cp, std::string& out) {
  if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) cp = 0xFFFD;
  utf8::append(cp, out);
}

std::string encode(std::u32string_view cps) {
  std::string out;
  out.reserve(cps.size());
  for (char32_t c : cps) append(c, out);
  return out;
}

bool is_ascii(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return static_cast<uint8_t>(c) < 0x80; });
}

size_t length(std::string_view s) {
  // Every code point has exactly one byte that is not a continuation byte (ill-formed bytes are
  // each read as one U+FFFD by decode(), which this count slightly differs from only on
  // ill-formed input, which never reaches the interpreter).
  size_t n = 0;
  for (char c : s) n += (static_cast<uint8_t>(c) & 0xC0) != 0x80;
  return n;
}

bool is_valid(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    uint32_t cp = 0;
    const size_t n = utf8::decode(s, i, cp);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

bool is_space(char32_t c) {
  return (flags(c) & kSpace) != 0;
}
bool is_printable(char32_t c) {
  return (flags(c) & kPrintable) != 0;
}
bool is_alpha(char32_t c) {
  return (flags(c) & kAlpha) != 0;
}
bool is_decimal(char32_t c) {
  return (flags(c) & kDecimal) != 0;
}
bool is_digit(char32_t c) {
  return (flags(c) & kDigit) != 0;
}
bool is_numeric(char32_t c) {
  return (flags(c) & kNumeric) != 0;
}
bool is_alnum(char32_t c) {
  return (flags(c) & (kAlpha | kDecimal | kDigit | kNumeric)) != 0;
}
bool is_cased(char32_t c) {
  return (flags(c) & kCased) != 0;
}
bool is_lower(char32_t c) {
  return (flags(c) & kLower) != 0;
}
bool is_upper(char32_t c) {
  return (flags(c) & kUpper) != 0;
}
bool is_word(char32_t c) {
  return c == '_' || is_alnum(c);
}

bool is_line_break(char32_t c) {
  switch (c) {
    case '\n':
    case '\r':
    case 0x0B:
    case 0x0C:
    case 0x1C:
    case 0x1D:
    case 0x1E:
    case 0x85:
    case 0x2028:
    case 0x2029:
      return true;
    default:
      return false;
  }
}

std::string lower(std::string_view s) {
  if (is_ascii(s)) {
    std::string out(s);
    for (char& c : out)
      if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
    return out;
  }
  const std::u32string cps = decode(s);
  std::u32string out;
  for (size_t i = 0; i < cps.size(); ++i) lower_at(cps, i, out);
  return encode(out);
}

std::string casefold(std::string_view s) {
  // Per character, without the final-sigma context of lower().
  std::u32string out;
  for (char32_t c : decode(s)) {
    auto sp =
        std::lower_bound(std::begin(tables::kFoldSpecials), std::end(tables::kFoldSpecials), c,
                         [](const tables::CaseSpecial& x, char32_t v) { return x.cp < v; });
    if (sp != std::end(tables::kFoldSpecials) && sp->cp == c)
      out += decode(sp->utf8);
    else
      to_lower_full(c, out);
  }
  return encode(out);
}

std::string upper(std::string_view s) {
  if (is_ascii(s)) {
    std::string out(s);
    for (char& c : out)
      if (c >= 'a' && c <= 'z') c = static_cast<char>(c - 'a' + 'A');
    return out;
  }
  std::u32string out;
  for (char32_t c : decode(s)) to_upper_full(c, out);
  return encode(out);
}

std::string title(std::string_view s) {
  const std::u32string cps = decode(s);
  std::u32string out;
  bool previous_is_cased = false;
  for (size_t i = 0; i < cps.size(); ++i) {
    if (previous_is_cased)
      lower_at(cps, i, out);
    else
      to_title_full(cps[i], out);
    previous_is_cased = is_cased(cps[i]);
  }
  return encode(out);
}

std::string capitalize(std::string_view s) {
  const std::u32string cps = decode(s);
  std::u32string out;
  for (size_t i = 0; i < cps.size(); ++i) {
    if (i == 0)
      to_title_full(cps[i], out);
    else
      lower_at(cps, i, out);
  }
  return encode(out);
}

std::string swapcase(std::string_view s) {
  const std::u32string cps = decode(s);
  std::u32string out;
  for (size_t i = 0; i < cps.size(); ++i) {
    if (is_upper(cps[i]))
      lower_at(cps, i, out);
    else if (is_lower(cps[i]))
      to_upper_full(cps[i], out);
    else
      out.push_back(cps[i]);
  }
  return encode(out);
}

bool str_is_lower(std::string_view s) {
  bool cased = false;
  for (char32_t c : decode(s)) {
    if (is_upper(c) || (flags(c) & kTitle)) return false;
    if (is_lower(c)) cased = true;
  }
  return cased;
}

bool str_is_upper(std::string_view s) {
  bool cased = false;
  for (char32_t c : decode(s)) {
    if (is_lower(c) || (flags(c) & kTitle)) return false;
    if (is_upper(c)) cased = true;
  }
  return cased;
}

bool str_is_title(std::string_view s) {
  bool cased = false;
  bool previous_is_cased = false;
  for (char32_t c : decode(s)) {
    if (is_upper(c) || (flags(c) & kTitle)) {
      if (previous_is_cased) return false;
      previous_is_cased = cased = true;
    } else if (is_lower(c)) {
      if (!previous_is_cased) return false;
      previous_is_cased = cased = true;
    } else {
      previous_is_cased = false;
    }
  }
  return cased;
}

}  // namespace tandem::jinja::unicode
