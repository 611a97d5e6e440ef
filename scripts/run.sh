#!/usr/bin/env bash
# The main job on a fresh machine: installs dependencies, builds, then runs `encore bench` when a
# GPU is visible, or `encore check` on the CPU backend when none is.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
./scripts/install_deps.sh
export PATH="$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"
if command -v nvcc >/dev/null; then
  ./scripts/build.sh cuda
  bin=build-cuda/apps/encore/encore
else
  ./scripts/build.sh cpu
  bin=build-cpu/apps/encore/encore
fi
"$bin" info
if nvidia-smi -L >/dev/null 2>&1 && [ "$("$bin" info | grep -c 'no CUDA device')" = 0 ]; then
  # Fresh results go to $OUT (default ./gpu-out, ignored); bench/results/ keeps only the baselines
  # the docs cite (bench/results/README.md).
  out=${OUT:-gpu-out}
  mkdir -p "$out"
  "$bin" bench --out "$out/bench-$(date -u +%Y%m%d)-$(git rev-parse --short=12 HEAD 2>/dev/null || echo local).json"
else
  "$bin" check
fi
