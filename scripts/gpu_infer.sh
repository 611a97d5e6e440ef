#!/usr/bin/env bash
# The inference-kernel verification and measurement pass on the GPU machine, in one call (from the
# repository root with .gpubin carried; everything under $OUT, summary in $OUT/gpu_infer.txt):
#   1. the QK-norm, RMSNorm and quantization GPU tests, memcheck on the quantization tests;
#   2. `encore bench` of ENCORE_INFER_SUITES (default "quant quant_plans qk_norm") -> $OUT/infer.json;
#   3. kernel durations under ncu (caches flushed before every kernel, clocks not locked): QK-norm at
#      1, 16, 64 tokens and the quantization at 4096 rows, the device time of the kernel alone, beside
#      the per-call time of CUDA-graph replays that the bench reports (which adds the launch gap).
source "$(dirname "$0")/gpu_pass.sh"
gpu_pass gpu_infer
filter='QuantGpu.*:QkNorm*:RmsNorm*'
timeout 150 "$B/encore_tests_gpu" --gtest_filter="$filter" --gtest_brief=1 >/tmp/infer_tests.log 2>&1
note "tests rc=$? $(grep -cE '^\[  FAILED' /tmp/infer_tests.log) failed"
grep -E "Failure|FAILED" /tmp/infer_tests.log | head -20 | tee -a "$sum"
for tool in memcheck; do  # the quantization kernel uses no shared memory: no racecheck
  timeout 150 compute-sanitizer --tool $tool --error-exitcode 1 "$B/encore_tests_gpu" --gtest_filter='QuantGpu.*' --gtest_brief=1 \
    >/tmp/infer_$tool.log 2>&1
  rc=$?
  note "$tool rc=$rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' /tmp/infer_$tool.log | tail -1)"
  [ $rc = 0 ] || grep -m 12 -E 'Race reported|Error|  at |access at' /tmp/infer_$tool.log | cut -c1-240 | tee -a "$sum"
done
timeout 240 "$B/encore" bench ${ENCORE_INFER_SUITES:-quant quant_plans qk_norm} --out "$OUT/infer.json" >/tmp/infer_bench.log 2>&1
note "bench rc=$?"
grep -E "fp8|qk_norm|copy" /tmp/infer_bench.log | tee -a "$sum" >/dev/null
ncu_time() {  # label kernel-regex sizes suite
  ENCORE_BENCH_SIZES=$3 timeout 90 ncu --clock-control none --cache-control all --metrics gpu__time_duration.sum -k "regex:$2" \
    --launch-count 30 "$B/encore" bench "$4" --out /tmp/ncu_bench.json >/tmp/ncu_t.log 2>&1
  python3 scripts/ncu_durations.py /tmp/ncu_t.log "$1" | tee -a "$sum"
}
for t in 1 16 64; do ncu_time "qk_norm 32+8 heads x128 tokens $t (flushed)" qk_norm_kernel $t qk_norm; done
ncu_time "fp8_group_quant 4096 x 7168 (flushed)" fp8_group_quant 4096 quant
