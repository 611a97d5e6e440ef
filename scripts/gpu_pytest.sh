#!/usr/bin/env bash
# The Python tests against CUDA tensors, on the GPU machine: builds the Python module for that
# machine's Python (scripts/build_pymodule.sh) and runs tests/python. Writes $OUT/pytest.log.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
log="$OUT/pytest.log"
if ! ./scripts/build_pymodule.sh "$log"; then
  echo "python module build FAILED (see $log)"; tail -20 "$log"; exit 1
fi
PYTHONPATH="$root/build-py/python" python3 -m pytest -q -rs tests/python >>"$log" 2>&1
rc=$?
grep -E "^(FAILED|ERROR|SKIPPED)|[0-9]+ (passed|failed)" "$log" | tail -15
exit $rc
