"""Property-based fuzzing of the blocks family's public entry points on the CPU backend:
llama_block_forward (with out= and workspace= buffers), llama_block_workspace_bytes,
llama_block_backward (d_x0 in place over d_x2 too) and qkv_norm_backward. Valid draws: numpy
(float32, float16) and CPU torch (float32, bfloat16, float16), M 1-130 (two 128-row partial tiles),
odd d / F, 1-3 heads of 2-8 columns with partial rotary heads; outputs in canary-guarded buffers;
against the textbook float64 block of tests/python/test_llama_block_autograd.py (torch autograd for
the gradients). Invalid draws (shapes, dtypes, overlapping outputs, workspaces, option types) must
raise ValueError / TypeError naming the argument (or, for a GEMM step's operand, the block step that
reads it: the steps' messages are prefixed "llama_block step ...") and write nothing.

Seeds: hypothesis with derandomize=True (fuzz_util.VALID: 200 draws, INVALID: 100 draws per test);
array contents from a drawn numpy seed."""
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import encore
from fuzz_util import (  # noqa: F401 (one_torch_thread: an autouse fixture)
    INVALID, SEEDS, VALID, Guard, bits, f64, is_torch, kinds, make, refused, torch, one_torch_thread)
from helpers import rel

if torch is None:
    pytest.skip("the block references need torch (autograd)", allow_module_level=True)
from test_llama_block_autograd import rms, rope, torch_block  # noqa: E402

IO_KINDS = kinds("np32", "np16", "t32", "tbf16", "t16")
F32 = np.float32
EPS = 1e-5
_TOL = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 8e-2}
FWD_NAMES = ("y0", "x0", "w0", "w1", "w2", "w3", "gamma0", "gamma1", "pos", "freq")


def _lib(a, like):
    return torch.from_numpy(np.ascontiguousarray(a)) if is_torch(like) else np.ascontiguousarray(a)


def _block(rng, kind, m, d, f, heads, hd, rotary):
    """The forward's inputs (kind's framework and dtype; pos int32, freq float32)."""
    n = heads * hd
    mk = lambda a: make(a, kind)  # noqa: E731
    ins = {"y0": mk(rng.standard_normal((m, d))), "x0": mk(rng.standard_normal((m, d))), "w0": mk(rng.standard_normal((d, d)) / np.sqrt(d)),
           "w1": mk(rng.standard_normal((2 * f, d)) / np.sqrt(d)), "w2": mk(rng.standard_normal((d, f)) / np.sqrt(f)),
           "w3": mk(rng.standard_normal((n, d)) / np.sqrt(d)), "gamma0": mk(1 + 0.2 * rng.standard_normal(d)),
           "gamma1": mk(1 + 0.2 * rng.standard_normal(d))}
    ins["pos"] = _lib(rng.integers(-1000, 70000, m).astype(np.int32), ins["y0"])
    ins["freq"] = _lib(encore.rope_freq_turns(heads, rotary, hd, float(rng.choice([10000.0, 500000.0]))), ins["y0"])
    return ins


def _leaves(ins):
    return [torch.from_numpy(f64(ins[n])).requires_grad_(True) for n in FWD_NAMES[:8]]


def _tol(a):
    return _TOL[str(a.dtype).rsplit(".", 1)[-1]]


_M = st.sampled_from([1, 2, 3, 5, 17, 33, 130])
_D = st.sampled_from([1, 2, 3, 8, 16, 24])
_F = st.sampled_from([1, 2, 3, 8, 12])
_HD = st.sampled_from([2, 4, 8])


@VALID
@given(seed=SEEDS, kind=st.sampled_from(IO_KINDS), m=_M, d=_D, f=_F, heads=st.integers(1, 3), hd=_HD, rot=st.integers(0, 3),
       mode=st.sampled_from(["plain", "out", "out_ws", "ws"]), eps=st.sampled_from([1e-5, 1e-6, 0.0]))
def test_llama_block_forward_valid(seed, kind, m, d, f, heads, hd, rot, mode, eps):
    rng = np.random.default_rng(seed)
    ins = _block(rng, kind, m, d, f, heads, hd, min(rot, heads))
    y0 = ins["y0"]
    args = [ins[n] for n in FWD_NAMES]
    before = [bits(a) for a in args]
    kw, guards = {"eps": eps}, []
    if mode.startswith("out"):
        shapes = ((m, d), (m, d), (m, 2 * f), (m, heads * hd))
        guards = [Guard(s, y0, pad=int(rng.integers(0, 4)), offset=int(rng.integers(0, 3))) for s in shapes]
        guards += [Guard((m,), y0, dtype=torch.float32 if is_torch(y0) else F32) for _ in range(2)]
        kw["out"] = tuple(g.view for g in guards)
    out = kw.get("out") or tuple(make(np.zeros(s), kind) for s in ((m, d), (m, d), (m, 2 * f), (m, heads * hd))) + \
        tuple(_lib(np.zeros(m, F32), y0) for _ in range(2))
    nbytes = encore.llama_block_workspace_bytes(*args, out, eps=eps)  # every draw: its valid calls
    assert nbytes >= 256 + m * d * np.dtype(F32 if kind in ("np32", "t32") else np.float16).itemsize  # h2 [M, d] at least
    if mode.endswith("ws"):
        kw["workspace"] = _lib(np.zeros(nbytes, np.uint8), y0)
    got = encore.llama_block_forward(*args, **kw)
    assert all(g.intact() for g in guards) and all(np.array_equal(bits(a), b) for a, b in zip(args, before))
    if "out" in kw:
        assert all(a is b for a, b in zip(got, kw["out"]))
    x1, x2, z1, qkv, r1, r2 = got
    leaves = _leaves(ins)
    with torch.no_grad():
        y, x, w0, w1, w2, w3, g0, g1 = leaves
        rx1 = y @ w0.T + x
        rz1 = rms(rx1, g0, eps) @ w1.T
        rx2, rq = torch_block(*leaves, torch.from_numpy(f64(ins["pos"])), torch.from_numpy(f64(ins["freq"])))
        if eps != EPS:  # torch_block's norms use 1e-5: recompute with this eps
            y1 = torch.nn.functional.silu(rz1[:, 0::2]) * rz1[:, 1::2]
            rx2 = y1 @ w2.T + rx1
            rq = rope(rms(rx2, g1, eps) @ w3.T, torch.from_numpy(f64(ins["pos"])), torch.from_numpy(f64(ins["freq"])))
    tol = _tol(y0)
    for name, ours, ref in (("x1", x1, rx1), ("x2", x2, rx2), ("z1", z1, rz1), ("qkv", qkv, rq)):
        assert ours.dtype == y0.dtype and tuple(ours.shape) == tuple(ref.shape), name
        assert rel(f64(ours), ref.numpy()) < tol or np.abs(f64(ours) - ref.numpy()).max() < tol * 1e-2, name
    with np.errstate(all="ignore"):
        r_ref = 1 / np.sqrt((rx1.numpy() ** 2).mean(1) + float(F32(eps)))
    assert np.allclose(f64(r1), r_ref, rtol=tol, equal_nan=True) and str(r1.dtype).endswith("float32")


def _fwd_grads(ins, d_qkv, d_x2):
    leaves = _leaves(ins)
    rx2, rq = torch_block(*leaves, torch.from_numpy(f64(ins["pos"])), torch.from_numpy(f64(ins["freq"])))
    ((rq * torch.from_numpy(d_qkv)).sum() + (rx2 * torch.from_numpy(d_x2)).sum()).backward()
    return [t.grad.numpy() for t in leaves]


@VALID
@given(seed=SEEDS, kind=st.sampled_from(kinds("np32", "np16", "t32", "tbf16", "t16")), m=_M, d=_D, f=_F, heads=st.integers(1, 3), hd=_HD,
       rot=st.integers(0, 3),
       mode=st.sampled_from(["plain", "out", "inplace"]))
def test_llama_block_backward_valid(seed, kind, m, d, f, heads, hd, rot, mode):
    rng = np.random.default_rng(seed)
    d = d if kind in ("np32", "t32") else max(d, 8)  # bf16: a norm over d < 8 columns leaves its gradient to rounding noise
    ins = _block(rng, kind, m, d, f, heads, hd, min(rot, heads))
    y0 = ins["y0"]
    saved = encore.llama_block_forward(*[ins[n] for n in FWD_NAMES], eps=EPS)
    d_qkv, d_x2 = make(rng.standard_normal((m, heads * hd)), kind), make(rng.standard_normal((m, d)), kind)
    want = _fwd_grads(ins, f64(d_qkv), f64(d_x2))  # d_y0, d_x0, dw0..dw3, dgamma0, dgamma1
    args = [ins[n] for n in ("y0", "w0", "w1", "w2", "w3", "gamma0", "gamma1", "pos", "freq")] + list(saved) + [d_qkv, d_x2]
    kw, guards = {}, []
    if mode != "plain":
        shapes = [(m, d), (m, d), (d, d), (2 * f, d), (d, f), (heads * hd, d)]
        guards = [Guard(s, y0, pad=int(rng.integers(0, 3)), offset=1) for s in shapes]
        guards += [Guard((d,), y0, dtype=torch.float32 if is_torch(y0) else F32) for _ in range(2)]
        out = [g.view for g in guards]
        if mode == "inplace":  # d_x0 written over d_x2 (the residual gradient in place)
            gd = Guard((m, d), y0, pad=2, offset=1)
            out[1] = args[-1] = gd.set(d_x2)
            guards[1] = gd
        kw["out"] = tuple(out)
    got = encore.llama_block_backward(*args, **kw)
    assert all(g.intact() for g in guards)
    tol = 2 * _tol(y0)
    for name, ours, ref in zip(("d_y0", "d_x0", "dw0", "dw1", "dw2", "dw3", "dgamma0", "dgamma1"), got, want):
        assert tuple(ours.shape) == ref.shape, name
        # relative to the gradient's norm, with an allowance of 0.1 per element for the ill-conditioned tiny d (d = 1: x_hat = sign(x))
        assert np.linalg.norm(f64(ours) - ref) <= tol * (np.linalg.norm(ref) + 0.1 * np.sqrt(ref.size)), (name, rel(f64(ours), ref))


@VALID
@given(seed=SEEDS, kind=st.sampled_from(kinds("np32", "np16", "t32", "tbf16", "t16")), m=_M, d=_D, heads=st.integers(1, 3), hd=_HD, rot=st.integers(0, 3),
       prev=st.booleans(), out=st.booleans())
def test_qkv_norm_backward_valid(seed, kind, m, d, heads, hd, rot, prev, out):
    rng = np.random.default_rng(seed)
    d = d if kind in ("np32", "t32") else max(d, 8)  # (as for the block backward)
    ins = _block(rng, kind, m, d, 1, heads, hd, min(rot, heads))
    x, g, w3 = ins["x0"], ins["gamma1"], ins["w3"]
    pos, freq = torch.from_numpy(f64(ins["pos"])), torch.from_numpy(f64(ins["freq"]))
    lx, lg, lw = (torch.from_numpy(f64(t)).requires_grad_(True) for t in (x, g, w3))
    q = rope(rms(lx, lg) @ lw.T, pos, freq)
    d_qkv, d_prev = make(rng.standard_normal((m, heads * hd)), kind), make(rng.standard_normal((m, d)), kind)
    ((q * torch.from_numpy(f64(d_qkv))).sum() + ((lx * torch.from_numpy(f64(d_prev))).sum() if prev else 0)).backward()
    r = _lib(1 / np.sqrt((f64(x) ** 2).mean(1) + EPS), x).float() if is_torch(x) else (1 / np.sqrt((f64(x) ** 2).mean(1) + EPS)).astype(F32)
    qkv = make(q.detach().numpy(), kind)
    kw, guards = {}, []
    if out:
        guards = [Guard((m, d), x), Guard(tuple(w3.shape), x), Guard((d,), x, dtype=torch.float32 if is_torch(x) else F32)]
        kw["out"] = tuple(gd.view for gd in guards)
    dx, dw3, dg = encore.qkv_norm_backward(x, g, w3, ins["pos"], ins["freq"], r, qkv, d_qkv, d_prev if prev else None, **kw)
    assert all(gd.intact() for gd in guards)
    tol = 2 * _tol(x)
    for name, ours, ref in (("dx", dx, lx.grad.numpy()), ("dw3", dw3, lw.grad.numpy()), ("dgamma", dg, lg.grad.numpy())):
        assert np.linalg.norm(f64(ours) - ref) <= tol * (np.linalg.norm(ref) + 0.1 * np.sqrt(ref.size)), (name, rel(f64(ours), ref))


# --- invalid draws ------------------------------------------------------------------------------------------

_FWD_BAD = ["y0_1d", "y0_list", "y0_f64", "x0_shape", "w0_shape", "w1_odd", "w1_cols", "w2_shape", "w3_1d", "gamma0_len", "gamma1_dtype",
            "pos_i64", "pos_len", "freq_len", "freq_f64", "eps_neg", "eps_nan", "eps_str", "out_5", "out_list", "out_x1_x2", "out_z1_x1",
            "out_qkv_x0", "out_r1_r2", "out_r_f16", "out_qkv_shape", "ws_small", "ws_f32", "ws_framework", "w0_col_stride"]


@INVALID
@given(seed=SEEDS, kind=st.sampled_from(kinds("np32", "t32")), case=st.sampled_from(_FWD_BAD))
@example(seed=0, kind="np32", case="out_z1_x1").via("regression: z1 overlapping x1 was written while x1 was still read")
def test_llama_block_forward_invalid(seed, kind, case):
    rng = np.random.default_rng(seed)
    m, d, f, heads, hd = int(rng.integers(1, 6)), 8, 4, 2, 4
    ins = _block(rng, kind, m, d, f, heads, hd, 1)
    y0 = ins["y0"]
    mk = lambda a: make(a, kind)  # noqa: E731
    shapes = [(m, d), (m, d), (m, 2 * f), (m, heads * hd)]
    guards = [Guard(s, y0) for s in shapes] + [Guard((m,), y0, dtype=torch.float32 if is_torch(y0) else F32) for _ in range(2)]
    out, kw, names = [g.view for g in guards], {}, []
    bad = lambda key, val, *nm: (ins.__setitem__(key, val), names.extend(nm or [key]))  # noqa: E731
    if case == "y0_1d":
        bad("y0", y0[0])
    elif case == "y0_list":
        bad("y0", f64(y0).tolist())
    elif case == "y0_f64":
        bad("y0", make(f64(y0), "np64") if kind == "np32" else y0.double(), "y0", "llama_block step")
    elif case in ("x0_shape", "w0_shape", "w2_shape"):
        key = case.split("_")[0]
        bad(key, mk(np.ones((d + 1, d + 1) if key != "x0" else (m + 1, d))), key, "llama_block step")
    elif case == "w1_odd":
        bad("w1", mk(np.ones((2 * f - 1, d))), "w1", "llama_block step")
    elif case == "w1_cols":
        bad("w1", mk(np.ones((2 * f, d + 1))), "w1", "llama_block step")
    elif case == "w3_1d":
        bad("w3", ins["w3"][0], "w3", "llama_block step")
    elif case == "gamma0_len":
        bad("gamma0", mk(np.ones(d + 1)), "gamma0", "llama_block step")
    elif case == "gamma1_dtype":
        bad("gamma1", np.ones(d, np.int32) if kind == "np32" else torch.ones(d, dtype=torch.int32), "gamma1", "llama_block step")
    elif case == "pos_i64":
        bad("pos", _lib(f64(ins["pos"]).astype(np.int64), y0), "pos", "llama_block step")
    elif case == "pos_len":
        bad("pos", _lib(np.zeros(m + 1, np.int32), y0), "pos", "llama_block step")
    elif case == "freq_len":
        bad("freq", _lib(np.zeros(heads * hd + 2, F32), y0), "freq", "llama_block step")
    elif case == "freq_f64":
        bad("freq", _lib(np.zeros(heads * hd), y0), "freq", "llama_block step")
    elif case.startswith("eps"):
        kw["eps"], names = {"eps_neg": -1e-5, "eps_nan": float("nan"), "eps_str": "1e-5"}[case], ["eps"]
    elif case == "out_5":
        out, names = out[:5], ["out"]
    elif case == "out_list":
        out, names = out[0], ["out"]
    elif case == "out_x1_x2":
        out[1], names = out[0], ["x1", "x2"]
    elif case == "out_z1_x1":  # z1 [M, 2F] and x1 [M, d] in one buffer, overlapping
        big = Guard((m, d + 2 * f - 2), y0)
        out[0], out[2], names = big.view[:, :d], big.view[:, d - 2:d - 2 + 2 * f], ["x1", "z1"]
        guards.append(big)
    elif case == "out_qkv_x0":  # qkv written over an input (x0 is [M, heads*hd] here)
        out[3], names = ins["x0"], ["qkv", "x0"]
    elif case == "out_r1_r2":
        out[5], names = out[4], ["r1", "r2"]
    elif case == "out_r_f16":
        g = Guard((m,), y0, dtype=torch.float16 if is_torch(y0) else np.float16)
        out[4], names = g.view, ["r1", "llama_block step"]
        guards.append(g)
    elif case == "out_qkv_shape":
        g = Guard((m, heads * hd + 1), y0)
        out[3], names = g.view, ["qkv", "llama_block step"]
        guards.append(g)
    elif case.startswith("ws"):
        want = encore.llama_block_workspace_bytes(*[ins[n] for n in FWD_NAMES], tuple(out))
        kw["workspace"] = {"ws_small": _lib(np.zeros(want - 257, np.uint8), y0), "ws_f32": _lib(np.zeros(want, F32), y0),
                           "ws_framework": np.zeros(want, np.uint8) if is_torch(y0) else torch.zeros(want, dtype=torch.uint8)}[case]
        names = ["workspace"]
    elif case == "w0_col_stride":
        bad("w0", mk(np.ones((d, 2 * d)))[:, ::2], "w0", "llama_block step")
    args = [ins[n] for n in FWD_NAMES]
    refused(lambda: encore.llama_block_forward(*args, out=tuple(out) if isinstance(out, list) else out, **kw), names, guards)


@pytest.mark.parametrize("op", ["backward", "qkv", "ws_bytes"])
@INVALID
@given(seed=SEEDS, kind=st.sampled_from(kinds("np32", "t32")), which=st.integers(0, 30),
       how=st.sampled_from(["shape", "dtype", "list", "none", "out_overlap", "out_count"]))
def test_block_backwards_invalid(op, seed, kind, which, how):
    rng = np.random.default_rng(seed)
    m, d, f, heads, hd = int(rng.integers(1, 6)), 8, 4, 2, 4
    ins = _block(rng, kind, m, d, f, heads, hd, 1)
    y0 = ins["y0"]
    saved = encore.llama_block_forward(*[ins[n] for n in FWD_NAMES])
    mk = lambda a: make(a, kind)  # noqa: E731
    if op == "backward":
        names = ["y0", "w0", "w1", "w2", "w3", "gamma0", "gamma1", "pos", "freq", "x1", "x2", "z1", "qkv", "r1", "r2", "d_qkv", "d_x2"]
        vals = [ins[n] for n in names[:9]] + list(saved) + [mk(np.ones((m, heads * hd))), mk(np.ones((m, d)))]
        outs = [mk(np.zeros(s)) for s in ((m, d), (m, d), (d, d), (2 * f, d), (d, f), (heads * hd, d))] + \
            [_lib(np.zeros(d, F32), y0), _lib(np.zeros(d, F32), y0)]
        call = lambda v, o: encore.llama_block_backward(*v, out=o)  # noqa: E731
    elif op == "qkv":
        names = ["x", "gamma", "w3", "pos", "freq", "r", "qkv", "d_qkv", "d_x_prev"]
        vals = [ins["x0"], ins["gamma1"], ins["w3"], ins["pos"], ins["freq"], saved[5], saved[3], mk(np.ones((m, heads * hd))), mk(np.ones((m, d)))]
        outs = [mk(np.zeros((m, d))), mk(np.zeros((heads * hd, d))), _lib(np.zeros(d, F32), y0)]
        call = lambda v, o: encore.qkv_norm_backward(*v, out=o)  # noqa: E731
    else:
        names = list(FWD_NAMES)
        vals = [ins[n] for n in FWD_NAMES]
        outs = [mk(np.zeros(s)) for s in ((m, d), (m, d), (m, 2 * f), (m, heads * hd))] + [_lib(np.zeros(m, F32), y0) for _ in range(2)]
        call = lambda v, o: encore.llama_block_workspace_bytes(*v, o)  # noqa: E731
    i = which % len(names)
    expect = [names[i], "llama_block step", "qkv_norm_backward"]
    if how == "shape":  # one more row (element)
        grown = np.concatenate([f64(vals[i]), f64(vals[i])[:1]])
        vals[i] = _lib(grown.astype(np.int32 if names[i] == "pos" else F32), y0) if names[i] in ("pos", "freq", "r", "r1", "r2") else mk(grown)
        if names[i] in ("y0", "x", "w3"):  # a defining dimension (M, d or Nqkv): the others disagree with it
            expect += names + ["out", "d_y0", "dx", "dw3", "x1", "r1", "r"]
    elif how == "dtype":
        vals[i] = _lib(np.zeros(tuple(vals[i].shape), np.int32 if names[i] != "pos" else np.int64), y0)
        if names[i] in ("y0", "x"):
            expect += ["out", "d_y0", "dx", "x1", "x0", "w0", "w3", "gamma"]
    elif how == "list":
        vals[i] = f64(vals[i]).tolist()
    elif how == "none":
        if names[i] == "d_x_prev":  # optional: a short out tuple instead
            how = "out_count"
        else:
            vals[i] = None
    if how == "out_overlap":  # two outputs in one buffer
        outs[1] = outs[0]
        expect = ["d_y0", "d_x0", "dx", "dw3", "x1", "x2", "out", "llama_block step"]
    elif how == "out_count":
        outs, expect = outs[:-1], ["out"]
    refused(lambda: call(vals, tuple(outs)), expect)


# --- regressions: the bugs these fuzzers found, as plain tests ----------------------------------------------

def test_regression_block_outputs_must_not_overlap():
    """Outputs overlapping each other or an input (z1 over x1, qkv over x0) were accepted: x1, x2 and qkv came
    out wrong (z1 is written while x1 is still read); a 1-D y0 raised IndexError."""
    rng = np.random.default_rng(0)
    ins = _block(rng, "np32", 5, 8, 4, 2, 4, 1)
    args = [ins[n] for n in FWD_NAMES]
    x1, x2, z1, qkv, r1, r2 = encore.llama_block_forward(*args)
    buf = np.zeros((5, 14), F32)
    refused(lambda: encore.llama_block_forward(*args, out=(buf[:, :8], x2.copy(), buf[:, 6:14], qkv.copy(), r1.copy(), r2.copy())), ["x1", "z1"])
    refused(lambda: encore.llama_block_forward(*args, out=(x1.copy(), x2.copy(), z1.copy(), ins["x0"], r1.copy(), r2.copy())), ["qkv", "x0"])
    refused(lambda: encore.llama_block_forward(ins["y0"][0], *args[1:]), ["y0"])
