#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/fuzz_*.cpp) with clang under ASan + UBSan into build-fuzz/
# and runs each for SECONDS (default 60) over its seed corpus, after replaying the inputs that once
# crashed it (fuzz/regressions/<target>/). Exits non-zero if any target crashes, leaks, times out
# or runs out of memory; the input that did it is kept under build-fuzz/artifacts/<target>/ and
# printed. New corpus entries stay in build-fuzz/corpus/<target>/ (fuzz/corpus/ is only read).
#
#   scripts/run-fuzz.sh [SECONDS]    TANDEM_FUZZ_JOBS=N sets the build's parallelism (default nproc)
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
start=$SECONDS
./scripts/install-fuzz-deps.sh

build=build-fuzz
# -O2 -g without NDEBUG: assertions (nlohmann's included) stay on while fuzzing.
cmake -S . -B "$build" -G Ninja -DCMAKE_CXX_COMPILER=clang++-14 -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g" -DTANDEM_FUZZ=ON -DTANDEM_CUDA=OFF -DTANDEM_TESTS=OFF \
  >/dev/null
cmake --build "$build" --target tandem_fuzz -j "${TANDEM_FUZZ_JOBS:-$(nproc 2>/dev/null || echo 2)}"
echo "run-fuzz: built in $((SECONDS - start)) s"

export UBSAN_OPTIONS=print_stacktrace=1
failed=()
for source in fuzz/fuzz_*.cpp; do
  target=$(basename "$source" .cpp)
  bin="$build/$target"
  artifacts="$build/artifacts/$target"
  corpus="$build/corpus/$target"
  log="$build/logs/$target.log"
  mkdir -p "$artifacts" "$corpus" "$(dirname "$log")"
  rm -f "$artifacts"/*  # what an earlier run found was printed by that run
  args=(-rss_limit_mb=2048 -timeout=10 -artifact_prefix="$artifacts/" -print_final_stats=1)
  [ -f "fuzz/$target.dict" ] && args+=(-dict="fuzz/$target.dict")

  # Every input that crashed this target once must still pass.
  regressions=()
  if [ -d "fuzz/regressions/$target" ]; then
    while IFS= read -r -d '' f; do regressions+=("$f"); done \
      < <(find "fuzz/regressions/$target" -type f -print0 | sort -z)
  fi
  if [ ${#regressions[@]} -gt 0 ] && ! "$bin" "${args[@]}" "${regressions[@]}" >"$log" 2>&1; then
    echo "run-fuzz: $target fails on a regression input:"
    tail -n 40 "$log"
    failed+=("$target")
    continue
  fi

  t0=$SECONDS
  seeds=()
  [ -d "fuzz/corpus/$target" ] && seeds+=("fuzz/corpus/$target")
  if "$bin" "${args[@]}" -max_total_time="$seconds" "$corpus" "${seeds[@]}" >>"$log" 2>&1; then
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
    echo "run-fuzz: $target ok: ${runs:-?} executions in $((SECONDS - t0)) s," \
      "corpus $(find "$corpus" -type f | wc -l) files"
  else
    echo "run-fuzz: $target FAILED (log: $log)"
    tail -n 60 "$log"
    for crash in "$artifacts"/*; do
      [ -f "$crash" ] || continue
      echo "--- $crash ($(stat -c %s "$crash") bytes):"
      head -c 1024 "$crash" | od -A d -c | head -n 40
    done
    failed+=("$target")
  fi
done

echo "run-fuzz: ${seconds} s per target, $((SECONDS - start)) s in all"
if [ ${#failed[@]} -gt 0 ]; then
  echo "run-fuzz: FAILED: ${failed[*]}"
  exit 1
fi
