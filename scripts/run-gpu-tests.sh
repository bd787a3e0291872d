#!/usr/bin/env bash
# GPU test suite (needs an NVIDIA GPU, sm_90 by default, and the CUDA toolkit): installs missing
# packages, builds with the CUDA backend into build-cuda/, and runs every test labelled `cuda`
# (CPU-vs-CUDA for each op, bitwise batch invariance, parity with transformers on the GPU,
# lossless speculative decoding on the GPU). CI has no GPU and runs scripts/run-tests.sh instead.
# Extra args go to cmake, e.g. -DTANDEM_CUDA_ARCHITECTURES=80 for an A100.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
jobs=$(nproc 2>/dev/null || echo 2)
cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DTANDEM_CUDA=ON "$@" >/dev/null
cmake --build build-cuda -j "$jobs"
ctest --test-dir build-cuda --output-on-failure -L cuda
