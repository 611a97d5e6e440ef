#!/usr/bin/env bash
# SASS of the kernels in a CUDA object or binary whose (mangled) name matches a regex, one
# instruction per line without encodings, plus a per-kernel count of instructions up to the first
# EXIT after the prologue (a rough size of the main path). Needs scripts/install_sass_tools.sh.
# Usage: scripts/sass.sh FILE [NAME_REGEX]
#   e.g. scripts/sass.sh build-cuda/CMakeFiles/encore_kernels_quant.dir/src/quant/cuda/fp8_group_quant.cu.o bfloat16Li2
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cuobjdump="$root/.tools/nvidia/cu13/bin/cuobjdump"
[ -x "$cuobjdump" ] || { echo "run scripts/install_sass_tools.sh first" >&2; exit 2; }
"$cuobjdump" --dump-sass "${1:?usage: scripts/sass.sh FILE [NAME_REGEX]}" | python3 -c '
import re, sys
pat = re.compile(sys.argv[1]) if len(sys.argv) > 1 else None
name, body = None, []
def flush():
    if name and (pat is None or pat.search(name)):
        main = next((i for i, l in enumerate(body) if "EXIT" in l and i > 20), len(body))
        print(f"== {name}: {len(body)} instructions, {main} to the first EXIT")
        print("\n".join(body))
for line in sys.stdin:
    m = re.search(r"Function : (\S+)", line)
    if m:
        flush(); name, body = m.group(1), []; continue
    m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(.*?);", line)
    if m and name: body.append(f"{m.group(1)}  {m.group(2).strip()}")
flush()
' "${2:-}"
