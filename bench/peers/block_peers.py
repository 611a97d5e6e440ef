"""LLaMA shifted-block forward peers for `encore bench gemm_epilogue` (llama_block_forward): the
textbook block in PyTorch bf16 (x1 = y0 @ w0.T + x0; z1 = rmsnorm(x1)*g0 @ w1.T; y1 = silu(gate)*up;
x2 = y1 @ w2.T + x1; qkv = RoPE(rmsnorm(x2)*g1 @ w3.T), interleaved gate/up and RoPE pairs as in
encore), eager, torch.compile, and its four matmuls alone (cuBLAS), at LLaMA 1B/8B/70B sizes with
M = 8192 and 16384. Timing: triton.testing.do_bench (median, L2 flushed between reps). When the encore Python module is
importable (built for this Python, e.g. PYTHONPATH=build-cuda/python after `scripts/gpu.sh build`;
`scripts/gpu.sh peers` sets it), encore.llama_block_forward is timed the same way, so the ratio
to torch.compile does not mix two timing methods, both as a plain call (outputs and workspace
allocated per call) and as `encore_static` (outputs and workspace allocated once). BLOCK_SIZES
(e.g. "8B") limits the sizes; ROUNDS (default 3) rounds per shape, contenders rotated, medians
(each round's times are in the JSON too).
Usage: python3 bench/peers/block_peers.py OUT.json"""
import json
import math
import os
import statistics
import sys

import torch
from triton.testing import do_bench

dev, bf = "cuda", torch.bfloat16
SIZES = {"1B": (2048, 8192, 32, 8, 64), "8B": (4096, 14336, 32, 8, 128), "70B": (8192, 28672, 64, 8, 128)}
ROUNDS = int(os.environ.get("ROUNDS", "3"))
if os.environ.get("BLOCK_SIZES"):
    SIZES = {k: v for k, v in SIZES.items() if k in os.environ["BLOCK_SIZES"].split(",")}
try:
    import encore
    HAVE_ENCORE = encore.built_with_cuda() and encore.cuda_device_count() > 0
except ImportError:
    HAVE_ENCORE = False


def rmsnorm(h, w, eps=1e-5):
    hf = h.float()
    return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(h.dtype)


def block(y0, x0, w0, w1, w2, w3, g0, g1, cos, sin):
    x1 = y0 @ w0.t() + x0
    z1 = rmsnorm(x1, g0) @ w1.t()
    y1 = torch.nn.functional.silu(z1[:, 0::2]) * z1[:, 1::2]
    x2 = y1 @ w2.t() + x1
    q = rmsnorm(x2, g1) @ w3.t()
    a, b = q[:, 0::2].float(), q[:, 1::2].float()
    qkv = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(1).to(q.dtype)
    return x1, x2, z1, qkv


def main(out):
    res = {}
    for name, (d, F, hq, hkv, hd) in SIZES.items():
        n = (hq + 2 * hkv) * hd
        for M in (8192, 16384):
            t = lambda *s, scale=1.0: (torch.randn(*s, device=dev, dtype=bf) * scale)
            y0, x0 = t(M, d), t(M, d)
            w0, w1, w2, w3 = t(d, d, scale=d ** -0.5), t(2 * F, d, scale=d ** -0.5), t(d, F, scale=F ** -0.5), t(n, d, scale=d ** -0.5)
            g0, g1 = t(d) * 0.2 + 1, t(d) * 0.2 + 1
            pos = torch.arange(M, device=dev).float() % 8192
            inv = 500000.0 ** (-torch.arange(0, hd, 2, device=dev).float() / hd)
            ang = pos[:, None] * inv.repeat((hq + hkv))[None, :]
            ang = torch.cat((ang, torch.zeros(M, hkv * hd // 2, device=dev)), dim=1)
            cos, sin = ang.cos(), ang.sin()
            args = (y0, x0, w0, w1, w2, w3, g0, g1, cos, sin)
            # A fresh static compile per shape: without the reset, dynamo (which caches by the code of
            # `block`) recompiles each later shape with the changed dimensions dynamic, whose kernels
            # can be slower (measured: 8B M = 8192 6.01 ms after the two 1B shapes, 5.41-5.52 ms
            # static); the peer must get its best kernels at every size.
            torch._dynamo.reset()
            comp = torch.compile(block, dynamic=False)
            comp(*args)
            key = f"{name}_M{M}"
            y1 = t(M, F)
            runs = {"eager": lambda: block(*args), "compile": lambda: comp(*args),
                    "gemms_only": lambda: (y0 @ w0.t(), x0 @ w1.t(), y1 @ w2.t(), x0 @ w3.t())}
            if HAVE_ENCORE:  # the same block (interleaved gate/up, RoPE on the q and k heads) in encore
                epos = (torch.arange(M, device=dev) % 8192).to(torch.int32)
                efreq = torch.from_numpy(encore.rope_freq_turns(hq + 2 * hkv, hq + hkv, hd, 500000.0)).to(dev)
                eargs = (y0, x0, w0, w1, w2, w3, g0, g1, epos, efreq)
                runs["encore"] = lambda: encore.llama_block_forward(*eargs)
                # The same with its outputs and workspace allocated once (fixed addresses, no allocation per call).
                eout = encore.llama_block_forward(*eargs)
                ews = torch.empty(encore.llama_block_workspace_bytes(*eargs, eout), dtype=torch.uint8, device=dev)
                runs["encore_static"] = lambda: encore.llama_block_forward(*eargs, out=eout, workspace=ews)
            # ROUNDS rounds, the contenders in a rotated order each round, the median per contender:
            # the GPU's clock drifts with its power draw, so back-to-back single runs differ by a few %.
            names, times = list(runs), {k: [] for k in runs}
            for r in range(ROUNDS):
                for k in names[r % len(names):] + names[:r % len(names)]:
                    times[k].append(do_bench(runs[k], warmup=10, rep=100, return_mode="median"))
            for k in names:
                res[f"block_{key}_{k}_ms"] = statistics.median(times[k])
                res[f"block_{key}_{k}_rounds_ms"] = times[k]
                print(f"block_{key}_{k}_ms {res[f'block_{key}_{k}_ms']:.4f}  rounds {' '.join(f'{x:.4f}' for x in times[k])}", flush=True)
            del args, comp, y0, x0, w0, w1, w2, w3, y1, cos, sin, ang, runs
            eargs = eout = ews = None
            torch.cuda.empty_cache()
            write(out, res)  # after every shape: a run cut by its timeout keeps what it measured
    res["complete"] = True
    write(out, res)


def write(out, res):
    res["gpu"] = torch.cuda.get_device_name(0)
    res["torch"] = torch.__version__
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "block_peers.json")
