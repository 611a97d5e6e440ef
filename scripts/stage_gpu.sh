#!/usr/bin/env bash
# Builds the CUDA configuration on this (CPU) machine and stages the binaries the GPU workflow
# needs in .gpubin/ (git-ignored), to be carried to the GPU machine with .deps/ (CUTLASS headers).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
./scripts/build.sh cuda
mkdir -p .gpubin
cp build-cuda/apps/encore/encore build-cuda/tests/encore_tests_gpu build-cuda/tests/encore_tests_cpu .gpubin/
# The shared peer script travels in .whl/ (ignored) for ENCORE_SHARED_PEERS runs.
if [ -f ../shared/docs/bench_peers.py ]; then mkdir -p .whl && cp ../shared/docs/bench_peers.py .whl/; fi
du -sh .gpubin .deps
