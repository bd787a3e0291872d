#!/usr/bin/env bash
# Issue 18's batched-decode figures for one tandem binary or several alternated in one sitting (an
# A/B): each round runs every binary at every batch size before the next round starts, so a drift
# of the GPU's clock or of a neighbour's load shows as spread, not as a difference between
# binaries. Random weights of a config's shape (`tandem bench --random-weights`), no weight files.
#
# Usage: bench/decode_ab.sh TANDEM[@VAR=VALUE[,VAR=VALUE...]] ...
#   A binary may be named several times with different environments, e.g. to time an A/B switch
#   of one binary: bench/decode_ab.sh build/tandem build/tandem@TANDEM_CUDA_RING=0
#   Default: ./build/tandem.
# Environment: CONFIG (default bench/configs/qwen35-9b.json), BATCHES (default "1 8 32"), ROUNDS
#   (default 2), WINDOWS (verify windows timed, default 2,4,8), PROMPT (prompt tokens per row,
#   default 512), GEN (tokens generated per run, default 32), STEP_REPEATS (timed forwards per
#   shape, default 5), BACKEND (cuda when nvidia-smi works, else cpu), OUT (directory for each
#   run's report and log, and results.tsv with every run's figures; default a new temporary
#   directory).
# Prints a line per run as it finishes, then one table row per binary and batch size: decode
# tok/s and the decode step over the rounds (min-max), the roofline fraction and each window's
# cost in decode steps and in milliseconds (the steps carry the step's own spread as well).
set -euo pipefail
cd "$(dirname "$0")/.."

[ $# -gt 0 ] || set -- ./build/tandem
config=${CONFIG:-bench/configs/qwen35-9b.json}
batches=${BATCHES:-1 8 32}
rounds=${ROUNDS:-2}
windows=${WINDOWS:-2,4,8}
prompt=${PROMPT:-512}
gen=${GEN:-32}
step_repeats=${STEP_REPEATS:-5}
if [ -z "${BACKEND:-}" ]; then
  if nvidia-smi > /dev/null 2>&1; then BACKEND=cuda; else BACKEND=cpu; fi
fi
out=${OUT:-$(mktemp -d /tmp/decode_ab.XXXXXX)}
mkdir -p "$out"
[ -f "$config" ] || { echo "decode_ab: no config $config" >&2; exit 2; }
[[ $rounds =~ ^[1-9][0-9]*$ ]] || { echo "decode_ab: ROUNDS must be a positive count" >&2; exit 2; }
for spec in "$@"; do
  bin=${spec%%@*}
  [ -x "$bin" ] || { echo "decode_ab: no tandem binary at $bin (from '$spec')" >&2; exit 2; }
  if [[ $spec == *@* ]]; then
    IFS=, read -ra vars <<< "${spec#*@}"
    for v in "${vars[@]}"; do
      [[ $v =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] ||
        { echo "decode_ab: '$v' in '$spec' is not VAR=VALUE" >&2; exit 2; }
    done
  fi
done
echo "decode_ab: $config on $BACKEND, batches $batches, $rounds rounds; runs in $out" >&2

# One run's figures from bench's report: decode tok/s, roofline %, step ms, and the windows as
# "tokens:steps:ms".
figures() {
  awk '$1 == "decode" && $3 == "tok/s" { d = $2 }
       $1 == "roofline" { r = $5; sub(/%/, "", r) }
       $1 == "decode" && $2 == "step" { s = $3 }
       $1 == "verify" { for (i = 1; i < NF; ++i) if ($i == "=") { x = $(i + 1); sub(/x$/, "", x) }
                        w = w (w == "" ? "" : " ") $2 ":" x ":" $4 }
       END { if (d == "" || s == "") exit 1; print d "\t" r "\t" s "\t" w }' "$1"
}

results=$out/results.tsv  # run, round, batch, spec, then figures' fields
: > "$results"
run=0
for round in $(seq 1 "$rounds"); do
  for b in $batches; do
    for spec in "$@"; do
      run=$((run + 1))
      bin=${spec%%@*}
      vars=()
      [[ $spec == *@* ]] && IFS=, read -ra vars <<< "${spec#*@}"
      file=$out/run$run.txt
      if ! env ${vars[@]+"${vars[@]}"} "$bin" bench --backend "$BACKEND" --random-weights "$config" \
        --prompt-tokens "$prompt" --gen-tokens "$gen" --repeats 1 --step-repeats "$step_repeats" \
        --long-prefill 0 --windows "$windows" --batch "$b" > "$file" 2> "$out/run$run.log"; then
        echo "decode_ab: '$spec' failed at batch $b (round $round): see $out/run$run.log" >&2
        exit 1
      fi
      if ! fig=$(figures "$file"); then
        echo "decode_ab: no decode figures in $file" >&2
        exit 1
      fi
      printf '%s\t%s\t%s\t%s\t%s\n' "$run" "$round" "$b" "$spec" "$fig" >> "$results"
      IFS=$'\t' read -r dec roof step wins <<< "$fig"
      printf 'round %s  batch %3s  %-40s decode %9s tok/s (%s%%)  step %s ms  windows %s\n' \
        "$round" "$b" "$spec" "$dec" "$roof" "$step" "$(sed -E 's/([0-9]+):([^: ]+):([^ ]+)/\1:\2 (\3 ms)/g' <<< "$wins")"
    done
  done
done

# The table: one row per (batch, binary), min-max over the rounds.
echo
echo "| binary | batch | decode tok/s | roofline | step ms | windows (tokens: steps, ms) |"
echo "|---|---|---|---|---|---|"
awk -F'\t' '
  function span(lo, hi) { return lo == hi ? lo : lo "-" hi }
  function widen(key, v) {
    if (!(key in lo) || v + 0 < lo[key] + 0) lo[key] = v
    if (!(key in hi) || v + 0 > hi[key] + 0) hi[key] = v
  }
  {
    k = $3 SUBSEP $4
    if (!(k in seen)) { seen[k] = 1; order[++n] = k; batch[k] = $3; spec[k] = $4 }
    widen(k SUBSEP "d", $5); widen(k SUBSEP "r", $6); widen(k SUBSEP "s", $7)
    m = split($8, ws, " ")
    for (i = 1; i <= m; ++i) {
      split(ws[i], tw, ":")
      if (!((k, tw[1]) in wseen)) { wseen[k, tw[1]] = 1; wlist[k] = wlist[k] " " tw[1] }
      widen(k SUBSEP "w" tw[1], tw[2]); widen(k SUBSEP "m" tw[1], tw[3])
    }
  }
  END {  # in the order of the first round: batches as BATCHES lists them, binaries as named
    for (i = 1; i <= n; ++i) {
      k = order[i]
      w = ""
      m = split(wlist[k], toks, " ")
      for (j = 1; j <= m; ++j)
        w = w (j > 1 ? "; " : "") toks[j] ": " span(lo[k SUBSEP "w" toks[j]], hi[k SUBSEP "w" toks[j]]) \
          ", " span(lo[k SUBSEP "m" toks[j]], hi[k SUBSEP "m" toks[j]]) " ms"
      printf "| %s | %s | %s | %s%% | %s | %s |\n", spec[k], batch[k],
        span(lo[k SUBSEP "d"], hi[k SUBSEP "d"]), span(lo[k SUBSEP "r"], hi[k SUBSEP "r"]),
        span(lo[k SUBSEP "s"], hi[k SUBSEP "s"]), w
    }
  }' "$results"
