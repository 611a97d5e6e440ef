"""Property-based fuzzing of the GEMM family's finishers and helpers on the CPU backend:
rms_final_reduce, partials_sum, lse_finish, cross_entropy_bwd / cross_entropy_bwd_, qk_norm_rope_,
qk_norm_rope_backward, rope_freq_turns and interleave_gate_up. Valid draws: odd / unit sizes,
strided views (any float32 partials layout the CPU backend reads), ignore_index rows, -inf tiles and
NaN / inf data, every dtype the op takes (numpy float32 / float16, torch float32 / bfloat16 /
float16), outputs in canary-guarded buffers (cross_entropy_bwd's out=, the in-place ops' untouched
parts); against float64 numpy math (docs/math/gemm_epilogues.md) and, for qk_norm_rope_backward, torch
autograd through a float64 forward. Invalid draws: ValueError / TypeError naming the argument.

Seeds: hypothesis with derandomize=True (fuzz_util.VALID: 200 draws, INVALID: 100 draws per test);
array contents from a drawn numpy seed."""
import math

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import encore
from fuzz_util import (  # noqa: F401 (one_torch_thread: an autouse fixture)
    INVALID, SEEDS, VALID, Guard, bits, close, f64, inject, is_torch, kinds, make, refused, same_values, strided, torch, one_torch_thread)

IO_KINDS = kinds("np32", "np16", "t32", "tbf16", "t16")
F32 = np.float32
_M = st.sampled_from([1, 2, 3, 5, 9, 17, 130])
_T = st.sampled_from([1, 2, 3, 7])


def _lib(a, like_torch):
    """A float32 / int32 numpy array, as a torch tensor when like_torch (strides kept)."""
    return torch.from_numpy(a) if like_torch and torch is not None else a


def _partials(rng, m, t, layout, special):
    v = rng.standard_normal((m, t)) * 3
    v = inject(v, rng, 0.05, (np.nan, np.inf, -np.inf)) if special else v
    if layout == "col":  # column-major storage
        return np.asfortranarray(v.astype(F32))
    if layout == "strided":  # every other column of a wider buffer
        wide = np.zeros((m, 2 * t), F32)
        wide[:, ::2] = v
        return wide[:, ::2]
    return v.astype(F32)


# --- rms_final_reduce / partials_sum / lse_finish -------------------------------------------------------

@VALID
@given(seed=SEEDS, m=_M, t=_T, layout=st.sampled_from(["row", "col", "strided"]), hidden=st.sampled_from([1, 7, 128, 4096]),
       eps=st.sampled_from([0.0, 1e-6, 1.0]), tt=st.booleans(), special=st.booleans())
def test_rms_final_reduce_valid(seed, m, t, layout, hidden, eps, tt, special):
    rng = np.random.default_rng(seed)
    p = np.abs(_partials(rng, m, t, layout, special)) if not special else _partials(rng, m, t, layout, True)
    r = encore.rms_final_reduce(_lib(p, tt), hidden, eps=eps)
    with np.errstate(all="ignore"):
        ref = 1 / np.sqrt(f64(p).sum(1) / hidden + float(F32(eps)))
    close(r, ref, "float32")


@VALID
@given(seed=SEEDS, m=_M, t=_T, layout=st.sampled_from(["row", "col", "strided"]), per_column=st.booleans(), scale=st.sampled_from([1.0, 0.5, -3.0, 0.0]),
       n_less=st.integers(0, 6), tt=st.booleans(), special=st.booleans())
def test_partials_sum_valid(seed, m, t, layout, per_column, scale, n_less, tt, special):
    rng = np.random.default_rng(seed)
    p = _partials(rng, m, t, layout, special)
    n = max(1, t - n_less) if per_column else None
    out = encore.partials_sum(_lib(p, tt), per_column=per_column, scale=scale, n=n)
    with np.errstate(all="ignore"):
        ref = float(F32(scale)) * (f64(p)[:, :n].sum(0) if per_column else f64(p).sum(1))
    close(out, ref, "float32", rtol_ulps=4)


@VALID
@given(seed=SEEDS, m=_M, t=_T, layout=st.sampled_from(["row", "col", "strided"]), target=st.booleans(), ignore=st.sampled_from([-100, 0, 3]),
       tt=st.booleans(), special=st.booleans())
def test_lse_finish_valid(seed, m, t, layout, target, ignore, tt, special):
    rng = np.random.default_rng(seed)
    p = _partials(rng, m, t, layout, False)
    p[rng.random((m, t)) < 0.2] = -np.inf  # tiles without a valid column
    if special:
        p[rng.random((m, t)) < 0.05] = np.nan
    mx = f64(p).max(1)
    with np.errstate(all="ignore"):
        lse = np.where(np.isneginf(mx), -np.inf, mx + np.log(np.exp(f64(p) - mx[:, None]).sum(1)))
    if not target:
        close(encore.lse_finish(_lib(p, tt), ignore_index=ignore), lse, "float32", rtol_ulps=4, atol=1e-6)
        return
    tg = rng.integers(0, 5, m).astype(np.int32)
    tg[rng.random(m) < 0.3] = ignore
    tl = rng.standard_normal(m).astype(F32)
    got_lse, loss = encore.lse_finish(_lib(p, tt), _lib(tg, tt), _lib(tl, tt), ignore_index=ignore)
    close(got_lse, lse, "float32", rtol_ulps=4, atol=1e-6)
    with np.errstate(all="ignore"):
        close(loss, np.where(tg == ignore, 0.0, f64(got_lse) - tl), "float32", rtol_ulps=4, atol=1e-6)


@pytest.mark.parametrize("op", ["rms_final_reduce", "partials_sum", "lse_finish"])
@INVALID
@given(seed=SEEDS, case=st.sampled_from(
    ["p_f64", "p_f16", "p_1d", "p_3d", "p_list", "p_none", "p_empty", "hidden_0", "hidden_str", "eps_neg", "eps_nan", "n_big", "n_0", "n_float",
     "scale_inf", "scale_str", "target_f32", "target_len", "no_target_logit", "target_logit_alone", "tl_len", "ignore_str"]))
def test_finishers_invalid(op, seed, case):
    rng = np.random.default_rng(seed)
    m, t = int(rng.integers(1, 6)), int(rng.integers(1, 4))
    p, kw, names, extra = rng.standard_normal((m, t)).astype(F32), {}, ["partials"], {}
    if case == "p_f64":
        p = p.astype(np.float64)
    elif case == "p_f16":
        p = p.astype(np.float16)
    elif case == "p_1d":
        p = p[:, 0].copy()
    elif case == "p_3d":
        p = p[None]
    elif case == "p_list":
        p = p.tolist()
    elif case == "p_none":
        p = None
    elif case == "p_empty":
        p = np.ones((m, 0), F32)
    elif op == "rms_final_reduce" and case in ("hidden_0", "hidden_str", "eps_neg", "eps_nan"):
        key, val = {"hidden_0": ("hidden", 0), "hidden_str": ("hidden", "128"), "eps_neg": ("eps", -1e-6), "eps_nan": ("eps", math.nan)}[case]
        kw[key], names = val, [key]
    elif op == "partials_sum" and case in ("n_big", "n_0", "n_float", "scale_inf", "scale_str"):
        key, val = {"n_big": ("n", t + 1), "n_0": ("n", 0), "n_float": ("n", 1.5), "scale_inf": ("scale", math.inf), "scale_str": ("scale", "1")}[case]
        kw[key], names = val, [key]
        kw.setdefault("per_column", True)
    elif op == "lse_finish" and case.startswith(("target", "no_", "tl", "ignore")):
        tg, tl = np.zeros(m, np.int32), np.zeros(m, F32)
        if case == "target_f32":
            tg, names = tg.astype(F32), ["target"]
        elif case == "target_len":
            tg, names = np.zeros(m + 1, np.int32), ["target"]
        elif case == "no_target_logit":
            tl, names = None, ["target_logit"]
        elif case == "target_logit_alone":
            tg, names = None, ["target", "target_logit", "loss"]
        elif case == "tl_len":
            tl, names = np.zeros(m + 2, F32), ["target_logit"]
        else:
            kw, names = {"ignore_index": "x"}, ["ignore_index"]
        extra = {"target": tg, "target_logit": tl}
    else:
        p = p.astype(np.int32)  # the case is another op's: an int32 partials array instead
    calls = {"rms_final_reduce": lambda: encore.rms_final_reduce(p, kw.get("hidden", 16), eps=kw.get("eps", 1e-6)),
             "partials_sum": lambda: encore.partials_sum(p, **kw),
             "lse_finish": lambda: encore.lse_finish(p, **extra, **kw)}
    refused(calls[op], names)


# --- cross_entropy_bwd / cross_entropy_bwd_ -----------------------------------------------------------

def _ce_case(rng, kind, m, n, ignore, special):
    z = rng.standard_normal((m, n)) * 2
    z = inject(z, rng, 0.02) if special else z
    logits = make(z, kind)
    lse = (np.log(np.exp(np.where(np.isfinite(z), z, 0)).sum(1)) + rng.uniform(-0.1, 0.1, m)).astype(F32)
    t = rng.integers(0, n, m)
    t[rng.random(m) < 0.25] = ignore
    return logits, lse, t.astype(np.int32)


def ce_ref(z, lse, t, alpha, ignore):
    with np.errstate(all="ignore"):
        d = alpha * (np.exp(z - lse[:, None]) - (np.arange(z.shape[1])[None] == t[:, None]))
    return np.where((t == ignore)[:, None], 0.0, d)


@pytest.mark.parametrize("op", ["cross_entropy_bwd", "cross_entropy_bwd_"])
@VALID
@given(seed=SEEDS, kind=st.sampled_from(IO_KINDS), m=_M, n=st.sampled_from([1, 2, 5, 8, 33, 257]), out=st.booleans(),
       alpha=st.sampled_from([None, 1.0, 0.25, -2.0]), ignore=st.sampled_from([-100, -1, 1]), special=st.booleans())
def test_cross_entropy_bwd_valid(op, seed, kind, m, n, out, alpha, ignore, special):
    rng = np.random.default_rng(seed)
    mode = "inplace" if op == "cross_entropy_bwd_" else "out" if out else "new"
    logits, lse, t = _ce_case(rng, kind, m, n, ignore, special)
    ref = ce_ref(f64(logits), lse.astype(np.float64), t, 1.0 if alpha is None else float(F32(alpha)), ignore)
    tt = is_torch(logits)
    lse_a, t_a, al = _lib(lse, tt), _lib(t, tt), None if alpha is None else _lib(np.array([alpha], F32), tt)
    if mode == "new":
        got = encore.cross_entropy_bwd(logits, lse_a, t_a, al, ignore_index=ignore)
        assert got is not logits
    elif mode == "out":
        g = Guard((m, n), logits, pad=int(rng.integers(0, 5)), offset=int(rng.integers(0, 3)))
        got = encore.cross_entropy_bwd(logits, lse_a, t_a, al, ignore_index=ignore, out=g.view)
        assert got is g.view and g.intact()
    else:  # in place, on a row-strided view inside a canary buffer
        g = Guard((m, n), logits, pad=int(rng.integers(0, 5)), offset=1)
        g.set(logits)
        got = encore.cross_entropy_bwd_(g.view, lse_a, t_a, al, ignore_index=ignore)
        assert got is g.view and g.intact()
    close(got, ref, logits.dtype, rtol_ulps=4, atol=1e-6)


@pytest.mark.parametrize("inplace", [False, True])
@INVALID
@given(seed=SEEDS, kind=st.sampled_from(IO_KINDS), case=st.sampled_from(
    ["target_oob", "target_neg", "target_i64", "target_len", "lse_len", "lse_f64", "alpha_2", "alpha_f16", "alpha_float", "logits_1d", "logits_f64",
     "logits_list", "out_shape", "out_dtype", "out_overlap", "out_list", "ignore_float", "lse_alias_out"]))
@example(seed=0, kind=IO_KINDS[0], case="out_list")
def test_cross_entropy_bwd_invalid(inplace, seed, kind, case):
    rng = np.random.default_rng(seed)
    m, n = int(rng.integers(2, 6)), int(rng.integers(2, 9))
    logits, lse, t = _ce_case(rng, kind, m, n, -100, False)
    g = Guard((m, n), logits)
    g.set(logits)
    logits, tt = g.view, is_torch(logits)
    args = {"logits": logits, "lse": _lib(lse, tt), "target": _lib(t, tt), "alpha": None}
    kw, names, guards, out = {}, [], [g], None
    if case in ("target_oob", "target_neg"):
        t2 = t.copy()
        t2[int(rng.integers(m))] = n + int(rng.integers(0, 3)) if case == "target_oob" else -int(rng.integers(1, 99))
        args["target"], names = _lib(t2, tt), ["target"]
    elif case == "target_i64":
        args["target"], names = _lib(t.astype(np.int64), tt), ["target"]
    elif case == "target_len":
        args["target"], names = _lib(np.zeros(m + 1, np.int32), tt), ["target"]
    elif case == "lse_len":
        args["lse"], names = _lib(np.zeros(m - 1, F32), tt), ["lse"]
    elif case == "lse_f64":
        args["lse"], names = _lib(lse.astype(np.float64), tt), ["lse"]
    elif case == "alpha_2":
        args["alpha"], names = _lib(np.ones(2, F32), tt), ["alpha"]
    elif case == "alpha_f16":
        args["alpha"], names = _lib(np.ones(1, np.float16), tt), ["alpha"]
    elif case == "alpha_float":
        args["alpha"], names = 0.5, ["alpha"]
    elif case == "logits_1d":
        args["logits"], names, guards = make(np.ones(n), kind), ["logits"], []
    elif case == "logits_f64":
        args["logits"], names, guards = make(np.ones((m, n)), "np64"), ["logits"], []
    elif case == "logits_list":
        args["logits"], names, guards = f64(logits).tolist(), ["logits"], []
    elif case == "ignore_float":
        kw, names = {"ignore_index": -100.0}, ["ignore_index"]
    elif not inplace:
        names = ["out"]
        if case == "out_shape":
            g2 = Guard((m, n + 1), logits)
            out, guards = g2.view, [g, g2]
        elif case == "out_dtype":
            g2 = Guard((m, n), logits, dtype=torch.float64 if tt else np.float64)
            out, guards = g2.view, [g, g2]
        elif case == "out_overlap":  # out a shifted view of the logits' own buffer
            out = g.buffer[:m, 1:1 + n] if g.buffer.shape[1] > n else g.buffer[1:m + 1, :n]
        elif case == "out_list":
            out = [[0.0] * n] * m
        else:  # lse written by the call: out aliasing lse
            buf = _lib(np.zeros(m * n + m, F32), tt)
            args["lse"], out, names = buf[:m], buf[m - 1:m - 1 + m * n].reshape(m, n), ["out", "lse"]
            if not str(logits.dtype).endswith("float32"):
                names.append("logits")
    else:  # in place: a bad target instead
        args["target"], names = _lib(np.full(m, n, np.int32), tt), ["target"]
    a = args
    if inplace:
        refused(lambda: encore.cross_entropy_bwd_(a["logits"], a["lse"], a["target"], a["alpha"], **kw), names, guards)
    else:
        refused(lambda: encore.cross_entropy_bwd(a["logits"], a["lse"], a["target"], a["alpha"], out=out, **kw), names, guards)


# --- qk_norm_rope_ / qk_norm_rope_backward ------------------------------------------------------------

def _qk_case(rng, kind, m, nq, nkv, hd, w32, special=False):
    n = (nq + 2 * nkv) * hd
    x = rng.standard_normal((m, n)) * 2
    x = inject(x, rng, 0.01) if special else x
    xa = make(x, kind)
    xs = f64(xa)
    with np.errstate(all="ignore"):
        part = (xs.reshape(m, -1, hd) ** 2).sum(-1)[:, :nq + nkv].astype(F32)
    part = np.concatenate([part, np.zeros((m, nkv), F32)], 1)  # [M, heads]: the V heads' sums are not read
    wk = "np32" if w32 else kind
    qw, kw = make(1 + 0.3 * rng.standard_normal(hd), wk), make(1 + 0.3 * rng.standard_normal(hd), wk)
    pos = rng.integers(-5000, 70000, m).astype(np.int32)
    freq = encore.rope_freq_turns(nq + 2 * nkv, nq + nkv, hd, float(rng.choice([10000.0, 500000.0])))
    tt = is_torch(xa)
    if tt and w32:
        qw, kw = torch.from_numpy(qw), torch.from_numpy(kw)
    return xa, _lib(part, tt), qw, kw, _lib(pos, tt), _lib(freq, tt)


def qk_forward_ref(x, part, qw, kw, pos, freq, nq, nkv, hd, eps):
    m = x.shape[0]
    h = x.reshape(m, -1, hd).copy()
    with np.errstate(all="ignore"):
        r = 1 / np.sqrt(part[:, :nq + nkv] / hd + float(F32(eps)))
        h[:, :nq] *= r[:, :nq, None] * qw
        h[:, nq:nq + nkv] *= r[:, nq:, None] * kw
        return rope_ref(h.reshape(m, -1), pos, freq)


def rope_ref(z, pos, freq):
    f = freq[0::2] + freq[1::2]
    turns = pos[:, None] * f[None]
    th = 2 * np.pi * (turns - np.rint(turns))
    a, b = z[:, 0::2], z[:, 1::2]
    out = z.copy()
    rot = f[None] != 0
    out[:, 0::2] = np.where(rot, a * np.cos(th) - b * np.sin(th), a)
    out[:, 1::2] = np.where(rot, b * np.cos(th) + a * np.sin(th), b)
    return out


_HD = st.sampled_from([2, 4, 8, 16, 64])


@VALID
@given(seed=SEEDS, kind=st.sampled_from(IO_KINDS), m=_M, nq=st.integers(1, 4), nkv=st.integers(1, 2), hd=_HD, w32=st.booleans(),
       eps=st.sampled_from([0.0, 1e-6, 1e-2]), pad=st.sampled_from([0, 3]), special=st.booleans())
def test_qk_norm_rope_valid(seed, kind, m, nq, nkv, hd, w32, eps, pad, special):
    rng = np.random.default_rng(seed)
    x, part, qw, kw, pos, freq = _qk_case(rng, kind, m, nq, nkv, hd, w32, special)
    g = Guard(x.shape, x, pad=pad, offset=1)
    qkv = g.set(x)
    v_before = bits(qkv[:, (nq + nkv) * hd:])
    ref = qk_forward_ref(f64(x), f64(part), f64(qw), f64(kw), f64(pos), f64(freq), nq, nkv, hd, eps)
    assert encore.qk_norm_rope_(qkv, part, qw, kw, pos, freq, nq, nkv, hd, eps) is qkv
    assert g.intact() and np.array_equal(bits(qkv[:, (nq + nkv) * hd:]), v_before)  # canaries and V heads untouched
    close(qkv, ref, x.dtype, rtol_ulps=4, atol=1e-5 * np.abs(ref[np.isfinite(ref)]).max(initial=0))


@VALID
@given(seed=SEEDS, kind=st.sampled_from(kinds("np32", "t32", "tbf16")), m=st.sampled_from([1, 2, 3, 7, 17]), nq=st.integers(1, 3),
       nkv=st.integers(1, 2), hd=st.sampled_from([2, 4, 8, 16]), w32=st.booleans(), eps=st.sampled_from([1e-6, 1e-2]))
def test_qk_norm_rope_backward_valid(seed, kind, m, nq, nkv, hd, w32, eps):
    if torch is None:
        return
    from test_qk_norm_rope_backward import forward_fp64

    rng = np.random.default_rng(seed)
    x, part, qw, kw, pos, freq = _qk_case(rng, kind, m, nq, nkv, hd, w32)
    dy = make(rng.standard_normal(tuple(x.shape)), kind)
    dx, dq, dk = encore.qk_norm_rope_backward(dy, x, part, qw, kw, pos, freq, nq, nkv, hd, eps)
    assert type(dx) is type(x) and dx.dtype == x.dtype and str(dq.dtype).endswith("float32")
    leaves = [torch.from_numpy(f64(t)).requires_grad_(True) for t in (x, qw, kw)]
    y = forward_fp64(*leaves, torch.from_numpy(f64(pos)), torch.from_numpy(f64(freq)), nq, nkv, hd, float(F32(eps)))
    want = torch.autograd.grad(y, leaves, torch.from_numpy(f64(dy)))
    for got, ref, dt in ((dx, want[0], x.dtype), (dq, want[1], "float32"), (dk, want[2], "float32")):
        ref = ref.numpy()
        err = np.linalg.norm(f64(got) - ref)
        tol = {"float32": 3e-6, "bfloat16": 1e-2}.get(str(dt).rsplit(".", 1)[-1], 3e-6)
        assert err <= tol * np.linalg.norm(ref) + 1e-9, (err, np.linalg.norm(ref))


@pytest.mark.parametrize("bwd", [False, True])
@INVALID
@given(seed=SEEDS, case=st.sampled_from(
    ["hd_odd", "hd_0", "hd_neg", "nq_0", "nkv_str", "width", "partials_heads", "partials_f16", "qw_len", "kw_i32", "pos_i64", "pos_len", "freq_len",
     "freq_f64", "eps_nan", "qkv_1d", "qkv_list", "partials_alias", "x_shape", "x_dtype", "dy_none"]))
def test_qk_norm_rope_invalid(bwd, seed, case):
    rng = np.random.default_rng(seed)
    m, nq, nkv, hd = int(rng.integers(1, 5)), int(rng.integers(1, 3)), 1, int(rng.choice([2, 8]))
    x, part, qw, kw, pos, freq = _qk_case(rng, "np32", m, nq, nkv, hd, False)
    g = Guard(x.shape, x)
    qkv = g.set(x)
    a = {"qkv": qkv, "partials": part, "q_weight": qw, "k_weight": kw, "pos": pos, "freq": freq}
    opts, names, guards = [nq, nkv, hd], [], [g]
    lead = "dy" if bwd else "qkv"
    if case in ("hd_odd", "hd_0", "hd_neg"):
        opts[2], names = {"hd_odd": 3, "hd_0": 0, "hd_neg": -2}[case], ["head_dim"]
    elif case == "nq_0":
        opts[0], names = 0, ["num_q_heads"]
    elif case == "nkv_str":
        opts[1], names = "1", ["num_kv_heads"]
    elif case == "width":
        opts[0], names = nq + 1, [lead, "partials"]
    elif case == "partials_heads":
        a["partials"], names = np.ones((m, nq + 2 * nkv + 1), F32), ["partials"]
    elif case == "partials_f16":
        a["partials"], names = part.astype(np.float16), ["partials"]
    elif case == "qw_len":
        a["q_weight"], names = np.ones(hd + 2, F32), ["q_weight"]
    elif case == "kw_i32":
        a["k_weight"], names = np.ones(hd, np.int32), ["k_weight"]
    elif case == "pos_i64":
        a["pos"], names = pos.astype(np.int64), ["pos"]
    elif case == "pos_len":
        a["pos"], names = np.zeros(m + 1, np.int32), ["pos"]
    elif case == "freq_len":
        a["freq"], names = freq[:-2].copy(), ["freq"]
    elif case == "freq_f64":
        a["freq"], names = freq.astype(np.float64), ["freq"]
    elif case == "eps_nan":
        names = ["eps"]
    elif case == "qkv_1d":
        a["qkv"], names, guards = qkv[0].copy(), [lead], []
    elif case == "qkv_list":
        a["qkv"], names, guards = f64(qkv).tolist(), [lead], []
    elif case == "partials_alias":  # partials inside the rows being written (forward) / dx (backward: allocated, so qkv shape instead)
        if bwd:
            a["qkv"], names = qkv[:, :-2], [lead, "x"]
        else:
            big = Guard((m, x.shape[1] + nq + 2 * nkv), x, pad=0, offset=0)
            a["qkv"], a["partials"], names, guards = big.view[:, :x.shape[1]], big.view[:, x.shape[1] - 1:-1], ["qkv", "partials"], []
    elif case in ("x_shape", "x_dtype", "dy_none"):
        if not bwd:
            opts[2], names = 2.0, ["head_dim"]
        elif case == "dy_none":
            a["qkv"], names, guards = None, ["dy"], []
    eps = math.nan if case == "eps_nan" else 1e-6
    if bwd:
        xx = {"x_shape": x[:, :-1], "x_dtype": x.astype(np.float16)}.get(case, x)
        if case in ("x_shape", "x_dtype"):
            names = ["x"]
        refused(lambda: encore.qk_norm_rope_backward(a["qkv"], xx, a["partials"], a["q_weight"], a["k_weight"], a["pos"], a["freq"], *opts,
                                                     eps=eps), names, guards)
    else:
        refused(lambda: encore.qk_norm_rope_(a["qkv"], a["partials"], a["q_weight"], a["k_weight"], a["pos"], a["freq"], *opts, eps=eps),
                names, guards)


# --- rope_freq_turns / interleave_gate_up ---------------------------------------------------------------

@VALID
@given(heads=st.integers(1, 9), rotary=st.integers(0, 9), hd=st.sampled_from([2, 4, 6, 8, 64, 128, 256]),
       base=st.sampled_from([1.5, 10000.0, 500000.0, 1e9]))
def test_rope_freq_turns_valid(heads, rotary, hd, base):
    rotary = min(rotary, heads)
    f = encore.rope_freq_turns(heads, rotary, hd, base)
    assert f.dtype == np.float32 and f.shape == (heads * hd,)
    i = np.arange(hd // 2)
    turns = base ** (-2.0 * i / hd) / (2 * np.pi)
    hi, lo = f.reshape(heads, hd // 2, 2)[..., 0], f.reshape(heads, hd // 2, 2)[..., 1]
    want = np.where(np.arange(heads)[:, None] < rotary, turns[None], 0.0)
    assert np.array_equal(hi, want.astype(F32)) and np.abs(hi.astype(np.float64) + lo - want).max() <= 1e-15 * np.abs(want).max(initial=1)


@INVALID
@given(heads=st.integers(-3, 5), rotary=st.integers(-2, 7), hd=st.sampled_from([-2, 0, 1, 3, 4]), base=st.sampled_from([10000.0, 1.0, 0.5, -2.0, math.nan]),
       bad_type=st.sampled_from([None, "heads", "hd", "base"]))
def test_rope_freq_turns_invalid(heads, rotary, hd, base, bad_type):
    ok = heads >= 1 and 0 <= rotary <= heads and hd >= 2 and hd % 2 == 0 and base > 1
    if ok and bad_type is None:
        hd = 3  # make the draw invalid
    names = []
    if not (heads >= 1 and 0 <= rotary <= heads):
        names += ["rotary_heads", "num_heads"]
    elif not (hd >= 2 and hd % 2 == 0):
        names += ["head_dim"]
    elif not base > 1:
        names += ["base"]
    if bad_type is not None:
        heads, hd, base = ("4" if bad_type == "heads" else heads), (4.0 if bad_type == "hd" else hd), ("1e4" if bad_type == "base" else base)
        names = [{"heads": "num_heads", "hd": "head_dim", "base": "base"}[bad_type]]
    refused(lambda: encore.rope_freq_turns(heads, rotary, hd, base), names)


@VALID
@given(seed=SEEDS, kind=st.sampled_from(IO_KINDS + ["np64"]), f=st.sampled_from([1, 2, 3, 17, 64]), k=st.sampled_from([1, 3, 8, 130]),
       pad=st.sampled_from([0, 2]), special=st.booleans())
def test_interleave_gate_up_valid(seed, kind, f, k, pad, special):
    rng = np.random.default_rng(seed)
    gv, uv = rng.standard_normal((f, k)), rng.standard_normal((f, k))
    gate, up = strided(make(inject(gv, rng, 0.05) if special else gv, kind), pad), strided(make(uv, kind), pad)
    out = encore.interleave_gate_up(gate, up)
    assert type(out) is type(gate) and out.dtype == gate.dtype and tuple(out.shape) == (2 * f, k)
    assert same_values(out[0::2], gate) and same_values(out[1::2], up)


@INVALID
@given(seed=SEEDS, case=st.sampled_from(["gate_1d", "up_shape", "up_dtype", "gate_list", "up_list", "up_none", "gate_none", "gate_3d", "up_str"]))
def test_interleave_gate_up_invalid(seed, case):
    rng = np.random.default_rng(seed)
    f, k = int(rng.integers(1, 5)), int(rng.integers(1, 5))
    gate, up = rng.standard_normal((f, k)).astype(F32), rng.standard_normal((f, k)).astype(F32)
    names = ["gate"]
    if case == "gate_1d":
        gate = gate[0]
    elif case == "up_shape":
        up, names = np.ones((f + 1, k), F32), ["up"]
    elif case == "up_dtype":
        up, names = up.astype(np.float64), ["up"]
    elif case == "gate_list":
        gate = gate.tolist()
    elif case == "up_list":
        up, names = up.tolist(), ["up"]
    elif case == "up_none":
        up, names = None, ["up"]
    elif case == "gate_none":
        gate = None
    elif case == "gate_3d":
        gate = gate[None]
    elif case == "up_str":
        up, names = "up", ["up"]
    refused(lambda: encore.interleave_gate_up(gate, up), names)


# --- regressions: the bugs these fuzzers found, as plain tests ----------------------------------------------

def test_regression_finisher_shapes_name_the_argument():
    """partials_sum of a 1-D array raised IndexError (a list: AttributeError), n <= 0 numpy's "negative
    dimensions"; rope_freq_turns of a negative head count the same; interleave_gate_up of a 1-D gate
    IndexError; cross_entropy_bwd named its out= "dlogits"."""
    refused(lambda: encore.partials_sum(np.ones(4, F32)), ["partials"])
    refused(lambda: encore.partials_sum([[1.0]]), ["partials"], kinds=(TypeError,))
    refused(lambda: encore.partials_sum(np.ones((4, 2), F32), per_column=True, n=-1), ["n"])
    refused(lambda: encore.rms_final_reduce([[1.0]], 8), ["partials"], kinds=(TypeError,))
    refused(lambda: encore.rope_freq_turns(-2, 1, 8), ["num_heads", "rotary_heads"])
    refused(lambda: encore.interleave_gate_up(np.ones(4, F32), np.ones(4, F32)), ["gate"])
    logits = np.ones((2, 3), F32)
    refused(lambda: encore.cross_entropy_bwd(logits, np.zeros(2, F32), np.zeros(2, np.int32), out=np.ones((2, 4), F32)), ["out"])
    refused(lambda: encore.qk_norm_rope_backward([[1.0]], logits, np.ones((2, 3), F32), np.ones(2, F32), np.ones(2, F32),
                                                 np.zeros(2, np.int32), np.zeros(6, F32), 1, 1, 2), ["dy"], kinds=(TypeError,))
