#!/usr/bin/env python3
"""Checks the tree against design.md's layout rules (run by scripts/test.sh; exits 1 on a breach).

Every message is "file:line: rule: detail". The rules:

- layers: a family (every folder of src/ but core, common and testing) keeps its cuda/ and reference/
  layers below its dispatch: they include core/..., common/..., encore/core/..., their own family's
  public headers (encore/<F>.hpp, encore/<F>_*.hpp, encore/<F>/...), their own family's bottom
  headers (problem.hpp, plan.hpp, fp8_scale.hpp) and layers, and third-party headers (cute, cutlass,
  the system); nothing of another family, no dispatch header of their own, kernels no CPU reference;
- test hooks: no kernel source (src/*/cuda/) includes a testing.hpp;
- public headers (include/encore/) include only public headers; they hold no launch plans or test hooks;
- outside the repository: no path of ../shared (or shared/docs) in src/, include/, python/, tests/,
  bench/, scripts/; no absolute path of a build machine (/work/, /home/, /root/) anywhere, and no
  /tmp/ in code comments (scripts and docs use /tmp at run time);
- references: a repository file named in a code comment or a doc (src/..., kda/cuda/launch.hpp,
  docs/x.md, bench/results/...json, or a bare file name) exists in the tree;
- no source file is over 800 lines;
- no "session N" diary references in code or docs.
"""
from __future__ import annotations

import io
import pathlib
import re
import subprocess
import sys
import tokenize

ROOT = pathlib.Path(__file__).resolve().parent.parent
SELF = "scripts/check_layout.py"
NOT_FAMILIES = {"core", "common", "testing"}
FAMILIES = tuple(sorted(p.name for p in (ROOT / "src").iterdir() if p.is_dir() and p.name not in NOT_FAMILIES))
BOTTOM = {"problem.hpp", "plan.hpp", "fp8_scale.hpp"}  # a family's headers its own layers may include
LAYERS = ("cuda", "reference")
C_LIKE = (".cpp", ".hpp", ".cu", ".cuh", ".def", ".h")
HASH_COMMENTED = (".sh", ".cmake", ".in", ".toml", ".txt")
SOURCE = C_LIKE + (".py",) + HASH_COMMENTED
INCLUDE = re.compile(r'^\s*#\s*include\s+(["<])([^">]+)[">]')
# A file path as comments and docs cite them: directories, a name, a known extension; not inside a
# URL, a placeholder (<family>/..., {name}.json, $OUT/...) or a longer word.
REF = re.compile(r"(?<![\w./$<>{}*%~:@\\-])((?:\.\./)*[A-Za-z0-9_][A-Za-z0-9_.-]*(?:/[A-Za-z0-9_][A-Za-z0-9_.-]*)*"
                 r"\.(?:hpp|cpp|cuh|cu|py|md|sh|cmake|def|json|csv))(?![\w/*{<-])")
ABSOLUTE = re.compile(r"(?<![\w.$~-])/(work|home|root|tmp)/")
SHARED = re.compile(r"\.\./shared\b|\bshared/docs\b")
# First path components that name another project's files (cited in comments and docs), not ours.
EXTERNAL = {"cute", "cutlass", "cub", "thrust", "torch", "fla", "triton", "flashinfer", "vllm", "sglang", "transformer_engine",
            "deep_ep", "csrc", "tools", "cuda", "nvidia", "liger_kernel", "megatron", "apex"}
# Another project named just before a missing file (same line or the two before): its file, not ours
# ("fla's tests/ops/test_kda.py", "CUTLASS 4.2's ... (`sm90_mma_array_...hpp`").
EXTERNAL_CONTEXT = re.compile(r"\b(fla|FLA|CUTLASS|cutlass|CuTe|vLLM|vllm|torch|PyTorch|FlashInfer|flashinfer|TRT-LLM|TensorRT|DeepEP|"
                              r"DeepGEMM|Triton|triton|torchtitan|Liger|Transformer Engine|Megatron|cuBLAS|cuDNN|cudnn|sglang|SGLang|upstream)\b")
# Files the build writes (named after ${...}/ in CMake code: gemm_launchers.cpp, encoreConfig.cmake, ...).
GENERATED = re.compile(r'\}/([\w.-]+\.\w+)"')


def tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split("\n")
    return [p for p in out if p and (ROOT / p).is_file()]


def family_of_public(inc: str) -> str | None:
    """The family a public header encore/... belongs to (None for encore/core/... and the umbrella)."""
    rest = inc[len("encore/"):]
    head = rest.split("/")[0]
    if head == "core":
        return None
    if "/" in rest:
        return head
    stem = head.rsplit(".", 1)[0]
    for f in FAMILIES:
        if stem == f or stem.startswith(f + "_"):
            return f
    return "?"  # encore.hpp (every family) or a header of no family


def include_breaches(rel: str, lines: list[str]) -> list[str]:
    parts = rel.split("/")
    if len(parts) < 4 or parts[0] != "src" or parts[1] not in FAMILIES or parts[2] not in LAYERS:
        return []
    family, layer, errors = parts[1], parts[2], []
    for n, line in enumerate(lines, 1):
        m = INCLUDE.match(line)
        if not m:
            continue
        inc, where = m.group(2), f"{rel}:{n}"
        p = inc.split("/")
        if layer == "cuda" and p[-1] == "testing.hpp":
            errors.append(f"{where}: test hook in a kernel: includes {inc} (declare what kernels need in cuda/launch.hpp)")
        elif p[0] in ("core", "common") or p[0] in ("cute", "cutlass"):
            continue
        elif p[0] == "encore":
            owner = family_of_public(inc)
            if owner == "?":
                errors.append(f"{where}: cross-family include: {inc} (a public header of every family or none; include the own one)")
            elif owner not in (None, family):
                errors.append(f"{where}: cross-family include: {inc} (another family's public header; share it through core/)")
        elif p[0] in FAMILIES:
            if p[0] != family:
                errors.append(f"{where}: cross-family include: {inc} (another family's header; share it through core/)")
            elif len(p) == 2 and p[1] not in BOTTOM and p[1] != "testing.hpp":
                errors.append(f"{where}: layer include: {inc} is a dispatch header (only {', '.join(sorted(BOTTOM))} from the layers)")
            elif len(p) > 2 and p[1] == "reference" and layer == "cuda":
                errors.append(f"{where}: layer include: a kernel includes the CPU reference {inc}")
        elif m.group(1) == '"' and len(p) > 1:
            errors.append(f"{where}: layer include: {inc} is outside the layers it may use")
    return errors


def c_comments(text: str) -> list[tuple[int, str]]:
    """(line, text) of the // and /* */ comments of C++/CUDA source (strings and raw strings skipped)."""
    out, i, n, line = [], 0, len(text), 1
    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
            i += 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append((line, text[i + 2:j]))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j
            for k, piece in enumerate(text[i + 2:j].split("\n")):
                out.append((line + k, piece))
            line += text.count("\n", i, j)
            i = j + 2
        elif c == "R" and text.startswith('R"', i) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            k = text.find("(", i + 2)
            end = text.find(")" + text[i + 2:k] + '"', k) if k >= 0 else -1
            j = n if end < 0 else end + k - i
            line += text.count("\n", i, j)
            i = j + 1
        elif c in "\"'":
            if c == "'" and i > 0 and text[i - 1].isalnum():  # a digit separator (1'000)
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            i = j + 1
        else:
            i += 1
    return out


def py_comments(text: str) -> list[tuple[int, str]]:
    """(line, text) of the # comments and docstrings of Python source."""
    out, prev = [], tokenize.NEWLINE
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                out.append((tok.start[0], tok.string[1:]))
            elif tok.type == tokenize.STRING and prev in (tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT):
                for k, piece in enumerate(tok.string.split("\n")):
                    out.append((tok.start[0] + k, piece))
            if tok.type not in (tokenize.COMMENT, tokenize.NL):
                prev = tok.type
    except (tokenize.TokenError, SyntaxError, IndentationError):
        pass
    return out


def hash_comments(lines: list[str]) -> list[tuple[int, str]]:
    """(line, text) of the # comments of shell and CMake (a # at a line's start or after a blank)."""
    out = []
    for n, line in enumerate(lines, 1):
        m = re.search(r"(?:^|\s)#(?![!{#])(.*)", line)
        if m and not line.lstrip().startswith("#!"):
            out.append((n, m.group(1)))
    return out


class Tree:
    def __init__(self, files: list[str]):
        self.files = set(files)
        self.names = {f.rsplit("/", 1)[-1] for f in files}
        self.generated = set()
        for f in files:
            if f.endswith((".cmake", "CMakeLists.txt")):
                self.generated.update(GENERATED.findall((ROOT / f).read_text(errors="replace")))

    def has(self, ref: str, rel: str) -> bool:
        here = rel.rsplit("/", 1)[0] if "/" in rel else ""
        if ref.startswith("../"):
            target = (ROOT / here / ref).resolve()
            try:
                return target.relative_to(ROOT).as_posix() in self.files
            except ValueError:
                return False
        ref = ref[2:] if ref.startswith("./") else ref
        if ref.split("/")[0].startswith("build"):  # a build tree's file (build-cuda/..., build/generated/...)
            return True
        if "/" not in ref:  # a bare name: a file of the tree or of the build; data files (OUT.json) are outputs
            return ref in self.names or ref in self.generated or ref.endswith((".json", ".csv"))
        for base in ("", "src/", "include/", here + "/" if here else ""):
            if base + ref in self.files:
                return True
        return any(f.endswith("/" + ref) for f in self.files)


def reference_breaches(rel: str, comments: list[tuple[int, str]], tree: Tree) -> list[str]:
    errors, recent = [], {}  # line -> comment text, for the context of the next lines
    for n, text in comments:
        for m in REF.finditer(text):
            ref = m.group(1)
            first = ref.split("/")[0]
            if SHARED.search(ref) or ref.startswith("shared/"):
                continue  # the outside-the-repository rule's (README and docs may describe the shared folder)
            if ("/" in ref and first in EXTERNAL) or tree.has(ref, rel):
                continue
            if EXTERNAL_CONTEXT.search(" ".join((recent.get(n - 2, ""), recent.get(n - 1, ""), text[:m.start()]))):
                continue
            errors.append(f"{rel}:{n}: missing file: {ref} is not in the tree")
        recent[n] = text
    return errors


def absolute_breaches(rel: str, lines: list[str], comments: list[tuple[int, str]], in_code: bool) -> list[str]:
    errors = []
    for n, line in enumerate(lines, 1):
        for m in ABSOLUTE.finditer(line):
            if m.group(1) != "tmp":
                errors.append(f"{rel}:{n}: build-machine path: /{m.group(1)}/... ({line.strip()[:60]})")
    if in_code:
        for n, text in comments:
            if re.search(r"(?<![\w.$~-])/tmp/", text):
                errors.append(f"{rel}:{n}: build-machine path: /tmp/ in a comment ({text.strip()[:60]})")
    return errors


def main() -> int:
    errors: list[str] = []
    files = tracked()
    tree = Tree(files)
    for rel in files:
        if rel == SELF or (rel.startswith("bench/results/") and not rel.endswith(".md")):
            continue
        is_doc = rel.endswith(".md")
        is_cmake = rel.endswith("CMakeLists.txt")
        if not (rel.endswith(SOURCE) or is_doc):
            continue
        text = (ROOT / rel).read_text(errors="replace")
        lines = text.split("\n")
        top = rel.split("/")[0]
        if rel.endswith(SOURCE) and text.count("\n") > 800:
            errors.append(f"{rel}:1: size: {text.count(chr(10))} lines (at most 800)")
        errors += include_breaches(rel, lines)
        if rel.startswith("include/"):
            for n, line in enumerate(lines, 1):
                m = INCLUDE.match(line)
                if m and m.group(1) == '"' and not m.group(2).startswith("encore/"):
                    errors.append(f"{rel}:{n}: public header: includes {m.group(2)}")
                if re.search(r"LaunchPlan|_override\(|profile_(enable|read)", line):
                    errors.append(f"{rel}:{n}: public header: a launch plan or test hook")
        if rel.endswith(C_LIKE):
            comments = c_comments(text)
        elif rel.endswith(".py"):
            comments = py_comments(text)
        elif is_doc:
            comments = list(enumerate(lines, 1))
        elif rel.endswith((".sh", ".cmake")) or is_cmake:
            comments = hash_comments(lines)
        else:
            comments = []
        code_tree = top in ("src", "include", "python", "tests", "bench", "scripts")
        if code_tree:
            for n, line in enumerate(lines, 1):
                if SHARED.search(line):
                    errors.append(f"{rel}:{n}: outside the repository: {line.strip()[:70]}")
        errors += absolute_breaches(rel, lines, comments, in_code=rel.endswith(C_LIKE + (".py",)))
        errors += reference_breaches(rel, comments, tree)
        if rel.endswith(SOURCE + (".md",)):
            for n, line in enumerate(lines, 1):
                if re.search(r"\bsessions? \d+", line, re.I):
                    errors.append(f"{rel}:{n}: session diary reference: {line.strip()[:80]}")
    errors = list(dict.fromkeys(errors))  # a line that breaks a rule twice is named once
    for e in errors:
        print("layout:", e)
    print(f"layout: {len(errors)} problem(s)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
