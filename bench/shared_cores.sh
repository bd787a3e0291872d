#!/usr/bin/env bash
# Decode speed on a shared machine: demo-model decode tok/s alone, then next to 1 and 2 busy
# neighbour processes (busy loops the scheduler places freely, as a compile's jobs would be).
# With T threads and k busy neighbours on C cores, a waiting policy that gives cores back keeps
# decode near its idle speed x (C / (T + k))-ish; one that spins collapses by 10-100x.
#
# Usage: bench/shared_cores.sh [label=command ...]
#   Each argument is a label and a command prefix that runs tandem, e.g.
#     pool=./build/tandem
#     omp-passive="env OMP_WAIT_POLICY=passive /tmp/tandem-old/build/tandem"
#   Default: pool=./build/tandem. Every configuration runs in the same window for each k, so
#   their figures are comparable with each other (not with another day's).
# Environment: RUNS (runs per cell, default 5), TOKENS (decode tokens per run, default 200),
#   THREADS (--threads, default 2), NEIGHBOURS (busy-neighbour counts, default "0 1 2"),
#   MODEL (default models/qwen35-demo).
# Prints one line per (neighbours, label): median decode tok/s, min-max over the runs, and the
# median as a fraction of the same label alone.
set -euo pipefail
cd "$(dirname "$0")/.."

runs=${RUNS:-5}
tokens=${TOKENS:-200}
threads=${THREADS:-2}
neighbours=${NEIGHBOURS:-"0 1 2"}
model=${MODEL:-models/qwen35-demo}
configs=("$@")
[ ${#configs[@]} -eq 0 ] && configs=("pool=./build/tandem")

busy_pids=()
stop_neighbours() {
  for pid in "${busy_pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${busy_pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  busy_pids=()
}
trap stop_neighbours EXIT

# decode tok/s of one greedy run that always generates $tokens tokens.
decode_rate() {
  local cmd=$1 out
  out=$($cmd generate --model "$model" --prompt 'def f(x):' --max-tokens "$tokens" --ignore-eos \
    --threads "$threads" --backend cpu --json)
  grep -o '"decode_tokens_per_second":[0-9.e+-]*' <<<"$out" | cut -d: -f2
}

# "median min max" of the numbers on stdin.
summary() {
  sort -g | awk '{v[NR] = $1} END {
    m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
    printf "%.1f %.1f %.1f\n", m, v[1], v[NR] }'
}

echo "shared_cores: $(nproc) CPUs, --threads $threads, $tokens tokens x $runs runs, load $(cut -d' ' -f1-3 /proc/loadavg)"
printf '%-10s %-14s %10s %19s %9s\n' neighbours config "tok/s" "min-max" "vs alone"
declare -A alone
for k in $neighbours; do
  for ((i = 0; i < k; i++)); do
    bash -c 'while :; do :; done' &
    busy_pids+=($!)
  done
  sleep 0.5  # let the neighbours settle on their cores
  for cfg in "${configs[@]}"; do
    label=${cfg%%=*}
    cmd=${cfg#*=}
    rates=$(for ((r = 0; r < runs; r++)); do decode_rate "$cmd"; done)
    read -r med lo hi <<<"$(summary <<<"$rates")"
    [ "$k" = 0 ] && alone[$label]=$med
    ratio=$(awk -v a="${alone[$label]:-0}" -v m="$med" 'BEGIN { if (a > 0) printf "%.2f", m / a; else print "-" }')
    printf '%-10s %-14s %10s %19s %9s\n' "$k" "$label" "$med" "$lo-$hi" "$ratio"
  done
  stop_neighbours
done
