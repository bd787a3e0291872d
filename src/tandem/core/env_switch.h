// Switches read from the environment, for A/B timing and debugging (TANDEM_CUDA_GRAPHS=0 and the
// like): a feature stays on unless its variable is set to exactly the value that turns it off.
#pragma once

#include <cstdlib>
#include <initializer_list>
#include <string_view>

namespace tandem {

// False only when the environment variable `name` is set to `off`; unset, empty or any other
// value leaves the switch on. Callers that read it on a hot path keep the answer in a static.
inline bool env_switch_on(const char* name, std::string_view off = "0") {
  const char* v = std::getenv(name);
  return !(v && std::string_view(v) == off);
}

// The integer the environment variable `name` holds when it is one of `allowed`; 0 (the
// caller's "decide for me") when it is unset or anything else.
inline int env_choice(const char* name, std::initializer_list<int> allowed) {
  const char* v = std::getenv(name);
  const int n = v ? std::atoi(v) : 0;
  for (const int a : allowed)
    if (n == a) return n;
  return 0;
}

}  // namespace tandem
