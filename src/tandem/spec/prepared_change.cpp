#include "tandem/spec/prepared_change.h"

namespace tandem::spec {

void apply_changes(const std::vector<PrepareFn>& prepare) {
  std::vector<std::unique_ptr<PreparedChange>> built;
  built.reserve(prepare.size());
  try {
    for (const PrepareFn& p : prepare) built.push_back(p());
  } catch (...) {
    for (auto& b : built)
      if (b) b->dispose();
    throw;
  }
  for (auto& b : built)
    if (b) b->commit();
}

}  // namespace tandem::spec
