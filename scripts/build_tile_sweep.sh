#!/usr/bin/env bash
# Builds the tile-sweep experiment (bench/experiments/tile_sweep.cu, not part of the CMake build)
# against build-cuda's kernel libraries into .gpupack/exp/tile_sweep (carried with [".gpupack"]).
# On the GPU machine: .gpupack/exp/tile_sweep [rounds] > $OUT/sweep.json 2> $OUT/sweep.txt
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
test -f build-cuda/libencore_kernels_gemm_epilogue.a || ./scripts/build.sh cuda
cutlass=.deps/cutlass/cutlass_library/source
mkdir -p .gpupack/exp
/usr/local/cuda/bin/nvcc -DENCORE_WITH_CUDA=1 -Iinclude -Isrc -isystem "$cutlass/include" -isystem "$cutlass/tools/util/include" \
  -O3 -DNDEBUG -std=c++20 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
  bench/experiments/tile_sweep.cu build-cuda/libencore_kernels_gemm_epilogue.a build-cuda/libencore_core.a -lcublas \
  -o .gpupack/exp/tile_sweep
echo "built .gpupack/exp/tile_sweep"
