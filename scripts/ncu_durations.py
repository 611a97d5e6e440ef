#!/usr/bin/env python3
"""Per-kernel device times from an `ncu --metrics gpu__time_duration.sum` log: one line per (kernel,
grid) with the median, the minimum and the number of launches, in microseconds (ncu prints ns, us or
ms). Kernel names lose their namespaces, arguments and `void`; template arguments stay (so
kda_state_kernel<64> and <32> are told apart). A (kernel, grid) launched again after a kernel not
seen before (the next benchmark configuration) starts a new group, numbered #2, #3, ...: a
persistent kernel has the same grid in every configuration (the launch of it that came just before
the new kernel's first one stays in the old group; medians do not notice). Where the log interleaves
ncu's `==PROF== Profiling` lines with the bench's result lines, each launch's configuration is known
and group g is the g-th configuration that launched the (kernel, grid) instead (so configurations that
reuse every kernel and grid of an earlier one stay apart). Used by scripts/gpu.sh (the ncu and
ab passes). Usage: ncu_durations.py NCU_LOG [LABEL]"""
import re
import sys

_UNIT_US = {"n": 1e-3, "u": 1.0, "m": 1e3}


def short_name(full):
    """Drop `void `, namespaces and the argument list, at template depth 0."""
    name, depth, cut = re.sub(r"^void ", "", full), 0, None
    for i, ch in enumerate(name):
        depth += ch == "<"
        depth -= ch == ">"
        if ch == "(" and depth == 0:
            cut = i
            break
    name = name[:cut] if cut is not None else name
    depth, start = 0, 0
    for i, ch in enumerate(name):
        depth += ch == "<"
        depth -= ch == ">"
        if depth == 0 and name.startswith("::", i):
            start = i + 2
    return name[start:]


def launch_configs(lines):
    """The benchmark configuration of each profiled launch, in launch order, where the log has ncu's
    `==PROF== Profiling` lines interleaved with the bench's result lines (`  kda_forward varlen_std
    123.4 us`, printed after each configuration); None when it has no result lines."""
    cfg, out, seen = 0, [], False
    for line in lines:
        if line.startswith("==PROF== Profiling"):
            out.append(cfg)
        elif re.match(r"  \w+ +\S+ .* us\s*$", line):
            cfg, seen = cfg + 1, True
    return out if seen else None


def durations(lines, cfgs=None):
    """{(kernel, grid, group): [µs per launch]}. With cfgs (launch_configs), group g of a (kernel,
    grid) is the g-th configuration that launched it; without, a (kernel, grid) seen again after a
    kernel not seen before starts a new group."""
    current, times, launch = None, {}, 0
    ranks = {}  # with cfgs: (name, grid) -> {configuration: group}
    group = {}  # without: (name, grid) -> its current group number
    for line in lines:
        m = re.match(r"\s+(\S.*?) \((\d+), (\d+), (\d+)\)x\((\d+), (\d+), (\d+)\)", line)
        if m:
            key = (short_name(m.group(1)), "x".join(m.group(2, 3, 4)))
            if cfgs is not None:
                r = ranks.setdefault(key, {})
                g = r.setdefault(cfgs[launch] if launch < len(cfgs) else -1, len(r) + 1)
            else:
                if key not in group:  # a new kernel: the keys already launched twice start new groups
                    for k, gk in group.items():
                        if len(times.get((*k, gk), [])) >= 2:
                            group[k] = -(gk + 1)
                    group[key] = 1
                elif group[key] < 0:
                    group[key] = -group[key]
                g = group[key]
            launch += 1
            current = (*key, g)
            continue
        m = re.search(r"gpu__time_duration\.sum\s+(\w+)\s+([\d.,]+)", line)
        if m and current:
            times.setdefault(current, []).append(float(m.group(2).replace(",", "")) * _UNIT_US[m.group(1)[0]])
            current = None
    return times


def main():
    label = sys.argv[2] + ": " if len(sys.argv) > 2 else ""
    lines = open(sys.argv[1]).read().splitlines()
    cfgs = launch_configs(lines)
    times = durations(lines, cfgs)
    if not times:
        print(f"ncu {label}no samples")
    for (name, grid, g), v in times.items():
        v.sort()
        tag = f" #{g}" if g > 1 else ""
        print(f"ncu {label}{name} grid {grid}{tag}: median {v[len(v) // 2]:.2f} us, min {v[0]:.2f} us over {len(v)} launches")


if __name__ == "__main__":
    main()
