#!/usr/bin/env bash
# Installs everything encore needs on a fresh Debian machine (idempotent).
#  - Debian packages: GoogleTest, ccache, ninja (apt-get)
#  - Python packages: nanobind, numpy, pytest, pytest-xdist, hypothesis (pip); torch (pip: PyPI's
#    default wheel, which runs on the CPU of a machine without a GPU) for the PyTorch layer's tests;
#    transformers for encore.transformers' tests
#  - CUTLASS 4.2 headers: the nvidia-cutlass==4.2.0.0 wheel, downloaded without its Python
#    dependencies and unpacked into .deps/cutlass (git-ignored). Nothing third-party is committed.
#  - .deps/googletest: a copy of Debian's GoogleTest sources (/usr/src/googletest), carried to the
#    GPU machine, which has no GoogleTest, for scripts/gpu.sh build (ENCORE_GTEST_SOURCE_DIR).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)

need_apt=()
{ [ -f /usr/include/gtest/gtest.h ] && [ -f /usr/src/googletest/CMakeLists.txt ]; } || need_apt+=(libgtest-dev)
command -v ccache >/dev/null || need_apt+=(ccache)
command -v ninja  >/dev/null || need_apt+=(ninja-build)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}"
fi

py=${PYTHON:-python3}
if ! "$py" -c "import nanobind, numpy, pytest, xdist, hypothesis" 2>/dev/null; then
  "$py" -m pip install -q "nanobind>=2.0" numpy pytest pytest-xdist hypothesis
fi
if ! "$py" -c "import torch" 2>/dev/null; then
  t0=$SECONDS
  "$py" -m pip install -q torch
  echo "torch installed in $((SECONDS - t0)) s"
fi
# transformers, the optional dependency of encore.transformers (the Hugging Face patch), so that CI runs
# tests/python/test_transformers_patch.py on the CPU (pip install measured at 25 s on the 2-core CPU machine;
# the tests take about 30 s there).
if ! "$py" -c "import transformers" 2>/dev/null; then
  t0=$SECONDS
  "$py" -m pip install -q "transformers>=5.25"
  echo "transformers installed in $((SECONDS - t0)) s"
fi
# CMake >= 3.28 knows nvcc 13's C++20 dialect flag (Debian 12 ships 3.25): take it from PyPI.
cmake_ok=$("$py" - <<'PY'
import shutil, subprocess, re
exe = shutil.which("cmake")
v = re.search(r"(\d+)\.(\d+)", subprocess.run([exe, "--version"], capture_output=True, text=True).stdout) if exe else None
print(1 if v and (int(v[1]), int(v[2])) >= (3, 28) else 0)
PY
)
if [ "$cmake_ok" != 1 ]; then
  "$py" -m pip install -q "cmake>=3.28,<4"
fi

cut="$root/.deps/cutlass"
if [ ! -f "$cut/cutlass_library/source/include/cutlass/version.h" ]; then
  tmp=$(mktemp -d)
  "$py" -m pip download -q --no-deps "nvidia-cutlass==4.2.0.0" -d "$tmp"
  mkdir -p "$cut"
  "$py" - "$tmp" "$cut" <<'PY'
import sys, zipfile, glob
whl = glob.glob(sys.argv[1] + "/nvidia_cutlass-*.whl")[0]
keep = ("cutlass_library/source/include/", "cutlass_library/source/tools/util/include/")
with zipfile.ZipFile(whl) as z:
    for n in z.namelist():
        if n.startswith(keep):
            z.extract(n, sys.argv[2])
PY
  rm -rf "$tmp"
fi
if [ ! -f "$root/.deps/googletest/CMakeLists.txt" ] && [ -f /usr/src/googletest/CMakeLists.txt ]; then
  mkdir -p "$root/.deps"
  cp -r /usr/src/googletest "$root/.deps/googletest"
fi
echo "dependencies ready; CUTLASS at $cut/cutlass_library/source, GoogleTest sources at $root/.deps/googletest"
