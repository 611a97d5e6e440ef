#!/usr/bin/env bash
# One launch of a GEMM-epilogue bench kernel (or of the cuBLAS GEMM it is timed against) under ncu,
# clocks left free, summarized for side-by-side reading: duration, SM clock, tensor-pipe and issue
# activity, warp stall reasons. Appends to $OUT/ncu_gemm_compare.txt.
# Usage: scripts/ncu_gemm_compare.sh NAME "BENCH FILTER" KERNEL_REGEX [LAUNCH_SKIP]
#   e.g. scripts/ncu_gemm_compare.sh swiglu_pp128 "gemm_swiglu pingpong_128x128 8B" device_kernel 3
#        scripts/ncu_gemm_compare.sh cublas_gate_up "gemm_row_scale pingpong_128x128 8B" nvjet 3
# NCU_LIST=N instead profiles the first N matching launches for their duration and DRAM bytes only,
# one line per launch: for picking one GEMM out of the several a filter launches (e.g. cuBLAS's
# LM-head GEMM, 8192 x 128256 x 4096, ~12 ms, among shorter ones: a fixed launch skip can catch a
# GEMM of another shape). The binary is $B/encore (default build-cuda/apps/encore, from
# `scripts/gpu.sh build`).
#        NCU_LIST=40 scripts/ncu_gemm_compare.sh cublas_lmhead "gemm_lse_no_d pingpong_128x128 8B" nvjet
set -uo pipefail
name=$1 filter=$2 kernel=$3 skip=${4:-3}
B=${B:-build-cuda/apps/encore}
OUT=${OUT:-./gpu-out}
sum="$OUT/ncu_gemm_compare.txt"
echo "== $name (filter '$filter', kernel /$kernel/, skip $skip)" >>"$sum"
if [ -n "${NCU_LIST:-}" ]; then
  ENCORE_BENCH_FILTER="$filter" timeout ${NCU_TIMEOUT:-300} \
    ncu --clock-control none -k "regex:$kernel" --launch-count "$NCU_LIST" \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
    "$B/encore" bench gemm_epilogue --out /tmp/ncu_$name.json >/tmp/ncu_$name.log 2>&1 || echo "ncu rc=$?" >>"$sum"
  python3 - "/tmp/ncu_$name.log" >>"$sum" <<'PY'
import re, sys
cur = None
for line in open(sys.argv[1]):
    m = re.match(r"\s+(\S.*?) \((\d+), (\d+), (\d+)\)x", line)
    if m:
        cur = {"kernel": m.group(1)[:60], "grid": "x".join(m.group(2, 3, 4))}
        continue
    m = re.search(r"(dram__bytes_read\.sum|dram__bytes_write\.sum|gpu__time_duration\.sum)\s+(\S+)\s+([\d.,]+)", line)
    if m and cur is not None:
        cur[m.group(1)] = m.group(3) + " " + m.group(2)
        if len(cur) == 5:
            print(f"  {cur['gpu__time_duration.sum']:>14}  read {cur['dram__bytes_read.sum']:>12}  write {cur['dram__bytes_write.sum']:>12}  grid {cur['grid']:>10}  {cur['kernel']}")
            cur = None
PY
  exit 0
fi
ENCORE_BENCH_FILTER="$filter" timeout ${NCU_TIMEOUT:-120} \
  ncu --clock-control none -k "regex:$kernel" --launch-skip "$skip" --launch-count 1 \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
  --section LaunchStats --section Occupancy \
  --metrics sm__cycles_elapsed.avg.per_second,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,dram__bytes_write.sum,dram__bytes_read.sum \
  "$B/encore" bench gemm_epilogue --out /tmp/ncu_$name.json >/tmp/ncu_$name.log 2>&1 || echo "ncu rc=$?" >>"$sum"
grep -vE '^==PROF==|^\s*$|----' /tmp/ncu_$name.log | grep -E 'Duration|Frequency|Throughput|gmma|pipe_xu|issue_active|dram__bytes|Stall|Warp Cycles|Issued Warp|No Eligible|Active Warps|Registers|device_kernel|nvjet|Eligible' \
  | cut -c1-160 >>"$sum"
