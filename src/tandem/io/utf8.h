// UTF-8 helpers shared by the tokenizer and its normalizer. Well-formed means Unicode 3.9:
// no overlong forms, no surrogates, nothing above U+10FFFF.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace tandem::utf8 {

constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";  // U+FFFD

// Length of the sequence a lead byte announces, and the range its second byte must fall in;
// 0 for a byte that cannot start a sequence.
struct LeadByte {
  size_t length;
  uint8_t second_lo;
  uint8_t second_hi;
};
inline LeadByte lead_byte(uint8_t c) {
  if (c < 0x80) return {1, 0, 0};
  if (c >= 0xC2 && c <= 0xDF) return {2, 0x80, 0xBF};
  if (c == 0xE0) return {3, 0xA0, 0xBF};
  if (c == 0xED) return {3, 0x80, 0x9F};
  if (c >= 0xE1 && c <= 0xEF) return {3, 0x80, 0xBF};
  if (c == 0xF0) return {4, 0x90, 0xBF};
  if (c >= 0xF1 && c <= 0xF3) return {4, 0x80, 0xBF};
  if (c == 0xF4) return {4, 0x80, 0x8F};
  return {0, 0, 0};
}

// Decodes the well-formed sequence at s[i] (i < s.size()) into cp; returns its length, or 0
// when the bytes there are ill-formed or cut off.
inline size_t decode(std::string_view s, size_t i, uint32_t& cp) {
  const auto c = static_cast<uint8_t>(s[i]);
  const LeadByte lead = lead_byte(c);
  if (lead.length == 1) {
    cp = c;
    return 1;
  }
  if (lead.length == 0 || s.size() - i < lead.length) return 0;
  const auto second = static_cast<uint8_t>(s[i + 1]);
  if (second < lead.second_lo || second > lead.second_hi) return 0;
  uint32_t value = c & (0x7Fu >> lead.length);
  for (size_t k = 1; k < lead.length; ++k) {
    const auto b = static_cast<uint8_t>(s[i + k]);
    if ((b & 0xC0) != 0x80) return 0;
    value = value << 6 | (b & 0x3Fu);
  }
  cp = value;
  return lead.length;
}

inline void append(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | cp >> 6));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | cp >> 12));
    out.push_back(static_cast<char>(0x80 | (cp >> 6 & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | cp >> 18));
    out.push_back(static_cast<char>(0x80 | (cp >> 12 & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp >> 6 & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// Appends bytes to out with each maximal ill-formed subpart replaced by one U+FFFD (Unicode
// 3.9 "substitution of maximal subparts", what Rust's String::from_utf8_lossy does). Returns how
// many bytes were consumed: all when final; otherwise a trailing sequence that could still
// complete is left for the caller to retry with more bytes.
inline size_t append_lossy(std::string_view bytes, bool final, std::string& out) {
  const size_t n = bytes.size();
  size_t i = 0;
  while (i < n) {
    const auto c = static_cast<uint8_t>(bytes[i]);
    const LeadByte lead = lead_byte(c);
    if (lead.length == 1) {
      out.push_back(static_cast<char>(c));
      ++i;
      continue;
    }
    if (lead.length == 0) {
      out.append(kReplacementChar);
      ++i;
      continue;
    }
    size_t k = 1;
    for (; k < lead.length && i + k < n; ++k) {
      const auto b = static_cast<uint8_t>(bytes[i + k]);
      const uint8_t lo = k == 1 ? lead.second_lo : 0x80, hi = k == 1 ? lead.second_hi : 0xBF;
      if (b < lo || b > hi) break;
    }
    if (k == lead.length) {
      out.append(bytes.substr(i, k));
    } else if (i + k == n && !final) {
      return i;
    } else {
      out.append(kReplacementChar);
    }
    i += k;
  }
  return n;
}

// Start of the character that ends at `end` (0 < end <= s.size()); an ill-formed byte counts
// as one character.
inline size_t previous_start(std::string_view s, size_t end) {
  for (size_t len = 2; len <= 4 && len <= end; ++len) {
    uint32_t cp = 0;
    if (decode(s, end - len, cp) == len) return end - len;
  }
  return end - 1;
}

}  // namespace tandem::utf8
