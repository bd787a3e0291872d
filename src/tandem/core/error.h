// Errors in tandem are exceptions that carry their context (file, tensor, expected vs got).
// User input never aborts the process: loaders and the command line throw tandem::Error,
// and the top level prints what() and exits non-zero.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace tandem {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// Builds the message from streamable parts: fail("tensor ", name, ": expected ", a, ", got ", b).
template <class... Parts>
[[noreturn]] void fail(Parts&&... parts) {
  std::ostringstream os;
  (os << ... << std::forward<Parts>(parts));
  throw Error(os.str());
}

// Internal invariant (a bug in tandem, not bad input). Still an exception, so a server survives.
#define TANDEM_CHECK(cond, ...)                                                             \
  do {                                                                                      \
    if (!(cond))                                                                            \
      ::tandem::fail(__FILE__, ":", __LINE__, ": check failed: " #cond " ", ##__VA_ARGS__); \
  } while (0)

}  // namespace tandem
