#!/usr/bin/env bash
# Every launch of the kernels matching KERNEL_REGEX in a filtered `encore bench gemm_epilogue` run,
# under ncu with clocks free: duration, DRAM bytes read and written, grid. For picking out one GEMM
# among the launches of a bench entry (e.g. cuBLAS's LM-head GEMM, 8192 x 128256 x 4096, ~12 ms,
# among the shorter ones the same filter also launches) and reading its DRAM traffic.
# Appends to $OUT/ncu_kernel_bytes.txt. Usage: scripts/ncu_kernel_bytes.sh NAME "BENCH FILTER" KERNEL_REGEX [COUNT]
#   e.g. scripts/ncu_kernel_bytes.sh cublas_lmhead "gemm_lse_no_d pingpong_128x128 8B" nvjet 40
set -uo pipefail
name=$1 filter=$2 kernel=$3 count=${4:-40}
B=${B:-.gpubin}
OUT=${OUT:-./gpu-out}
sum="$OUT/ncu_kernel_bytes.txt"
echo "== $name (filter '$filter', kernel /$kernel/, first $count launches)" >>"$sum"
ENCORE_BENCH_FILTER="$filter" timeout ${NCU_TIMEOUT:-300} \
  ncu --clock-control none -k "regex:$kernel" --launch-count "$count" \
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
