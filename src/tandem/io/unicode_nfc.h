// Unicode Normalization Form C (UAX #15) for the tokenizer's NFC normalizer.
#pragma once

#include <string>
#include <string_view>

namespace tandem {

// Canonical decomposition, canonical ordering, then canonical composition. Bytes that are not
// well-formed UTF-8 are copied through unchanged and act as starters that compose with nothing,
// so normalization never loses input. Data: Unicode 14 (see unicode_nfc_tables.inc).
std::string nfc_normalize(std::string_view text);

}  // namespace tandem
