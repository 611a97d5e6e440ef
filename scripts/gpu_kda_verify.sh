#!/usr/bin/env bash
# A KDA build's verification on the GPU machine, in one call (~430-520 s; keep the call's limit at
# 600 s): every GPU test, `encore check`,
# compute-sanitizer memcheck and racecheck on the KDA tests, the harness (`encore bench kda`), the
# Python tests (module built there) and fla's chunk_kda against encore's in one process
# (bench/peers/kda_peers.py, ROUNDS rounds, default 2). Carry [".gpupack", ".whl"] (scripts/stage_gpu.sh
# writes .gpupack/gpu.tar.gz; .whl holds the fla-core and einops wheels) and run from the repository
# root: scripts/gpu_kda_verify.sh. Writes its logs and JSON under $OUT and a summary on stdout.
set -u
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
./scripts/gpu_unpack.sh >/dev/null
timeout 240 .gpubin/encore_tests_gpu --gtest_brief=1 >"$OUT/gpu_tests.log" 2>&1
echo "all gpu tests rc=$? $(grep -E '(PASSED|FAILED) ' "$OUT/gpu_tests.log" | tr '\n' ' ')"
grep -E "^\[  FAILED" "$OUT/gpu_tests.log" | head
timeout 90 .gpubin/encore check >"$OUT/check.log" 2>&1; echo "check rc=$? $(tail -1 "$OUT/check.log")"
for tool in memcheck racecheck; do
  timeout 150 compute-sanitizer --tool $tool --error-exitcode 1 .gpubin/encore_tests_gpu --gtest_filter='KdaGpu.*' --gtest_brief=1 >"/tmp/$tool.log" 2>&1
  echo "kda $tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "/tmp/$tool.log" | tail -1)"
done
grep -E "kda .*rel-rms" "$OUT/gpu_tests.log" >"$OUT/kda_errors.txt"
ENCORE_COMMIT=$(cat .gpubin/COMMIT) timeout 60 .gpubin/encore bench kda --out "$OUT/bench_kda.json" >/tmp/bench.log 2>&1
echo "bench rc=$?"; grep -E "^  kda_forward" /tmp/bench.log
timeout 200 ./scripts/gpu_pytest.sh >/tmp/pytest.out 2>&1; echo "pytest rc=$? $(tail -3 /tmp/pytest.out | tr '\n' ' ')"
./scripts/gpu_wheels.sh
PYTHONPATH=/tmp/site:build-py/python PYTHONUNBUFFERED=1 ROUNDS=${ROUNDS:-2} timeout 280 python3 bench/peers/kda_peers.py "$OUT/kda_peers.json" \
  >"$OUT/kda_peers.log" 2>&1
echo "peers rc=$?"; grep -E "gpu_kernel_ms|rel_rms" "$OUT/kda_peers.log"
