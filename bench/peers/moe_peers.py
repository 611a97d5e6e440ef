"""The single-GPU MoE layer against its torch peers in one process (issue 31's benchmark), bf16, at the
Qwen3-30B-A3B shapes (hidden 2048, 128 experts, top-8, expert FFN 768) and DeepSeek-V3-like shapes
(hidden 7168, 256 experts, top-8, expert FFN 2048), tokens 1, 16, 64, 512, 4096, 16384 (MOE_TOKENS):

- torch: a torchtitan-style path (torch_layer below: softmax top-8, sort-based permutation
  padded to 16-row groups, two torch._grouped_mm, SwiGLU, weighted index_add_), and its two grouped GEMMs
  alone on the same groups;
- eager: a per-expert Python loop (tokens <= 4096);
- encore: the router GEMM (torch) + encore.moe_forward with persistent buffers, and its routing,
  dispatch and combine alone, each with the bytes it must move against a device copy of the same bytes
  (torch's copy_, the copy-bandwidth floor) timed in the same run.
Times are triton do_bench medians (ms), as the anchor measured; MOE_ROUNDS rounds alternate the
implementations (medians). Correctness: encore's output against the torch path's (relative RMS).
Needs the encore module built for this Python (PYTHONPATH=build-cuda/python). Usage: moe_peers.py OUT.json."""
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import encore

dev, bf = "cuda", torch.bfloat16
SHAPES = {"qwen3_30b_a3b": (2048, 128, 8, 768), "deepseek_v3_like": (7168, 256, 8, 2048)}
if os.environ.get("MOE_SHAPES"):
    SHAPES = {n: SHAPES[n] for n in os.environ["MOE_SHAPES"].split(",")}
TOKENS = [int(t) for t in os.environ.get("MOE_TOKENS", "1,16,64,512,4096,16384").split(",")]
ROUNDS = int(os.environ.get("MOE_ROUNDS", "3"))
ALIGN = int(os.environ.get("MOE_ALIGN_M", "16"))


def bench(f):
    return do_bench(f, warmup=10, rep=100, return_mode="median")


def torch_layer(x, Wr, W13t, W2t, K, prep_only=False):
    T, D = x.shape
    E, Fd = W13t.shape[0], W2t.shape[1]
    logits = (x @ Wr.T).float()
    w, ids = torch.topk(logits.softmax(-1), K, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).to(bf)
    ids, w = ids.flatten(), w.flatten()
    counts = torch.bincount(ids, minlength=E)
    padded = (counts + 15) // 16 * 16
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(ids, stable=True)
    sid = ids[order]
    rank = torch.arange(ids.numel(), device=dev) - (torch.cumsum(counts, 0) - counts)[sid]
    dest = ends[sid] - padded[sid] + rank
    xp = torch.zeros(T * K + 16 * E, D, device=dev, dtype=bf)
    xp[dest] = x[order // K]
    if prep_only:
        return xp, ends.int()
    h = torch._grouped_mm(xp, W13t, offs=ends.int())
    a = F.silu(h[:, :Fd]) * h[:, Fd:]
    o = torch._grouped_mm(a, W2t, offs=ends.int())
    out = torch.zeros(T, D, device=dev, dtype=torch.float32)
    out.index_add_(0, order // K, (o[dest] * w[order, None]).float())
    return out.to(bf)


def eager_layer(x, Wr, W13, W2, K):
    probs = (x @ Wr.T).float().softmax(-1)
    w, ids = probs.topk(K, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    out = torch.zeros(x.shape, device=dev, dtype=torch.float32)
    Fd = W2.shape[2]
    for e in ids.unique().tolist():
        t, j = (ids == e).nonzero(as_tuple=True)
        h = x[t] @ W13[e].T
        a = F.silu(h[:, :Fd]) * h[:, Fd:]
        out.index_add_(0, t, (w[t, j, None] * (a @ W2[e].T).float()))
    return out.to(bf)


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).pow(2).mean() / b.pow(2).mean().clamp_min(1e-30)).sqrt().item()


def main(out):
    res = {"align_m": ALIGN}
    for name, (D, E, K, Fd) in SHAPES.items():
        torch.manual_seed(0)
        Wr = (torch.randn(E, D, device=dev) * D ** -0.5).to(bf)
        W13 = (torch.randn(E, 2 * Fd, D, device=dev) * D ** -0.5).to(bf)
        W2 = (torch.randn(E, D, Fd, device=dev) * Fd ** -0.5).to(bf)
        W13t, W2t = W13.transpose(1, 2), W2.transpose(1, 2)
        for T in TOKENS:
            key = f"{name}_T{T}"
            x = torch.randn(T, D, device=dev).to(bf)
            r = {}
            xp, offs = torch_layer(x, Wr, W13t, W2t, K, prep_only=True)
            a_in = torch.randn(xp.shape[0], Fd, device=dev).to(bf)
            nbytes = encore.moe_buffers_bytes(T, D, Fd, E, K, x, ALIGN)
            buffers = torch.empty(nbytes + 256, dtype=torch.uint8, device=dev)
            logits = x @ Wr.T
            ids, w = encore.moe_routing(logits, K)
            disp = encore.moe_dispatch(ids, E, x=x, align_m=ALIGN)
            y = torch.randn(disp["x_permuted"].shape, device=dev).to(bf)
            calls = {
                "torch_layer": lambda: torch_layer(x, Wr, W13t, W2t, K),
                "torch_grouped_gemms": lambda: (torch._grouped_mm(xp, W13t, offs=offs), torch._grouped_mm(a_in, W2t, offs=offs)),
                "encore_layer": lambda: encore.moe_forward(x, x @ Wr.T, W13, W2, K, align_m=ALIGN, buffers=buffers, max_tokens=T),
                "encore_routing": lambda: encore.moe_routing(logits, K),
                "encore_dispatch": lambda: encore.moe_dispatch(ids, E, x=x, align_m=ALIGN),
                "encore_combine": lambda: encore.moe_combine(y, disp["slot_rows"], w),
            }
            if T <= 4096:
                calls["eager_loop"] = lambda: eager_layer(x, Wr, W13, W2, K)
            # The bytes each step must move (read + write), copied by torch in the same run: the floor.
            moved = {"encore_routing": T * E * 2 + T * K * 8, "encore_dispatch": 2 * T * K * D * 2 + T * K * 12,
                     "encore_combine": T * K * D * 2 + T * D * 2 + T * K * 8}
            copies = {}
            for step, n in moved.items():
                src = torch.empty(n // 2, device=dev, dtype=bf)
                dst = torch.empty_like(src)
                copies[step] = (lambda s=src, d=dst: d.copy_(s))
            times = {c: [] for c in list(calls) + [f"{s}_copy_floor" for s in copies]}
            for c, f in list(calls.items()):
                try:
                    f()
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001 (reported; the other numbers still count)
                    r[f"{c}_error"] = repr(e)[:300]
                    print(f"  {key} {c} failed: {e!r}"[:300], flush=True)
                    del calls[c], times[c]
            for _ in range(ROUNDS):
                for c, f in calls.items():
                    times[c].append(bench(f))
                for s, f in copies.items():
                    times[f"{s}_copy_floor"].append(bench(f) / 2)  # a copy reads and writes n/2: n bytes moved
            for c, ts in times.items():
                r[f"{c}_ms"] = statistics.median(ts)
            if "encore_layer" in calls:
                r["encore_vs_torch_out_rel_rms"] = rel(calls["encore_layer"](), calls["torch_layer"]())
                r["encore_layer_over_torch_grouped_gemms"] = r["encore_layer_ms"] / r["torch_grouped_gemms_ms"]
                r["speedup_vs_torch_layer"] = r["torch_layer_ms"] / r["encore_layer_ms"]
            for s in copies:
                if f"{s}_ms" in r:
                    r[f"{s}_of_copy_bandwidth"] = r[f"{s}_copy_floor_ms"] / r[f"{s}_ms"]
            r["grouped_gemm_tflops_torch"] = 2 * T * K * 3 * D * Fd / r["torch_grouped_gemms_ms"] / 1e9
            res[key] = r
            print(key, {k: round(v, 4) for k, v in r.items() if isinstance(v, float)}, flush=True)
            write(out, res)
            del x, xp, a_in, buffers, y, disp
        del Wr, W13, W2, W13t, W2t
        torch.cuda.empty_cache()
    res["complete"] = True
    write(out, res)


def write(out, res):
    res["gpu"] = torch.cuda.get_device_name(0)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "moe_peers.json")
