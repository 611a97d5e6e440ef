#!/usr/bin/env bash
# The Python tests against CUDA tensors, on the GPU machine, without recompiling the kernels: links
# the kernel libraries staged by scripts/stage_gpu.sh in .gpulibs/ (carry it; ~24 MB) into a Python
# module built there for its own Python, then runs tests/python. Writes $OUT/pytest.log.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
log="$OUT/pytest.log"
if ! cmake -S . -B build-py -G Ninja -DENCORE_CUDA=ON -DENCORE_BUILD_PYTHON=ON -DENCORE_BUILD_TESTS=OFF \
       -DENCORE_BUILD_BENCH=OFF -DENCORE_BUILD_APPS=OFF -DCMAKE_BUILD_TYPE=Release \
       -DENCORE_PREBUILT_KERNELS="$root/.gpulibs" >"$log" 2>&1 ||
   ! cmake --build build-py -j >>"$log" 2>&1; then
  echo "python module build FAILED (see $log)"; tail -20 "$log"; exit 1
fi
PYTHONPATH="$root/build-py/python" python3 -m pytest -q -rs tests/python >>"$log" 2>&1
rc=$?
grep -E "^(FAILED|ERROR|SKIPPED)|[0-9]+ (passed|failed)" "$log" | tail -15
exit $rc
