"""KDA training against its peers (issue 47): fla-core 0.6.0's chunk_kda, NVIDIA cudnn-frontend 1.32's Hopper engine
kda_hopper_cuda (the torch op cudnn.linear_attention.ops.kda.kimi_delta_attention, plan pinned by name) and
encore.kda.chunk_kda, in one process on the same tensors: bf16, K = V = 128, H 16 and 32, varlen seq_lens 1800, 1500,
2000, 1200, 800 and B 1 / B 4, T 8192, with an initial state and the final state.

Two gate configurations (KDA_PEER_GATES=fla,cudnn), drawn from one set of random tensors:
  fla    fla's model contract: the raw gate g with the in-kernel softplus gate -exp(A_log) softplus(g + dt_bias),
         q/k L2 norm inside the op, post-sigmoid beta; gradients of q, k, v, g, beta, A_log, dt_bias, h0. cuDNN takes
         only its lower-bound ("safe") gate, and its backward neither that gate nor the norm: fla and encore only.
  cudnn  what cuDNN's Hopper backward takes: the precomputed fp32 log gate g = -5 sigmoid(exp(A_log) (g + dt_bias)) in
         (-5, 0), unit-norm q/k normalized outside the op, post-sigmoid beta (bf16; cuDNN an exact fp32 copy), scale
         1/sqrt(128); fla with safe_gate=True (its path for gates bounded below by -5; KDA_FLA_SAFE_GATE=0: off);
         cuDNN in its own layouts (THD tokens, int32 cu_seqlens, the state [N, H, V, K] an exact transposed copy made
         outside the timed region). Gradients of q, k, v, g, beta, h0.

Per configuration (shape x H x gate) and implementation, medians over ROUNDS rounds (default 3), the order of the
implementations rotated each round: device time (the summed CUDA kernel time per call from torch.profiler) of the
forward alone (grad enabled: the residuals saved), the inference forward (under torch.no_grad: "infer"), the backward alone (one recorded graph replayed with retain_graph)
and forward + backward; wall time per forward + backward (CUDA events, host dispatch included); the bytes the forward
keeps for the backward (allocated after the forward minus before: residuals, o and the final state), also per token
and head; the peak of a forward + backward above the inputs; the last round's per-kernel split; o, the final state
and every gradient against fla's (relative RMS difference, the same inputs).

Needs the encore module built for this Python (PYTHONPATH=build-cuda/python) and, for the peers, fla-core 0.6.0 with
einops and nvidia-cudnn-frontend 1.32.0 (the wheels in .whl, installed by scripts/gpu_wheels.sh; cuDNN's path also
uses torch's cuda-bindings and libcudnn and the CUDA headers for its NVRTC compile; not nvidia-cutlass-dsl). A peer
that is missing or declines a configuration is reported (JSON "errors") and skipped; encore runs alone without them.
The first calls of a shape are slow and untimed: fla autotunes its Triton kernels (~170 s per new H, varlen or fixed,
and gate on a fresh machine; cached on disk after), cuDNN compiles with NVRTC (cache CUDNN_FRONTEND_CAKE_CACHE_DIR).

Usage: kda_train_peers.py [OUT.json] (default $OUT/kda_train_peers.json). Env: ROUNDS, KDA_PEER_CONFIGS,
KDA_PEER_HEADS (kda_configs.py); KDA_PEER_GATES; KDA_TRAIN_WHO (default fla,encore,cudnn; also encore_savedh:
rematerialize=False, the chunk-start states saved); KDA_CUDNN_PLAN (default kda_hopper_cuda; none: cuDNN's own
choice); ENCORE_COMMIT (into the environment block). KDA_PEER_DEVICE=cpu is a debug path: encore's CPU backend
alone, wall time in place of device time, no memory figures (KDA_PEER_CONFIGS=varlen_tiny KDA_PEER_HEADS=2 ROUNDS=1)."""
import importlib.metadata
import os
import platform
import statistics
import sys
import time
import traceback

os.environ.setdefault("CUDNN_FRONTEND_CAKE_CACHE_DIR", "/tmp/cfe_cake")

import torch  # noqa: E402 (before cudnn: torch loads the libcudnn.so.9 that cudnn-frontend then finds)
import torch.nn.functional as F  # noqa: E402

# the script's folder is on sys.path
from kda_configs import CONFIGS, ENCORE_WHY, HAVE_ENCORE, HEADS, ROUNDS, K, V, bf, dev, write  # noqa: E402

GATES = os.environ.get("KDA_PEER_GATES", "fla,cudnn").split(",")
WHO = os.environ.get("KDA_TRAIN_WHO", "fla,encore,cudnn").split(",")
ENCORES = ("encore", "encore_savedh")
PLAN = os.environ.get("KDA_CUDNN_PLAN", "kda_hopper_cuda")
PLAN = None if PLAN.lower() in ("", "none") else PLAN
FLA_SAFE_GATE = os.environ.get("KDA_FLA_SAFE_GATE", "1") == "1"
LB = -5.0  # the lower bound of cuDNN's (and fla's safe) gate in log space
GRADS = {"fla": ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "h0"), "cudnn": ("q", "k", "v", "g", "beta", "h0")}
cuda = dev == "cuda"


# ----------------------------------------------------------------------------------------------------------- peers
def load_peers():
    """{who: chunk_kda-like callable}, {who: why it is not timed}, {what: version or path} for the environment."""
    fns, why, info = {}, {}, {}
    for who in WHO:
        if who == "fla":
            if not cuda:
                why[who] = "fla's Triton kernels need CUDA"
                continue
            try:
                from fla.ops.kda import chunk_kda
                fns[who] = chunk_kda
            except Exception as e:  # noqa: BLE001
                why[who] = f"import fla.ops.kda failed ({e!r}): install the fla-core 0.6.0 and einops wheels"
        elif who == "cudnn":
            if not cuda:
                why[who] = "cuDNN needs CUDA"
                continue
            try:
                import cudnn
                from cudnn.linear_attention.cake import compiler
                from cudnn.linear_attention.ops.kda import kimi_delta_attention
                info["cudnn_backend"] = cudnn.backend_version()
                info["nvrtc"] = ".".join(map(str, compiler.nvrtc_version()))
                info["nvrtc_headers"] = [str(p) for p in compiler.cuda_include_dirs()]  # the engine declines without
                fns[who] = kimi_delta_attention
            except Exception as e:  # noqa: BLE001
                why[who] = (f"cudnn-frontend's KDA op unusable ({e!r}): install the nvidia-cudnn-frontend 1.32.0 "
                            "wheel; its Hopper engine needs cuda-bindings (torch's) and the CUDA headers (CUDA_HOME)")
        elif who in ENCORES:
            if HAVE_ENCORE:
                from encore.kda import chunk_kda
                fns[who] = chunk_kda
            else:
                why[who] = ENCORE_WHY
    return fns, why, info


# ---------------------------------------------------------------------------------------------------------- inputs
def inputs(B, lens, H, gate):
    """The leaves of both gate configurations come from one draw per (shape, H): fla's gate takes it raw, cuDNN's
    gate its precomputed log gate and normalized q/k. Also the cotangents and the sequence table."""
    T = sum(lens) if lens else 8192
    N = len(lens) if lens else B
    torch.manual_seed(0)
    x = {"q": torch.randn(B, T, H, K, device=dev, dtype=bf), "k": torch.randn(B, T, H, K, device=dev, dtype=bf),
         "v": torch.randn(B, T, H, V, device=dev, dtype=bf), "g": torch.randn(B, T, H, K, device=dev, dtype=bf),
         "beta": torch.randn(B, T, H, device=dev, dtype=bf).sigmoid(), "A_log": torch.randn(H, device=dev),
         "dt_bias": torch.randn(H * K, device=dev), "h0": 0.1 * torch.randn(N, H, K, V, device=dev)}
    cot = (torch.randn(B, T, H, V, device=dev, dtype=bf), torch.randn(N, H, K, V, device=dev))
    if gate == "cudnn":
        x["q"] = F.normalize(x["q"].float(), dim=-1).to(bf)
        x["k"] = F.normalize(x["k"].float(), dim=-1).to(bf)
        x["g"] = LB * torch.sigmoid(x.pop("A_log").exp().view(H, 1) * (x["g"].float() + x.pop("dt_bias").view(H, K)))
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist()) if lens else torch.arange(0, (B + 1) * T, T)
    return x, cot, cu, (B, T, H, N, bool(lens))


def runner(who, fn, x, cot, cu, shape, gate):
    """(forward returning (o, final_state), leaves, cotangents, map of the implementation's gradients and
    final state to fla's layout), every leaf a fresh copy of the inputs."""
    B, T, H, N, varlen = shape
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
    if who == "cudnn":  # fp32 beta, the state [N, H, V, K], int32 cu_seqlens, THD tensors
        leaves["beta"] = x["beta"].float().requires_grad_(True)
        leaves["h0"] = x["h0"].transpose(-1, -2).contiguous().requires_grad_(True)
        q, k, v, g, beta, h0 = leaves.values()
        cu32 = cu.to(dev, torch.int32)

        def fwd():
            o, fs = fn(q.view(-1, H, K), k.view(-1, H, K), v.view(-1, H, V), g.view(-1, H, K), beta.view(-1, H), cu32,
                       scale=K ** -0.5, initial_state=h0, output_final_state=True, plan_name=PLAN)
            return o.view(B, T, H, V), fs

        return (fwd, list(leaves.values()), (cot[0], cot[1].transpose(-1, -2).contiguous()),
                lambda fs, grads: (fs.transpose(-1, -2), grads[:-1] + (grads[-1].transpose(-1, -2),)))
    kw = dict(scale=K ** -0.5, initial_state=leaves["h0"], output_final_state=True)
    if gate == "fla":
        kw.update(A_log=leaves["A_log"], dt_bias=leaves["dt_bias"], use_gate_in_kernel=True,
                  use_qk_l2norm_in_kernel=True)
    elif who == "fla":
        kw.update(safe_gate=FLA_SAFE_GATE)
    if varlen:
        kw.update(cu_seqlens=cu.to(dev), cu_seqlens_cpu=cu)
    if who.startswith("encore"):
        kw.update(rematerialize="_savedh" not in who)
    q, k, v, g, beta = (leaves[n] for n in ("q", "k", "v", "g", "beta"))
    return (lambda: fn(q, k, v, g, beta, **kw)), list(leaves.values()), cot, (lambda fs, grads: (fs, grads))


# ---------------------------------------------------------------------------------------------------------- timing
def sync():
    if cuda:
        torch.cuda.synchronize()


def device_ms(f, calls=3):
    """The summed CUDA kernel time per call and the per-kernel split (on the CPU debug path: wall time, no split)."""
    if not cuda:
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        return (time.perf_counter() - t0) / calls * 1e3, {}
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(calls):
            f()
        torch.cuda.synchronize()
    avg = [e for e in p.key_averages() if e.device_time_total > 0]
    avg.sort(key=lambda e: -e.device_time_total)
    split = {e.key[:120]: round(e.device_time_total / calls / 1e3, 4) for e in avg}
    return sum(e.device_time_total for e in avg) / calls / 1e3, split


def wall_ms(f, calls=5):
    if not cuda:
        return None
    f()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    s.record()
    for _ in range(calls):
        f()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / calls


def allocated():
    return torch.cuda.memory_allocated() if cuda else 0


def measure(who, fn, x, cot, cu, shape, gate):
    fwd, leaves, cot, to_fla = runner(who, fn, x, cot, cu, shape, gate)

    def step():
        return torch.autograd.grad(fwd(), leaves, cot)

    for _ in range(2):  # the first calls autotune (fla) and compile (cuDNN)
        step()
    sync()
    r, split = {}, {}
    r["fwd_ms"], split["fwd"] = device_ms(fwd)

    def infer():  # the inference forward: no grad, so no residuals where the implementation skips them
        with torch.no_grad():
            return fwd()

    infer()
    r["infer_ms"], split["infer"] = device_ms(infer)
    sync()
    before = allocated()
    outs = fwd()
    sync()
    r["saved_bytes"] = allocated() - before if cuda else None
    bwd = lambda o=outs: torch.autograd.grad(o, leaves, cot, retain_graph=True)  # noqa: E731
    r["bwd_ms"], split["bwd"] = device_ms(bwd)
    ref = (outs[0].detach(), outs[1].detach())
    del outs, bwd
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base = allocated()
    grads = step()
    sync()
    r["peak_bytes"] = torch.cuda.max_memory_allocated() - base if cuda else None
    r["fwd_bwd_ms"], _ = device_ms(step)
    r["fwd_bwd_wall_ms"] = wall_ms(step)
    fs, grads = to_fla(ref[1], tuple(t.detach() for t in grads))
    return r, split, (ref[0], fs) + grads


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).pow(2).mean() / b.pow(2).mean().clamp_min(1e-30)).sqrt().item()


# ------------------------------------------------------------------------------------------------------------ main
def environment(info):
    env = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
           "cuda": torch.version.cuda, "python": platform.python_version(), "commit": os.environ.get("ENCORE_COMMIT"),
           "rounds": ROUNDS, "who": WHO, "gates": GATES, "heads": HEADS, "configs": list(CONFIGS), "cudnn_plan": PLAN,
           "fla_safe_gate_with_cudnn_gate": FLA_SAFE_GATE, **info}
    for dist in ("fla-core", "nvidia-cudnn-frontend", "triton", "einops", "cuda-bindings"):
        try:
            env[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            env[dist] = None
    if HAVE_ENCORE:
        import encore
        env["encore"] = encore.__version__
    return env


def run_config(key, who_fns, x, cot, cu, shape, gate, res):
    live = list(who_fns)
    runs, splits, outs = {w: [] for w in live}, {}, {}
    for rnd in range(ROUNDS):
        for who in live[rnd % len(live):] + live[:rnd % len(live)]:
            if who not in runs:
                continue
            t0 = time.perf_counter()
            try:
                r, splits[who], o = measure(who, who_fns[who], x, cot, cu, shape, gate)
            except Exception as e:  # noqa: BLE001 (a peer declining a configuration must not cost the others)
                res["errors"][f"{key}/{who}"] = repr(e)[:2000]
                print(f"  !! {key} {who} failed: {e!r}"[:600], flush=True)
                traceback.print_exc(limit=3)
                del runs[who]
                sync()  # a sticky CUDA error ends the run here, with what was written
                continue
            runs[who].append(r)
            outs.setdefault(who, o)
            print(f"  [{key} round {rnd + 1}/{ROUNDS}] {who}: fwd {r['fwd_ms']:.3f} infer {r['infer_ms']:.3f} bwd {r['bwd_ms']:.3f} "
                  f"fwd+bwd {r['fwd_bwd_ms']:.3f} ms ({time.perf_counter() - t0:.1f} s)", flush=True)
    B, T, H = shape[:3]
    names = ("o", "final_state") + tuple(f"d{n}" for n in GRADS[gate])
    out = {}
    for who, rs in runs.items():
        if not rs:
            continue
        d = {k_: (statistics.median(r[k_] for r in rs) if rs[0][k_] is not None else None) for k_ in rs[0]}
        d["saved_bytes_per_token_head"] = d["saved_bytes"] / (B * T * H) if d["saved_bytes"] is not None else None
        if "fla" in out:  # fla comes first
            for k_ in ("fwd_ms", "infer_ms", "bwd_ms", "fwd_bwd_ms"):
                d[f"{k_[:-3]}_speedup_vs_fla"] = out["fla"][k_] / d[k_]
            d["vs_fla_rel_rms"] = {n: rel(a, b) for n, a, b in zip(names, outs[who], outs["fla"])}
        d["kernels_last_round"] = splits[who]
        d["rounds"] = rs
        out[who] = d
    ref = out.get("cudnn")  # cuDNN's times over each other implementation's (cuDNN gate only)
    for who, d in out.items() if ref else ():
        if who != "cudnn":
            for k_ in ("fwd_ms", "infer_ms", "bwd_ms", "fwd_bwd_ms"):
                d[f"{k_[:-3]}_speedup_vs_cudnn"] = ref[k_] / d[k_]
    return out


def main(out):
    bad = sorted(set(WHO) - set(ENCORES) - {"fla", "cudnn"}) + sorted(set(GATES) - set(GRADS))
    if bad:
        sys.exit(f"kda_train_peers.py: unknown KDA_TRAIN_WHO / KDA_PEER_GATES entries {bad}")
    if cuda and not torch.cuda.is_available():
        sys.exit("kda_train_peers.py needs a CUDA device (KDA_PEER_DEVICE=cpu: the CPU debug path, encore alone)")
    fns, why, info = load_peers()
    res = {"environment": environment(info), "errors": dict(why), "results": {}, "complete": False}
    for who, msg in why.items():
        print(f"!! {who} not timed: {msg}", flush=True)
    if not fns:
        write(out, res)
        sys.exit("kda_train_peers.py: no implementation to time")
    order = [w for w in WHO if w in fns and w != "fla"]
    order = (["fla"] if "fla" in fns else []) + order  # fla first in the table: the ratios divide by its times
    print(f"timing {order}; configs {list(CONFIGS)}, H {HEADS}, gates {GATES}, {ROUNDS} rounds -> {out}", flush=True)
    for name, (B, lens) in CONFIGS.items():
        for H in HEADS:
            for gate in GATES:
                key = f"{name}/H{H}/{gate}_gate"
                who_fns = {w: fns[w] for w in order if w != "cudnn" or gate == "cudnn"}
                t0 = time.perf_counter()
                x, cot, cu, shape = inputs(B, lens, H, gate)
                try:
                    res["results"][key] = run_config(key, who_fns, x, cot, cu, shape, gate, res)
                except Exception as e:  # a sticky CUDA error: keep what was measured, say where it ended
                    res["errors"]["fatal"] = f"{key}: {e!r}"[:2000]
                    write(out, res)
                    raise
                res["results"][key]["_config"] = {"B": B, "T": shape[1], "H": H, "seq_lens": lens, "gate": gate,
                                                  "seconds": round(time.perf_counter() - t0, 1)}
                del x, cot
                if cuda:
                    torch.cuda.empty_cache()
                write(out, res)
                print_config(key, res["results"][key])
    res["complete"] = True
    write(out, res)
    print_table(res)


def _f(v, fmt):
    return format(v, fmt) if v is not None else "-".rjust(len(format(0.0, fmt)))


def print_config(key, whos):
    for who, d in whos.items():
        if who != "_config" and "vs_fla_rel_rms" in d:
            errs = ", ".join(f"{n} {e:.2e}" for n, e in d["vs_fla_rel_rms"].items())
            print(f"  {key} {who} vs fla (rel RMS): {errs}", flush=True)


def print_table(res):
    unit = "ms device time" if cuda else "ms wall time (CPU debug path)"
    print(f"\n==== medians, {unit} per call; f+b wall: CUDA events; saved: bytes / (token, head) kept by the "
          "forward (o and final state included); peak: MiB above the inputs; xfla: fla's fwd+bwd / this; "
          "err: max rel RMS vs fla")
    print(f"{'config':32s} {'who':18s} {'fwd':>8s} {'infer':>8s} {'bwd':>8s} {'fwd+bwd':>8s} {'f+b wall':>8s} {'saved':>7s} "
          f"{'peakMiB':>8s} {'xfla':>6s} {'err':>8s}")
    for key, whos in res["results"].items():
        for who, d in whos.items():
            if who == "_config":
                continue
            errs = list(d.get("vs_fla_rel_rms", {}).values())
            peak = d["peak_bytes"] / 2**20 if d["peak_bytes"] is not None else None
            print(f"{key:32s} {who:18s} {_f(d['fwd_ms'], '8.3f')} {_f(d['infer_ms'], '8.3f')} {_f(d['bwd_ms'], '8.3f')} "
                  f"{_f(d['fwd_bwd_ms'], '8.3f')} {_f(d['fwd_bwd_wall_ms'], '8.3f')} "
                  f"{_f(d['saved_bytes_per_token_head'], '7.0f')} {_f(peak, '8.1f')} "
                  f"{_f(d.get('fwd_bwd_speedup_vs_fla'), '6.2f')} {_f(max(errs) if errs else None, '8.2e')}")
    for k_, v in res["errors"].items():
        print(f"  error {k_}: {v[:300]}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.environ.get("OUT", "."), "kda_train_peers.json"))
