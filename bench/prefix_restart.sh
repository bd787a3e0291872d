#!/usr/bin/env bash
# Restart to first token with the prefix cache's disk tier vs a cold prefill.
#
#   bench/prefix_restart.sh MODEL_DIR VOCAB [SYSTEM_TOKENS] [extra serve args...]
#
# 1. A server with --prefix-cache-dir and --prefix-cache-persist answers one request whose prompt
#    is a SYSTEM_TOKENS-token system prompt (token ids) and shuts down, writing its boundaries.
# 2. A server restarted on the same folder: the time from its start to listening, and the TTFT of
#    a request = the system prompt + 64 tokens of its own (read back from disk).
# 3. The same with a server without the cache (cold prefill of the whole prompt).
# Env: TANDEM (binary, default build/tandem), PORT (default 8140). One JSON line on stdout.
set -euo pipefail
model=$1
vocab=$2
system=${3:-2048}
shift $(($# < 3 ? $# : 3))
tandem=${TANDEM:-build/tandem}
port=${PORT:-8140}
dir=$(mktemp -d)
here=$(cd "$(dirname "$0")" && pwd)
pid=
trap 'if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; fi; rm -rf "$dir"' EXIT

start() {  # start LOG args...: returns when listening; $started: the seconds it took
  local log=$1
  shift
  local t0
  t0=$(date +%s.%N)
  "$tandem" serve --model "$model" --port "$port" --served-model-name bench "$@" >"$log" 2>&1 &
  pid=$!
  for _ in $(seq 600); do
    grep -q listening "$log" && break
    sleep 0.05
  done
  grep -q listening "$log" || { cat "$log" >&2; exit 1; }
  started=$(python3 -c "print($(date +%s.%N) - $t0)")
}

ask() {  # ask SEED_OF_USER_TOKENS: prints TTFT ms and cached tokens
  python3 - "$port" "$vocab" "$system" "$1" <<'PY'
import os, random, sys
sys.path.insert(0, os.environ["HERE"])
from prefix_bench import stream
port, vocab, system, user_seed = (int(x) for x in sys.argv[1:5])
rng = random.Random(7)
prompt = [rng.randrange(vocab) for _ in range(system)]
if user_seed >= 0:
    u = random.Random(user_seed)
    prompt += [u.randrange(vocab) for _ in range(64)]
ttft, _, cached = stream(f"http://127.0.0.1:{port}", {
    "model": "bench", "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True,
    "stream_options": {"include_usage": True}, "return_token_ids": True, "ignore_eos": True})
print(f"{ttft * 1e3:.1f} {cached}")
PY
}

export HERE=$here
start "$dir/a.log" --prefix-cache-dir "$dir/cache" --prefix-cache-persist "$@"
ask -1 >/dev/null
kill -INT "$pid"
wait "$pid" || true
files=$(find "$dir/cache" -name '*.tpc' | wc -l)
bytes=$(du -sb "$dir/cache" | cut -f1)

start "$dir/b.log" --prefix-cache-dir "$dir/cache" "$@"
warm_start=$started
read -r warm_ttft warm_cached < <(ask 1)
kill -INT "$pid"
wait "$pid" || true

start "$dir/c.log" --prefix-cache-memory 0 "$@"
cold_start=$started
read -r cold_ttft cold_cached < <(ask 1)
kill -INT "$pid"
wait "$pid" || true

printf '{"system_tokens": %d, "files": %d, "bytes_on_disk": %d, "disk": {"start_s": %.3f, "ttft_ms": %s, "cached_tokens": %d}, "cold": {"start_s": %.3f, "ttft_ms": %s, "cached_tokens": %d}}\n' \
  "$system" "$files" "$bytes" "$warm_start" "$warm_ttft" "$warm_cached" "$cold_start" "$cold_ttft" "$cold_cached"
