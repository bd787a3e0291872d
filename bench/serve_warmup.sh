#!/usr/bin/env bash
# What `tandem serve`'s start-up warm-up (--warmup-rows) buys its first clients: a fresh server
# without it and one with it, alternated, each timed to "listening" and then driven by
# bench/loadgen.py at the given concurrency levels (its first requests are a fresh server's).
#
#   bench/serve_warmup.sh MODEL_DIR [extra serve args...]
#
# Env: TANDEM (binary, default build/tandem), ROWS (warm-up rows of the warmed server, default
# 32), LEVELS (default 1,8), REQS (requests per client, 4), GEN (tokens per request, 64), PROMPTS
# (JSONL with "prompt", default MODEL_DIR/prompts.jsonl), ROUNDS (alternations, 2), PORT (8125).
set -euo pipefail
model=$1
shift
extra=("$@")  # more serve arguments (--draft mtp, --max-batch ...)
here=$(cd "$(dirname "$0")" && pwd)
tandem=${TANDEM:-build/tandem}
rows=${ROWS:-32}
levels=${LEVELS:-1,8}
reqs=${REQS:-4}
gen=${GEN:-64}
prompts=${PROMPTS:-$model/prompts.jsonl}
rounds=${ROUNDS:-2}
port=${PORT:-8125}
name=$(basename "$model")
[ -x "$tandem" ] || { echo "serve_warmup: no tandem binary at $tandem" >&2; exit 2; }
[ -f "$prompts" ] || { echo "serve_warmup: no prompts file $prompts" >&2; exit 2; }
log=$(mktemp)
trap 'rm -f "$log"' EXIT

run() {  # warm-up rows, label
  local t0 pid
  t0=$(date +%s%N)
  "$tandem" serve --model "$model" --port "$port" --warmup-rows "$1" "${extra[@]}" > "$log" 2>&1 &
  pid=$!
  for _ in $(seq 1 6000); do
    grep -q listening "$log" && break
    kill -0 "$pid" 2> /dev/null || { cat "$log" >&2; exit 1; }
    sleep 0.05
  done
  echo "$2: listening after $(( ($(date +%s%N) - t0) / 1000000 )) ms; $(grep -h 'warm-up done' "$log" || echo 'no warm-up')"
  python3 "$here/loadgen.py" --url "http://127.0.0.1:$port" --model "$name" --concurrency "$levels" \
    --requests-per-client "$reqs" --max-tokens "$gen" --prompts-file "$prompts" --ramp 0 \
    --label "$2" | grep "c="
  kill -INT "$pid"
  wait "$pid" || true
}
for r in $(seq 1 "$rounds"); do
  run 0 "cold$r"
  run "$rows" "warm$r"
done
