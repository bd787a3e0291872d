// A small loaded Qwen3.5 fixture model (tests/fixtures/qwen35_tied), for tests of code that reads
// only a TargetView's sizes: the token drafters (n-gram lookup, the continuation drafter).
#pragma once

#include <memory>
#include <string>

#include "tandem/model/qwen3_5.h"

namespace tandem::test {

inline const Qwen35Model& tied_fixture_model() {
  static std::unique_ptr<Qwen35Model> m =
      Qwen35Model::load(std::string(TANDEM_FIXTURES_DIR) + "/qwen35_tied");
  return *m;
}

}  // namespace tandem::test
