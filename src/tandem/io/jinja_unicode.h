// Python str semantics on UTF-8 text, for the Jinja interpreter: Python strings are sequences of
// code points, so len(), indexing, slicing, strip() and the case mappings all work on code points,
// and "whitespace", "printable", "alpha" are Unicode properties. The character data comes from
// jinja_unicode_tables.h (generated from the same Python unicodedata version as the jinja2
// reference fixtures).
//
// Strings given to these functions are well-formed UTF-8 (everything that enters the interpreter
// is: JSON strings, template text that was checked when parsed). An ill-formed byte is read as
// U+FFFD so that nothing here can run past the end of a string.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace tandem::jinja::unicode {

// Code points of s, and back.
std::u32string decode(std::string_view s);
std::string encode(std::u32string_view cps);
void append(char32_t cp, std::string& out);

bool is_ascii(std::string_view s);
// Python len(s): the number of code points.
size_t length(std::string_view s);
// Whether s is well-formed UTF-8.
bool is_valid(std::string_view s);

// Python's character predicates (str.isspace() etc. of a one-character string).
bool is_space(char32_t c);
bool is_printable(char32_t c);
bool is_alpha(char32_t c);
bool is_decimal(char32_t c);
bool is_digit(char32_t c);
bool is_numeric(char32_t c);
bool is_alnum(char32_t c);
bool is_cased(char32_t c);
bool is_lower(char32_t c);
bool is_upper(char32_t c);
// A word character of Python's re module (\w): alphanumeric or '_'.
bool is_word(char32_t c);
// A line boundary of str.splitlines() (\r\n counts as one boundary; the caller handles it).
bool is_line_break(char32_t c);

// Python str.lower(), str.upper(), str.title(), str.capitalize(), str.swapcase() and
// str.casefold(), with full case mappings ("ß".upper() == "SS") and the final-sigma rule.
std::string lower(std::string_view s);
std::string casefold(std::string_view s);
std::string upper(std::string_view s);
std::string title(std::string_view s);
std::string capitalize(std::string_view s);
std::string swapcase(std::string_view s);

// Python str.islower()/isupper(): at least one cased character and every cased one lower/upper.
bool str_is_lower(std::string_view s);
bool str_is_upper(std::string_view s);
// Python str.istitle().
bool str_is_title(std::string_view s);

// Position of the first occurrence of `needle` in hay[from, to) (to clamped to hay.size()), or
// npos. Linear in the lengths whatever the text (Knuth-Morris-Pratt beyond short needles), so that
// hostile inputs cannot make `in`, find, split or replace quadratic; an empty needle is found at
// `from`.
template <class CharT>
size_t find_substring(std::basic_string_view<CharT> hay, std::basic_string_view<CharT> needle,
                      size_t from = 0, size_t to = std::basic_string_view<CharT>::npos) {
  constexpr size_t npos = std::basic_string_view<CharT>::npos;
  to = std::min(to, hay.size());
  if (from > to || needle.size() > to - from) return npos;
  hay = hay.substr(0, to);
  if (needle.size() <= 8) return hay.find(needle, from);  // at most 8 comparisons per position
  std::vector<size_t> border(needle.size() + 1, 0);
  for (size_t i = 1, k = 0; i < needle.size(); ++i) {
    while (k && needle[i] != needle[k]) k = border[k];
    if (needle[i] == needle[k]) ++k;
    border[i + 1] = k;
  }
  for (size_t i = from, k = 0; i < hay.size(); ++i) {
    while (k && hay[i] != needle[k]) k = border[k];
    if (hay[i] == needle[k]) ++k;
    if (k == needle.size()) return i + 1 - k;
  }
  return npos;
}

// The last occurrence of `needle` in hay[from, to), or npos; linear as find_substring.
template <class CharT>
size_t rfind_substring(std::basic_string_view<CharT> hay, std::basic_string_view<CharT> needle,
                       size_t from = 0, size_t to = std::basic_string_view<CharT>::npos) {
  constexpr size_t npos = std::basic_string_view<CharT>::npos;
  to = std::min(to, hay.size());
  if (from > to || needle.size() > to - from) return npos;
  const std::basic_string<CharT> rh(hay.rbegin() + static_cast<std::ptrdiff_t>(hay.size() - to),
                                    hay.rend() - static_cast<std::ptrdiff_t>(from));
  const std::basic_string<CharT> rn(needle.rbegin(), needle.rend());
  const size_t p = find_substring<CharT>(rh, rn);
  return p == npos ? npos : to - p - needle.size();
}

}  // namespace tandem::jinja::unicode
