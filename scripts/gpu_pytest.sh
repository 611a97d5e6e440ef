#!/usr/bin/env bash
# The Python tests against CUDA tensors, on the GPU machine: builds the Python module for that
# machine's Python and runs tests/python. With .gpulibs/ carried (the kernel libraries staged by
# scripts/stage_gpu.sh, ~24 MB) it links them instead of recompiling the kernels; without it the
# kernels are compiled here (needs .deps/cutlass). Writes $OUT/pytest.log.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
log="$OUT/pytest.log"
prebuilt=()
[ -d .gpulibs ] && prebuilt=(-DENCORE_PREBUILT_KERNELS="$root/.gpulibs")
if ! cmake -S . -B build-py -G Ninja -DENCORE_CUDA=ON -DENCORE_BUILD_PYTHON=ON -DENCORE_BUILD_TESTS=OFF \
       -DENCORE_BUILD_BENCH=OFF -DENCORE_BUILD_APPS=OFF -DCMAKE_BUILD_TYPE=Release "${prebuilt[@]}" >"$log" 2>&1 ||
   ! cmake --build build-py -j >>"$log" 2>&1; then
  echo "python module build FAILED (see $log)"; tail -20 "$log"; exit 1
fi
PYTHONPATH="$root/build-py/python" python3 -m pytest -q -rs tests/python >>"$log" 2>&1
rc=$?
grep -E "^(FAILED|ERROR|SKIPPED)|[0-9]+ (passed|failed)" "$log" | tail -15
exit $rc
