"""Property-based fuzzing on CUDA of the blocks family (the GPU machine; skipped elsewhere):
llama_block_forward (plain, into canary-guarded out= buffers, with a workspace=), llama_block_backward
(into guarded buffers, d_x0 in place over d_x2 too) and qkv_norm_backward. Valid draws: bf16 / fp16 CUDA
tensors, M 1-130 (the 128-row tiles' edge), d 8-64, F 8-48, 1-3 heads of 8-32 columns with partial rotary
heads, eps 0 to 1e-5, the gradients from the CUDA forward's saved tensors; every output under the 2x rule
against the CPU backend (fuzz_cuda_util.within_2x: at most twice as far from the CPU backend on the same
values in float32 as the CPU backend in the inputs' dtype, which rounds every intermediate as CUDA does,
plus a few units of the output dtype's rounding). Invalid draws: an input, a saved tensor or an output on
the CPU, fp32 tensors (the GEMM steps take bf16 / fp16), d or F not a multiple of 8, gamma in another
dtype, a workspace too small or on the CPU: ValueError (invalid) or RuntimeError (unsupported on CUDA)
naming the argument or the block step that reads it, the guarded outputs untouched (intact around the
views where a later step's CUDA limit stops a block that already ran its first steps).

Seeds: hypothesis with derandomize=True (fuzz_util.VALID: 200 draws, INVALID: 100 draws per test)."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import encore
from fuzz_cuda_util import DT, CudaGuard, pair, within_2x
from fuzz_util import INVALID, SEEDS, VALID, refused, torch  # noqa: F401
from helpers import needs_torch_cuda

pytestmark = needs_torch_cuda

FWD = ("y0", "x0", "w0", "w1", "w2", "w3", "gamma0", "gamma1", "pos", "freq")
BWD = ("y0", "w0", "w1", "w2", "w3", "gamma0", "gamma1", "pos", "freq")  # then the saved x1, x2, z1, qkv, r1, r2, d_qkv, d_x2
SAVED = ("x1", "x2", "z1", "qkv", "r1", "r2")
GRADS = ("d_y0", "d_x0", "dw0", "dw1", "dw2", "dw3", "dgamma0", "dgamma1")


def _block(rng, dt, m, d, f, heads, hd, rot):
    """{name: (CUDA, CPU)} of the forward's inputs: matrices and gammas in dt, pos int32, freq float32."""
    x = {"y0": pair(rng, (m, d), dt), "x0": pair(rng, (m, d), dt), "w0": pair(rng, (d, d), dt, d ** -0.5),
         "w1": pair(rng, (2 * f, d), dt, d ** -0.5), "w2": pair(rng, (d, f), dt, f ** -0.5), "w3": pair(rng, (heads * hd, d), dt, d ** -0.5)}
    for name in ("gamma0", "gamma1"):
        g, c = pair(rng, (d,), dt, 0.2)
        x[name] = (g + 1, c + 1)
    pos = torch.from_numpy(rng.integers(-1000, 70000, m).astype(np.int32))
    freq = torch.from_numpy(encore.rope_freq_turns(heads, min(rot, heads), hd, float(rng.choice([10000.0, 500000.0]))))
    x["pos"], x["freq"] = (pos.cuda(), pos), (freq.cuda(), freq)
    return x


def _f32(tensors):
    """CPU copies in float32 (the reference's inputs: the same values); integer and absent ones as they are."""
    return [t if t is None or not t.is_floating_point() else t.detach().cpu().float() for t in tensors]


def _guards(rng, shapes, dt, stats):
    """Canary-guarded CUDA outputs: `shapes` in dt (rows 0 or 8 elements longer: 16-byte rows), then `stats` [n] float32."""
    return [CudaGuard(s, dt, row_pad=int(rng.choice([0, 8]))) for s in shapes] + [CudaGuard((n,), "float32") for n in stats]


@VALID
@given(seed=SEEDS, dt=st.sampled_from(["bf16", "f16"]), m=st.sampled_from([1, 2, 17, 130]), d=st.sampled_from([8, 16, 40, 64]),
       f=st.sampled_from([8, 24, 48]), heads=st.integers(1, 3), hd=st.sampled_from([8, 16, 32]), rot=st.integers(0, 3),
       mode=st.sampled_from(["plain", "out", "out_ws", "ws"]), eps=st.sampled_from([1e-5, 1e-6, 0.0]))
def test_llama_block_forward_cuda_equals_cpu(seed, dt, m, d, f, heads, hd, rot, mode, eps):
    dt = DT[dt]
    rng = np.random.default_rng(seed)
    x = _block(rng, dt, m, d, f, heads, hd, rot)
    args = [x[n][0] for n in FWD]
    kw, guards = {"eps": eps}, []
    shapes = ((m, d), (m, d), (m, 2 * f), (m, heads * hd))
    if mode.startswith("out"):
        guards = _guards(rng, shapes, dt, (m, m))
        kw["out"] = tuple(g.view for g in guards)
    if mode.endswith("ws"):
        sized = kw.get("out") or tuple(torch.empty(s, dtype=getattr(torch, dt if len(s) == 2 else "float32"), device="cuda")
                                       for s in shapes + ((m,), (m,)))
        kw["workspace"] = torch.zeros(encore.llama_block_workspace_bytes(*args, sized, eps=eps), dtype=torch.uint8, device="cuda")
    got = encore.llama_block_forward(*args, **kw)
    torch.cuda.synchronize()
    if "out" in kw:
        assert all(a is b for a, b in zip(got, kw["out"])) and all(g.intact() for g in guards)
    ref = encore.llama_block_forward(*[x[n][1] for n in FWD], eps=eps)
    ref32 = encore.llama_block_forward(*_f32([x[n][1] for n in FWD]), eps=eps)
    for name, g, r, r32 in zip(SAVED, got, ref, ref32):
        assert g.is_cuda and g.dtype == r.dtype, name
        within_2x(g, r, r32, "float32" if name in ("r1", "r2") else dt)


@VALID
@given(seed=SEEDS, dt=st.sampled_from(["bf16", "f16"]), m=st.sampled_from([1, 3, 17, 130]), d=st.sampled_from([8, 16, 40]),
       f=st.sampled_from([8, 24]), heads=st.integers(1, 3), hd=st.sampled_from([8, 16]), rot=st.integers(0, 3),
       mode=st.sampled_from(["plain", "out", "inplace"]))
def test_llama_block_backward_cuda_equals_cpu(seed, dt, m, d, f, heads, hd, rot, mode):
    dt = DT[dt]
    rng = np.random.default_rng(seed)
    x = _block(rng, dt, m, d, f, heads, hd, rot)
    saved = encore.llama_block_forward(*[x[n][0] for n in FWD])  # what the CUDA forward saves, read by all three backwards
    dq, dx2 = pair(rng, (m, heads * hd), dt), pair(rng, (m, d), dt)
    args = [x[n][0] for n in BWD] + list(saved) + [dq[0], dx2[0]]
    cpu = [x[n][1] for n in BWD] + [s.cpu() for s in saved] + [dq[1], dx2[1]]
    kw, guards = {}, []
    if mode != "plain":
        guards = _guards(rng, ((m, d), (m, d), (d, d), (2 * f, d), (d, f), (heads * hd, d)), dt, (d, d))
        out = [g.view for g in guards]
        if mode == "inplace":  # d_x0 written over d_x2 (the residual gradient in place)
            guards[1] = CudaGuard((m, d), dt, row_pad=8)
            out[1] = args[-1] = guards[1].set(dx2[0])
        kw["out"] = tuple(out)
    got = encore.llama_block_backward(*args, **kw)
    torch.cuda.synchronize()
    if "out" in kw:
        assert all(a is b for a, b in zip(got, kw["out"])) and all(g.intact() for g in guards)
    ref, ref32 = encore.llama_block_backward(*cpu), encore.llama_block_backward(*_f32(cpu))
    for name, g, r, r32 in zip(GRADS, got, ref, ref32):
        assert g.is_cuda and g.dtype == r.dtype and g.shape == r.shape, name
        within_2x(g, r, r32, "float32" if name.startswith("dgamma") else dt)


@VALID
@given(seed=SEEDS, dt=st.sampled_from(["bf16", "f16"]), m=st.sampled_from([1, 3, 17, 130]), d=st.sampled_from([8, 16, 40, 64]),
       heads=st.integers(1, 3), hd=st.sampled_from([8, 16, 32]), rot=st.integers(0, 3), prev=st.booleans(), out=st.booleans())
def test_qkv_norm_backward_cuda_equals_cpu(seed, dt, m, d, heads, hd, rot, prev, out):
    """The first layer's QKV-norm backward on the CUDA forward's x2, r2 and qkv (x, r and qkv of the QKV GEMM)."""
    dt = DT[dt]
    rng = np.random.default_rng(seed)
    x = _block(rng, dt, m, d, 8, heads, hd, rot)
    fwd = encore.llama_block_forward(*[x[n][0] for n in FWD])
    dq, dprev = pair(rng, (m, heads * hd), dt), pair(rng, (m, d), dt) if prev else (None, None)
    args = [fwd[1], x["gamma1"][0], x["w3"][0], x["pos"][0], x["freq"][0], fwd[5], fwd[3], dq[0], dprev[0]]
    cpu = [fwd[1].cpu(), x["gamma1"][1], x["w3"][1], x["pos"][1], x["freq"][1], fwd[5].cpu(), fwd[3].cpu(), dq[1], dprev[1]]
    guards = _guards(rng, ((m, d), (heads * hd, d)), dt, (d,)) if out else []
    got = encore.qkv_norm_backward(*args, out=tuple(g.view for g in guards) if out else None)
    torch.cuda.synchronize()
    assert all(g.intact() for g in guards)
    ref, ref32 = encore.qkv_norm_backward(*cpu), encore.qkv_norm_backward(*_f32(cpu))
    for name, g, r, r32 in zip(("dx", "dw3", "dgamma"), got, ref, ref32):
        assert g.is_cuda and g.dtype == r.dtype, name
        within_2x(g, r, r32, "float32" if name == "dgamma" else dt)


_FWD_BAD = ["w0_cpu", "pos_cpu", "x1_cpu", "r1_cpu", "f32", "d_not_8", "f_not_8", "gamma0_f32", "ws_cpu", "ws_small"]


@INVALID
@given(seed=SEEDS, dt=st.sampled_from(["bf16", "f16"]), case=st.sampled_from(_FWD_BAD))
def test_llama_block_forward_cuda_refusals(seed, dt, case):
    dt = DT[dt]
    rng = np.random.default_rng(seed)
    m, d, f, heads, hd = int(rng.integers(2, 9)), 16, 8, 2, 8
    d, f = (12 if case == "d_not_8" else d), (12 if case == "f_not_8" else f)
    dt = "float32" if case == "f32" else dt
    x = _block(rng, dt, m, d, f, heads, hd, 1)
    args = {n: x[n][0] for n in FWD}
    guards = _guards(rng, ((m, d), (m, d), (m, 2 * f), (m, heads * hd)), dt, (m, m))
    out, kw = [g.view for g in guards], {}
    kind, names = ValueError, ["llama_block step"]
    if case in ("w0_cpu", "pos_cpu"):
        name = case.split("_")[0]
        args[name], names = x[name][1], [name, "llama_block step"]
    elif case in ("x1_cpu", "r1_cpu"):  # an output on the CPU
        i = SAVED.index(case.split("_")[0])
        out[i], names = torch.empty(tuple(out[i].shape), dtype=out[i].dtype), [case.split("_")[0], "llama_block step", "row_scale"]
    elif case in ("d_not_8", "f_not_8"):  # 24-byte rows: unsupported by the GEMM steps' TMA (step 1 for d; step 3 for F)
        kind = RuntimeError
    elif case == "gamma0_f32":
        args["gamma0"] = args["gamma0"].float()
    elif case.startswith("ws"):
        nbytes = encore.llama_block_workspace_bytes(*[args[n] for n in FWD], tuple(out))
        kw["workspace"] = torch.zeros(nbytes, dtype=torch.uint8) if case == "ws_cpu" else torch.zeros(nbytes - 257, dtype=torch.uint8, device="cuda")
        names = ["workspace"]
    refused(lambda: encore.llama_block_forward(*[args[n] for n in FWD], out=tuple(out), **kw), names, kinds=(kind,))
    assert all(g.untouched() for g in guards)  # every step is checked before the first writes (F: step 3's limit)


@pytest.mark.parametrize("op", ["llama_block_backward", "qkv_norm_backward"])
@INVALID
@given(seed=SEEDS, dt=st.sampled_from(["bf16", "f16"]),
       case=st.sampled_from(["d_qkv_cpu", "saved_cpu", "r_cpu", "prev_cpu", "dgamma_cpu", "f32", "d_not_8"]))
def test_block_backwards_cuda_refusals(op, seed, dt, case):
    dt = DT[dt]
    rng = np.random.default_rng(seed)
    m, d, f, heads, hd = int(rng.integers(2, 9)), (12 if case == "d_not_8" else 16), 8, 2, 8
    dt = "float32" if case == "f32" else dt
    x = _block(rng, dt, m, d, f, heads, hd, 1)
    saved = [s.cuda() for s in encore.llama_block_forward(*[x[n][1] for n in FWD])]  # the CPU forward: any d, any dtype
    dq, dx2 = pair(rng, (m, heads * hd), dt), pair(rng, (m, d), dt)
    kind, names = ValueError, [op]
    if op == "llama_block_backward":
        args = dict(zip(BWD + SAVED + ("d_qkv", "d_x2"), [x[n][0] for n in BWD] + saved + [dq[0], dx2[0]]))
        guards = _guards(rng, ((m, d), (m, d), (d, d), (2 * f, d), (d, f), (heads * hd, d)), dt, (d, d))
        saved_name, r_name, prev_name, out_names = "x1", "r2", "d_x2", GRADS
    else:
        args = {"x": saved[1], "gamma": x["gamma1"][0], "w3": x["w3"][0], "pos": x["pos"][0], "freq": x["freq"][0], "r": saved[5],
                "qkv": saved[3], "d_qkv": dq[0], "d_x_prev": dx2[0]}
        guards = _guards(rng, ((m, d), (heads * hd, d)), dt, (d,))
        saved_name, r_name, prev_name, out_names = "qkv", "r", "d_x_prev", ("dx", "dw3", "dgamma")
    out = [g.view for g in guards]
    if case in ("d_qkv_cpu", "saved_cpu", "r_cpu", "prev_cpu"):
        name = {"d_qkv_cpu": "d_qkv", "saved_cpu": saved_name, "r_cpu": r_name, "prev_cpu": prev_name}[case]
        args[name], names = args[name].cpu(), [name]
    elif case == "dgamma_cpu":
        out[-1], names = torch.empty(d), [out_names[-1]]
    elif case == "d_not_8":  # stage (a)'s rmsnorm_bwd writes [M, d] tiles: 24-byte rows, unsupported on CUDA
        kind = RuntimeError
    # f32: the steps' CUDA GEMMs take bf16 / fp16 (the RoPE backward before them writes the workspace only)
    call = encore.llama_block_backward if op == "llama_block_backward" else encore.qkv_norm_backward
    refused(lambda: call(*args.values(), out=tuple(out)), names, kinds=(kind,))
    assert all(g.untouched() for g in guards)
