#!/usr/bin/env bash
# What drawing sampled tokens where the logits are costs and buys (issue 19, point 1).
#  1. A target forward's cost by what it hands the host: greedy ids (argmax on the device),
#     ids drawn at T = 1 on the device (ops::sample_rows), or every window token's logits (what
#     sampled decoding copied before), for a decode step and 2-, 4- and 8-token verify windows.
#  2. Speculative decoding at T = 0.8 against plain decoding at T = 0.8, each drafter in a process
#     of its own, alternated.
#
# Usage: bench/sampling_bench.sh [tandem binary] [model dir]
#   Defaults: ./build/tandem and models/qwen35-demo. On a GPU machine pass --backend through
#   BACKEND (default cuda when nvidia-smi works, else cpu).
# Environment: ROUNDS (alternations, default 2), BATCHES (default "1 8"), CONFIG (a random-weight
#   config.json for part 1 instead of the model, e.g. bench/configs/qwen35-9b.json).
# Prints one JSON document per measurement, each on its own line, prefixed by what it is.
set -euo pipefail
cd "$(dirname "$0")/.."

tandem=${1:-./build/tandem}
model=${2:-models/qwen35-demo}
rounds=${ROUNDS:-2}
batches=${BATCHES:-"1 8"}
if [ -z "${BACKEND:-}" ]; then
  if nvidia-smi > /dev/null 2>&1; then BACKEND=cuda; else BACKEND=cpu; fi
fi
[ -x "$tandem" ] || { echo "sampling_bench: no tandem binary at $tandem" >&2; exit 2; }
[ -d "$model" ] || { echo "sampling_bench: no model directory $model" >&2; exit 2; }

source_args=(--model "$model")
[ -n "${CONFIG:-}" ] && source_args=(--random-weights "$CONFIG")

for round in $(seq 1 "$rounds"); do
  for b in $batches; do
    for output in tokens samples logits; do
      echo "# round $round, batch $b, step output $output"
      "$tandem" bench --backend "$BACKEND" "${source_args[@]}" --batch "$b" --repeats 1 \
        --gen-tokens 16 --windows 2,4,8 --step-output "$output" --json |
        python3 -c 'import json,sys; j=json.load(sys.stdin); print(json.dumps({
          "step_ms": j["decode_step_seconds"]["median"] * 1e3,
          "windows": {w["tokens"]: round(w["seconds"]["median"] * 1e3, 4)
                      for w in j["verify_windows"]}}))'
    done
  done
done

for round in $(seq 1 "$rounds"); do
  for b in $batches; do
    for draft in mtp ngram; do
      echo "# round $round, batch $b, --drafts $draft, T 0.8"
      "$tandem" bench-spec --backend "$BACKEND" --model "$model" \
        --prompts-file "$model/prompts.jsonl" --max-tokens 64 --repeats 3 --depths 3 \
        --batch "$b" --drafts "$draft" --temperature 0.8 --json |
        python3 -c 'import json,sys; print(json.dumps([{k: r.get(k) for k in
          ("draft", "depth", "speedup", "decode_speedup", "mean_accepted_length", "identical_to_plain")}
          for r in json.load(sys.stdin)]))'
    done
  done
done
