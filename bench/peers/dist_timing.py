"""Shared by the multi-GPU peer scripts (moe_ep_peers.py, kda_cp_peers.py; run under torch.distributed.run):
the median wall time of a call between barriers, the slowest rank's."""
import statistics

import torch
import torch.distributed as dist


def median_us(fn, rounds, reps=1, active=True):
    """Median over `rounds` of the wall time per call (us) of `reps` calls of fn between a barrier and a
    synchronize (CUDA events), after 2 warm-up calls; the maximum over the ranks. active=False: this rank only
    joins the barriers (a contender that runs on one rank)."""
    if active:
        for _ in range(2):
            fn()
    out = []
    for _ in range(rounds):
        dist.barrier()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps if active else 0):
            fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / reps * 1e3)
    m = torch.tensor([statistics.median(out) if active else 0.0], device="cuda")
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    return float(m.item())
