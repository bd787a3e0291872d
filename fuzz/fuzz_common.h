// Shared by the fuzz targets (fuzz/fuzz_*.cpp) and by tests/test_fuzz_regressions.cpp, which
// compiles the same target files with TANDEM_FUZZ_REPLAY defined to replay saved inputs under
// gtest. Each target file puts its checks in run_one() inside its own namespace and defines
// libFuzzer's entry point only when it is built as a fuzzer.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace tandem::fuzz {

// A broken invariant: something the code under test must never do, whatever the input.
struct Failure : std::logic_error {
  using std::logic_error::logic_error;
};

// Under libFuzzer an abort is a crash: the input is saved and the run stops. Replayed by the
// test, a throw lets gtest name the input and carry on with the others.
[[noreturn]] inline void fail(const std::string& what) {
#ifdef TANDEM_FUZZ_REPLAY
  throw Failure(what);
#else
  std::fprintf(stderr, "fuzz check failed: %s\n", what.c_str());
  std::abort();
#endif
}

}  // namespace tandem::fuzz
