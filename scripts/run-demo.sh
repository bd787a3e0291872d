#!/usr/bin/env bash
# Installs missing packages, builds, and runs the main job: generation on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
./scripts/build.sh
model=tests/fixtures/qwen35_untied_sharded
echo "== tandem generate on $model (tiny random-weight Qwen3.5 fixture)"
./build/tandem generate --model "$model" --token-ids 11,22,33,44 --max-tokens 16 --json
