#!/usr/bin/env bash
# On the GPU machine: restores .gpubin/ and .gpulibs/ from the archive scripts/stage_gpu.sh wrote
# (.gpupack/gpu.tar.gz, carried as [".gpupack"]), from the repository root.
set -euo pipefail
tar -xzf .gpupack/gpu.tar.gz
echo "unpacked .gpubin ($(cat .gpubin/COMMIT)) and .gpulibs"
