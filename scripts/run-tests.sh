#!/usr/bin/env bash
# Installs missing packages, builds, and runs every CPU test; then rebuilds the suite under
# AddressSanitizer + UndefinedBehaviorSanitizer (build-asan/) and runs it again; then runs every
# fuzz target for a bounded time. Set TANDEM_SKIP_SANITIZERS=1 to run only the first pass.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
./scripts/install-test-deps.sh
./scripts/build.sh
jobs=$(nproc 2>/dev/null || echo 2)
ctest --test-dir build --output-on-failure -j "$jobs" -L cpu
if [ "${TANDEM_SKIP_SANITIZERS:-0}" != "1" ]; then
  # The sanitizer pass checks host code; the CUDA backend is left out of it (no GPU here).
  # -g1 (line tables: what a sanitizer's stack trace prints) instead of full debug information
  # takes about a quarter off this build's time (the heaviest test file: 77 s -> 41 s); -O2
  # keeps the tests' numeric loops fast.
  cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTANDEM_SANITIZE=ON \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" -DTANDEM_CUDA=OFF >/dev/null
  cmake --build build-asan -j "$jobs"
  # Lossless speculation's matrix runs here at depths 1 and 4 only (every drafter, every
  # temperature): depths 2 and 3 take the same code paths with windows in between, about 20 s
  # each under the sanitizers; the first pass above runs the whole matrix.
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
    ctest --test-dir build-asan --output-on-failure -j "$jobs" -L cpu \
    -E 'Drafters/Lossless\..*_depth[23]_'
fi

# Fuzz targets (libFuzzer, clang, ASan + UBSan) for what parses untrusted input: request bodies,
# chat templates and messages, the tokenizer, safetensors headers. Each replays its regression
# inputs, then fuzzes for a bounded time. TANDEM_SKIP_FUZZ=1 leaves this out; TANDEM_FUZZ_SECONDS
# sets the time per target.
if [ "${TANDEM_SKIP_FUZZ:-0}" != "1" ]; then
  ./scripts/run-fuzz.sh "${TANDEM_FUZZ_SECONDS:-30}"
fi
