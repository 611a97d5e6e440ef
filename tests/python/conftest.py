"""pytest hooks for tests/python. ENCORE_PYTEST_FAILURES=FILE: each failed test's node id and its error line
appended to FILE as it happens (under pytest-xdist by the controller), so a run cut by a time limit before
pytest's summary still names what failed (scripts/gpu.sh sets it on the GPU machine)."""
import os


def pytest_runtest_logreport(report):
    path = os.environ.get("ENCORE_PYTEST_FAILURES")
    if not path or not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    crash = getattr(report.longrepr, "reprcrash", None)
    line = crash.message if crash is not None else str(report.longrepr).strip().splitlines()[-1:]
    with open(path, "a") as f:
        f.write(f"{report.nodeid} ({report.when}): {' '.join(str(line).split())[:300]}\n")
