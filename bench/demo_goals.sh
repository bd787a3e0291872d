#!/usr/bin/env bash
# Issue 19's demo figures, for one binary or several alternated (an A/B in one sitting): speed-up
# end to end and decode only against plain decoding of the same run, and where each batch's time
# goes (bench-spec --json group_ms, ms per batch):
#   - MTP (the demo's own layer) on its held-out prompts: depth 3 and auto at batch 1, depth 2 and
#     auto at 8 rows;
#   - n-gram lookup on the code-edit prompts, depth 6, batch 1, 64 and 96 tokens.
# Every run checks its tokens against plain decoding (identical_to_plain).
#
# Usage: bench/demo_goals.sh TANDEM [TANDEM ...]
#   Defaults: ./build/tandem. BACKEND defaults to cuda when nvidia-smi works, else cpu.
# Environment: ROUNDS (alternations, default 2), MODEL (default models/qwen35-demo),
#   REPEATS (bench-spec --repeats, default 3), WARMUP (untimed runs per binary first, default 1:
#   an idle GPU starts at a low clock, which made one run's prefill twice another's), AUTO_WARMUP
#   (bench-spec --warmup of the auto settings, default 40: auto's steady state, every (rows,
#   depth) shape's CUDA graphs captured, as in a server that has run for a while).
# Prints one line per run: the binary, the setting, then the figures as JSON.
set -euo pipefail
cd "$(dirname "$0")/.."

[ $# -gt 0 ] || set -- ./build/tandem
rounds=${ROUNDS:-2}
model=${MODEL:-models/qwen35-demo}
repeats=${REPEATS:-3}
if [ -z "${BACKEND:-}" ]; then
  if nvidia-smi > /dev/null 2>&1; then BACKEND=cuda; else BACKEND=cpu; fi
fi
for t in "$@"; do
  [ -x "$t" ] || { echo "demo_goals: no tandem binary at $t" >&2; exit 2; }
done
[ -d "$model" ] || { echo "demo_goals: no model directory $model" >&2; exit 2; }

summary='import json,sys
for r in json.load(sys.stdin):
    if r.get("draft") == "none":
        continue
    g = {k: round(v, 3) for k, v in (r.get("group_ms") or {}).items()}
    print(json.dumps({"speedup": round(r["speedup"], 3), "decode_speedup":
        round(r["decode_speedup"], 3), "identical": r.get("identical_to_plain"), "group_ms": g}))'

for t in "$@"; do
  for _ in $(seq 1 "${WARMUP:-1}"); do
    "$t" bench-spec --backend "$BACKEND" --model "$model" --prompts-file "$model/prompts.jsonl" \
      --drafts mtp --depths 3 --batch 1 --max-tokens 64 --repeats "$repeats" > /dev/null 2>&1 ||
      { echo "demo_goals: warm-up run of $t failed" >&2; exit 1; }
  done
done

# setting: drafter, prompts, depth, batch, tokens per request
# (depth auto: what generate and serve run by default; at 8 rows depth 2 measured fastest of 2..5;
# the code edits also at 96 tokens, the length their benchmark was written for: a renamed copy of
# the function, which 64 tokens cut short)
settings=("mtp $model/prompts.jsonl 3 1 64" "mtp $model/prompts.jsonl auto 1 64"
          "mtp $model/prompts.jsonl 2 8 64" "mtp $model/prompts.jsonl auto 8 64"
          "ngram bench/prompts/code-edit.jsonl 6 1 64" "ngram bench/prompts/code-edit.jsonl 6 1 96")
for round in $(seq 1 "$rounds"); do
  for setting in "${settings[@]}"; do
    read -r draft prompts depth batch tokens <<< "$setting"
    for t in "$@"; do
      printf '%s round %s %s depth %s batch %s tokens %s: ' "$t" "$round" "$draft" "$depth" "$batch" "$tokens"
      warmup=1
      [ "$depth" = auto ] && warmup=${AUTO_WARMUP:-40}
      "$t" bench-spec --backend "$BACKEND" --model "$model" --prompts-file "$prompts" \
        --drafts "$draft" --depths "$depth" --batch "$batch" --max-tokens "$tokens" \
        --repeats "$repeats" --warmup "$warmup" --json | python3 -c "$summary"
    done
  done
done
