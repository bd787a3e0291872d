#!/usr/bin/env bash
# Installs missing packages, builds, and runs the main job: the bundled demo model (a 16M-parameter
# Qwen3.5 with a native MTP layer, models/qwen35-demo) continues a Python function with
# speculative decoding: its own MTP layer drafts 3 tokens per round, the target verifies. Runs on
# the GPU when tandem was built with CUDA and a GPU is present (--backend auto), else on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
./scripts/build.sh
model=models/qwen35-demo
prompt='def read_config(path):
    """Read a JSON configuration file and return it as a dict."""
'
echo "== tandem generate --model $model --draft mtp --depth 3 --backend auto"
printf '%s' "$prompt"
./build/tandem generate --model "$model" --prompt "$prompt" --max-tokens 96 --temperature 0.6 --top-p 0.9 \
  --seed 1 --draft mtp --depth 3 --backend auto
