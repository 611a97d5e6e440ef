"""Property-based fuzzing of the moe family's public entry points on the CPU backend: moe_routing,
moe_dispatch (plain and the fused FP8 gather), moe_combine, moe_forward, moe_permuted_rows and
moe_buffers_bytes. Valid draws: numpy (float32, float16) and CPU torch (float32, bfloat16, float16)
inputs, odd and unit token counts, 1 to 64 experts, every top_k, softmax / sigmoid scoring, grouped
top-k with a correction bias, align_m powers of two, experts without tokens, duplicated experts in a
row, row-strided views, -inf (masked) and NaN logits, outputs and persistent buffers in
canary-guarded arrays; against the float64 numpy routing / forward of tests/python/test_moe.py and
the dispatch invariants. Invalid draws: ValueError / TypeError naming the argument.

Seeds: hypothesis with derandomize=True (fuzz_util.VALID: 200 draws, INVALID: 100 draws per test);
array contents from a drawn numpy seed."""
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import encore
from fuzz_util import (  # noqa: F401 (one_torch_thread: an autouse fixture)
    INVALID, SEEDS, VALID, Guard, close, f64, is_torch, kinds, make, refused, same_values, strided, torch, one_torch_thread)
from helpers import rel
from test_moe import forward_ref, routing_ref

IO_KINDS = kinds("np32", "np16", "t32", "tbf16", "t16")
F32 = np.float32
_T = st.sampled_from([1, 2, 3, 5, 9, 33])


def _np(a):
    """An int / float32 array as numpy (torch tensors through .numpy())."""
    return a.numpy() if is_torch(a) else np.asarray(a)


def _lib(a, like):
    return torch.from_numpy(np.ascontiguousarray(a)) if is_torch(like) else a


def _routing_case(data, rng, kind, t, e):
    """Options of a valid grouped / plain routing over e experts, and its logits and bias."""
    n_group = data.draw(st.sampled_from([g for g in (1, 2, 4, 8) if e % g == 0]))
    topk_group = data.draw(st.integers(1, n_group))
    k = data.draw(st.integers(1, topk_group * e // n_group))
    sigmoid = data.draw(st.booleans())
    bias = (0.1 * rng.standard_normal(e)).astype(F32) if data.draw(st.booleans()) else None
    return dict(k=k, sigmoid=sigmoid, renorm=data.draw(st.booleans()), n_group=n_group, topk_group=topk_group, bias=bias,
                scale=data.draw(st.sampled_from([1.0, 2.5, 0.125])))


# --- moe_routing -----------------------------------------------------------------------------------------

@VALID
@given(data=st.data(), seed=SEEDS, kind=st.sampled_from(IO_KINDS), t=_T, e=st.sampled_from([1, 2, 3, 4, 6, 8, 16, 64]), pad=st.sampled_from([0, 0, 3]),
       masked=st.booleans())
def test_moe_routing_valid(data, seed, kind, t, e, pad, masked):
    rng = np.random.default_rng(seed)
    c = _routing_case(data, rng, kind, t, e)
    lv = 2 * rng.standard_normal((t, e))
    if masked and not c["sigmoid"]:  # -inf logits: experts masked out of a row (one stays finite)
        lv[rng.random((t, e)) < 0.3] = -np.inf
        lv[:, 0] = np.where(np.isinf(lv).all(1), 0.0, lv[:, 0])
    logits = strided(make(lv, kind), pad)
    bias = c["bias"]
    if bias is not None and is_torch(logits) and data.draw(st.booleans()):
        bias = torch.from_numpy(bias).to(torch.bfloat16)
    ids, w = encore.moe_routing(logits, c["k"], scoring="sigmoid" if c["sigmoid"] else "softmax", renormalize=c["renorm"], n_group=c["n_group"],
                                topk_group=c["topk_group"], correction_bias=_lib(bias, logits) if bias is not None and not is_torch(bias) else bias,
                                routed_scaling_factor=c["scale"])
    with np.errstate(all="ignore"):
        rids, rw = routing_ref(f64(logits), c["k"], sigmoid=c["sigmoid"], renorm=c["renorm"], n_group=c["n_group"], topk_group=c["topk_group"],
                               bias=None if bias is None else f64(bias), scale=c["scale"])
    assert str(ids.dtype).endswith("int32") and str(w.dtype).endswith("float32") and tuple(ids.shape) == (t, c["k"])
    np.testing.assert_array_equal(_np(ids), rids)
    close(w, rw.astype(np.float64), "float32", rtol_ulps=8)


@INVALID
@given(seed=SEEDS, kind=st.sampled_from(IO_KINDS), case=st.sampled_from(
    ["k_0", "k_big", "k_str", "k_float", "scoring", "n_group", "topk_group", "k_groups", "bias_len", "bias_f64", "bias_2d", "logits_f64",
     "logits_1d", "logits_list", "logits_col_stride", "rsf_0", "rsf_nan", "rsf_str", "logits_empty"]))
def test_moe_routing_invalid(seed, kind, case):
    rng = np.random.default_rng(seed)
    t, e = int(rng.integers(1, 6)), 8
    logits = make(rng.standard_normal((t, e)), kind)
    kw, k, names = {}, 2, []
    if case == "k_0":
        k, names = 0, ["top_k"]
    elif case == "k_big":
        k, names = e + int(rng.integers(1, 4)), ["top_k"]
    elif case == "k_str":
        k, names = "2", ["top_k"]
    elif case == "k_float":
        k, names = 2.0, ["top_k"]
    elif case == "scoring":
        kw, names = {"scoring": str(rng.choice(["Softmax", "relu", ""]))}, ["scoring"]
    elif case == "n_group":
        kw, names = {"n_group": int(rng.choice([0, 3, 5, -2]))}, ["n_group"]
    elif case == "topk_group":
        kw, names = {"n_group": 4, "topk_group": int(rng.choice([0, 5]))}, ["topk_group"]
    elif case == "k_groups":  # more experts than the kept groups hold
        kw, k, names = {"n_group": 4, "topk_group": 1}, 3, ["top_k"]
    elif case == "bias_len":
        kw, names = {"correction_bias": _lib(np.zeros(e + 1, F32), logits)}, ["correction_bias"]
    elif case == "bias_f64":
        kw, names = {"correction_bias": _lib(np.zeros(e), logits)}, ["correction_bias"]
    elif case == "bias_2d":
        kw, names = {"correction_bias": _lib(np.zeros((1, e), F32), logits)}, ["correction_bias"]
    elif case == "logits_f64":
        logits, names = make(f64(logits), "np64"), ["logits"]
    elif case == "logits_1d":
        logits, names = logits[0], ["logits"]
    elif case == "logits_list":
        logits, names = f64(logits).tolist(), ["logits"]
    elif case == "logits_col_stride":
        logits, names = make(np.ones((t, 2 * e)), kind)[:, ::2], ["logits"]
    elif case.startswith("rsf"):
        kw, names = {"routed_scaling_factor": {"rsf_0": 0.0, "rsf_nan": float("nan"), "rsf_str": "1"}[case]}, ["routed_scaling_factor"]
    elif case == "logits_empty":
        logits, names = make(np.ones((t, 0)), kind), ["logits", "top_k"]
    refused(lambda: encore.moe_routing(logits, k, **kw), names)


# --- moe_dispatch ----------------------------------------------------------------------------------------

def _ids(rng, t, k, e, dup):
    ids = np.stack([rng.permutation(e)[:k] for _ in range(t)]).astype(np.int32)
    if dup and k > 1:
        ids[:, 1] = ids[:, 0]  # the same expert twice in a row: two slots, two rows
    return ids


@VALID
@given(seed=SEEDS, kind=st.sampled_from(IO_KINDS), t=_T, e=st.sampled_from([1, 2, 5, 8, 16]), kfrac=st.floats(0, 1),
       align=st.sampled_from([1, 2, 8, 64, 1024]), with_x=st.booleans(), fp8=st.booleans(), d=st.sampled_from([1, 7, 128, 256]),
       pad=st.sampled_from([0, 0, 8]), dup=st.booleans(), pow2=st.booleans())
def test_moe_dispatch_valid(seed, kind, t, e, kfrac, align, with_x, fp8, d, pad, dup, pow2):
    rng = np.random.default_rng(seed)
    k = 1 + int(kfrac * (e - 1))
    ids = _ids(rng, t, k, e, dup)
    fp8 = fp8 and with_x and d % 128 == 0
    x = strided(make(rng.standard_normal((t, d)) * 3, kind), pad) if with_x else None
    ids_a = _lib(ids, x) if x is not None else ids
    r = encore.moe_dispatch(ids_a, e, x=x, align_m=align, fp8=fp8, power_of_two_scales=pow2)
    counts, offs, rows, slots = (_np(r[key]) for key in ("expert_counts", "expert_offsets", "slot_rows", "row_slots"))
    np.testing.assert_array_equal(counts, np.bincount(ids.ravel(), minlength=e))
    assert offs[0] == 0 and np.all(offs % align == 0) and np.array_equal(np.diff(offs), -(-counts // align) * align)
    assert len(slots) == encore.moe_permuted_rows(t, k, e, align) and len(np.unique(rows)) == t * k
    np.testing.assert_array_equal(slots[rows.ravel()], np.arange(t * k))
    assert np.all(slots[np.setdiff1d(np.arange(len(slots)), rows.ravel())] == -1)
    for j in range(k):  # each slot's row lies in its expert's block
        assert np.all((rows[:, j] >= offs[ids[:, j]]) & (rows[:, j] < offs[ids[:, j] + 1]))
    if x is None:
        assert "x_permuted" not in r
        return
    xp = r["x_permuted"]
    used = int(offs[e])
    if not fp8:
        assert same_values(xp[rows], np.repeat(f64(x)[:, None, :], k, 1))
        assert np.all(f64(xp)[:used][slots[:used] < 0] == 0)  # padding rows zeroed
        return
    plain = encore.moe_dispatch(ids_a, e, x=x, align_m=align)["x_permuted"]
    q, s = encore.fp8_group_quant(plain[:used], power_of_two_scales=pow2)
    qb = (lambda a: a.view(torch.uint8).numpy() if is_torch(a) else a)
    np.testing.assert_array_equal(qb(xp[:used]), qb(q))
    np.testing.assert_array_equal(_np(r["x_scales"][:used]).view(np.uint32), _np(s).view(np.uint32))


@INVALID
@given(seed=SEEDS, kind=st.sampled_from(IO_KINDS), case=st.sampled_from(
    ["E_0", "E_str", "ids_oob", "ids_neg", "ids_i64", "ids_f32", "ids_1d", "ids_list", "k_gt_E", "align_3", "align_0", "align_2048",
     "align_float", "x_rows", "x_1d", "x_f64", "x_list", "fp8_no_x", "fp8_d", "x_col_stride", "ids_col_stride"]))
def test_moe_dispatch_invalid(seed, kind, case):
    rng = np.random.default_rng(seed)
    t, e, k = int(rng.integers(1, 6)), 6, 2
    ids, x = _ids(rng, t, k, e, False), make(rng.standard_normal((t, 128)), kind)
    kw, E, names = {"x": x}, e, []
    if case == "E_0":
        E, names = 0, ["num_experts"]
    elif case == "E_str":
        E, names = "6", ["num_experts"]
    elif case in ("ids_oob", "ids_neg"):
        ids[int(rng.integers(t)), int(rng.integers(k))] = e + int(rng.integers(0, 3)) if case == "ids_oob" else -1
        names = ["topk_ids"]
    elif case == "ids_i64":
        ids, names = ids.astype(np.int64), ["topk_ids"]
    elif case == "ids_f32":
        ids, names = ids.astype(F32), ["topk_ids"]
    elif case == "ids_1d":
        ids, names = ids[:, 0].copy(), ["topk_ids"]
    elif case == "ids_list":
        ids, names = ids.tolist(), ["topk_ids"]
    elif case == "k_gt_E":
        ids, names = np.zeros((t, e + 1), np.int32), ["topk_ids"]
    elif case.startswith("align"):
        kw["align_m"], names = {"align_3": 3, "align_0": 0, "align_2048": 2048, "align_float": 8.0}[case], ["align_m"]
    elif case == "x_rows":
        kw["x"], names = make(np.ones((t + 1, 128)), kind), ["x"]
    elif case == "x_1d":
        kw["x"], names = x[0], ["x"]
    elif case == "x_f64":
        kw["x"], names = make(np.ones((t, 128)), "np64"), ["x"]
    elif case == "x_list":
        kw["x"], names = f64(x).tolist(), ["x"]
    elif case == "fp8_no_x":
        kw, names = {"fp8": True}, ["x"]
    elif case == "fp8_d":
        kw, names = {"x": make(np.ones((t, 100)), kind), "fp8": True}, ["x_scales", "x", "D"]
    elif case == "x_col_stride":
        kw["x"], names = make(np.ones((t, 256)), kind)[:, ::2], ["x"]
    elif case == "ids_col_stride":
        ids, names = np.repeat(ids, 2, axis=1)[:, ::2], ["topk_ids"]
    ids_a = _lib(ids, x) if isinstance(ids, np.ndarray) and case != "ids_col_stride" else ids
    if case == "ids_col_stride" and is_torch(x):
        ids_a = torch.from_numpy(ids)
    refused(lambda: encore.moe_dispatch(ids_a, E, **kw), names)


# --- moe_combine -----------------------------------------------------------------------------------------

@VALID
@given(seed=SEEDS, kind=st.sampled_from(IO_KINDS), t=_T, k=st.integers(1, 6), r=st.sampled_from([1, 2, 7, 40]), d=st.sampled_from([1, 3, 16, 130]),
       out_mode=st.sampled_from(["new", "guard", "guard_f32", "guard_f16"]), pad=st.sampled_from([0, 4]), special=st.booleans())
def test_moe_combine_valid(seed, kind, t, k, r, d, out_mode, pad, special):
    rng = np.random.default_rng(seed)
    yv = rng.standard_normal((r, d))
    if special:
        yv[rng.random((r, d)) < 0.05] = np.nan
    y = strided(make(yv, kind), pad)
    rows = rng.integers(0, r, (t, k)).astype(np.int32)
    w = (rng.standard_normal((t, k)) * (rng.random((t, k)) > 0.1)).astype(F32)  # some zero weights
    out, g = None, None
    if out_mode != "new":
        dt = {"guard": None, "guard_f32": "f32", "guard_f16": "f16"}[out_mode]
        if dt is not None:
            dt = (torch.float32 if dt == "f32" else torch.float16) if is_torch(y) else (F32 if dt == "f32" else np.float16)
        g = Guard((t, d), y, dtype=dt, pad=3, offset=1)
        out = g.view
    got = encore.moe_combine(y, _lib(rows, y), _lib(w, y), out=out)
    if g is not None:
        assert got is g.view and g.intact()
    ys = f64(y)
    terms = w[:, :, None].astype(np.float64) * ys[rows]
    with np.errstate(all="ignore"):
        ref = terms.sum(1)
        mag = np.abs(terms).sum(1)
    out_dt = got.dtype
    close(got, ref, out_dt, rtol_ulps=2, atol=4 * k * 2.0**-24 * float(np.nanmax(mag, initial=0)))
    assert same_values(encore.moe_combine(y, _lib(rows, y), _lib(w, y)), encore.moe_combine(y, _lib(rows, y), _lib(w, y)))  # reproducible


@INVALID
@given(seed=SEEDS, kind=st.sampled_from(IO_KINDS), case=st.sampled_from(
    ["rows_oob", "rows_neg", "rows_i64", "rows_shape", "w_shape", "w_f64", "w_1d", "y_f64", "y_1d", "y_list", "out_shape", "out_f64",
     "out_alias_y", "out_list", "rows_list", "y_col_stride"]))
def test_moe_combine_invalid(seed, kind, case):
    rng = np.random.default_rng(seed)
    t, k, r, d = int(rng.integers(1, 5)), 2, 6, 4
    y, rows, w = make(rng.standard_normal((r, d)), kind), rng.integers(0, r, (t, k)).astype(np.int32), np.ones((t, k), F32)
    g = Guard((t, d), y)
    out, names, guards = g.view, [], [g]
    if case in ("rows_oob", "rows_neg"):
        rows[int(rng.integers(t)), int(rng.integers(k))] = r + int(rng.integers(0, 3)) if case == "rows_oob" else -int(rng.integers(1, 5))
        names = ["slot_rows"]
    elif case == "rows_i64":
        rows, names = rows.astype(np.int64), ["slot_rows"]
    elif case == "rows_shape":
        rows, names = np.zeros((t, k + 1), np.int32), ["slot_rows", "topk_weights"]
    elif case == "w_shape":
        w, names = np.ones((t + 1, k), F32), ["topk_weights"]
    elif case == "w_f64":
        w, names = w.astype(np.float64), ["topk_weights"]
    elif case == "w_1d":
        w, names = np.ones(t * k, F32), ["topk_weights"]
    elif case == "y_f64":
        y, names, guards = make(f64(y), "np64"), ["expert_out", "out"], []
    elif case == "y_1d":
        y, names, guards = y[0], ["expert_out"], []
    elif case == "y_list":
        y, names, guards = f64(y).tolist(), ["expert_out"], []
    elif case == "out_shape":
        g = Guard((t, d + 1), y)
        out, names, guards = g.view, ["out"], [g]
    elif case == "out_f64":
        g = Guard((t, d), y, dtype=torch.float64 if is_torch(y) else np.float64)
        out, names, guards = g.view, ["out"], [g]
    elif case == "out_alias_y":
        out, names, guards = y[:t], ["out"], []
    elif case == "out_list":
        out, names = [[0.0] * d] * t, ["out"]
    elif case == "rows_list":
        rows, names = rows.tolist(), ["slot_rows", "expert_out"]
    elif case == "y_col_stride":
        y, names, guards = make(np.ones((r, 2 * d)), kind)[:, ::2], ["expert_out"], []
    rows_a = _lib(rows, y) if isinstance(rows, np.ndarray) and not isinstance(y, list) else rows
    w_a = _lib(w, y) if not isinstance(y, list) else w
    refused(lambda: encore.moe_combine(y, rows_a, w_a, out=out), names, guards)


# --- moe_forward / moe_buffers_bytes / moe_permuted_rows ----------------------------------------------------

@VALID
@given(data=st.data(), seed=SEEDS, kind=st.sampled_from(IO_KINDS), t=st.sampled_from([1, 2, 3, 7, 9]), e=st.sampled_from([1, 2, 4, 8]),
       d=st.sampled_from([1, 3, 8, 16]), f=st.sampled_from([1, 2, 5, 8]), align=st.sampled_from([1, 4, 16]),
       mode=st.sampled_from(["plain", "buffers", "out"]))
def test_moe_forward_valid(data, seed, kind, t, e, d, f, align, mode):
    rng = np.random.default_rng(seed)
    c = _routing_case(data, rng, kind, t, e)
    x = make(rng.standard_normal((t, d)), kind)
    logits = make(2 * rng.standard_normal((t, e)), "np32")
    logits = _lib(logits, x)
    w13, w2 = make(rng.standard_normal((e, 2 * f, d)) / np.sqrt(d), kind), make(rng.standard_normal((e, d, f)) / np.sqrt(f), kind)
    kw = dict(scoring="sigmoid" if c["sigmoid"] else "softmax", renormalize=c["renorm"], n_group=c["n_group"], topk_group=c["topk_group"],
              correction_bias=None if c["bias"] is None else _lib(c["bias"], x), routed_scaling_factor=c["scale"], align_m=align)
    guard = None
    if mode == "buffers":
        max_tokens = t + int(rng.integers(0, 5))
        nbytes = encore.moe_buffers_bytes(max_tokens, d, f, e, c["k"], x, align)
        assert nbytes > 0
        kw.update(buffers=_lib(np.zeros(nbytes + 256, np.uint8), x), max_tokens=max_tokens)
    elif mode == "out":
        guard = Guard((t, d), x)
        kw["out"] = guard.view
    out = encore.moe_forward(x, logits, w13, w2, c["k"], **kw)
    if guard is not None:
        assert out is guard.view and guard.intact()
    assert out.dtype == x.dtype and tuple(out.shape) == (t, d)
    ref = forward_ref(f64(x), f64(logits), f64(w13), f64(w2), c["k"], sigmoid=c["sigmoid"], renorm=c["renorm"], n_group=c["n_group"],
                      topk_group=c["topk_group"], bias=c["bias"], scale=c["scale"])
    tol = {"np32": 1e-5, "t32": 1e-5, "np16": 6e-3, "t16": 6e-3}.get(kind, 3e-2)
    assert rel(f64(out), ref) <= tol or np.abs(f64(out) - ref).max() <= tol * 1e-2, rel(f64(out), ref)


@INVALID
@given(seed=SEEDS, kind=st.sampled_from(IO_KINDS), case=st.sampled_from(
    ["x_f64", "x_1d", "x_empty", "w13_odd", "w13_2d", "w13_d", "w2_shape", "w2_dtype", "logits_rows", "logits_list", "k_big", "k_0", "buffers_small",
     "buffers_f32", "buffers_torch_mix", "max_tokens_small", "max_tokens_str", "out_shape", "out_alias_x", "align_3", "bias_len"]))
def test_moe_forward_invalid(seed, kind, case):
    rng = np.random.default_rng(seed)
    t, e, d, f = int(rng.integers(1, 5)), 4, 8, 4
    x, logits = make(rng.standard_normal((t, d)), kind), make(rng.standard_normal((t, e)), "np32")
    logits = _lib(logits, x)
    w13, w2 = make(rng.standard_normal((e, 2 * f, d)), kind), make(rng.standard_normal((e, d, f)), kind)
    kw, k, names, guards = {}, 2, [], []
    if case == "x_f64":
        x, names = make(f64(x), "np64"), ["x"]
    elif case == "x_1d":
        x, names = x[0], ["x"]
    elif case == "x_empty":
        x, names = make(np.ones((0, d)), kind), ["x"]
    elif case == "w13_odd":
        w13, names = w13[:, :-1], ["w13"]
    elif case == "w13_2d":
        w13, names = w13[0], ["w13"]
    elif case == "w13_d":
        w13, names = make(np.ones((e, 2 * f, d + 1)), kind), ["w13"]
    elif case == "w2_shape":
        w2, names = make(np.ones((e, d, f + 1)), kind), ["w2"]
    elif case == "w2_dtype":
        w2, names = make(f64(w2), "np64"), ["w2"]
    elif case == "logits_rows":
        logits, names = _lib(np.ones((t + 1, e), F32), x), ["router_logits"]
    elif case == "logits_list":
        logits, names = np.ones((t, e)).tolist(), ["router_logits"]
    elif case == "k_big":
        k, names = e + 1, ["top_k"]
    elif case == "k_0":
        k, names = 0, ["top_k"]
    elif case.startswith("buffers"):
        nbytes = encore.moe_buffers_bytes(t, d, f, e, k, x)
        buf = {"buffers_small": np.zeros(nbytes // 2, np.uint8), "buffers_f32": np.zeros(nbytes, F32)}.get(case)
        if case == "buffers_torch_mix":
            buf = np.zeros(nbytes + 256, np.uint8) if is_torch(x) else (torch.zeros(nbytes + 256, dtype=torch.uint8) if torch is not None else None)
        if buf is None:
            buf = np.zeros(3, np.uint8)
        kw, names = {"buffers": buf}, ["buffers"]
    elif case == "max_tokens_small":
        t2 = t + 2
        x, logits, names = make(np.ones((t2, d)), kind), _lib(np.ones((t2, e), F32), x), ["max_tokens", "buffers", "buffers.topk_ids"]
        kw = {"max_tokens": t2 - 1}
    elif case == "max_tokens_str":
        kw, names = {"max_tokens": "8"}, ["max_tokens"]
    elif case == "out_shape":
        g = Guard((t, d + 1), x)
        kw, names, guards = {"out": g.view}, ["out"], [g]
    elif case == "out_alias_x":
        kw, names = {"out": x}, ["out"]
    elif case == "align_3":
        kw, names = {"align_m": 3}, ["align_m"]
    elif case == "bias_len":
        kw, names = {"correction_bias": _lib(np.zeros(e + 1, F32), x)}, ["correction_bias"]
    refused(lambda: encore.moe_forward(x, logits, w13, w2, k, **kw), names, guards)


@VALID
@given(t=st.integers(0, 10**6), e=st.integers(1, 2**20 - 1), kfrac=st.floats(0, 1), align_log=st.integers(0, 10))
def test_moe_permuted_rows_and_bytes_valid(t, e, kfrac, align_log):
    k, align = 1 + int(kfrac * (min(e, 64) - 1)), 2**align_log
    assert encore.moe_permuted_rows(t, k, e, align) == t * k + min(e, t * k) * (align - 1)
    tb, eb = 1 + t % 4096, 1 + e % 64  # moe_buffers_bytes on every draw, at sizes that stay cheap
    kb = min(k, eb)
    x = np.zeros(1, F32)
    nbytes = encore.moe_buffers_bytes(tb, 16, 8, eb, kb, x, align)
    assert nbytes >= 16 * encore.moe_permuted_rows(tb, kb, eb, align) * 4  # x_permuted alone
    assert encore.moe_buffers_bytes(tb + 1, 16, 8, eb, kb, x, align) >= nbytes


@INVALID
@given(t=st.integers(-5, 5), k=st.integers(-2, 9), e=st.sampled_from([-1, 0, 4, 2**20]), align=st.sampled_from([0, 1, 3, 8, 2048, -4]),
       bad_type=st.sampled_from([None, "tokens", "top_k", "align_m"]))
def test_moe_permuted_rows_invalid(t, k, e, align, bad_type):
    ok = t >= 0 and 1 <= e < 2**20 and 1 <= k <= e and 1 <= align <= 1024 and align & (align - 1) == 0
    if ok and bad_type is None:
        align = 3
    args = {"tokens": t, "top_k": k, "num_experts": e, "align_m": align}
    if bad_type is not None:
        args[bad_type] = {"tokens": "5", "top_k": 1.5, "align_m": None}[bad_type]
    refused(lambda: encore.moe_permuted_rows(**args), ["tokens", "top_k", "num_experts", "align_m"])


@INVALID
@given(t=st.integers(-3, 4), d=st.integers(-1, 9), f=st.integers(-1, 5), e=st.integers(-1, 9), k=st.integers(-1, 10), align=st.sampled_from([1, 3, 8, 0]),
       bad_type=st.sampled_from([None, None, "like", "max_tokens", "top_k", "align_m"]))
def test_moe_buffers_bytes_invalid(t, d, f, e, k, align, bad_type):
    """An invalid shape or option: 0 bytes (the documented contract); an argument of a wrong type: TypeError naming it."""
    ok = t >= 1 and d >= 1 and f >= 1 and 1 <= e and 1 <= k <= e and align in (1, 8)
    args = {"max_tokens": t, "hidden": d, "intermediate": f, "num_experts": e, "top_k": k, "like": np.zeros(1, F32), "align_m": align}
    if bad_type is None:
        if ok:
            args["top_k"] = e + 1
        assert encore.moe_buffers_bytes(**args) == 0
        return
    args[bad_type] = {"like": [0.0], "max_tokens": 4.0, "top_k": "2", "align_m": None}[bad_type]
    refused(lambda: encore.moe_buffers_bytes(**args), [bad_type], kinds=(TypeError,))


# --- regressions: the bugs these fuzzers found, as plain tests ----------------------------------------------

def test_regression_moe_messages_name_the_argument():
    """A negative top_k raised numpy's "negative dimensions"; moe_forward named its buffers "workspace" and
    x's dtype "shape"; moe_permuted_rows took a negative token count (negative rows) and align_m 3."""
    x, logits = np.ones((3, 8), F32), np.zeros((3, 4), F32)
    w13, w2 = np.ones((4, 4, 8), F32), np.ones((4, 8, 2), F32)
    refused(lambda: encore.moe_routing(logits, -1), ["top_k"])
    refused(lambda: encore.moe_forward(x, logits, w13, w2, 2, buffers=np.zeros(10, np.uint8)), ["buffers"])
    refused(lambda: encore.moe_forward(x.astype(np.float64), logits, w13, w2, 2), ["x"])
    refused(lambda: encore.moe_permuted_rows(-5, 2, 8, 4), ["tokens"])
    refused(lambda: encore.moe_permuted_rows(5, 2, 8, 3), ["align_m"])
    refused(lambda: encore.moe_buffers_bytes(5, 16, 6, 8, 2, [1.0]), ["like"], kinds=(TypeError,))
