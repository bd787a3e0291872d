// Switches read from the environment, for A/B timing and debugging (TANDEM_CUDA_GRAPHS=0 and the
// like): a feature stays on unless its variable is set to exactly the value that turns it off.
#pragma once

#include <cstdlib>
#include <string_view>

namespace tandem {

// False only when the environment variable `name` is set to `off`; unset, empty or any other
// value leaves the switch on. Callers that read it on a hot path keep the answer in a static.
inline bool env_switch_on(const char* name, std::string_view off = "0") {
  const char* v = std::getenv(name);
  return !(v && std::string_view(v) == off);
}

}  // namespace tandem
