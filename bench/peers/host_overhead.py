"""Host cost per call of small encore ops from Python: wall time of back-to-back calls on tiny shapes.

Ops: rms_norm, qk_norm_, a GEMM epilogue (gemm_row_scale) and chunk_kda's forward (no grad). Paths per
op: "public" (the encore function on plain torch tensors, eager: its launcher called directly),
"torch_op" (torch.ops.encore.<op>.default: the dispatcher, then the same launcher; what torch.compile
traces) and, for the norm ops, "binding" (the raw encore._encore <op>_run call on prebuilt capsules,
output preallocated, options and stream cached: the least a launcher can cost). References in the
same job: "torch_rms_norm" (torch.nn.functional.rms_norm, eager), "torch_launch" (one empty kernel
launched by torch: torch.cuda._sleep(0)), "to_dlpack" (one capsule), "torch_empty" (one
torch.empty_like), and torch's own ops through the entry path the gate reads, "aten_add_torch_op_host"
(torch.ops.aten.add.Tensor: one output, one kernel) and "aten_rms_norm_torch_op_host"
(torch.ops.aten.rms_norm.default): the floor a torch.ops call has on the host of the job.
Each number: the best of 7 repeats of N calls timed between torch.cuda.synchronize() calls, Python's garbage
collector off while timing (as timeit has it: its pauses land on whichever call allocates); the
shapes are tiny, so the host, not the GPU, is the bottleneck ("device_us": the public call's device
time per call from a CUDA-graph replay, for comparison).
"<path>_host": the host time alone, calls queued behind a busy GPU (host_us), the number the
torch.ops gate reads (chunk_kda's device time, ~18 us, exceeds its host time, so the wall time
cannot show it); "torch_op_host_paired" / "torch_rms_norm_host_paired": the torch.ops path and torch's
F.rms_norm timed in alternation (21 rounds, best of each), for hosts whose speed drifts within the job;
"public_paired" / "torch_rms_norm_paired" the same for the public path's wall time (rms_norm);
"torch_op_host_paired_aten" / "aten_add_torch_op_host_paired": the torch.ops path beside torch.ops.aten.add.
Gates (issue 46): rms_norm's public path (wall, paired with F.rms_norm) at or under torch's; every op's
torch_op path <= 10 us of host time.
Usage: python3 bench/peers/host_overhead.py [OUT.json]  (CUDA build and GPU; falls back to the CPU
backend, whose numbers include the CPU reference's arithmetic, when none is present)."""
import gc
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


def wall_us(call, sync, repeats=REPEATS):
    for _ in range(200):
        call()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(N):
            call()
        sync()
        best = min(best, (time.perf_counter() - t0) / N * 1e6)
    return best


def paired_us(measure, call, ref, rounds=3 * REPEATS):
    """measure(call, 1) and measure(ref, 1) in alternation (one repeat of each a round, best over the rounds):
    the reference beside the op in time, so a host whose speed drifts within the job moves both."""
    pairs = [(measure(call, 1), measure(ref, 1)) for _ in range(rounds)]
    return min(p[0] for p in pairs), min(p[1] for p in pairs)


def host_us(call, sync, cuda, m=100, repeats=REPEATS):
    """Host time per call alone: m calls queued behind a GPU held busy by a 50 ms sleep kernel, timed
    without a sync (the queue holds them all: <= 10 launches a call), best of REPEATS. Where the
    device time of a call exceeds its host time (chunk_kda), this is the host cost that wall_us
    cannot show; a path that synchronized would show the sleep here."""
    if not cuda:
        return wall_us(call, sync)
    for _ in range(20):
        call()
    sync()
    best = float("inf")
    for _ in range(repeats):
        torch.cuda._sleep(int(1e8))
        t0 = time.perf_counter()
        for _ in range(m):
            call()
        best = min(best, (time.perf_counter() - t0) / m * 1e6)
        sync()
    return best


def main():
    out_path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.environ.get("OUT", "."), "host_overhead.json")
    cuda = encore.built_with_cuda() and encore.cuda_device_count() > 0 and torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    stream = torch.cuda.current_stream().cuda_stream if cuda else 0
    bf = torch.bfloat16
    hq, hkv, hd = 32, 8, 128
    ops = encore.register_torch_ops()
    from torch.utils.dlpack import to_dlpack as dl

    x = torch.randn(1, 4096, device=dev, dtype=bf)
    w = torch.rand(4096, device=dev, dtype=bf) + 0.5
    y = torch.empty_like(x)
    qkv = torch.randn(1, (hq + 2 * hkv) * hd, device=dev, dtype=bf)
    qw, kw = torch.rand(hd, device=dev, dtype=bf) + 0.5, torch.rand(hd, device=dev, dtype=bf) + 0.5
    a = torch.randn(8, 256, device=dev, dtype=bf)
    wg = torch.randn(256, 256, device=dev, dtype=bf)
    rs = torch.rand(8, device=dev, dtype=torch.float32) + 0.5
    T, H, K = 64, 2, 128  # chunk_kda forward on one chunk
    q, k, v = (torch.randn(1, T, H, K, device=dev, dtype=bf) for _ in range(3))
    q, k = torch.nn.functional.normalize(q.float(), dim=-1).to(bf), torch.nn.functional.normalize(k.float(), dim=-1).to(bf)
    g = -torch.rand(1, T, H, K, device=dev, dtype=torch.float32)
    beta = torch.rand(1, T, H, device=dev, dtype=bf)

    rms_opts = _encore.RmsNormOptions(1e-6, 0.0)
    rms_args = _encore.RmsNormArgs(dl(x), dl(w), dl(y))
    qk_opts = _encore.QkNormOptions(hq, hkv, hd, 1e-6, 0.0)
    qk_args = _encore.QkNormArgs(dl(qkv), dl(qw), dl(kw))
    paths = {
        "rms_norm [1, 4096] bf16": {
            "public": lambda: encore.rms_norm(x, w),
            "torch_op": lambda: ops.rms_norm(x, w, 1e-6, 0.0),
            "binding": lambda: _encore.rms_norm_run(rms_args, rms_opts, None, stream),
        },
        f"qk_norm_ [1, {(hq + 2 * hkv) * hd}] bf16 ({hq} q + {hkv} kv heads of {hd})": {
            "public": lambda: encore.qk_norm_(qkv, qw, kw, hq, hkv, hd),
            "torch_op": lambda: ops.qk_norm_(qkv, qw, kw, hq, hkv, hd, 1e-6, 0.0),
            "binding": lambda: _encore.qk_norm_run(qk_args, qk_opts, None, stream),
        },
        "gemm_row_scale [8, 256] x [256, 256] bf16": {
            "public": lambda: encore.gemm_row_scale(a, wg, rs),
            "torch_op": lambda: ops.gemm_row_scale(a, wg, rs),  # tile left at its default, "auto"
        },
        f"chunk_kda forward [1, {T}, {H}, {K}] bf16, no grad": {
            "public": lambda: encore.chunk_kda(q, k, v, g, beta),
            "torch_op": lambda: ops.kda_forward(q, k, v, g, beta),  # the optional arguments left at their defaults
        },
    }
    refs = {"torch_rms_norm": lambda: torch.nn.functional.rms_norm(x, (4096,), w, 1e-6), "to_dlpack": lambda: dl(x),
            "torch_empty": lambda: torch.empty_like(x)}
    if cuda:
        refs["torch_launch"] = lambda: torch.cuda._sleep(0)
    # torch's own ops through the path the gate reads (OpOverload, the boxed dispatcher call): the platform's
    # floor for a torch.ops call that allocates an output and launches one kernel
    aten_refs = {"aten_add_torch_op": lambda: torch.ops.aten.add.Tensor(x, x),
                 "aten_rms_norm_torch_op": lambda: torch.ops.aten.rms_norm.default(x, [4096], w, 1e-6)}

    results = {"device": torch.cuda.get_device_name() if cuda else "cpu (CPU backend; includes its arithmetic)",
               "torch": torch.__version__, "encore": getattr(encore, "__version__", "?"),
               "commit": os.environ.get("ENCORE_COMMIT", "?"), "calls_per_repeat": N, "goal_us": GOAL_US, "ops": {},
               "references_us": {}}
    gc.collect()
    gc.disable()  # collections would land on whichever timed call allocates
    with torch.inference_mode():
        results["references_us"] = {name: wall_us(call, sync) for name, call in refs.items()}
        results["references_us"]["torch_rms_norm_host"] = host_us(refs["torch_rms_norm"], sync, cuda)
        results["references_us"].update({name + "_host": host_us(call, sync, cuda) for name, call in aten_refs.items()})
        host_round = lambda c, r: host_us(c, sync, cuda, repeats=r)  # noqa: E731  (one round of paired_us)
        for op, calls in paths.items():
            row = {name: wall_us(call, sync) for name, call in calls.items()}
            row.update({name + "_host": host_us(call, sync, cuda) for name, call in calls.items() if name != "binding"})
            # the torch.ops path and torch's F.rms_norm alternating: the gate's number beside its reference in time (on
            # the CPU backend host_us is wall_us: the numbers above)
            row["torch_op_host_paired"], row["torch_rms_norm_host_paired"] = (
                paired_us(host_round, calls["torch_op"], refs["torch_rms_norm"]) if cuda
                else (row["torch_op_host"], results["references_us"]["torch_rms_norm_host"]))
            if cuda:  # beside torch's own add through torch.ops.aten: the same entry path, torch's kernel
                row["torch_op_host_paired_aten"], row["aten_add_torch_op_host_paired"] = paired_us(host_round, calls["torch_op"],
                                                                                                 aten_refs["aten_add_torch_op"])
            if op.startswith("rms_norm"):  # the public gate's number beside its reference in time
                row["public_paired"], row["torch_rms_norm_paired"] = paired_us(lambda c, r: wall_us(c, sync, repeats=r), calls["public"],
                                                                               refs["torch_rms_norm"])
            if cuda:
                row["device_us"] = graph_us(lambda i: calls["public"]())
            results["ops"][op] = row
            print(op + ": " + ", ".join(f"{k} {v:.2f} us" for k, v in row.items()), flush=True)
        refs_again = {name: wall_us(call, sync) for name, call in refs.items()}  # before and after: the job's drift
        results["references_after_us"] = refs_again
    gc.enable()
    print("references: " + ", ".join(f"{k} {v:.2f} us" for k, v in results["references_us"].items()))
    rms_row = results["ops"]["rms_norm [1, 4096] bf16"]
    rms_public, torch_rms = rms_row["public_paired"], rms_row["torch_rms_norm_paired"]
    worst_op = max(row["torch_op_host"] for row in results["ops"].values())
    results["gates"] = {"rms_norm_public_us": rms_public, "torch_rms_norm_us": torch_rms,
                        "rms_norm_at_or_under_torch": rms_public <= torch_rms,
                        "torch_op_worst_us": worst_op, "torch_op_all_within_goal": worst_op <= GOAL_US}
    print(f"gates: rms_norm public {rms_public:.2f} us vs torch {torch_rms:.2f} us; torch.ops worst host {worst_op:.2f} us "
          f"(goal <= {GOAL_US:.0f})")
    with open(out_path, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
