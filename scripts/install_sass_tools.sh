#!/usr/bin/env bash
# Installs cuobjdump and nvdisasm (NVIDIA's wheels from PyPI: nvidia-cuda-cuobjdump,
# nvidia-cuda-nvdisasm) into .tools/ (git-ignored), so SASS can be read on this CPU machine, whose
# CUDA toolkit lacks them. Usage: scripts/install_sass_tools.sh; then scripts/sass.sh.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest="$root/.tools"
[ -x "$dest/nvidia/cu13/bin/cuobjdump" ] && { echo "already installed in $dest"; exit 0; }
tmp=$(mktemp -d)
python3 -m pip download --no-deps -q nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm -d "$tmp"
mkdir -p "$dest"
for w in "$tmp"/*.whl; do python3 -m zipfile -e "$w" "$dest"; done
chmod +x "$dest"/nvidia/cu13/bin/*
rm -rf "$tmp"
"$dest/nvidia/cu13/bin/cuobjdump" --version | tail -1
