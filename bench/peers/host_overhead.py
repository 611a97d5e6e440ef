"""Host cost per call of small encore ops from Python: wall time of back-to-back calls on tiny shapes.

Paths per op: "public" (encore.rms_norm on plain torch tensors in eager mode: the direct path; under
torch.compile, a dispatch mode or for tensor subclasses it goes through torch.ops.encore), "torch_op"
(torch.ops.encore.<op>.default called directly), "direct" (the public function with an explicit
stream: no torch.ops), "binding" (the raw encore._encore call on the tensors, output preallocated
and the stream handle cached: nanobind calls Tensor.__dlpack__ per tensor), "binding_capsules" (the
same on torch.utils.dlpack.to_dlpack capsules, as the wrappers pass them) and "binding_alloc" (that
plus torch.empty_like and torch's current-stream query: the least an op's kernel does); and
"overhead_us" = public - binding_capsules (what the Python layers add to the binding). References:
"dlpack" (one Tensor.__dlpack__), "to_dlpack" (one capsule), "torch_empty" (one torch.empty_like),
"torch_rms_norm" (torch.nn.functional.rms_norm, eager).
Each number: the best of 7 repeats of N calls timed between torch.cuda.synchronize() calls; the
shapes are tiny, so the host, not the GPU, is the bottleneck ("device_us": the public call's device
time per call from a CUDA-graph replay, for comparison). Goal: public <= 10 us per call. The C++
launch cost is measured separately (the C++ bench suites).
Usage: python3 bench/peers/host_overhead.py [OUT.json]  (CUDA build and GPU; falls back to the CPU
backend, whose numbers include the CPU reference's arithmetic, when none is present)."""
import json
import os
import sys
import time

import torch
from graph_timing import graph_us

import encore
from encore import _encore

GOAL_US = 10.0
N, REPEATS = 5000, 7


def wall_us(call, sync):
    for _ in range(200):
        call()
    sync()
    best = float("inf")
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        for _ in range(N):
            call()
        sync()
        best = min(best, (time.perf_counter() - t0) / N * 1e6)
    return best


def main():
    out_path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.environ.get("OUT", "."), "host_overhead.json")
    cuda = encore.built_with_cuda() and encore.cuda_device_count() > 0 and torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    stream = torch.cuda.current_stream().cuda_stream if cuda else 0
    raw_stream = encore.torch_ops._torch_stream
    bf = torch.bfloat16
    hq, hkv, hd = 32, 8, 128

    x = torch.randn(1, 4096, device=dev, dtype=bf)
    w = torch.rand(4096, device=dev, dtype=bf) + 0.5
    y = torch.empty_like(x)
    qkv = torch.randn(1, (hq + 2 * hkv) * hd, device=dev, dtype=bf)
    qw, kw = torch.rand(hd, device=dev, dtype=bf) + 0.5, torch.rand(hd, device=dev, dtype=bf) + 0.5
    ops = torch.ops.encore

    from torch.utils.dlpack import to_dlpack as dl

    def rms_binding_alloc():
        out = torch.empty_like(x)
        _encore.rms_norm_out(dl(x), dl(w), dl(out), 1e-6, 0.0, raw_stream(x))

    paths = {
        "rms_norm [1, 4096] bf16": {
            "public": lambda: encore.rms_norm(x, w),
            "torch_op": lambda: ops.rms_norm.default(x, w, 1e-6, 0.0),
            "direct": lambda: encore.rms_norm(x, w, stream=stream),
            "binding": lambda: _encore.rms_norm_out(x, w, y, 1e-6, 0.0, stream),
            "binding_capsules": lambda: _encore.rms_norm_out(dl(x), dl(w), dl(y), 1e-6, 0.0, stream),
            "binding_alloc": rms_binding_alloc,
        },
        f"qk_norm_ [1, {(hq + 2 * hkv) * hd}] bf16 ({hq} q + {hkv} kv heads of {hd})": {
            "public": lambda: encore.qk_norm_(qkv, qw, kw, hq, hkv, hd),
            "torch_op": lambda: ops.qk_norm_.default(qkv, qw, kw, hq, hkv, hd, 1e-6, 0.0),
            "direct": lambda: encore.qk_norm_(qkv, qw, kw, hq, hkv, hd, stream=stream),
            "binding": lambda: _encore.qk_norm_(qkv, qw, kw, hq, hkv, hd, 1e-6, 0.0, stream),
            "binding_capsules": lambda: _encore.qk_norm_(dl(qkv), dl(qw), dl(kw), hq, hkv, hd, 1e-6, 0.0, stream),
        },
    }
    refs = {"dlpack": lambda: x.__dlpack__(), "to_dlpack": lambda: dl(x), "torch_empty": lambda: torch.empty_like(x),
            "torch_rms_norm": lambda: torch.nn.functional.rms_norm(x, (4096,), w, 1e-6)}

    results = {"device": torch.cuda.get_device_name() if cuda else "cpu (CPU backend; includes its arithmetic)",
               "torch": torch.__version__, "encore": getattr(encore, "__version__", "?"), "calls_per_repeat": N,
               "goal_us": GOAL_US, "ops": {}, "references_us": {}}
    with torch.inference_mode():
        for op, calls in paths.items():
            row = {name: wall_us(call, sync) for name, call in calls.items()}
            row["overhead_us"] = row["public"] - row["binding_capsules"]
            if cuda:
                row["device_us"] = graph_us(lambda i: calls["public"]())
            results["ops"][op] = row
            print(op + ": " + ", ".join(f"{k} {v:.2f} us" for k, v in row.items()), flush=True)
        results["references_us"] = {name: wall_us(call, sync) for name, call in refs.items()}
    print("references: " + ", ".join(f"{k} {v:.2f} us" for k, v in results["references_us"].items()))
    worst = max(row["public"] for row in results["ops"].values())
    results["public_worst_us"] = worst
    results["meets_goal"] = worst <= GOAL_US
    print(f"public path, worst op: {worst:.2f} us per call (goal <= {GOAL_US:.0f} us): "
          f"{'met' if worst <= GOAL_US else 'NOT met'}")
    with open(out_path, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
