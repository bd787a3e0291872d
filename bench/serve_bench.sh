#!/usr/bin/env bash
# Server benchmark: `tandem bench --batch B` (the engine alone) against `tandem serve` under
# bench/loadgen.py at several concurrency levels, on the same model in the same sitting; then the
# inter-token latency of 32 streams while one long prompt is admitted.
#
#   bench/serve_bench.sh MODEL_DIR OUT_DIR [extra serve args...]
#
# Env: TANDEM (binary, default build/tandem), LEVELS (default 1,8,32,64), PROMPT (prompt tokens,
# 128), GEN (tokens per request, 256), VOCAB (token ids are drawn below it; default: the model's
# vocab_size), LONG (long prompt tokens, 8192; 0 skips), BATCH (bench batch, 32), PORT (8123),
# REQS (requests per client, 2), RAMP (seconds over which clients start, 1), LABEL.
set -euo pipefail
model=$1
out=$2
shift 2
here=$(cd "$(dirname "$0")" && pwd)
tandem=${TANDEM:-build/tandem}
levels=${LEVELS:-1,8,32,64}
prompt=${PROMPT:-128}
gen=${GEN:-256}
long=${LONG:-8192}
batch=${BATCH:-32}
port=${PORT:-8123}
reqs=${REQS:-2}
ramp=${RAMP:-1}
label=${LABEL:-$(basename "$model")}
vocab=${VOCAB:-$(python3 -c "import json,sys; c=json.load(open(sys.argv[1])); print(c.get('text_config', c)['vocab_size'])" "$model/config.json")}
mkdir -p "$out"

if [ "$batch" != 0 ]; then
  echo "== tandem bench --batch $batch ($label)"
  "$tandem" bench --model "$model" --batch "$batch" --prompt-tokens "$prompt" --gen-tokens 128 \
    --repeats 3 --windows 2 --json > "$out/bench_batch$batch.json"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: v for k, v in d.items() if 'decode' in k and not isinstance(v, (list, dict))})" "$out/bench_batch$batch.json" || true
fi

"$tandem" serve --model "$model" --port "$port" "$@" 2> "$out/serve.log" &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  grep -q "listening on" "$out/serve.log" && break
  kill -0 $pid || { cat "$out/serve.log"; exit 1; }
  sleep 0.5
done
cat "$out/serve.log"
name=$(python3 -c "import json,urllib.request; print(json.load(urllib.request.urlopen('http://127.0.0.1:$port/v1/models'))['data'][0]['id'])")
echo "== loadgen ($label, serve $*)"
python3 "$here/loadgen.py" --url "http://127.0.0.1:$port" --model "$name" --concurrency "$levels" \
  --requests-per-client "$reqs" --prompt-tokens "$prompt" --max-tokens "$gen" --vocab "$vocab" \
  --ramp "$ramp" --label "$label" --json | tee "$out/loadgen.jsonl"
if [ "$long" != 0 ]; then
  echo "== 32 streams while a $long-token prompt is admitted"
  python3 "$here/loadgen.py" --url "http://127.0.0.1:$port" --model "$name" --concurrency 32 \
    --requests-per-client 3 --prompt-tokens "$prompt" --max-tokens "$gen" --vocab "$vocab" \
    --long-prompt-tokens "$long" --long-prompt-at 3 --label "$label-long" --json | tee "$out/long_prompt.json"
fi
curl -s "http://127.0.0.1:$port/metrics" > "$out/metrics.txt" || true
kill -TERM $pid
wait $pid || true
trap - EXIT
