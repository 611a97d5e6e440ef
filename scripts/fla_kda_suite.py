"""Runs fla's own KDA test file as given, with fla's chunk_kda replaced by encore.kda.chunk_kda (issue 51's gate:
every `test_chunk*` case passes). The test file is not part of encore: carry it (e.g. `.whl/fla_tests/test_kda.py`,
fla-org/flash-linear-attention tests/ops/test_kda.py at the commit written beside it) with fla-core installed.

    python3 scripts/fla_kda_suite.py TEST_FILE [-k EXPR] [--fla]   # EXPR defaults to test_chunk
--fla runs the file with fla's own chunk_kda (its warnings, e.g. dA_log's ratios, beside encore's; fla autotunes).
Writes $OUT/fla_kda_suite.json (fla_kda_suite_fla.json with --fla: per-case outcome, counts, fla's warnings) when OUT
is set; exits nonzero when a case fails."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

PATCH = '''import fla.ops.kda
import encore.kda
fla.ops.kda.chunk_kda = encore.kda.chunk_kda  # the test module imports it after this conftest runs
'''


def main():
    if len(sys.argv) < 2 or not os.path.isfile(sys.argv[1]):
        sys.exit("usage: fla_kda_suite.py TEST_FILE [-k EXPR]: TEST_FILE, fla's tests/ops/test_kda.py, is missing")
    src, expr, own = sys.argv[1], "test_chunk", "--fla" in sys.argv
    if "-k" in sys.argv:
        expr = sys.argv[sys.argv.index("-k") + 1]
    with tempfile.TemporaryDirectory() as d:
        shutil.copy(src, os.path.join(d, "test_kda.py"))
        with open(os.path.join(d, "conftest.py"), "w") as f:
            f.write("" if own else PATCH)
        xml = os.path.join(d, "report.xml")
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "-k", expr,
                              "--junitxml", xml, os.path.join(d, "test_kda.py")], cwd=d, capture_output=True, text=True)
        print(run.stdout[-20000:], run.stderr[-5000:], sep="\n")
        rc = run.returncode
        cases = {}
        for tc in ET.parse(xml).getroot().iter("testcase"):
            outcome = "passed"
            for tag in ("failure", "error", "skipped"):
                node = tc.find(tag)
                if node is not None:
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                    cases[tc.get("name")] = {"outcome": outcome, "message": (node.get("message") or "")[:400]}
                    break
            else:
                cases[tc.get("name")] = {"outcome": outcome, "time_s": float(tc.get("time", 0))}
    counts = {}
    for c in cases.values():
        counts[c["outcome"]] = counts.get(c["outcome"], 0) + 1
    commit_file = os.path.join(os.path.dirname(os.path.abspath(src)), "COMMIT")
    commit = open(commit_file).read().strip() if os.path.exists(commit_file) else None
    import torch
    # fla's warning-only checks (assert_close(..., warning=True)): "<name> diff: <d> ratio: <r>" under each case's id
    warned, case = {}, None
    for line in run.stdout.splitlines():
        if line.startswith("test_kda.py::"):
            case = line.split("::", 1)[1].strip()
        elif "UserWarning:" in line and "ratio:" in line and case:
            warned.setdefault(case, []).append(line.split("UserWarning:")[-1].strip())
    doc = {"test_file": src, "fla_commit": commit, "filter": expr, "chunk_kda": "fla" if own else "encore", "counts": counts,
           "warnings": warned, "cases": cases,
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
           "encore_commit": os.environ.get("ENCORE_COMMIT")}
    print(f"fla's KDA tests with {doc['chunk_kda']}'s chunk_kda:", counts)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "fla_kda_suite_fla.json" if own else "fla_kda_suite.json"), "w") as f:
            json.dump(doc, f, indent=1)
    sys.exit(rc)


if __name__ == "__main__":
    main()
