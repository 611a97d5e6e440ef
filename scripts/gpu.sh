#!/usr/bin/env bash
# The GPU entry point: builds, verifies and measures encore on a GPU machine (H100/H200, CUDA 13,
# CMake, ninja, Python with PyTorch, nanobind and pytest, compute-sanitizer, ncu; no network).
# Run from the repository root:   scripts/gpu.sh PASS [PASS ...]      (docs/gpu_workflow.md)
#
# Passes (run in the order given; each logs to $OUT/<pass>.log and prints a one-line summary):
#   build      configure and build build-cuda (CUDA sm_90a, Release, tests, bench, CLI, Python module)
#   unpack     instead of build: what build-cuda/carry holds (scripts/gpu_python_here.sh: the Python modules built
#              elsewhere for this machine's Python and torch; encore.xz, tests.xz: the CLI and the GPU test binary)
#              into build-cuda, with the tree's Python files
#   test       encore_tests_gpu and encore_tests_cpu (ENCORE_TEST_FILTER, default all)
#   check      `encore check` (every op, GPU against the CPU backend)
#   sanitize   compute-sanitizer memcheck and racecheck on ENCORE_SANITIZE_FILTER
#   sass       cuobjdump summary of the `encore` binary (kernels, 128-bit loads/stores, local memory)
#   pytest     tests/python against build-cuda/python (wheels in .whl/ installed first)
#   bench      `encore bench $ENCORE_BENCH_SUITES` (default: every suite) -> $OUT/bench_<suites>.json
#   peers      bench/peers/<name>_peers.py for each name in ENCORE_PEERS -> $OUT/<name>_peers.json
#   ncu        per-kernel device times under ncu over `encore bench $ENCORE_BENCH_SUITES`
#   tile_sweep bench/gemm/tile_sweep.cu (target encore_tile_sweep: the GEMM mainloop on unshipped
#              tiles against cuBLAS) -> $OUT/tile_sweep.json
#   ab         A/B of two source trees (ENCORE_AB_A, ENCORE_AB_B; see below)
#   verify     = build test check sanitize pytest
#
# Environment:
#   OUT                    results folder (default ./gpu-out)
#   ENCORE_COMMIT          commit stamped into the bench JSON (the GPU copy may have no .git:
#                          pass the literal hash; else `git rev-parse` when .git is present)
#   ENCORE_JOBS            build parallelism (default: all cores)
#   ENCORE_DEADLINE        seconds the whole script may take (default 570, inside a 600 s call);
#                          each step's timeout is cut to what is left, so the summary always returns
#   ENCORE_TEST_FILTER     gtest filter for `test` (default *); ENCORE_TEST_SHARDS the GPU binary's processes
#                          (default 4), ENCORE_TEST_SECONDS each one's limit (default 300),
#                          ENCORE_TEST_PARALLEL=1 runs the shards at once (default: one after another)
#   ENCORE_PYTEST_ARGS     pytest arguments for `pytest` (default tests/python; e.g. test files, -k EXPR)
#   ENCORE_BUILD_TARGETS   cmake targets for `build` (default all; e.g. "_encore _encore_torch encore_py_files" for pytest and peers only)
#   ENCORE_SANITIZE_FILTER gtest filter for both tools of `sanitize` (default: tests of each family,
#                          see memcheck_default and racecheck_default below)
#   ENCORE_SANITIZE_TOOLS  default "memcheck racecheck"
#   ENCORE_BENCH_SUITES    suites for bench/ncu (default: all); ENCORE_BENCH_FILTER, ENCORE_BENCH_SIZES
#                          are read by the suites themselves
#   ENCORE_PEERS_NPROC     processes (GPUs) per peer script, via torch.distributed.run (default 1; moe_ep: 2-8)
#   ENCORE_PEERS           peer names (qk_norm kda block; default all three) or paths of .py scripts
#                          (run with ENCORE_PEERS_ARGS and OUT); ROUNDS, BLOCK_SIZES, KDA_PEER_CONFIGS,
#                          KDA_PEER_HEADS, KDA_PEER_GATES, KDA_TRAIN_WHO, TF_PEER_MODELS, TF_PEER_WHO, ... are read by
#                          the peer scripts (each script's docstring lists its own)
#   ENCORE_NCU_KERNELS     kernel regex for `ncu` (default .), ENCORE_NCU_LAUNCHES (default 400),
#                          ENCORE_NCU_FLAGS (extra ncu flags, e.g. "--clock-control none --cache-control all")
#   ENCORE_SWEEP_ROUNDS    rounds of tile_sweep (default 7)
#   ENCORE_AB_A, ENCORE_AB_B  the two sides of `ab`: "." (this tree, build-cuda), a source directory,
#                          a .tar.gz, or a name NAME for .deps/ab/NAME.tar.gz (scripts/ab_pack.sh)
#   ENCORE_AB_SUITES       suites timed by `ab` (default $ENCORE_BENCH_SUITES, else kda)
#   ENCORE_AB_ROUNDS       rounds, the two builds alternating within each (default 3)
#   ENCORE_AB_TESTS        gtest filter each side must pass before it is timed (default: the GPU tests
#                          of the suites' families; 0 skips them)
#   ENCORE_AB_NCU          kernel regex: also per-kernel ncu times of each side (default: none)
#   ENCORE_SASS_KEEP=1     also write the whole SASS listing to $OUT/sass.txt.gz
#   ENCORE_OUT_MAX_FILES   a device call returns at most 8 files (the default): beyond it the logs
#                          are packed into $OUT/logs.tgz, then everything but summary.txt into out.tgz
#   ENCORE_DRY_RUN=1       print the commands instead of running them (paths are still checked)
# Carried ignored folders: .deps (.deps/cutlass from scripts/install_deps.sh, .deps/googletest, and
# .deps/ab from scripts/ab_pack.sh for `ab`), .whl (peer wheels: fla-core, einops, liger-kernel,
# nvidia-cudnn-frontend; transformers 5.25 with huggingface-hub 2.4 and its HTTP client).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 2

OUT=${OUT:-$root/gpu-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
BUILD=build-cuda
JOBS=${ENCORE_JOBS:-$(nproc)}
DRY=${ENCORE_DRY_RUN:-0}
CUTLASS=$root/.deps/cutlass/cutlass_library/source
GTEST=$root/.deps/googletest
DEADLINE=$(( $(date +%s) + ${ENCORE_DEADLINE:-570} ))
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
fails=0
log=/dev/null
pass_failed=0

if [ -z "${ENCORE_COMMIT:-}" ] && git -C "$root" rev-parse --git-dir >/dev/null 2>&1; then
  ENCORE_COMMIT=$(git -C "$root" rev-parse --short=12 HEAD)
  git -C "$root" diff --quiet HEAD 2>/dev/null || ENCORE_COMMIT+="+dirty"
fi
export ENCORE_COMMIT=${ENCORE_COMMIT:-unknown}
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi

usage() {
  sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
  exit 2
}

say() { echo "$*" | tee -a "$SUMMARY"; }
left() { echo $(( DEADLINE - $(date +%s) )); }
# step SECONDS CMD...: runs CMD under a timeout (cut to the time left), output appended to $log;
# a failure marks the pass failed. Returns CMD's status.
step() {
  local limit=$1; shift
  local rest; rest=$(( $(left) - 5 ))
  [ "$rest" -lt "$limit" ] && limit=$rest
  echo "+ $(printf '%q ' "$@")(timeout ${limit}s)" >>"$log"
  if [ "$DRY" = 1 ]; then echo "  + $(printf '%q ' "$@")"; return 0; fi
  if [ "$limit" -le 0 ]; then echo "deadline reached: not run" >>"$log"; pass_failed=1; return 124; fi
  timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  [ $rc = 124 ] && echo "TIMEOUT after ${limit}s" >>"$log"
  [ $rc = 0 ] || { echo "rc=$rc" >>"$log"; pass_failed=1; }
  return $rc
}
need() {  # need PATH WHAT: fails the pass when PATH is missing (dry runs only warn)
  [ -e "$1" ] && return 0
  echo "missing $1 ($2)" | tee -a "$log"
  [ "$DRY" = 1 ] && return 0
  pass_failed=1
  return 1
}
# gtest_line FROM [TO]: "N passed, M failed" from the gtest output in $log's lines FROM+1..TO. The
# failures are the tests that ran less those that passed or skipped (gtest's own totals: --gtest_brief
# drops the per-test FAILED lines); no "tests ... ran" total means the binary died: "crashed".
gtest_line() {
  local t p s r
  t=$(sed -n "$(( $1 + 1 )),${2:-\$}p" "$log")
  if grep -q '^deadline reached: not run' <<<"$t"; then echo "0 passed, not run (deadline)"; pass_failed=1; return; fi
  r=$(grep -E '^\[==========\] [0-9]+ tests? from .* ran' <<<"$t" | tail -1 | grep -oE '[0-9]+' | head -1)
  p=$(grep -E '^\[  PASSED  \] [0-9]+' <<<"$t" | tail -1 | grep -oE '[0-9]+' | head -1)
  s=$(grep -E '^\[  SKIPPED \] [0-9]+ test' <<<"$t" | tail -1 | grep -oE '[0-9]+' | head -1)
  if [ -z "$r" ]; then echo "${p:-0} passed, crashed (no gtest totals)"; pass_failed=1; return; fi
  echo "${p:-0} passed, $(( r - ${p:-0} - ${s:-0} )) failed"
}
mark() { wc -l <"$log"; }

# ---- passes ------------------------------------------------------------------------------------
# configure_build SRC BUILD_DIR EXTRA...: the CUDA configuration of a source tree.
configure_build() {
  local src=$1 dir=$2; shift 2
  local gt=(-DENCORE_GTEST_SOURCE_DIR="$GTEST")
  if [ ! -f "$GTEST/CMakeLists.txt" ] && [ ! -f /usr/include/gtest/gtest.h ]; then
    echo "no GoogleTest ($GTEST or an installed libgtest-dev): building without tests" | tee -a "$log"
    gt=(-DENCORE_BUILD_TESTS=OFF)
  fi
  step 120 cmake -S "$src" -B "$dir" -G Ninja -DENCORE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a \
    -DCMAKE_BUILD_TYPE=Release -DENCORE_CUTLASS_DIR="$CUTLASS" "${gt[@]}" "$@"
}

pass_build() {
  need "$CUTLASS/include/cutlass/version.h" "CUTLASS headers: carry .deps (scripts/install_deps.sh)" || return
  local py; py=$(command -v python3)
  configure_build "$root" "$BUILD" -DENCORE_BUILD_PYTHON=ON -DPython_EXECUTABLE="$py" || return
  # shellcheck disable=SC2086
  step 480 cmake --build "$BUILD" -j "$JOBS" ${ENCORE_BUILD_TARGETS:+--target $ENCORE_BUILD_TARGETS} || return
  local f
  detail="$BUILD at $ENCORE_COMMIT:"
  for f in "$BUILD"/apps/encore/encore "$BUILD"/tests/encore_tests_{gpu,cpu} "$BUILD"/python/encore/_encore*.so; do
    [ -e "$f" ] && detail+=" ${f##*/}"
  done
}

# The GPU binary runs as ENCORE_TEST_SHARDS (default 4) processes, gtest's own sharding (tests dealt
# round-robin), each under ENCORE_TEST_SECONDS (default 300): a whole-binary pass of ~390 s on an
# H100 then needs ~100 s a shard, under a third of each limit. The totals add over the shards.
pass_test() {
  need "$BUILD/tests/encore_tests_gpu" "run the build pass first" || return
  local f=${ENCORE_TEST_FILTER:-*} shards=${ENCORE_TEST_SHARDS:-4} i m1 m2 line f_ gp=0 gf=0 crashed=""
  local par=${ENCORE_TEST_PARALLEL:-0} main_log=$log
  # run_shard I: shard I of the GPU binary, its output appended to $log.
  run_shard() {
    # Not brief: each test's [ RUN ] / [ OK ] lines (with its time) show what ran before a timeout.
    step "${ENCORE_TEST_SECONDS:-300}" env GTEST_TOTAL_SHARDS="$shards" GTEST_SHARD_INDEX="$1" "$BUILD/tests/encore_tests_gpu" \
      --gtest_filter="$f" ||
      { [ $? = 124 ] && grep -E '^\[ RUN +\]' "$log" | tail -1 | sed 's/^\[ RUN *\]/    timed out in:/' >>"$log"; }
  }
  if [ "$par" = 1 ] && [ "$DRY" != 1 ]; then  # the shards at once (each its own log part), then read in order
    for ((i = 0; i < shards; i++)); do
      (log=$OUT/.shard$i.part; : >"$log"; run_shard "$i") &
    done
    wait
  fi
  for ((i = 0; i < shards; i++)); do
    m1=$(mark)
    echo "== shard $((i + 1)) of $shards" >>"$log"
    if [ "$par" = 1 ] && [ "$DRY" != 1 ]; then cat "$OUT/.shard$i.part" >>"$log"; rm -f "$OUT/.shard$i.part"; else run_shard "$i"; fi
    log=$main_log
    line=$(gtest_line "$m1")
    case "$line" in
      *"not run"*) crashed+=" (shard $((i + 1)) not run: deadline)" ;;
      *crashed*) crashed+=" (shard $((i + 1)) crashed)"; gp=$((gp + ${line%% *})) ;;
      *) gp=$((gp + ${line%% passed*})); f_=${line#*, }; gf=$((gf + ${f_%% failed*})) ;;
    esac
  done
  [ "$gf" = 0 ] || pass_failed=1
  m2=$(mark)
  step 200 "$BUILD/tests/encore_tests_cpu" --gtest_filter="$f" --gtest_brief=1
  detail="gpu: $gp passed, $gf failed$crashed; cpu: $(gtest_line "$m2")"
  grep -E '^\[  FAILED  \] [A-Za-z].*\([0-9]+ ms\)$' "$log" | sort -u | head -8 | sed 's/^/    /'
}

pass_unpack() {
  local c=$BUILD/carry pkg=$BUILD/python/encore
  need "$c" "carry build-cuda/carry (scripts/gpu_python_here.sh, or xz'd binaries)" || return
  [ "$DRY" = 1 ] && return
  detail=
  if [ -f "$c/_encore312.so.xz" ]; then
    mkdir -p "$pkg" && cp python/encore/*.py "$pkg"/ && xz -dc "$c/_encore312.so.xz" >"$pkg/_encore.cpython-312-x86_64-linux-gnu.so" ||
      { pass_failed=1; return; }
    if [ -f "$c/_encore_torch.so.xz" ]; then
      xz -dc "$c/_encore_torch.so.xz" >"$pkg/_encore_torch.so" && cp "$c/_encore_torch.version" "$pkg"/ || { pass_failed=1; return; }
    fi
    detail+="python module (torch kernels for $(cat "$pkg/_encore_torch.version" 2>/dev/null || echo none)); "
  fi
  local f bin
  for f in encore:apps/encore/encore tests:tests/encore_tests_gpu; do
    bin=$BUILD/${f#*:}
    [ -f "$c/${f%%:*}.xz" ] || continue
    mkdir -p "$(dirname "$bin")" && xz -dc "$c/${f%%:*}.xz" >"$bin" && chmod +x "$bin" || { pass_failed=1; return; }
    detail+="${bin##*/}; "
  done
  [ -n "$detail" ] || { detail="nothing to unpack in $c"; pass_failed=1; }
}

pass_check() {
  need "$BUILD/apps/encore/encore" "run the build pass first" || return
  step 30 "$BUILD/apps/encore/encore" info
  step 180 "$BUILD/apps/encore/encore" check
  [ "$DRY" = 1 ] || detail=$(tail -1 "$log")
}

# Defaults: memcheck on the alias and split paths of norm, every QK-norm and quantization variant,
# every catalogue epilogue on every tile, the LSE variants and the finishers, KDA and the block;
# racecheck on the kernels with hand-written shared-memory synchronization (norm, QK-norm, KDA,
# the finishers).
memcheck_default='NormGpu.HAliasesResidual:NormGpu.RunsOnRequestedStream:NormGpu.SplitRowPaths:QkNormGpu.EveryKernelVariant:QuantGpu.EveryKernelVariant:GemmEpilogueGpu.EveryEpilogueOnEveryTile:GemmEpilogueGpu.LseVariants:GemmEpilogueGpu.Finishers:GemmEpilogueGpu.QkNormRopeFinish:KdaGpu.*:LlamaBlockGpu.*:MoeGpu.SmallShapesEveryKernel:MoeGpu.BadInputsOnCuda:MoeForwardGpu.FusedSwigluMatchesUnfused'
racecheck_default='NormGpu.RunsOnRequestedStream:NormGpu.SplitRowPaths:QkNormGpu.EveryKernelVariant:GemmEpilogueGpu.Finishers:KdaGpu.*:MoeGpu.SmallShapesEveryKernel'
pass_sanitize() {
  need "$BUILD/tests/encore_tests_gpu" "run the build pass first" || return
  command -v compute-sanitizer >/dev/null || need compute-sanitizer "not on PATH" || return
  local t f def
  detail=
  for t in ${ENCORE_SANITIZE_TOOLS:-memcheck racecheck}; do
    def=$memcheck_default
    [ "$t" = racecheck ] && def=$racecheck_default
    f=${ENCORE_SANITIZE_FILTER:-$def}
    step 300 compute-sanitizer --tool "$t" --error-exitcode 1 "$BUILD/tests/encore_tests_gpu" --gtest_filter="$f" --gtest_brief=1
    local rc=$?
    detail+="$t rc=$rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1 | sed 's/^========= //'); "
    [ $rc = 0 ] || grep -m 8 -E 'Race reported|Invalid|Error|  at ' "$log" | cut -c1-200 | sed 's/^/    /'
  done
}

pass_sass() {
  need "$BUILD/apps/encore/encore" "run the build pass first" || return
  command -v cuobjdump >/dev/null || need cuobjdump "not on PATH" || return
  local s=/tmp/encore_sass.txt
  step 120 bash -c "cuobjdump --dump-sass '$BUILD/apps/encore/encore' >'$s'" || return
  [ "$DRY" = 1 ] && return
  detail="$(grep -c 'Function :' "$s") kernels; 128-bit global loads $(grep -c 'LDG.E.128' "$s"), stores $(grep -c 'STG.E.128' "$s"), local-memory ops $(grep -cE 'LDL|STL' "$s"), HGMMA $(grep -c 'HGMMA' "$s")"
  # Per kernel: instructions and local-memory operations, the kernels that spill first.
  awk '/Function :/{if(n)print l, n, k; k=$3; n=0; l=0} /\/\*[0-9a-f]+\*\//{n++} /LDL|STL/{l++} END{if(n)print l, n, k}' "$s" \
    | sort -rn | head -40 | awk '{printf "  local-memory ops %5d  instructions %6d  %s\n", $1, $2, $3}' >>"$log"
  [ "${ENCORE_SASS_KEEP:-0}" = 1 ] && gzip -c "$s" >"$OUT/sass.txt.gz"
}

wheels() {  # the carried peer wheels into /tmp/site, once
  [ -n "${_wheels_done:-}" ] && return
  _wheels_done=1
  if ls .whl/*.whl >/dev/null 2>&1; then
    step 180 ./scripts/gpu_wheels.sh "$log"
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
}

pass_pytest() {
  need "$BUILD/python/encore" "the Python module: run the build pass first" || return
  wheels
  rm -f "$OUT/pytest_failures.txt"  # this pass's failures only
  # shellcheck disable=SC2086
  step 540 env PYTHONPATH="$root/$BUILD/python${PYTHONPATH:+:$PYTHONPATH}" ENCORE_PYTEST_FAILURES="$OUT/pytest_failures.txt" python3 -m pytest -q -rs ${ENCORE_PYTEST_ARGS:-tests/python}
  detail=$(grep -E '[0-9]+ (passed|failed)' "$log" | tail -1)
  [ -s "$OUT/pytest_failures.txt" ] && { echo "failed so far ($OUT/pytest_failures.txt):"; cat "$OUT/pytest_failures.txt"; } >>"$log"
  # no totals (a crash of the runner, or -q twice, which drops pytest's summary line): not a pass
  [ "$DRY" = 1 ] || [ -n "$detail" ] || { detail="no pytest totals in the log"; pass_failed=1; }
}

suites_tag() { local s=${1:-all}; s=${s// /_}; echo "${s:-all}"; }

pass_bench() {
  need "$BUILD/apps/encore/encore" "run the build pass first" || return
  local suites=${ENCORE_BENCH_SUITES:-}
  local json
  json="$OUT/bench_$(suites_tag "$suites").json"
  step 20 nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm --format=csv
  # shellcheck disable=SC2086
  step 540 "$BUILD/apps/encore/encore" bench $suites --out "$json"
  detail="$(basename "$json") ($(grep -c '"suite"' "$json" 2>/dev/null || echo 0) records, commit $ENCORE_COMMIT)"
}

# Triton autotune results (fla's kernels cache theirs on disk: FLA_CACHE_RESULTS, ~170 s of tuning per new shape
# family on a fresh machine): .whl/triton_autotune_<GPU>.tgz, written by an earlier peers pass on that GPU model
# ($OUT/triton_autotune_<GPU>.tgz: copy it into .whl/), is unpacked into the Triton cache before the peers run,
# and what the cache then holds is packed into $OUT after them.
gpu_model() { nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oE 'H[0-9]+' | head -1; }
autotune_in() {
  export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton_cache}
  mkdir -p "$TRITON_CACHE_DIR"
  local f; f=.whl/triton_autotune_$(gpu_model).tgz
  [ -f "$f" ] || return 0
  tar -xzf "$f" -C "$TRITON_CACHE_DIR" && echo "autotune results from $f: $(find "$TRITON_CACHE_DIR" -name '*.autotune.json' | wc -l) files" >>"$log"
}
autotune_out() {
  local n; n=$(find "$TRITON_CACHE_DIR" -name '*.autotune.json' 2>/dev/null | wc -l)
  [ "$n" -gt 0 ] || return 0
  (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar -czf "$OUT/triton_autotune_$(gpu_model).tgz" -T -)
}

pass_peers() {
  wheels
  [ "$DRY" = 1 ] || autotune_in
  local pp="$root/$BUILD/python${PYTHONPATH:+:$PYTHONPATH}" p
  [ -d "$BUILD/python/encore" ] || echo "no encore Python module: the peers run without encore" | tee -a "$log"
  detail=
  # ENCORE_PEERS_NPROC > 1: one process per GPU (torch.distributed.run), for the multi-GPU scripts (moe_ep)
  local -a py=(python3)
  [ "${ENCORE_PEERS_NPROC:-1}" -gt 1 ] && py=(python3 -m torch.distributed.run --standalone --nproc-per-node "$ENCORE_PEERS_NPROC")
  for p in ${ENCORE_PEERS:-qk_norm kda block}; do
    local rc
    if [[ $p == *.py ]]; then
      need "$p" "peer script" || continue
      # shellcheck disable=SC2086
      step 540 env OUT="$OUT" PYTHONPATH="$pp" PYTHONUNBUFFERED=1 "${py[@]}" "$p" ${ENCORE_PEERS_ARGS:-}
    else
      need "bench/peers/${p}_peers.py" "peer script" || continue
      step 540 env OUT="$OUT" PYTHONPATH="$pp" PYTHONUNBUFFERED=1 "${py[@]}" "bench/peers/${p}_peers.py" "$OUT/${p}_peers.json"
    fi
    rc=$?
    detail+="$p rc=$rc; "
  done
  [ "$DRY" = 1 ] || autotune_out
}

ncu_times() {  # ncu_times BIN LABEL RAWLOG: per-kernel device times of `encore bench` under ncu
  local bin=$1 label=$2 raw=$3
  # shellcheck disable=SC2086
  step 300 bash -c "ncu ${ENCORE_NCU_FLAGS:-} --metrics gpu__time_duration.sum -k 'regex:${4:-${ENCORE_NCU_KERNELS:-.}}' \
    --launch-count ${ENCORE_NCU_LAUNCHES:-400} '$bin' bench ${ENCORE_BENCH_SUITES:-} --out /tmp/encore_ncu.json >'$raw' 2>&1"
  [ "$DRY" = 1 ] || python3 scripts/ncu_durations.py "$raw" "$label" >>"$log" 2>&1
}
pass_ncu() {
  need "$BUILD/apps/encore/encore" "run the build pass first" || return
  command -v ncu >/dev/null || need ncu "not on PATH" || return
  ncu_times "$BUILD/apps/encore/encore" "$ENCORE_COMMIT" /tmp/encore_ncu.log
  detail="kernels /${ENCORE_NCU_KERNELS:-.}/ over suites ${ENCORE_BENCH_SUITES:-all}"
}

pass_tile_sweep() {
  need "$BUILD/build.ninja" "run the build pass first" || return
  step 300 cmake --build "$BUILD" -j "$JOBS" --target encore_tile_sweep || return
  step 300 bash -c "'$BUILD/bench/encore_tile_sweep' ${ENCORE_SWEEP_ROUNDS:-7} >'$OUT/tile_sweep.json'"
  detail="tile_sweep.json, table in tile_sweep.log"
}

# ab_side SPEC: resolves one side of the A/B to "NAME SRC BUILD_DIR" (unpacking a tarball).
ab_side() {
  local spec=$1 name src
  if [ "$spec" = . ]; then echo "tree $root $BUILD"; return; fi
  [ -f "$spec" ] || [ -d "$spec" ] || spec=.deps/ab/$spec.tar.gz
  if [ -d "$spec" ]; then
    name=$(basename "$spec"); src=$(cd "$spec" && pwd)
  elif [ -f "$spec" ]; then
    name=$(basename "$spec" .tar.gz)
    src=/tmp/encore-ab/$name
    if [ "$DRY" != 1 ]; then mkdir -p /tmp/encore-ab && tar -xzf "$spec" -C /tmp/encore-ab || return 1; fi
  else
    return 1
  fi
  echo "$name $src build-ab-$name"
}
ab_tests_default() {  # the GPU tests of the families the suites measure
  local f='' s
  for s in $1; do
    case $s in
      norm*) f+=":NormGpu.*" ;; qk_norm*) f+=":QkNormGpu.*" ;; quant*) f+=":QuantGpu.*" ;;
      decode_path) f+=":QkNormGpu.*:QuantGpu.*" ;; gemm*) f+=":GemmEpilogueGpu.*:LlamaBlockGpu.*" ;; kda*) f+=":KdaGpu.*" ;;
    esac
  done
  echo "${f#:}"
}
pass_ab() {
  local suites=${ENCORE_AB_SUITES:-${ENCORE_BENCH_SUITES:-kda}}
  local tests=${ENCORE_AB_TESTS:-$(ab_tests_default "$suites")}
  local sides=() spec line
  for spec in "${ENCORE_AB_A:-}" "${ENCORE_AB_B:-}"; do
    [ -n "$spec" ] || { echo "set ENCORE_AB_A and ENCORE_AB_B" | tee -a "$log"; pass_failed=1; return; }
    line=$(ab_side "$spec") || { echo "ab: cannot find '$spec' (a directory, a .tar.gz or .deps/ab/NAME.tar.gz)" | tee -a "$log"; pass_failed=1; return; }
    sides+=("$line")
  done
  local name src dir
  for line in "${sides[@]}"; do
    read -r name src dir <<<"$line"
    [ -f "$src/COMMIT" ] && echo "$name: commit $(cat "$src/COMMIT")" >>"$log"
    if [ "$dir" = "$BUILD" ] && [ -x "$BUILD/apps/encore/encore" ]; then continue; fi
    local t=(--target encore_cli) py=(-DENCORE_BUILD_PYTHON=OFF)
    [ "$tests" = 0 ] || t+=(--target encore_tests_gpu)
    [ "$dir" = "$BUILD" ] && py=(-DENCORE_BUILD_PYTHON=ON -DPython_EXECUTABLE="$(command -v python3)")
    configure_build "$src" "$dir" "${py[@]}" || return
    step 480 cmake --build "$dir" -j "$JOBS" "${t[@]}" || return
  done
  if [ "$tests" != 0 ]; then
    for line in "${sides[@]}"; do
      read -r name src dir <<<"$line"
      step 300 "$dir/tests/encore_tests_gpu" --gtest_filter="$tests" --gtest_brief=1 ||
        { echo "ab: $name fails its tests: not timed" | tee -a "$log"; return; }
    done
  fi
  if [ -n "${ENCORE_AB_NCU:-}" ]; then
    for line in "${sides[@]}"; do
      read -r name src dir <<<"$line"
      ENCORE_BENCH_SUITES=$suites ncu_times "$dir/apps/encore/encore" "$name" "/tmp/encore_ncu_$name.log" "$ENCORE_AB_NCU"
    done
  fi
  local r jsons=()
  for r in $(seq 1 "${ENCORE_AB_ROUNDS:-3}"); do
    for line in "${sides[@]}"; do
      read -r name src dir <<<"$line"
      local c=$ENCORE_COMMIT
      [ -f "$src/COMMIT" ] && [ "$dir" != "$BUILD" ] && c=$(cat "$src/COMMIT")
      # shellcheck disable=SC2086
      step 300 env ENCORE_COMMIT="$c" "$dir/apps/encore/encore" bench $suites --out "/tmp/ab_${name}_r$r.json"
      jsons+=("/tmp/ab_${name}_r$r.json")
    done
  done
  [ "$DRY" = 1 ] && return
  read -r a _ <<<"${sides[0]}"; read -r b _ <<<"${sides[1]}"
  python3 - "$a" "$b" "${jsons[@]}" >>"$log" 2>&1 <<'PY'
import json, statistics, sys
a, b, files = sys.argv[1], sys.argv[2], sys.argv[3:]
times = {}
for f in files:
    side = a if f.split("/")[-1].startswith(f"ab_{a}_r") else b
    for r in json.load(open(f))["records"]:
        if not isinstance(r.get("time_us"), (int, float)):
            continue
        key = " ".join(f"{k}={v}" for k, v in r.items() if isinstance(v, str) and k != "version")
        times.setdefault(key, {}).setdefault(side, []).append(r["time_us"])
print(f"\nA/B medians over rounds (time_us): A = {a}, B = {b}, B/A < 1 means B is faster")
for key, t in times.items():
    if a in t and b in t:
        ta, tb = statistics.median(t[a]), statistics.median(t[b])
        print(f"  {ta:10.2f} {tb:10.2f}  B/A {tb / ta:6.3f}  {key}")
PY
  (cd /tmp && tar -czf "$OUT/ab.tgz" "${jsons[@]#/tmp/}" encore_ncu_*.log 2>/dev/null || tar -czf "$OUT/ab.tgz" "${jsons[@]#/tmp/}")
  detail="A=$a B=$b, suites $suites, ${ENCORE_AB_ROUNDS:-3} rounds: table in ab.log, JSON in ab.tgz"
}

# ---- main --------------------------------------------------------------------------------------
[ $# -ge 1 ] || usage
passes=()
for p in "$@"; do
  case $p in
    verify) passes+=(build test check sanitize pytest) ;;
    build|unpack|test|check|sanitize|sass|pytest|bench|peers|ncu|tile_sweep|ab) passes+=("$p") ;;
    -h|--help|help) usage ;;
    *) echo "scripts/gpu.sh: unknown pass '$p'" >&2; usage ;;
  esac
done
say "gpu.sh ${passes[*]} at $ENCORE_COMMIT on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || echo 'no GPU')$([ "$DRY" = 1 ] && echo ' (dry run)')"
for p in "${passes[@]}"; do
  log=$OUT/$p.log
  : >"$log"
  pass_failed=0
  detail=
  t0=$(date +%s)
  [ "$DRY" = 1 ] && echo "$p:"
  "pass_$p"
  dt=$(( $(date +%s) - t0 ))
  if [ "$pass_failed" = 0 ]; then state=ok; else state=FAILED; fails=$((fails + 1)); fi
  say "$(printf '%-10s %-6s %4ss  %s' "$p" "$state" "$dt" "$detail")"
done
say "gpu.sh: ${#passes[@]} pass(es), $fails failed; logs in $OUT"
# A device call returns at most 8 files from $OUT: past ENCORE_OUT_MAX_FILES (default 8) the logs go
# into logs.tgz, then everything but the summary into out.tgz.
max=${ENCORE_OUT_MAX_FILES:-8}
count() { find "$OUT" -maxdepth 1 -type f | wc -l; }
if [ "$(count)" -gt "$max" ]; then
  (cd "$OUT" && tar -czf logs.tgz ./*.log && rm -f ./*.log)
  if [ "$(count)" -gt "$max" ]; then
    (cd "$OUT" && tar -czf /tmp/encore_out.tgz --exclude=summary.txt . && find . -maxdepth 1 -type f ! -name summary.txt -delete &&
      mv /tmp/encore_out.tgz out.tgz)
  fi
  echo "packed $OUT to $(count) files: $(ls "$OUT" | tr '\n' ' ')"
fi
exit $(( fails > 0 ))
