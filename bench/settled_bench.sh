#!/usr/bin/env bash
# What settling rounds on the device buys (issue 19, point 1: --settled-rounds): speculative
# decoding with each round's draft, accept walk and commits where the tokens are and the next
# round queued before the host reads it, against the same drafter with host rounds (one wait per
# round for the verify's tokens and the proposals), each against plain decoding of the same run.
#  1. The demo model (a trained MTP layer), depth 3 and auto, greedy and T = 0.8; with
#     DRAFTS="mtp ngram" the n-gram drafter too, on the code-edit prompts (its use case).
#  2. With CONFIG (a random-weight config.json, e.g. bench/configs/qwen35-9b.json): a random MTP
#     layer on that shape, whose proposals are never accepted: the round's overhead alone.
# Every run checks its tokens against plain decoding (identical_to_plain).
#
# Usage: bench/settled_bench.sh [tandem binary] [model dir]
#   Defaults: ./build/tandem and models/qwen35-demo; BACKEND defaults to cuda when nvidia-smi
#   works, else cpu.
# Environment: ROUNDS (alternations, default 2), BATCHES (default "1 8"), TEMPS (default
#   "0 0.8"; set empty to skip part 1), DEPTHS (default "3,auto"), DRAFTS (default "mtp"),
#   CONFIG (adds part 2).
# Prints one JSON document per run, each on its own line, prefixed by what it is.
set -euo pipefail
cd "$(dirname "$0")/.."

tandem=${1:-./build/tandem}
model=${2:-models/qwen35-demo}
rounds=${ROUNDS:-2}
batches=${BATCHES:-"1 8"}
temps=${TEMPS-"0 0.8"}
depths=${DEPTHS:-"3,auto"}
drafts=${DRAFTS:-mtp}
if [ -z "${BACKEND:-}" ]; then
  if nvidia-smi > /dev/null 2>&1; then BACKEND=cuda; else BACKEND=cpu; fi
fi
[ -x "$tandem" ] || { echo "settled_bench: no tandem binary at $tandem" >&2; exit 2; }
[ -d "$model" ] || { echo "settled_bench: no model directory $model" >&2; exit 2; }

summary='import json,sys; print(json.dumps([{k: r.get(k) for k in ("draft", "depth", "tokens_per_second",
  "speedup", "decode_speedup", "mean_accepted_length", "identical_to_plain")}
  for r in json.load(sys.stdin)]))'

for round in $(seq 1 "$rounds"); do
  for b in $batches; do
    for t in $temps; do
      for d in $drafts; do
        prompts=$model/prompts.jsonl
        [ "$d" = ngram ] && prompts=bench/prompts/code-edit.jsonl
        for mode in host settled; do
          flag=()
          [ "$mode" = settled ] && flag=(--settled-rounds)
          echo "# round $round, demo, $d on $(basename "$prompts"), batch $b, T $t, $mode rounds"
          "$tandem" bench-spec --backend "$BACKEND" --model "$model" \
            --prompts-file "$prompts" --max-tokens 64 --repeats 3 --depths "$depths" \
            --batch "$b" --drafts "$d" --temperature "$t" "${flag[@]}" --json |
            python3 -c "$summary"
        done
      done
    done
  done
done

[ -n "${CONFIG:-}" ] || exit 0
for round in $(seq 1 "$rounds"); do
  for b in $batches; do
    for mode in host settled; do
      flag=()
      [ "$mode" = settled ] && flag=(--settled-rounds)
      echo "# round $round, $CONFIG, random MTP layer, batch $b, $mode rounds"
      "$tandem" bench-spec --backend "$BACKEND" --random-weights "$CONFIG" --random-prompts "$b" \
        --prompt-tokens 512 --max-tokens 64 --repeats 1 --depths 3 --batch "$b" --drafts mtp \
        "${flag[@]}" --json | python3 -c "$summary"
    done
  done
done
