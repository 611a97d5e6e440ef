#!/usr/bin/env python3
"""Checks the tree against design.md's layout rules (run by scripts/test.sh; exits 1 on a breach):

- a family's cuda/ and reference/ layers include nothing above them: from src/<family>/ only the
  family's bottom (problem.hpp, testing.hpp, fp8_scale.hpp), never a dispatch header, and no other
  family's kernels, references or dispatch;
- public headers (include/encore/) include only public headers and point nowhere outside the
  repository; they hold no launch plans or test hooks;
- no source file is over 800 lines;
- no "session N" diary references in code or docs.
"""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
FAMILIES = ("norm", "quant", "gemm", "kda", "moe")
BOTTOM = {"problem.hpp", "testing.hpp", "fp8_scale.hpp"}
SOURCE = (".cpp", ".hpp", ".cu", ".cuh", ".py", ".sh", ".cmake", ".in", ".def")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def tracked() -> list[pathlib.Path]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split()
    return [ROOT / p for p in out if (ROOT / p).is_file()]


def layer_breaches(path: pathlib.Path, rel: str) -> list[str]:
    parts = rel.split("/")
    if len(parts) < 4 or parts[0] != "src" or parts[1] not in FAMILIES or parts[2] not in ("cuda", "reference"):
        return []
    family, errors = parts[1], []
    for inc in INCLUDE.findall(path.read_text(errors="replace")):
        p = inc.split("/")
        if p[0] in ("encore", "core", "common", "cute", "cutlass") or len(p) == 1:
            continue
        if p[0] in FAMILIES:
            if p[0] != family:
                if not (len(p) == 2 and p[1] in BOTTOM):
                    errors.append(f"{rel}: includes {inc} (another family's layers)")
            elif len(p) == 2 and p[1] not in BOTTOM:
                errors.append(f"{rel}: includes the dispatch header {inc}")
            elif len(p) > 2 and p[1] == "reference" and parts[2] == "cuda":
                errors.append(f"{rel}: a kernel includes the CPU reference {inc}")
            continue
        errors.append(f"{rel}: includes {inc}, outside the layers it may use")
    return errors


def main() -> int:
    errors = []
    for path in tracked():
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("bench/results/"):
            continue
        if rel.endswith(SOURCE):
            text = path.read_text(errors="replace")
            if text.count("\n") > 800:
                errors.append(f"{rel}: {text.count(chr(10))} lines (at most 800)")
            errors += layer_breaches(path, rel)
            if rel.startswith("include/"):
                for inc in INCLUDE.findall(text):
                    if not inc.startswith("encore/"):
                        errors.append(f"{rel}: public header includes {inc}")
                if "../shared" in text or "shared/docs" in text:
                    errors.append(f"{rel}: points outside the repository (../shared)")
                if re.search(r"LaunchPlan|_override\(|profile_(enable|read)", text):
                    errors.append(f"{rel}: a launch plan or test hook in a public header")
        if rel.endswith(SOURCE + (".md",)) and rel != "scripts/check_layout.py":
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if re.search(r"\bsessions? \d+", line, re.I):
                    errors.append(f"{rel}:{n}: session diary reference: {line.strip()[:80]}")
    for e in errors:
        print("layout:", e)
    print(f"layout: {len(errors)} problem(s)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
