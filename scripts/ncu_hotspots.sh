#!/usr/bin/env bash
# Where a kernel spends its time, on the GPU machine: one launch profiled with ncu's full set, then
# a text summary (speed of light, occupancy, stall reasons by PC sampling, the hottest SASS lines,
# the lines with shared-memory bank conflicts).
# Usage: scripts/ncu_hotspots.sh NAME KERNEL_REGEX LAUNCH_SKIP -- encore args...
# (e.g. scripts/ncu_hotspots.sh state kda_state_kernel 50 -- bench kda --out /tmp/x.json)
# Writes $OUT/ncu_NAME.txt and the whole annotated SASS listing $OUT/ncu_NAME_sass.txt; the binary
# is $B/encore (default build-cuda/apps/encore, from `scripts/gpu.sh build`). ncu matches
# KERNEL_REGEX against the function's base name, without template arguments; NCU_NAME_BASE=demangled matches the demangled name instead, e.g.
# NCU_NAME_BASE=demangled scripts/ncu_hotspots.sh state32 'kda_state_kernel<.int.32>' 3 -- bench kda
# (the demangled name reads kda_state_kernel<(int)32>).
set -uo pipefail
name=$1 kernel=$2 skip=$3
shift 4
B=${B:-build-cuda/apps/encore}
OUT=${OUT:-./gpu-out}
rep=/tmp/ncu_$name
timeout ${NCU_TIMEOUT:-240} ncu --set full ${NCU_NAME_BASE:+--kernel-name-base $NCU_NAME_BASE} -k "regex:$kernel" --launch-skip "$skip" --launch-count 1 -f -o "$rep" "$B/encore" "$@" \
  >"$OUT/ncu_${name}_run.log" 2>&1 || echo "ncu rc=$?" >>"$OUT/ncu_$name.txt"
ncu -i "$rep.ncu-rep" --page details >>"$OUT/ncu_$name.txt" 2>&1
ncu -i "$rep.ncu-rep" --page raw --csv >/tmp/raw_$name.csv 2>/dev/null
ncu -i "$rep.ncu-rep" --page source --csv --print-source sass >/tmp/src_$name.csv 2>/dev/null
python3 - "$name" /tmp/raw_$name.csv /tmp/src_$name.csv "$OUT/ncu_${name}_sass.txt" >>"$OUT/ncu_$name.txt" 2>&1 <<'PY'
import csv, sys
name, raw, src = sys.argv[1:4]
rows = list(csv.reader(open(raw)))
if len(rows) >= 3:
    hdr, vals = rows[0], rows[2]
    st = [(h, v) for h, v in zip(hdr, vals) if 'pcsamp_warps_issue_stalled' in h and not h.endswith('not_issued')]
    def num(v):
        try: return float(v.replace(',', ''))
        except ValueError: return 0.0
    st.sort(key=lambda x: -num(x[1]))
    print(f"== {name}: stall samples by reason")
    for h, v in st[:14]: print(f"  {h.replace('smsp__pcsamp_warps_issue_stalled_', ''):40s} {v}")
rows = list(csv.reader(open(src)))
hi = next((i for i, r in enumerate(rows) if any('Warp Stall Sampling (All' in c for c in r)), None)
if hi is not None:
    hdr = rows[hi]
    def col(key):
        return next((i for i, c in enumerate(hdr) if key in c), None)
    ca, ci = col('Warp Stall Sampling (All'), col('Instructions Executed')
    cs = next((i for i, c in enumerate(hdr) if c.strip() == 'Source'), 1)
    body = [r for r in rows[hi + 1:] if len(r) > ca]
    def num(r, c):
        try: return float(r[c].replace(',', '')) if c is not None else 0.0
        except ValueError: return 0.0
    tot = sum(num(r, ca) for r in body) or 1
    itot = sum(num(r, ci) for r in body) or 1
    # Regions between clock reads (the kda_chunk phase marks): share of samples and of instructions.
    cuts = [i for i, r in enumerate(body) if 'SR_CLOCK' in r[cs]]
    if cuts:
        print(f"== {name}: regions between clock reads (SASS lines, share of stall samples, of warp instructions)")
        edges = [0] + cuts + [len(body)]
        for a, b in zip(edges, edges[1:]):
            sa = sum(num(r, ca) for r in body[a:b]); si = sum(num(r, ci) for r in body[a:b])
            print(f"  lines {a:5d}-{b:5d}  samples {100 * sa / tot:5.1f}%  instructions {100 * si / itot:5.1f}%  ({si:.0f})")
    print(f"== {name}: hottest SASS lines (share of all stall samples), total warp instructions {itot:.0f}")
    idx = sorted(range(len(body)), key=lambda i: -num(body[i], ca))[:40]
    for i in sorted(idx):
        print(f"  {i:5d} {100 * num(body[i], ca) / tot:5.1f}%  {body[i][cs][:110]}")
    # Shared-memory bank conflicts: the wavefronts beyond one per request, by region and the top lines.
    cx = next((i for i, c in enumerate(hdr) if 'Shared' in c and 'Excessive' in c), None)
    xt = sum(num(r, cx) for r in body) if cx is not None else 0
    if xt > 0:
        print(f"== {name}: excessive shared-memory wavefronts (bank conflicts) {xt:.0f}, by region between clock reads")
        for a, b in zip(edges, edges[1:]) if cuts else [(0, len(body))]:
            print(f"  lines {a:5d}-{b:5d}  {100 * sum(num(r, cx) for r in body[a:b]) / xt:5.1f}%")
        print(f"== {name}: the lines with the most (index, excessive wavefronts, warp instructions)")
        for i in sorted(range(len(body)), key=lambda i: -num(body[i], cx))[:24]:
            if num(body[i], cx) > 0:
                print(f"  {i:5d} {num(body[i], cx):9.0f} {num(body[i], ci):9.0f}  {body[i][cs][:90]}")
    # The whole listing, one line per SASS instruction, for reading offline: index, share of stall
    # samples, warp instructions executed, the per-reason sample columns that are not all zero.
    reasons = [i for i, c in enumerate(hdr) if 'stall' in c.lower() and i not in (ca,)]
    reasons = [i for i in reasons if any(num(r, i) for r in body)]
    with open(sys.argv[4], 'w') as f:
        f.write('# index  samples%  executed  ' + '  '.join(hdr[i] for i in reasons) + '  source\n')
        for i, r in enumerate(body):
            f.write(f"{i:5d} {100 * num(r, ca) / tot:5.2f} {num(r, ci):9.0f} " + ' '.join(f"{num(r, j):.0f}" for j in reasons) +
                    f"  {r[cs][:90]}\n")
PY
