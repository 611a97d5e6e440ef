#!/usr/bin/env bash
# Configures and builds encore. Usage: scripts/build.sh cpu|cuda [extra cmake args...]
#   cpu  -> build-cpu  (ENCORE_CUDA=OFF, Python module on)
#   cuda -> build-cuda (ENCORE_CUDA=ON, sm_90a; tests, benchmarks, CLI)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
mode=${1:?usage: scripts/build.sh cpu|cuda [cmake args]}
shift
jobs=${ENCORE_JOBS:-$(nproc)}
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
case "$mode" in
  cpu)  dir="$root/build-cpu";  args=(-DENCORE_CUDA=OFF -DENCORE_BUILD_PYTHON=ON) ;;
  cuda) dir="$root/build-cuda"; args=(-DENCORE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a) ;;
  *) echo "scripts/build.sh: mode must be cpu or cuda, got '$mode'" >&2; exit 2 ;;
esac
cmake -S "$root" -B "$dir" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release "${args[@]}" "$@" >/dev/null
cmake --build "$dir" -j "$jobs"
