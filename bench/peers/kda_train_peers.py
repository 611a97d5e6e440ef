"""KDA training step against fla (issue 29's benchmark): fla's chunk_kda and encore.kda.chunk_kda (saved-h and
rematerialize), bf16, H 16, K = V = 128, in-kernel softplus gate with dt_bias, q/k L2 norm, initial state and
final state, at the standard varlen configuration (seq_lens 1800, 1500, 2000, 1200, 800) and B 1 / B 4, T 8192.

Per configuration and implementation, in one process, the implementations alternating over ROUNDS rounds
(medians): the backward alone and forward + backward as device time (the summed CUDA kernel time per call from
torch.profiler; the backward replays one recorded graph with retain_graph), the bytes the forward keeps for the
backward (memory allocated after the forward minus before, the output included), the peak of a forward +
backward above the inputs; and each encore gradient against fla's (relative RMS difference: both compute the
same gradients from the same bf16 inputs). Needs fla-core (carried in .whl) and the encore module built for this
Python (PYTHONPATH=build-cuda/python). Usage: kda_train_peers.py OUT.json (KDA_PEER_CONFIGS=name,...; ROUNDS,
default 3; KDA_TRAIN_WHO=fla,encore,encore_remat,encore_simt,encore_simt_remat picks the implementations, e.g.
encore alone for a profile without fla's minutes of Triton autotuning; encore and encore_remat run the default
tensor-core backward kernels, ENCORE_KDA_BWD_SIMT=0, encore_simt* the first SIMT ones, =1)."""
import os
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from fla.ops.kda import chunk_kda as fla_chunk_kda

from kda_configs import CONFIGS, HAVE_ENCORE, ROUNDS, H, K, V, bf, dev, write  # noqa: E402 (the script's folder is on sys.path)

if HAVE_ENCORE:
    from encore.kda import chunk_kda as encore_chunk_kda
GRADS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "h0")


def inputs(B, lens):
    T = sum(lens) if lens else 8192
    N = len(lens) if lens else B
    torch.manual_seed(0)
    t = {"q": torch.randn(B, T, H, K, device=dev, dtype=bf), "k": torch.randn(B, T, H, K, device=dev, dtype=bf),
         "v": torch.randn(B, T, H, V, device=dev, dtype=bf), "g": torch.randn(B, T, H, K, device=dev, dtype=bf),
         "beta": torch.randn(B, T, H, device=dev, dtype=bf).sigmoid(), "A_log": torch.randn(H, device=dev),
         "dt_bias": torch.randn(H * K, device=dev), "h0": 0.1 * torch.randn(N, H, K, V, device=dev)}
    for x in t.values():
        x.requires_grad_(True)
    cot = (torch.randn(B, T, H, V, device=dev, dtype=bf), torch.randn(N, H, K, V, device=dev))
    cu = None if lens is None else torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.long)
    return t, cot, cu


def runner(who, t, cu):
    kw = dict(A_log=t["A_log"], dt_bias=t["dt_bias"], use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
              initial_state=t["h0"], output_final_state=True)
    if cu is not None:
        kw.update(cu_seqlens=cu.to(dev), cu_seqlens_cpu=cu)
    if who == "fla":
        return lambda: fla_chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], **kw)
    remat = who.endswith("_remat")
    return lambda: encore_chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], rematerialize=remat, **kw)


def kernel_ms(f, calls=3):
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(calls):
            f()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in p.key_averages()) / calls / 1e3, p


def measure(who, t, cot, cu):
    # encore's backward kernels: the SIMT ones for encore_simt*, the tensor-core ones (the default) otherwise
    os.environ["ENCORE_KDA_BWD_SIMT"] = "1" if who.startswith("encore_simt") else "0"
    fwd = runner(who, t, cu)
    leaves = list(t.values())

    def step():
        o, fin = fwd()
        return torch.autograd.grad((o, fin), leaves, cot)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    outs = fwd()
    torch.cuda.synchronize()
    saved = torch.cuda.memory_allocated() - before
    bwd_ms, prof = kernel_ms(lambda: torch.autograd.grad(outs, leaves, cot, retain_graph=True))
    del outs
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    grads = step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    step_ms, _ = kernel_ms(step)
    breakdown = {e.key: e.device_time_total / 3 / 1e3 for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
                 if e.device_time_total > 0}
    return {"bwd_gpu_kernel_ms": bwd_ms, "fwd_bwd_gpu_kernel_ms": step_ms, "saved_bytes": saved, "peak_bytes": peak,
            "bwd_breakdown": breakdown}, grads


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).pow(2).mean() / b.pow(2).mean().clamp_min(1e-30)).sqrt().item()


def main(out):
    res = {}
    whos = ["fla"] + (["encore", "encore_remat", "encore_simt", "encore_simt_remat"] if HAVE_ENCORE else [])
    if os.environ.get("KDA_TRAIN_WHO"):
        picked = os.environ["KDA_TRAIN_WHO"].split(",")
        whos = [w for w in whos if w in picked]  # fla first: the ratios divide by its times
    for name, (B, lens) in CONFIGS.items():
        t, cot, cu = inputs(B, lens)
        tokens = sum(lens) if lens else B * 8192
        runs = {who: [] for who in whos}
        grads = {}
        for rnd in range(ROUNDS):
            for who in list(runs):
                try:
                    t0 = time.perf_counter()
                    r, grads[who] = measure(who, t, cot, cu)
                    runs[who].append(r)
                    print(f"  [{name} round {rnd + 1}/{ROUNDS}] {who}: bwd {r['bwd_gpu_kernel_ms']:.3f} ms "
                          f"({time.perf_counter() - t0:.1f} s with warm-up)", flush=True)
                except Exception as e:  # noqa: BLE001 (an encore failure must not cost fla's numbers; reported)
                    res[f"kda_train_{who}_{name}_error"] = repr(e)
                    print(f"  {name} {who} failed: {e!r}", flush=True)
                    del runs[who]
        for who, rs in runs.items():
            for key in ("bwd_gpu_kernel_ms", "fwd_bwd_gpu_kernel_ms", "saved_bytes", "peak_bytes"):
                res[f"kda_train_{who}_{name}_{key}"] = statistics.median(r[key] for r in rs)
            res[f"kda_train_{who}_{name}_saved_bytes_per_token_head"] = res[f"kda_train_{who}_{name}_saved_bytes"] / tokens / H
            res[f"kda_train_{who}_{name}_bwd_breakdown"] = rs[-1]["bwd_breakdown"]
            res[f"kda_train_{who}_{name}_rounds"] = [{k: r[k] for k in r if k != "bwd_breakdown"} for r in rs]
            if who != "fla" and "fla" in runs:
                for gname, a, b in zip(GRADS, grads[who], grads["fla"]):
                    res[f"kda_train_{who}_vs_fla_{name}_d{gname}_rel_rms"] = rel(a, b)
                res[f"kda_train_{who}_{name}_bwd_speedup_vs_fla"] = (res[f"kda_train_fla_{name}_bwd_gpu_kernel_ms"] /
                                                                    res[f"kda_train_{who}_{name}_bwd_gpu_kernel_ms"])
                res[f"kda_train_{who}_{name}_fwd_bwd_speedup_vs_fla"] = (res[f"kda_train_fla_{name}_fwd_bwd_gpu_kernel_ms"] /
                                                                        res[f"kda_train_{who}_{name}_fwd_bwd_gpu_kernel_ms"])
        for key, val in res.items():
            if name in key and not isinstance(val, (dict, list)):
                print(f"{key} {val:.4g}" if isinstance(val, float) else f"{key} {val}", flush=True)
        del t, cot, grads
        torch.cuda.empty_cache()
        write(out, res)
    res["complete"] = True
    write(out, res)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "kda_train_peers.json")
