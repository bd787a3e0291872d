#include "tandem/io/unicode_nfc.h"

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <tuple>
#include <utility>
#include <vector>

#include "tandem/io/utf8.h"

namespace tandem {
namespace {

struct Decomposition {
  uint32_t cp;
  uint32_t first;
  uint32_t second;    // 0 for a singleton decomposition
  uint32_t composes;  // 1 when (first, second) recomposes to cp under NFC
};

struct CombiningClassRange {
  uint32_t first;
  uint32_t last;
  uint32_t ccc;
};

#include "tandem/io/unicode_nfc_tables.inc"

// Hangul syllables decompose and compose arithmetically (Unicode 3.12).
constexpr uint32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr uint32_t kLCount = 19, kVCount = 21, kTCount = 28;
constexpr uint32_t kNCount = kVCount * kTCount, kSCount = kLCount * kNCount;

// A byte that is not part of well-formed UTF-8 travels as this marker plus the byte value; it
// is outside the code point range, so no table matches it.
constexpr uint32_t kRawByte = 0x80000000u;

// Nothing below these decomposes or has a non-zero class: a cheap reject of the common case.
constexpr uint32_t kFirstDecomposable = 0xC0;
constexpr uint32_t kFirstCombining = 0x300;
static_assert(kDecompositions[0].cp >= kFirstDecomposable);
static_assert(kCombiningClasses[0].first >= kFirstCombining);

uint32_t combining_class(uint32_t cp) {
  if (cp < kFirstCombining || cp >= kRawByte) return 0;
  const auto* end = std::end(kCombiningClasses);
  const auto* it =
      std::upper_bound(std::begin(kCombiningClasses), end, cp,
                       [](uint32_t c, const CombiningClassRange& r) { return c < r.first; });
  if (it == std::begin(kCombiningClasses)) return 0;
  --it;
  return cp <= it->last ? it->ccc : 0;
}

const Decomposition* find_decomposition(uint32_t cp) {
  if (cp < kFirstDecomposable || cp >= kRawByte) return nullptr;
  const auto* end = std::end(kDecompositions);
  const auto* it = std::lower_bound(std::begin(kDecompositions), end, cp,
                                    [](const Decomposition& d, uint32_t c) { return d.cp < c; });
  return it != end && it->cp == cp ? it : nullptr;
}

void decompose(uint32_t cp, std::vector<uint32_t>& out) {
  if (cp >= kSBase && cp < kSBase + kSCount) {
    const uint32_t s = cp - kSBase;
    out.push_back(kLBase + s / kNCount);
    out.push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount != 0) out.push_back(kTBase + s % kTCount);
    return;
  }
  const Decomposition* d = find_decomposition(cp);
  if (d == nullptr) {
    out.push_back(cp);
    return;
  }
  decompose(d->first, out);
  if (d->second != 0) decompose(d->second, out);
}

struct PairComposite {
  uint64_t key;  // first << 32 | second
  uint32_t composite;
};

const std::vector<PairComposite>& composition_index() {
  static const std::vector<PairComposite> index = [] {
    std::vector<PairComposite> v;
    for (const Decomposition& d : kDecompositions)
      if (d.composes) v.push_back({uint64_t{d.first} << 32 | d.second, d.cp});
    std::sort(v.begin(), v.end(),
              [](const PairComposite& a, const PairComposite& b) { return a.key < b.key; });
    return v;
  }();
  return index;
}

// The primary composite of (first, second), or 0.
uint32_t compose(uint32_t first, uint32_t second) {
  if (first >= kLBase && first < kLBase + kLCount && second >= kVBase && second < kVBase + kVCount)
    return kSBase + ((first - kLBase) * kVCount + (second - kVBase)) * kTCount;
  if (first >= kSBase && first < kSBase + kSCount && (first - kSBase) % kTCount == 0 &&
      second > kTBase && second < kTBase + kTCount)
    return first + (second - kTBase);
  if (first >= kRawByte || second >= kRawByte) return 0;
  const auto& index = composition_index();
  const uint64_t key = uint64_t{first} << 32 | second;
  auto it = std::lower_bound(index.begin(), index.end(), key,
                             [](const PairComposite& p, uint64_t k) { return p.key < k; });
  return it != index.end() && it->key == key ? it->composite : 0;
}

void append_code_point(uint32_t cp, std::string& out) {
  if (cp >= kRawByte)
    out.push_back(static_cast<char>(cp & 0xFF));
  else
    utf8::append(cp, out);
}

}  // namespace

std::string nfc_normalize(std::string_view text) {
  // ASCII is always normalized (the common case for code and English).
  if (std::all_of(text.begin(), text.end(), [](char c) { return static_cast<uint8_t>(c) < 0x80; }))
    return std::string(text);

  // 1. Full canonical decomposition.
  std::vector<uint32_t> cps;
  cps.reserve(text.size() + 8);
  for (size_t i = 0; i < text.size();) {
    uint32_t cp = 0;
    size_t n = utf8::decode(text, i, cp);
    if (n == 0) {
      cp = kRawByte | static_cast<uint8_t>(text[i]);
      n = 1;
    }
    decompose(cp, cps);
    i += n;
  }

  // 2. Canonical ordering: stable sort of every run of non-starters by combining class.
  std::vector<uint32_t> ccc(cps.size());
  for (size_t i = 0; i < cps.size(); ++i) ccc[i] = combining_class(cps[i]);
  for (size_t i = 0; i < cps.size();) {
    if (ccc[i] == 0) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < cps.size() && ccc[j] != 0) ++j;
    if (j - i > 1) {
      std::vector<std::pair<uint32_t, uint32_t>> run;  // (class, code point)
      for (size_t k = i; k < j; ++k) run.emplace_back(ccc[k], cps[k]);
      std::stable_sort(run.begin(), run.end(),
                       [](const auto& a, const auto& b) { return a.first < b.first; });
      for (size_t k = i; k < j; ++k) std::tie(ccc[k], cps[k]) = run[k - i];
    }
    i = j;
  }

  // 3. Canonical composition. A character composes with the last starter unless something in
  // between blocks it: a starter, or a non-starter of the same or higher class.
  std::vector<uint32_t> out;
  out.reserve(cps.size());
  size_t starter = SIZE_MAX;  // index in out of the last starter
  uint32_t last_ccc = 0;      // class of the last character appended after that starter
  for (size_t i = 0; i < cps.size(); ++i) {
    const uint32_t cp = cps[i], cls = ccc[i];
    if (starter != SIZE_MAX) {
      const bool adjacent = starter + 1 == out.size();
      if (adjacent || (last_ccc != 0 && last_ccc < cls)) {
        if (uint32_t c = compose(out[starter], cp); c != 0) {
          out[starter] = c;
          continue;
        }
      }
    }
    if (cls == 0) starter = out.size();
    last_ccc = cls;
    out.push_back(cp);
  }

  std::string result;
  result.reserve(text.size() + 8);
  for (uint32_t cp : out) append_code_point(cp, result);
  return result;
}

}  // namespace tandem
