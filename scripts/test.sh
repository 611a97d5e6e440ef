#!/usr/bin/env bash
# All tests, from a fresh clone: installs dependencies, builds the CPU-only configuration and (when
# nvcc is present) the CUDA configuration for sm_90a (norm, quant, MoE routing/dispatch/combine also for
# sm_100a: ENCORE_PORTABLE_ARCHS), runs every ctest suite of both (GPU tests skip
# cleanly without a device), the packaging checks and the Python tests on the CPU backend with torch
# (the PyTorch layer, the fuzz tests; CUDA-only tests skip); first the layout rules (scripts/check_layout.py).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
./scripts/install_deps.sh
export PATH="$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"  # pip's cmake
# ccache keyed on paths relative to the tree: the packaging check's wheel build reuses build-cpu's objects
export CCACHE_BASEDIR="$root" CCACHE_NOHASHDIR=true

python3 scripts/check_layout.py
./scripts/build.sh cpu
(cd build-cpu && ctest --output-on-failure -j 2)
if command -v nvcc >/dev/null; then
  ./scripts/build.sh cuda -DENCORE_PORTABLE_ARCHS=100a  # the portable families also for Blackwell (compiled, not run)
  (cd build-cuda && ctest --output-on-failure -j 2)
else
  echo "nvcc not found: CUDA configuration not built"
fi
./scripts/test_packaging.sh  # wheel in a fresh venv; cmake --install + find_package consumer
# The Python tests on the CPU backend, torch included (CUDA-only tests skip); two workers, the slowest listed
PYTHONPATH="$root/build-cpu/python" python3 -m pytest -q -n 2 --durations=12 tests/python
