"""Training peers of issue 30 (the GEMM-epilogue backward), every contender in one process, bf16, timed with
triton.testing.do_bench (median), contenders rotated over ROUNDS rounds (medians of the rounds):

  swiglu_mlp   SwiGLU MLP forward + backward (x [M, d] -> down(silu(gate) * up)): encore.nn.SwiGLUMLP without
               the norm (Liger's LigerSwiGLUMLP contract) and with the input RMSNorm fused, against eager,
               torch.compile and Liger (LigerSiLUMulFunction) on the same math, and its GEMMs alone (cuBLAS:
               the gate/up GEMM, the down GEMM, their dgrads and wgrads: the nine GEMMs of the unfused MLP)
  lm_head_ce   LM head + cross-entropy forward + backward (x [M, 4096], W [128256, 4096], mean over the rows):
               encore.nn.FusedLinearCrossEntropyLoss (recompute, stored-logits and grad-in-forward modes) against eager,
               torch.compile and Liger's LigerFusedLinearCrossEntropyLoss, time and the extra peak memory
               above the inputs, and the three GEMMs alone
  bwd_kernels  the backward epilogue kernels alone: rmsnorm_bwd (dz [M, N] · w [N, d] with the norm backward) and
               swiglu_bwd (dx [M, d] · w_down [d, F] with SwiGLU's backward) against the same GEMM alone (cuBLAS)
               and cuBLAS + the glue compiled by torch.compile, at each size (the glue's share grows as d shrinks)
  block        the shifted LLaMA block forward + backward: encore.nn.LlamaBlock against torch.compile of the
               textbook block (docs/math/gemm_epilogues.md §5) and its 12 GEMMs alone

Sizes: TRAIN_SIZES (default 1B,8B; 70B too), TRAIN_M (default 8192; e.g. 8192,16384), TRAIN_SECTIONS (default
all four). TRAIN_PROFILE=1: also each contender's kernels under torch.profiler (5 calls after the timing): per kernel its
calls and device us per call (<prefix>_<contender>_kernels), each call's kernel sum (_call_sums_us) and the
launches of a call in order with per-launch medians over the calls (_sequence).
Needs liger-kernel (carried in .whl) and the encore module (PYTHONPATH=build-cuda/python, set by
`scripts/gpu.sh peers`). A contender that fails is recorded as <key>_error and the others still run.
Usage: python3 bench/peers/train_peers.py OUT.json"""
import json
import os
import statistics
import sys
import traceback
import zlib

import torch
import torch.nn.functional as F
from triton.testing import do_bench

dev, bf = "cuda", torch.bfloat16
SIZES = {"1B": (2048, 8192, 32, 8), "8B": (4096, 14336, 32, 8), "70B": (8192, 28672, 64, 8)}  # d, F, q heads, kv heads
SIZES = {k: SIZES[k] for k in os.environ.get("TRAIN_SIZES", "1B,8B").split(",")}
MS = [int(m) for m in os.environ.get("TRAIN_M", "8192").split(",")]
SECTIONS = os.environ.get("TRAIN_SECTIONS", "swiglu_mlp,lm_head_ce,bwd_kernels,block").split(",")
ROUNDS = int(os.environ.get("ROUNDS", "3"))
PROFILE = os.environ.get("TRAIN_PROFILE", "0").lower() in ("1", "true", "yes", "on")
torch.backends.cuda.matmul.allow_tf32 = False
try:
    import encore
    import encore.nn
    HAVE_ENCORE = encore.built_with_cuda() and encore.cuda_device_count() > 0
except ImportError:
    HAVE_ENCORE = False
RES = {"gpu": torch.cuda.get_device_name(0), "encore_timed": HAVE_ENCORE}
OUT = sys.argv[1] if len(sys.argv) > 1 else "train_peers.json"


def save():
    with open(OUT, "w") as f:
        json.dump(RES, f, indent=1)


def rec(key, val):
    RES[key] = val
    print(f"{key:64s} {val:.4f}" if isinstance(val, float) else f"{key:64s} {val}", flush=True)
    save()


def timed(prefix, fns, rep=100, memory=False):
    """Median over ROUNDS rotated rounds of do_bench per contender; with memory, the extra peak above the
    allocation before a call. A contender that raises is recorded as an error and dropped."""
    fns = dict(fns)
    for k in list(fns):
        try:
            for _ in range(2):
                fns[k]()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 (recorded; the other contenders still run)
            rec(f"{prefix}_{k}_error", repr(e)[:300])
            traceback.print_exc()
            del fns[k]
    rounds = {k: [] for k in fns}
    for r in range(ROUNDS):
        names = list(fns)
        for k in names[r % len(names):] + names[:r % len(names)] if names else []:
            rounds[k].append(do_bench(fns[k], warmup=10, rep=rep, return_mode="median"))
    out = {}
    for k, v in rounds.items():
        out[k] = statistics.median(v)
        rec(f"{prefix}_{k}_ms", out[k])
        RES[f"{prefix}_{k}_rounds_ms"] = v
        if memory:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fns[k]()
            torch.cuda.synchronize()
            rec(f"{prefix}_{k}_peak_extra_GB", (torch.cuda.max_memory_allocated() - base) / 1e9)
    if PROFILE:
        try:
            kernel_breakdown(prefix, fns)
        except Exception as e:  # noqa: BLE001 (the timings above stand)
            rec(f"{prefix}_profile_error", repr(e)[:300])
            traceback.print_exc()
    return out


SEQUENCE_OF = ("encore", "encore_norm", "gemms_only", "gemm_only", "compile")  # contenders whose launches are listed in order
ENCORE_NODES = ("SwigluBwdPairs", "SwigluAuxStore", "CrossEntropyGrad", "ColumnPartials", "RowPartials", "OnlineLse",
                "RopeRotateT", "Sm90AuxLoad", "Sm90AuxStore", "Sm90SrcFetch", "Sm90ColBroadcast", "Sm90RowBroadcast")


def short_kernel_name(name):
    """A kernel's name cut to what tells the launches apart: CUTLASS kernels (encore's; their mangled names need
    not spell "encore") by schedule, the epilogue nodes their names hold and a hash of the whole name; others
    (cuBLAS's nvjet kernels by their tile name) by their first 60 characters."""
    if "cutlass" in name:
        sched = "pp" if "Pingpong" in name else "coop" if "Cooperative" in name else "?"
        nodes = "+".join(n for n in ENCORE_NODES if n in name) or "plain"
        return f"cutlass:{sched}:{nodes}:{zlib.crc32(name.encode()) % 10000:04d}"
    return name[:60]


def kernel_breakdown(prefix, fns, calls=5):
    """Device time per kernel (short_kernel_name) over `calls` calls of each contender (torch.profiler, CUDA
    activity), each call's kernel sum, and for SEQUENCE_OF the launches of a call in order with the median over
    the calls of each launch's time (the calls differ by several percent on a power-limited GPU)."""
    from torch.profiler import ProfilerActivity, profile
    for k, f in fns.items():
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                f()
            torch.cuda.synchronize()
        ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
        rows = {}
        for e in ev:
            r = rows.setdefault(short_kernel_name(e.name), [0, 0.0])
            r[0] += 1
            r[1] += e.time_range.elapsed_us()
        table = sorted(([n, c / calls, us / calls] for n, (c, us) in rows.items()), key=lambda r: -r[2])
        RES[f"{prefix}_{k}_kernels"] = table
        per = len(ev) // calls
        if per and len(ev) == per * calls:
            split = [ev[i * per:(i + 1) * per] for i in range(calls)]
            RES[f"{prefix}_{k}_call_sums_us"] = [round(sum(e.time_range.elapsed_us() for e in c), 1) for c in split]
            if k in SEQUENCE_OF:
                seq = [[short_kernel_name(split[-1][i].name),
                        round(statistics.median(c[i].time_range.elapsed_us() for c in split), 1)] for i in range(per)]
                RES[f"{prefix}_{k}_sequence"] = seq
                print(f"{prefix}_{k} launches of a call (medians of {calls}): " +
                      "; ".join(f"{n} {us:.0f}" for n, us in seq), flush=True)
        else:
            RES[f"{prefix}_{k}_sequence_error"] = f"{len(ev)} launches in {calls} calls: not one sequence per call"
        print(f"{prefix}_{k}: {sum(r[2] for r in table):.1f} us of kernels per call", flush=True)
        for n, c, us in table[:14]:
            print(f"   {us:9.1f} us  x{c:g}  {n}", flush=True)
    save()


def ratios(prefix, t, base):
    for k, v in t.items():
        if k != base and base in t:
            rec(f"{prefix}_{k}_over_{base}", v / t[base])


def param(*shape, scale=1.0):
    return (torch.randn(*shape, device=dev) * scale).to(bf).requires_grad_()


def zero_grads(ts):
    for t in ts:
        t.grad = None


# ---- SwiGLU MLP ---------------------------------------------------------------------------------
def swiglu_mlp(name, M):
    d, Fi, _, _ = SIZES[name]
    prefix = f"swiglu_mlp_{name}_M{M}"
    torch.manual_seed(0)
    x = param(M, d)
    w13 = param(2 * Fi, d, scale=d ** -0.5)  # rows gate 2j, up 2j+1 (encore's layout; the torch math slices)
    w2 = param(d, Fi, scale=Fi ** -0.5)
    g = param(d)
    dy = torch.randn(M, d, device=dev).to(bf)
    leaves = [x, w13, w2, g]

    def mlp(x, w13, w2):
        z = x @ w13.t()
        return (F.silu(z[:, 0::2]) * z[:, 1::2]) @ w2.t()

    def mlp_norm(x, g, w13, w2):
        xf = x.float()
        h = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * g
        return mlp(h, w13, w2)

    mc, mnc = torch.compile(mlp), torch.compile(mlp_norm)

    def step(f):
        def s():
            zero_grads(leaves)
            f().backward(dy)
        return s

    fns = {"eager": step(lambda: mlp(x, w13, w2)), "compile": step(lambda: mc(x, w13, w2)),
           "compile_norm": step(lambda: mnc(x, g, w13, w2))}
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
        w13s = param(2 * Fi, d, scale=d ** -0.5)  # Liger's layout: gate rows then up rows
        leaves.append(w13s)  # every contender's parameters lose their .grad each step (no accumulation adds)

        def liger():
            gg, u = (x @ w13s.t()).chunk(2, dim=-1)
            return LigerSiLUMulFunction.apply(gg, u) @ w2.t()
        fns["liger"] = step(liger)
    except ImportError as e:
        rec(f"{prefix}_liger_error", repr(e))
    if HAVE_ENCORE:
        plain = encore.nn.SwiGLUMLP(d, Fi, norm=False, device=dev, dtype=bf)
        normed = encore.nn.SwiGLUMLP(d, Fi, norm=True, device=dev, dtype=bf)
        leaves.extend(list(plain.parameters()) + list(normed.parameters()))
        fns["encore"] = step(lambda: plain(x))
        fns["encore_norm"] = step(lambda: normed(x))
    A = {"x": x.detach(), "y": torch.randn(M, Fi, device=dev).to(bf), "dz": torch.randn(M, 2 * Fi, device=dev).to(bf)}
    W13, W2 = w13.detach(), w2.detach()

    def gemms():  # forward 2, dgrad 2, wgrad 2: the nine GEMMs' FLOPs (gate and up as one)
        A["x"] @ W13.t(); A["y"] @ W2.t()
        dy @ W2; A["dz"] @ W13
        dy.t() @ A["y"]; A["dz"].t() @ A["x"]
    fns["gemms_only"] = gemms
    t = timed(prefix, fns)
    ratios(prefix, t, "gemms_only")
    ratios(prefix, {k: v for k, v in t.items() if k != "gemms_only"}, "compile")


# ---- LM head + cross-entropy --------------------------------------------------------------------
def lm_head_ce(M):
    d, V = 4096, 128256
    prefix = f"lm_head_ce_8B_vocab128k_M{M}"
    torch.manual_seed(0)
    x = param(M, d)
    W = param(V, d, scale=d ** -0.5)
    y = torch.randint(0, V, (M,), device=dev)
    leaves = [x, W]

    def step(f):
        def s():
            zero_grads(leaves)
            f().backward()
        return s

    ce_c = torch.compile(lambda x, W, y: F.cross_entropy((x @ W.t()).float(), y))
    fns = {"eager": step(lambda: F.cross_entropy((x @ W.t()).float(), y)), "compile": step(lambda: ce_c(x, W, y))}
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        lg = LigerFusedLinearCrossEntropyLoss()
        fns["liger"] = step(lambda: lg(W, x, y))
    except ImportError as e:
        rec(f"{prefix}_liger_error", repr(e))
    if HAVE_ENCORE:
        ours = encore.nn.FusedLinearCrossEntropyLoss()
        fns["encore"] = step(lambda: ours(W, x, y))
        try:
            stored = encore.nn.FusedLinearCrossEntropyLoss(recompute=False)
            fns["encore_stored"] = step(lambda: stored(W, x, y))
            in_fwd = encore.nn.FusedLinearCrossEntropyLoss(grad_in_forward=True)
            fns["encore_in_forward"] = step(lambda: in_fwd(W, x, y))
        except TypeError as e:
            rec(f"{prefix}_encore_stored_error", repr(e))
    a, Wd = x.detach(), W.detach()
    dl = torch.randn(M, V, device=dev).to(bf)
    fns["gemms_only"] = lambda: (a @ Wd.t(), dl @ Wd, dl.t() @ a)
    t = timed(prefix, fns, rep=50, memory=True)
    ratios(prefix, t, "gemms_only")
    ratios(prefix, {k: v for k, v in t.items() if k != "gemms_only"}, "compile")


# ---- the backward epilogue kernels alone ----------------------------------------------------------
def bwd_kernels(name, M):
    d, Fi, hq, hkv = SIZES[name]
    N = (hq + 2 * hkv) * 128
    torch.manual_seed(0)
    r = lambda *s, sc=1.0: (torch.randn(*s, device=dev) * sc).to(bf)  # noqa: E731
    # rmsnorm_bwd: the QKV dgrad through the attention norm (dz [M, N] · w3 [N, d])
    dz, w3, x, g = r(M, N), r(N, d, sc=d ** -0.5), r(M, d), r(d)
    rr = torch.rand(M, device=dev) + 0.5
    zdz = torch.randn(M, device=dev)

    def glue_norm(da, x, g, rr, zdz):
        xh = x.float() * rr[:, None]
        dx = rr[:, None] * (g.float() * da.float() - xh * zdz[:, None])
        return dx.to(x.dtype), (xh * g.float()).to(x.dtype), (da.float() * xh).sum(0)
    gn = torch.compile(glue_norm)
    prefix = f"rmsnorm_bwd_{name}_M{M}"
    fns = {"gemm_only": lambda: dz @ w3, "cublas_compiled_glue": lambda: gn(dz @ w3, x, g, rr, zdz)}
    if HAVE_ENCORE:
        fns["encore"] = lambda: (lambda o: encore.partials_sum(o["partials"], per_column=True, n=d))(
            encore.gemm_epilogue("rmsnorm_bwd", dz, w3, c=x, gamma=g, row_scale=rr, zdz=zdz))
    t = timed(prefix, fns)
    ratios(prefix, t, "gemm_only")
    ratios(prefix, {k: v for k, v in t.items() if k != "gemm_only"}, "cublas_compiled_glue")
    # swiglu_bwd: the down projection's dgrad (dx [M, d] · w2 [d, F]) with SwiGLU's backward on the saved z
    dx, w2, z = r(M, d), r(d, Fi, sc=Fi ** -0.5), r(M, 2 * Fi)

    def glue_swiglu(dy, z):
        gg, u = z[:, 0::2].float(), z[:, 1::2].float()
        s = torch.sigmoid(gg)
        dyf = dy.float()
        dgate, dup = dyf * u * s * (1 + gg * (1 - s)), dyf * gg * s
        dzz = torch.stack((dgate, dup), -1).reshape(z.shape).to(z.dtype)
        return (gg * s * u).to(z.dtype), dzz, (gg * dgate + u * dup).sum(-1)
    gs = torch.compile(glue_swiglu)
    prefix = f"swiglu_bwd_{name}_M{M}"
    fns = {"gemm_only": lambda: dx @ w2, "cublas_compiled_glue": lambda: gs(dx @ w2, z)}
    if HAVE_ENCORE:
        fns["encore"] = lambda: (lambda o: encore.partials_sum(o["partials"], scale=1.0 / d))(
            encore.gemm_epilogue("swiglu_bwd", dx, w2, c=z))
    t = timed(prefix, fns)
    ratios(prefix, t, "gemm_only")
    ratios(prefix, {k: v for k, v in t.items() if k != "gemm_only"}, "cublas_compiled_glue")


# ---- the shifted block forward + backward ----------------------------------------------------------
def block(name, M):
    d, Fi, hq, hkv = SIZES[name]
    Nq, nrot = (hq + 2 * hkv) * 128, (hq + hkv) * 128
    prefix = f"block_train_{name}_M{M}"
    torch.manual_seed(0)
    y0, x0 = param(M, d), param(M, d)
    w0, w13, w2, w3 = param(d, d, scale=d ** -0.5), param(2 * Fi, d, scale=d ** -0.5), param(d, Fi, scale=Fi ** -0.5), \
        param(Nq, d, scale=d ** -0.5)
    g0, g1 = param(d), param(d)
    posf = torch.arange(M, device=dev).float()[:, None] * (10000 ** (-torch.arange(64, device=dev).float() / 64))[None]
    cos, sin = posf.cos().to(bf)[:, None], posf.sin().to(bf)[:, None]
    dqkv, dx2 = torch.randn(M, Nq, device=dev).to(bf), torch.randn(M, d, device=dev).to(bf)
    leaves = [y0, x0, w0, w13, w2, w3, g0, g1]
    with_grad = list(leaves)  # + the encore module's parameters: every .grad reset each step

    def rms(x, g, eps=1e-5):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * g

    def rope(t):
        rt, rest = t[:, :nrot], t[:, nrot:]
        rt = rt.view(rt.shape[0], -1, 128)
        a, b = rt[..., :64], rt[..., 64:]
        rt = torch.cat([a * cos - b * sin, b * cos + a * sin], -1).view(t.shape[0], nrot)
        return torch.cat([rt, rest], -1)

    def blk(y0, x0, w0, w13, w2, w3, g0, g1):
        x1 = y0 @ w0.t() + x0
        z1 = rms(x1, g0) @ w13.t()
        y1 = F.silu(z1[:, 0::2]) * z1[:, 1::2]
        x2 = y1 @ w2.t() + x1
        return rope(rms(x2, g1) @ w3.t()), x2
    comp = torch.compile(blk)

    def step(f):
        def s():
            zero_grads(with_grad)
            qkv, x2 = f()
            torch.autograd.backward([qkv, x2], [dqkv, dx2])
        return s
    fns = {"eager": step(lambda: blk(*leaves)), "compile": step(lambda: comp(*leaves))}
    if HAVE_ENCORE:
        try:
            mod = encore.nn.LlamaBlock(d, Fi, hq, hkv, 128, device=dev, dtype=bf)
            with_grad.extend(mod.parameters())
            pos = torch.arange(M, device=dev, dtype=torch.int32)

            def ours():
                x2, qkv = mod(y0, x0, pos)
                return qkv, x2
            fns["encore"] = step(ours)
        except Exception as e:  # noqa: BLE001 (the module's constructor signature is recorded if it differs)
            rec(f"{prefix}_encore_error", repr(e)[:300])
    A = {k: torch.randn(*s, device=dev).to(bf) for k, s in
         {"y0": (M, d), "h1": (M, d), "y1": (M, Fi), "h2": (M, d), "dz1": (M, 2 * Fi), "dx": (M, d), "dq": (M, Nq)}.items()}
    Wd = {"w0": w0.detach(), "w13": w13.detach(), "w2": w2.detach(), "w3": w3.detach()}

    def gemms():
        a = A
        a["y0"] @ Wd["w0"].t(); a["h1"] @ Wd["w13"].t(); a["y1"] @ Wd["w2"].t(); a["h2"] @ Wd["w3"].t()
        a["dq"] @ Wd["w3"]; a["dx"] @ Wd["w2"]; a["dz1"] @ Wd["w13"]; a["dx"] @ Wd["w0"]
        a["dq"].t() @ a["h2"]; a["dx"].t() @ a["y1"]; a["dz1"].t() @ a["h1"]; a["dx"].t() @ a["y0"]
    fns["gemms_only"] = gemms
    t = timed(prefix, fns)
    ratios(prefix, t, "gemms_only")
    ratios(prefix, {k: v for k, v in t.items() if k != "gemms_only"}, "compile")


def guarded(label, fn, *args):
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 (one section's failure keeps the others' numbers)
        rec(f"{label}_error", repr(e)[:300])
        traceback.print_exc()
    torch.cuda.empty_cache()
    torch._dynamo.reset()


for M in MS:
    if "swiglu_mlp" in SECTIONS:
        for name in SIZES:
            guarded(f"swiglu_mlp_{name}_M{M}", swiglu_mlp, name, M)
    if "lm_head_ce" in SECTIONS:
        guarded(f"lm_head_ce_M{M}", lm_head_ce, M)
    if "bwd_kernels" in SECTIONS:
        for name in SIZES:
            guarded(f"bwd_kernels_{name}_M{M}", bwd_kernels, name, M)
    if "block" in SECTIONS:
        for name in SIZES:
            guarded(f"block_train_{name}_M{M}", block, name, M)
RES["complete"] = True
save()
