#!/usr/bin/env bash
# Where a kernel's shared-memory bank conflicts are, on the GPU machine: one launch under ncu's
# source counters, then the SASS lines with the most excessive shared-memory wavefronts (the
# wavefronts beyond one per request: bank conflicts), each with its phase (the regions between
# clock reads, as scripts/ncu_hotspots.sh counts them) and executed count.
# Usage: scripts/ncu_smem_conflicts.sh NAME KERNEL_REGEX LAUNCH_SKIP -- encore args...
# (e.g. scripts/ncu_smem_conflicts.sh chunk kda_chunk_kernel 5 -- bench kda --out /tmp/x.json)
# Writes $OUT/ncu_smem_NAME.txt; the binary is $B/encore (default .gpubin).
set -uo pipefail
name=$1 kernel=$2 skip=$3
shift 4
B=${B:-.gpubin}
OUT=${OUT:-./gpu-out}
rep=/tmp/ncu_smem_$name
timeout ${NCU_TIMEOUT:-240} ncu --section SourceCounters --section MemoryWorkloadAnalysis_Tables -k "regex:$kernel" \
  --launch-skip "$skip" --launch-count 1 -f -o "$rep" "$B/encore" "$@" >"/tmp/ncu_smem_${name}_run.log" 2>&1 ||
  echo "ncu rc=$?" >>"$OUT/ncu_smem_$name.txt"
ncu -i "$rep.ncu-rep" --page source --csv --print-source sass >/tmp/src_smem_$name.csv 2>/dev/null
python3 - "$name" /tmp/src_smem_$name.csv >>"$OUT/ncu_smem_$name.txt" 2>&1 <<'PY'
import csv, sys
name, src = sys.argv[1:3]
rows = list(csv.reader(open(src)))
hi = next((i for i, r in enumerate(rows) if any('Source' == c.strip() for c in r)), None)
if hi is None:
    print("no source table"); sys.exit()
hdr = rows[hi]
body = [r for r in rows[hi + 1:] if len(r) == len(hdr)]
cs = next(i for i, c in enumerate(hdr) if c.strip() == 'Source')
def col(*keys):
    return next((i for i, c in enumerate(hdr) if all(k in c for k in keys)), None)
cx = col('Shared', 'Excessive')
cw = col('L1 Wavefronts Shared') if cx is None else next((i for i, c in enumerate(hdr) if 'L1 Wavefronts Shared' in c and 'Excessive' not in c and 'Ideal' not in c), None)
ce = col('Instructions Executed')
print(f"== {name}: columns {[hdr[i] for i in (cx, cw, ce) if i is not None]}")
def num(r, c):
    try: return float(r[c].replace(',', '')) if c is not None else 0.0
    except ValueError: return 0.0
cuts = [i for i, r in enumerate(body) if 'SR_CLOCK' in r[cs]]
phase = lambda i: sum(1 for c in cuts if c <= i)
tot = sum(num(r, cx) for r in body) or 1
print(f"== {name}: excessive shared wavefronts {tot:.0f} in all; by region between clock reads:")
edges = [0] + cuts + [len(body)]
for k, (a, b) in enumerate(zip(edges, edges[1:])):
    print(f"  region {k} lines {a:5d}-{b:5d}: {100 * sum(num(r, cx) for r in body[a:b]) / tot:5.1f}%")
print(f"== {name}: the top lines (index, region, excessive, wavefronts, executed, SASS)")
for i in sorted(range(len(body)), key=lambda i: -num(body[i], cx))[:40]:
    r = body[i]
    print(f"  {i:5d} r{phase(i)} {num(r, cx):9.0f} {num(r, cw):9.0f} {num(r, ce):8.0f}  {r[cs][:90]}")
PY
