#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/fuzz_*.cpp) with clang under ASan + UBSan into build-fuzz/
# and runs each for SECONDS (default 60) over its seed corpus, after replaying the inputs that once
# crashed it (fuzz/regressions/<target>/). Exits non-zero if any target crashes, leaks, times out
# or runs out of memory; the input that did it is kept under build-fuzz/artifacts/<target>/ and
# printed. New corpus entries stay in build-fuzz/corpus/<target>/ (fuzz/corpus/ is only read).
#
#   scripts/run-fuzz.sh [SECONDS]
#
# Env:
#   TANDEM_FUZZ_JOBS=N     the build's parallelism (default nproc)
#   TANDEM_FUZZ_RUNS=N     run each target for N executions in all instead of SECONDS (the long
#                          campaigns BENCHMARKS.md records); SECONDS then only caps each worker
#   TANDEM_FUZZ_WORKERS=J  libFuzzer processes per target (default 1), sharing the corpus; with
#                          RUNS each takes N / J executions; the report sums them
#   TANDEM_FUZZ_TARGETS="fuzz_a fuzz_b"  a subset of the targets (default all)
#   TANDEM_FUZZ_NO_BUILD=1 run the binaries already in build-fuzz/ (a machine without clang that
#                          was handed the build, e.g. a larger one for a long campaign)
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
runs=${TANDEM_FUZZ_RUNS:-0}
workers=${TANDEM_FUZZ_WORKERS:-1}
start=$SECONDS
case "$runs$workers" in *[!0-9]*)
  echo "run-fuzz: TANDEM_FUZZ_RUNS and TANDEM_FUZZ_WORKERS must be whole numbers" >&2
  exit 2 ;;
esac
[ "$workers" -ge 1 ] || { echo "run-fuzz: TANDEM_FUZZ_WORKERS must be at least 1" >&2; exit 2; }

build=build-fuzz
if [ "${TANDEM_FUZZ_NO_BUILD:-0}" = 1 ]; then
  echo "run-fuzz: using the binaries in $build/ as they are"
else
  # Debian's clang 14 and its compiler runtimes (libFuzzer, ASan, UBSan).
  ./scripts/install-deps.sh clang-14 libclang-rt-14-dev
  # -O2 -g without NDEBUG: assertions (nlohmann's included) stay on while fuzzing.
  cmake -S . -B "$build" -G Ninja -DCMAKE_CXX_COMPILER=clang++-14 -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g" -DTANDEM_FUZZ=ON -DTANDEM_CUDA=OFF -DTANDEM_TESTS=OFF \
    >/dev/null
  cmake --build "$build" --target tandem_fuzz -j "${TANDEM_FUZZ_JOBS:-$(nproc 2>/dev/null || echo 2)}"
  echo "run-fuzz: built in $((SECONDS - start)) s"
fi

targets=()
if [ -n "${TANDEM_FUZZ_TARGETS:-}" ]; then
  for t in $TANDEM_FUZZ_TARGETS; do
    [ -f "fuzz/$t.cpp" ] || { echo "run-fuzz: no fuzz target $t (fuzz/$t.cpp)" >&2; exit 2; }
    targets+=("$t")
  done
else
  for source in fuzz/fuzz_*.cpp; do targets+=("$(basename "$source" .cpp)"); done
fi

export UBSAN_OPTIONS=print_stacktrace=1
root=$PWD
failed=()
for target in "${targets[@]}"; do
  bin="$root/$build/$target"
  [ -x "$bin" ] || { echo "run-fuzz: $bin is missing (build it first)"; failed+=("$target"); continue; }
  artifacts="$root/$build/artifacts/$target"
  corpus="$root/$build/corpus/$target"
  logs="$root/$build/logs/$target"
  log="$logs/main.log"
  rm -rf "$logs"
  mkdir -p "$artifacts" "$corpus" "$logs"
  rm -f "$artifacts"/*  # what an earlier run found was printed by that run
  args=(-rss_limit_mb=2048 -timeout=10 -artifact_prefix="$artifacts/" -print_final_stats=1)
  [ -f "fuzz/$target.dict" ] && args+=(-dict="$root/fuzz/$target.dict")

  # Every input that crashed this target once must still pass.
  regressions=()
  if [ -d "fuzz/regressions/$target" ]; then
    while IFS= read -r -d '' f; do regressions+=("$root/$f"); done \
      < <(find "fuzz/regressions/$target" -type f -print0 | sort -z)
  fi
  if [ ${#regressions[@]} -gt 0 ] &&
    ! "$bin" "${args[@]}" "${regressions[@]}" >"$logs/regressions.txt" 2>&1; then
    echo "run-fuzz: $target fails on a regression input:"
    tail -n 40 "$logs/regressions.txt"
    failed+=("$target")
    continue
  fi

  t0=$SECONDS
  seeds=()
  [ -d "fuzz/corpus/$target" ] && seeds+=("$root/fuzz/corpus/$target")
  bound=(-max_total_time="$seconds")
  if [ "$runs" -gt 0 ]; then
    bound=(-runs=$(((runs + workers - 1) / workers)))
    [ "${1:-}" != "" ] && bound+=(-max_total_time="$seconds")
  fi
  # With several workers libFuzzer writes each one's output to fuzz-<i>.log in its working
  # directory: run them in the log folder and read every log.
  ok=1
  if [ "$workers" -gt 1 ]; then
    (cd "$logs" && "$bin" "${args[@]}" "${bound[@]}" -jobs="$workers" -workers="$workers" \
      "$corpus" "${seeds[@]}" >>"$log" 2>&1) || ok=0
  else
    "$bin" "${args[@]}" "${bound[@]}" "$corpus" "${seeds[@]}" >>"$log" 2>&1 || ok=0
  fi
  # The parent of several workers echoes their logs into its own: count the workers' logs only.
  counted=("$log")
  [ "$workers" -gt 1 ] && counted=("$logs"/fuzz-*.log)
  executed=$(cat "${counted[@]}" | sed -n 's/^stat::number_of_executed_units: *//p' |
    awk '{s += $1} END {print s + 0}')
  if [ "$ok" = 1 ]; then
    echo "run-fuzz: $target ok: $executed executions in $((SECONDS - t0)) s ($workers worker(s))," \
      "corpus $(find "$corpus" -type f | wc -l) files"
  else
    echo "run-fuzz: $target FAILED after $executed executions (logs: $logs)"
    for l in "$logs"/*.log; do
      grep -q "ERROR\|SUMMARY\|deadly\|timeout\|out-of-memory" "$l" && tail -n 60 "$l"
    done
    for crash in "$artifacts"/*; do
      [ -f "$crash" ] || continue
      echo "--- $crash ($(stat -c %s "$crash") bytes):"
      head -c 1024 "$crash" | od -A d -c | head -n 40
    done
    failed+=("$target")
  fi
done

if [ "$runs" -gt 0 ]; then
  echo "run-fuzz: $runs executions per target asked, $((SECONDS - start)) s in all"
else
  echo "run-fuzz: ${seconds} s per target, $((SECONDS - start)) s in all"
fi
if [ ${#failed[@]} -gt 0 ]; then
  echo "run-fuzz: FAILED: ${failed[*]}"
  exit 1
fi
