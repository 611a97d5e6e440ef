#!/usr/bin/env bash
# Builds the CUDA configuration on this (CPU) machine and stages the binaries the GPU workflow
# needs in .gpubin/ (git-ignored), to be carried to the GPU machine with .deps/ (CUTLASS headers).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
./scripts/build.sh cuda
mkdir -p .gpubin
# The commit the binaries are built from (the GPU machine's copy has no .git): gpu_run.sh stamps it
# into the bench JSON; "+dirty" when the tree had uncommitted changes.
{ git rev-parse --short=12 HEAD 2>/dev/null || echo unknown; } | tr -d '\n' >.gpubin/COMMIT
git diff --quiet HEAD 2>/dev/null || echo -n "+dirty" >>.gpubin/COMMIT
cp build-cuda/apps/encore/encore build-cuda/tests/encore_tests_gpu .gpubin/
# The cpu test binary stays here (.gpubin-tests/, ignored): with it .gpubin outgrows the 64 MiB a
# device call carries, and the cpu tests run on this machine anyway.
rm -f .gpubin/encore_tests_cpu
mkdir -p .gpubin-tests && cp build-cuda/tests/encore_tests_cpu .gpubin-tests/
# The shared peer script travels in .whl/ (ignored) for ENCORE_SHARED_PEERS runs.
if [ -f ../shared/docs/bench_peers.py ]; then mkdir -p .whl && cp ../shared/docs/bench_peers.py .whl/; fi
# The kernel libraries for scripts/gpu_pytest.sh (a separate call: .gpubin and .gpulibs together
# exceed the 64 MiB carry).
mkdir -p .gpulibs && cp build-cuda/libencore_kernels_*.a .gpulibs/
# Everything above, gzip-compressed into one archive (the binaries shrink about 4x): carry
# [".gpupack"] alone and unpack on the GPU machine with scripts/gpu_unpack.sh.
mkdir -p .gpupack
tar -czf .gpupack/gpu.tar.gz .gpubin .gpulibs
du -sh .gpubin .gpulibs .gpupack .deps
