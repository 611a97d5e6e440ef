# Sourced by the GPU-machine passes (gpu_kda.sh, gpu_infer.sh): `gpu_pass NAME` sets B (the binaries,
# default .gpubin), OUT (default ./gpu-out), sum ($OUT/NAME.txt, emptied) and note (echo to stdout
# and the summary).
gpu_pass() {
  set -uo pipefail
  B=${B:-.gpubin}
  OUT=${OUT:-./gpu-out}
  mkdir -p "$OUT"
  sum="$OUT/$1.txt"
  : >"$sum"
}
note() { echo "$*" | tee -a "$sum"; }
