#!/usr/bin/env bash
# Builds the GPU machine's Python modules here, so a device call needs no build (docs/gpu_workflow.md):
# encore._encore for its Python (3.12, from pyenv) and encore._encore_torch against its torch (the PyPI wheel of the
# same version: headers and libraries only, nothing of it runs here), sm_90a, into BUILD (default build-gpu-py), then
# packs them into build-cuda/carry/ (_encore312.so.xz, _encore_torch.so.xz, _encore_torch.version). The device call
# carries build-cuda/carry and unpacks with `scripts/gpu.sh unpack` before the pytest or peers passes.
# Usage: scripts/gpu_python_here.sh [TORCH_VERSION (2.11.0)] [PYTHON (pyenv 3.12)]
set -euo pipefail
cd "$(dirname "$0")/.."
torch_version=${1:-2.11.0}
py=${2:-$(ls -d "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3 2>/dev/null | tail -1)}
[ -x "$py" ] || { echo "gpu_python_here: no Python 3.12 (pass its path)" >&2; exit 1; }
build=${BUILD:-build-gpu-py}
tw=/tmp/encore_torch_$torch_version
if [ ! -d "$tw/torch/include" ]; then
  mkdir -p "$tw"
  python3 -m pip download -q "torch==$torch_version" --no-deps --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --only-binary=:all: -d "$tw"
  unzip -q -o "$tw"/torch-*.whl 'torch/include/*' 'torch/lib/libc10.so' 'torch/lib/libtorch_cpu.so' 'torch/lib/libc10_cuda.so' \
    'torch/version.py' -d "$tw"
  rm -f "$tw"/torch-*.whl
fi
full_version=$(sed -n "s/^__version__ = '\(.*\)'$/\1/p" "$tw/torch/version.py")
"$py" -m pip install -q nanobind >/dev/null
# The configuring Python, except for the one question python/CMakeLists.txt asks torch (include paths, version,
# library folder, C++ ABI), answered from the unpacked wheel: importing it would need its CUDA libraries.
wrap=$tw/python3
cat >"$wrap" <<EOF
#!/bin/bash
if [ "\$1" = "-c" ] && [[ "\$2" == *"import os, torch, torch.utils.cpp_extension"* ]]; then
  printf '%s\n' "$tw/torch/include;$tw/torch/include/torch/csrc/api/include" "$full_version" "$tw/torch/lib" 1
  exit 0
fi
exec "$py" "\$@"
EOF
chmod +x "$wrap"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DENCORE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a \
  -DENCORE_CUTLASS_DIR="$PWD/.deps/cutlass/cutlass_library/source" -DENCORE_BUILD_PYTHON=ON -DENCORE_BUILD_TESTS=OFF \
  -DPython_EXECUTABLE="$wrap" >/dev/null
cmake --build "$build" --target _encore _encore_torch encore_py_files -j "$(nproc)"
mkdir -p build-cuda/carry
pkg=$build/python/encore
xz -T0 -c "$pkg"/_encore.cpython-312-*.so >build-cuda/carry/_encore312.so.xz
xz -T0 -c "$pkg"/_encore_torch.so >build-cuda/carry/_encore_torch.so.xz
cp "$pkg"/_encore_torch.version build-cuda/carry/
echo "gpu_python_here: build-cuda/carry holds encore's modules for Python 3.12 and torch $full_version ($(git rev-parse --short HEAD))"
