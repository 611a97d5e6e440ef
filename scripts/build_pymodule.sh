#!/usr/bin/env bash
# Builds the Python module for this machine's Python into build-py/ (import with
# PYTHONPATH=build-py/python), on the GPU machine: with .gpulibs/ carried (the kernel libraries
# staged by scripts/stage_gpu.sh) it links them instead of recompiling the kernels; without it the
# kernels are compiled here (needs .deps/cutlass). Usage: scripts/build_pymodule.sh LOG
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
log=${1:?usage: scripts/build_pymodule.sh LOG}
prebuilt=()
[ -d .gpulibs ] && prebuilt=(-DENCORE_PREBUILT_KERNELS="$root/.gpulibs")
cmake -S . -B build-py -G Ninja -DENCORE_CUDA=ON -DENCORE_BUILD_PYTHON=ON -DENCORE_BUILD_TESTS=OFF \
  -DENCORE_BUILD_BENCH=OFF -DENCORE_BUILD_APPS=OFF -DCMAKE_BUILD_TYPE=Release "${prebuilt[@]}" >"$log" 2>&1 &&
  cmake --build build-py -j >>"$log" 2>&1
