#!/usr/bin/env bash
# The KDA verification and measurement pass on the GPU machine, in one call (run from the repository
# root with .gpubin and .whl carried; writes everything under $OUT):
#   1. the KDA GPU tests; 2. compute-sanitizer memcheck and racecheck on them; 3. the per-kernel
#   device times (ncu, locked clocks) at the bench configurations; 4. `encore bench` of the suites in
#   ENCORE_KDA_SUITES (default "kda") with fla's chunk_kda in the same job (ENCORE_KDA_PEERS=1);
#   with ENCORE_KDA_PY=1 the Python module is built here first (scripts/build_pymodule.sh, linking
#   the carried .gpulibs) so that bench/peers/kda_peers.py also times encore.kda_forward alternating
#   with fla in one process and compares their outputs.
# Each step has its own timeout so a slow one cannot swallow the rest; the summary is in
# $OUT/gpu_kda.txt.
source "$(dirname "$0")/gpu_pass.sh"
gpu_pass gpu_kda
timeout 150 "$B/encore_tests_gpu" --gtest_filter='KdaGpu.*' --gtest_brief=1 >"$OUT/kda_tests.log" 2>&1
note "tests rc=$?"; grep -E "kda |Failure|actual" "$OUT/kda_tests.log" | tee -a "$sum"
for tool in memcheck racecheck; do
  timeout 150 compute-sanitizer --tool $tool --error-exitcode 1 "$B/encore_tests_gpu" --gtest_filter='KdaGpu.*' --gtest_brief=1 \
    >"$OUT/$tool.log" 2>&1
  rc=$?
  note "$tool rc=$rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/$tool.log" | tail -1)"
  [ $rc = 0 ] || grep -m 12 -E 'Race reported|Error|  at |access at' "$OUT/$tool.log" | cut -c1-240 | tee -a "$sum"
done
timeout 120 ncu --metrics gpu__time_duration.sum -k regex:kda_ --launch-count 400 "$B/encore" bench kda --out /tmp/ncu_kda.json \
  >"$OUT/ncu.log" 2>&1
python3 scripts/ncu_durations.py "$OUT/ncu.log" | tee -a "$sum"
if [ -n "${ENCORE_KDA_PY:-}" ]; then
  if timeout 300 ./scripts/build_pymodule.sh "$OUT/pymodule.log"; then export PYTHONPATH="$PWD/build-py/python${PYTHONPATH:+:$PYTHONPATH}"
  else note "python module build FAILED (see pymodule.log): kda_peers.py times fla alone"; fi
fi
ENCORE_SKIP_TESTS=1 ENCORE_KDA_PEERS=${ENCORE_KDA_PEERS:-1} ENCORE_BENCH_SUITES="${ENCORE_KDA_SUITES:-kda}" timeout 400 ./scripts/gpu_run.sh \
  >"$OUT/run.log" 2>&1
note "gpu_run rc=$?"; grep -E '^==|kda_|fla' "$OUT/run.log" | tee -a "$sum"
