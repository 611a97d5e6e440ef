#!/usr/bin/env bash
# The GPU workflow (H100/H200, CUDA 13, PyTorch, no network). Run from the repository root.
#   - binaries: uses .gpubin/ when carried (built on a CPU machine by scripts/stage_gpu.sh), else
#     builds build-cuda here (needs GoogleTest for the tests);
#   - runs the gpu test suite, `encore check`, compute-sanitizer on a subset, a SASS check,
#     the Python tests against CUDA tensors (the module is built here: it must match this Python),
#     and `encore bench` (suites from ENCORE_BENCH_SUITES, default norm);
#   - ENCORE_SKIP_TESTS=1 keeps only info, check and bench; ENCORE_SKIP_BENCH=1 drops the bench;
#     ENCORE_SKIP_PYTEST=1 skips building the Python module here and its tests;
#     ENCORE_SHARED_PEERS="section ..." runs those sections of the shared bench_peers.py;
#     ENCORE_PEERS=1 adds the torch.compile / Liger QK-norm peers (Liger carried as a wheel in .whl);
#   - writes logs and the benchmark JSON to $OUT (default ./gpu-out).
# Needs carried: .deps/cutlass (CUTLASS headers, from scripts/install_deps.sh) and optionally .gpubin.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
OUT=${OUT:-$root/gpu-out}
mkdir -p "$OUT"
log="$OUT/gpu_run.log"
: >"$log"
say() { echo "== $*" | tee -a "$log"; }
fails=0
step() {  # step NAME CMD...: runs, logs, counts failures
  local name=$1; shift
  say "$name"
  if "$@" 2>&1 | tee -a "$log"; then say "$name: ok"; else say "$name: FAILED"; fails=$((fails + 1)); fi
}
suites=${ENCORE_BENCH_SUITES:-norm}
# The build's commit for the JSON: ENCORE_COMMIT, else the one stage_gpu.sh recorded.
if [ -z "${ENCORE_COMMIT:-}" ] && [ -f .gpubin/COMMIT ]; then export ENCORE_COMMIT=$(cat .gpubin/COMMIT); fi

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm --format=csv | tee -a "$log"

if [ -x .gpubin/encore ]; then
  bin=.gpubin
else
  say "no carried .gpubin: building build-cuda here"
  cmake -S . -B build-cuda -G Ninja -DENCORE_CUDA=ON -DCMAKE_BUILD_TYPE=Release >>"$log" 2>&1 && cmake --build build-cuda -j >>"$log" 2>&1 || { say "build FAILED"; exit 1; }
  mkdir -p .gpubin
  cp build-cuda/apps/encore/encore .gpubin/
  [ -x build-cuda/tests/encore_tests_gpu ] && cp build-cuda/tests/encore_tests_gpu build-cuda/tests/encore_tests_cpu .gpubin/
  bin=.gpubin
fi

step "encore info" "$bin/encore" info
if [ "${ENCORE_SKIP_TESTS:-0}" != 1 ]; then
[ -x "$bin/encore_tests_gpu" ] && step "gpu tests (ctest -L gpu equivalent)" "$bin/encore_tests_gpu" --gtest_brief=1
[ -x "$bin/encore_tests_cpu" ] && step "cpu tests" "$bin/encore_tests_cpu" --gtest_brief=1
fi  # ENCORE_SKIP_TESTS
step "encore check" "$bin/encore" check
if [ "${ENCORE_SKIP_TESTS:-0}" != 1 ]; then
if command -v compute-sanitizer >/dev/null && [ -x "$bin/encore_tests_gpu" ]; then
  step "compute-sanitizer memcheck" compute-sanitizer --tool memcheck --error-exitcode 1 "$bin/encore_tests_gpu" \
    --gtest_filter='NormGpu.HAliasesResidual:NormGpu.RunsOnRequestedStream:QuantGpu.EveryKernelVariant:QkNormGpu.EveryKernelVariant:GemmEpilogueGpu.*' --gtest_brief=1
  step "compute-sanitizer racecheck" compute-sanitizer --tool racecheck --error-exitcode 1 "$bin/encore_tests_gpu" \
    --gtest_filter='NormGpu.RunsOnRequestedStream' --gtest_brief=1
fi
if command -v cuobjdump >/dev/null; then
  cuobjdump --dump-sass "$bin/encore" >"$OUT/sass.txt" 2>&1
  say "SASS: $(grep -c 'Function :' "$OUT/sass.txt") kernels; 128-bit global loads $(grep -c 'LDG.E.128' "$OUT/sass.txt"), stores $(grep -c 'STG.E.128' "$OUT/sass.txt"), local-memory ops $(grep -cE 'LDL|STL' "$OUT/sass.txt"), HGMMA $(grep -c 'HGMMA' "$OUT/sass.txt")"
  gzip -f "$OUT/sass.txt"
fi

fi  # ENCORE_SKIP_TESTS

# Python module for this machine's Python, then the Python tests (CUDA tensors included).
if [ "${ENCORE_SKIP_TESTS:-0}" != 1 ] && [ "${ENCORE_SKIP_PYTEST:-0}" != 1 ] && python3 -c "import nanobind" 2>/dev/null; then
  step "pytest (CPU and CUDA)" env OUT="$OUT" ./scripts/gpu_pytest.sh
fi

[ "${ENCORE_SKIP_BENCH:-0}" = 1 ] || step "encore bench" "$bin/encore" bench $suites --out "$OUT/bench_${suites// /_}.json"

# Peers (torch.compile, Liger) measured the same way, when ENCORE_PEERS=1; Liger travels as a wheel
# in .whl (see docs/gpu_workflow.md).
if [ "${ENCORE_PEERS:-0}" = 1 ]; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    ./scripts/gpu_wheels.sh "$log"
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  step "peers: qk_norm" env PYTHONUNBUFFERED=1 python3 bench/peers/qk_norm_peers.py "$OUT/qk_norm_peers.json"
fi
# fla chunk_kda forward (ENCORE_KDA_PEERS=1; fla-core carried as a wheel in .whl).
if [ "${ENCORE_KDA_PEERS:-0}" = 1 ]; then
  ./scripts/gpu_wheels.sh "$log"
  step "peers: fla chunk_kda" env PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 python3 bench/peers/kda_peers.py "$OUT/kda_peers.json"
fi
# torch.compile / eager / cuBLAS of the LLaMA shifted block (ENCORE_BLOCK_PEERS=1), and encore's block
# through the Python module timed the same way (the module from the pytest step, else built here).
if [ "${ENCORE_BLOCK_PEERS:-0}" = 1 ]; then
  if ! ls build-py/python/encore/_encore*.so >/dev/null 2>&1 && ! ./scripts/build_pymodule.sh "$OUT/pymodule.log"; then
    say "python module build failed (see pymodule.log): the block peers run without encore"
  fi
  step "peers: llama block" env PYTHONPATH="$root/build-py/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 \
    python3 bench/peers/block_peers.py "$OUT/block_peers.json"
fi
# The shared peer script (../shared/docs/bench_peers.py, copied into the carried .whl/ by
# scripts/stage_gpu.sh) for the sections named in ENCORE_SHARED_PEERS; writes $OUT/anchors.json.
if [ -n "${ENCORE_SHARED_PEERS:-}" ] && [ -f .whl/bench_peers.py ]; then
  step "peers: shared bench_peers.py ($ENCORE_SHARED_PEERS)" env OUT="$OUT" PYTHONUNBUFFERED=1 python3 .whl/bench_peers.py $ENCORE_SHARED_PEERS
fi
say "done: $fails failed step(s)"
exit $fails
