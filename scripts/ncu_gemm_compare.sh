#!/usr/bin/env bash
# One launch of a GEMM-epilogue bench kernel (or of the cuBLAS GEMM it is timed against) under ncu,
# clocks left free, summarized for side-by-side reading: duration, SM clock, tensor-pipe and issue
# activity, warp stall reasons. Appends to $OUT/ncu_gemm_compare.txt.
# Usage: scripts/ncu_gemm_compare.sh NAME "BENCH FILTER" KERNEL_REGEX [LAUNCH_SKIP]
#   e.g. scripts/ncu_gemm_compare.sh swiglu_pp128 "gemm_swiglu pingpong_128x128 8B" device_kernel 3
#        scripts/ncu_gemm_compare.sh cublas_gate_up "gemm_row_scale pingpong_128x128 8B" nvjet 3
set -uo pipefail
name=$1 filter=$2 kernel=$3 skip=${4:-3}
B=${B:-.gpubin}
OUT=${OUT:-./gpu-out}
sum="$OUT/ncu_gemm_compare.txt"
echo "== $name (filter '$filter', kernel /$kernel/, skip $skip)" >>"$sum"
ENCORE_BENCH_FILTER="$filter" timeout ${NCU_TIMEOUT:-120} \
  ncu --clock-control none -k "regex:$kernel" --launch-skip "$skip" --launch-count 1 \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
  --section LaunchStats --section Occupancy \
  --metrics sm__cycles_elapsed.avg.per_second,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,dram__bytes_write.sum,dram__bytes_read.sum \
  "$B/encore" bench gemm_epilogue --out /tmp/ncu_$name.json >/tmp/ncu_$name.log 2>&1 || echo "ncu rc=$?" >>"$sum"
grep -vE '^==PROF==|^\s*$|----' /tmp/ncu_$name.log | grep -E 'Duration|Frequency|Throughput|gmma|pipe_xu|issue_active|dram__bytes|Stall|Warp Cycles|Issued Warp|No Eligible|Active Warps|Registers|device_kernel|nvjet|Eligible' \
  | cut -c1-160 >>"$sum"
