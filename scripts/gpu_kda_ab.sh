#!/usr/bin/env bash
# A/B measurement of KDA builds on the GPU machine, in one call: for each directory holding an
# `encore` binary (e.g. main's .gpubin and experiment builds unpacked from a carried archive), the
# per-kernel device times under ncu (locked clocks; stable across jobs) and then ROUNDS rounds of
# `encore bench kda kda_phases`, the builds interleaved within each round so clock drift hits all of
# them alike. Writes $OUT/ab_<name>_ncu.txt and $OUT/ab_<name>_r<round>.json (name = the directory's
# last component) and a summary in $OUT/gpu_kda_ab.txt; where a directory has `encore_tests_gpu`
# (scripts/stage_ab.sh puts it there), that build's KDA GPU tests run first ($OUT/ab_<name>_tests.log).
# The per-build files end up packed in $OUT/ab.tgz (a device call returns at most 8 files: with three
# builds, loose files were left behind), beside the summary.
# Usage: scripts/gpu_kda_ab.sh DIR [DIR ...]   (ROUNDS, default 2)
source "$(dirname "$0")/gpu_pass.sh"
gpu_pass gpu_kda_ab
for d in "$@"; do  # each build's KDA GPU tests first, where its directory has the test binary
  n=$(basename "$d")
  [ -x "$d/encore_tests_gpu" ] || continue
  timeout 150 "$d/encore_tests_gpu" --gtest_filter='KdaGpu.*' --gtest_brief=1 >"$OUT/ab_${n}_tests.log" 2>&1
  note "== $n KDA tests rc=$? $(grep -E '(PASSED|FAILED) ' "$OUT/ab_${n}_tests.log" | tr '\n' ' ')"
done
for d in "$@"; do
  n=$(basename "$d")
  timeout 120 ncu --metrics gpu__time_duration.sum -k regex:kda_ --launch-count 400 "$d/encore" bench kda \
    --out /tmp/ncu_ab.json >"/tmp/ncu_ab_$n.log" 2>&1
  note "== $n ncu"; python3 scripts/ncu_durations.py "/tmp/ncu_ab_$n.log" "$n" | tee "$OUT/ab_${n}_ncu.txt" | tee -a "$sum"
done
for r in $(seq 1 "${ROUNDS:-2}"); do
  for d in "$@"; do
    n=$(basename "$d")
    timeout 120 "$d/encore" bench kda kda_phases --out "$OUT/ab_${n}_r$r.json" >"/tmp/bench_ab_$n.log" 2>&1
    note "== $n round $r rc=$?"; grep -E 'kda' "/tmp/bench_ab_$n.log" | head -40 | tee -a "$sum" >/dev/null
  done
done
(cd "$OUT" && tar -czf ab.tgz ab_* && rm -f ab_*)
