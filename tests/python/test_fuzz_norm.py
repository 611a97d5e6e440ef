"""Property-based fuzzing of the norm family's public entry points on the CPU backend: rms_norm,
add_rms_norm and qk_norm_ over numpy (float32, float16) and CPU torch (float32, bfloat16, float16)
arrays, odd and unit sizes, row-strided views, 3-D inputs, every h_out mode, eps / weight_offset,
NaN / inf in the data; against a float64 numpy reference, with outputs in canary-guarded buffers.
Invalid draws (wrong dtypes, ranks, sizes, strides, types, aliasing, non-finite options) must raise
ValueError / TypeError naming the argument and write nothing.

Seeds: hypothesis with derandomize=True (fuzz_util.VALID: 200 draws, INVALID: 100 draws per test), so
the draws follow from the test names and reproduce in CI; array contents come from a drawn numpy seed."""
import numpy as np
from hypothesis import example, given
from hypothesis import strategies as st

import encore
from fuzz_util import (  # noqa: F401 (one_torch_thread: an autouse fixture)
    INVALID, SEEDS, VALID, Guard, as_float64, bits, close, f64, inject, is_torch, kinds, make, refused, same_values, strided, torch, one_torch_thread)

NORM_KINDS = kinds("np32", "np16", "t32", "tbf16", "t16")
HALF_KINDS = kinds("np16", "tbf16", "t16")


def _f32(v):
    return float(np.float32(v))


def rms_ref(h, w, eps, offset):
    """y = h / sqrt(mean(h**2) + eps) * (w + offset) in float64 (eps and offset as the float32 options)."""
    with np.errstate(all="ignore"):
        r = 1.0 / np.sqrt((h * h).mean(-1, keepdims=True) + _f32(eps))
        return h * r * (w + _f32(offset))


def _rounded_sum(x, r):
    """x + r added in float32 and rounded to x's dtype (what add_rms_norm writes to h)."""
    if is_torch(x):
        return (x.float() + r.float()).to(x.dtype)
    with np.errstate(all="ignore"):
        return (x.astype(np.float32) + r.astype(np.float32)).astype(x.dtype)


_ROWS = st.sampled_from([1, 2, 3, 5, 7, 9, 17, 33])
_HIDDEN = st.sampled_from([1, 2, 3, 7, 8, 15, 64, 127, 128, 129, 1000, 4096])
_EPS = st.sampled_from([0.0, 1e-6, 1e-5, 0.1, 1.0])
_OFFSET = st.sampled_from([0.0, 1.0, -0.5])


def _input(rng, rows, hidden, kind, special, scale=1.0):
    v = scale * rng.standard_normal((rows, hidden))
    return make(inject(v, rng, 0.03) if special else v, kind)


# --- rms_norm -----------------------------------------------------------------------------------------

@VALID
@given(seed=SEEDS, kind=st.sampled_from(NORM_KINDS), rows=_ROWS, hidden=_HIDDEN, lead=st.sampled_from([0, 0, 2, 3]),
       pad=st.sampled_from([0, 0, 1, 8, 13]), eps=_EPS, offset=_OFFSET, special=st.booleans(), scale=st.sampled_from([1e-3, 1.0, 30.0]),
       numpy_weight=st.booleans())
def test_rms_norm_valid(seed, kind, rows, hidden, lead, pad, eps, offset, special, scale, numpy_weight):
    rng = np.random.default_rng(seed)
    rows = max(1, min(rows, 20000 // hidden))
    x = _input(rng, rows * max(lead, 1), hidden, kind, special, scale)
    x = x.reshape(lead, rows, hidden) if lead else strided(x, pad)
    w = make(1.0 + 0.5 * rng.standard_normal(hidden), kind)
    if numpy_weight and kind in ("t32", "t16"):  # CPU frameworks mixed: a numpy weight beside a torch x
        w = w.numpy()
    x_before = bits(x)
    y = encore.rms_norm(x, w, eps=eps, weight_offset=offset)
    assert type(y) is type(x) and y.dtype == x.dtype and tuple(y.shape) == tuple(x.shape)
    assert np.array_equal(bits(x), x_before)  # the input is not written
    close(y, rms_ref(f64(x), f64(w), eps, offset), x.dtype)


@INVALID
@given(seed=SEEDS, kind=st.sampled_from(NORM_KINDS), case=st.sampled_from(
    ["x_int", "x_f64", "x_u8", "w_dtype", "w_len", "w_2d", "x_0d", "x_no_rows", "x_no_hidden", "x_col_stride", "w_stride", "eps_neg",
     "eps_nan", "eps_inf", "eps_str", "offset_nan", "offset_inf", "offset_str", "x_list", "w_none", "w_str", "x_readonly"]))
def test_rms_norm_invalid(seed, kind, case):
    rng = np.random.default_rng(seed)
    rows, hidden = int(rng.integers(1, 9)), int(rng.integers(2, 70))
    x, w = _input(rng, rows, hidden, kind, False), make(np.ones(hidden), kind)
    kw, name = {}, "x"
    if case == "x_int":
        x = x.to(torch.int32) if is_torch(x) else x.astype(np.int32)
    elif case == "x_f64":
        x, w = (x.double(), w.double()) if is_torch(x) else (x.astype(np.float64), w.astype(np.float64))
    elif case == "x_u8":
        x = x.to(torch.uint8) if is_torch(x) else x.astype(np.uint8)
    elif case == "w_dtype":
        w, name = as_float64(w), "weight"
    elif case == "w_len":
        w, name = make(np.ones(hidden + int(rng.choice([-1, 1]))), kind), "weight"
    elif case == "w_2d":
        w, name = make(np.ones((2, hidden)), kind), "weight"
    elif case == "x_0d":
        x = make(np.array(1.0), kind)
    elif case == "x_no_rows":
        x = make(np.ones((0, hidden)), kind)
    elif case == "x_no_hidden":
        x, w = make(np.ones((rows, 0)), kind), make(np.ones(0), kind)
    elif case == "x_col_stride":
        x, w = make(np.ones((rows, 2 * hidden)), kind)[:, ::2], make(np.ones(hidden), kind)
    elif case == "w_stride":
        w, name = make(np.ones(2 * hidden), kind)[::2], "weight"
    elif case.startswith(("eps", "offset")):
        key, what = case.split("_")
        name = "eps" if key == "eps" else "weight_offset"
        kw[name] = {"neg": -1e-3, "nan": float("nan"), "inf": float("inf"), "str": "1e-6"}[what]
    elif case == "x_list":
        x = f64(x).tolist()
    elif case == "w_none":
        w, name = None, "weight"
    elif case == "w_str":
        w, name = "weight", "weight"
    elif case == "x_readonly":
        x = f64(x).astype(np.float32)
        x.flags.writeable = False
        w = np.ones(hidden, np.float32)
    refused(lambda: encore.rms_norm(x, w, **kw), [name])


# --- add_rms_norm -------------------------------------------------------------------------------------

@VALID
@given(seed=SEEDS, kind=st.sampled_from(NORM_KINDS), rows=_ROWS, hidden=_HIDDEN, lead=st.sampled_from([0, 0, 2]),
       pad=st.sampled_from([0, 0, 1, 8]), mode=st.sampled_from(["new", "residual", "x", "guard"]), eps=_EPS, offset=_OFFSET,
       special=st.booleans())
def test_add_rms_norm_valid(seed, kind, rows, hidden, lead, pad, mode, eps, offset, special):
    rng = np.random.default_rng(seed)
    rows = max(1, min(rows, 20000 // hidden))
    if mode == "guard":
        lead = 0
    x = _input(rng, rows * max(lead, 1), hidden, kind, special)
    r = _input(rng, rows * max(lead, 1), hidden, kind, special)
    x, r = (x.reshape(lead, rows, hidden), r.reshape(lead, rows, hidden)) if lead else (strided(x, pad), strided(r, pad))
    w = make(1.0 + 0.5 * rng.standard_normal(hidden), kind)
    h_ref = _rounded_sum(x, r)
    y_ref = rms_ref(f64(h_ref), f64(w), eps, offset)
    guard = None
    h_out = {"new": None, "residual": r, "x": x}.get(mode)
    if mode == "guard":
        guard = Guard(x.shape, x, pad=int(rng.integers(1, 9)), offset=int(rng.integers(0, 4)))
        h_out = guard.view
    x_before, r_before = bits(x), bits(r)
    y, h = encore.add_rms_norm(x, r, w, eps=eps, weight_offset=offset, h_out=h_out)
    assert type(y) is type(x) and y.dtype == x.dtype and tuple(y.shape) == tuple(x.shape) and tuple(h.shape) == tuple(x.shape)
    if h_out is not None:
        assert h is h_out
    assert same_values(h, h_ref)  # h rounded to the dtype, exactly
    close(y, y_ref, x.dtype)
    if mode != "x":
        assert np.array_equal(bits(x), x_before)
    if mode != "residual":
        assert np.array_equal(bits(r), r_before)
    if guard is not None:
        assert guard.intact()


@INVALID
@given(seed=SEEDS, kind=st.sampled_from(NORM_KINDS), case=st.sampled_from(
    ["r_rows", "r_hidden", "r_dtype", "r_col_stride", "h_shape", "h_dtype", "h_col_stride", "h_overlap_x", "h_overlap_r", "h_overlap_w",
     "h_rows_overlap", "h_not_viewable", "h_list", "r_list", "w_len", "eps_nan", "eps_str", "offset_inf", "x_int", "r_none"]))
def test_add_rms_norm_invalid(seed, kind, case):
    rng = np.random.default_rng(seed)
    rows, hidden = int(rng.integers(2, 9)), int(rng.integers(2, 70))
    x, r, w = _input(rng, rows, hidden, kind, False), _input(rng, rows, hidden, kind, False), make(np.ones(hidden), kind)
    guard = Guard((rows, hidden), x, pad=4, offset=2)
    h_out, kw, names, guards = guard.view, {}, ["h_out", "h"], [guard]
    if case == "r_rows":
        r, names = make(np.ones((rows + 1, hidden)), kind), ["residual"]
    elif case == "r_hidden":
        r, names = make(np.ones((rows, hidden + 1)), kind), ["residual"]
    elif case == "r_dtype":
        r, names = as_float64(r), ["residual"]
    elif case == "r_col_stride":
        r, names = make(np.ones((rows, 2 * hidden)), kind)[:, ::2], ["residual"]
    elif case == "h_shape":
        guard = Guard((rows, hidden + 1), x)
        h_out, guards = guard.view, [guard]
    elif case == "h_dtype":
        guard = Guard((rows, hidden), x, dtype=torch.float64 if is_torch(x) else np.float64)
        h_out, guards = guard.view, [guard]
    elif case == "h_col_stride":
        guard = Guard((rows, 2 * hidden), x)
        h_out, guards = guard.view[:, ::2], [guard]
    elif case in ("h_overlap_x", "h_overlap_r"):  # h a shifted view of the buffer x (or residual) lives in: partial overlap
        g2 = Guard((rows + 1, hidden), x, pad=0, offset=0)
        g2.set(make(rng.standard_normal((rows + 1, hidden)), kind))
        src, h_out = g2.view[:rows], g2.view[1:]
        x, r = (src, r) if case == "h_overlap_x" else (x, src)
        guards = [g2]
    elif case == "h_overlap_w":
        g2 = Guard((1, rows * hidden + hidden), x, pad=0, offset=0)
        flat = g2.view[0]
        w, h_out, guards, names = flat[:hidden], flat[hidden // 2:hidden // 2 + rows * hidden].reshape(rows, hidden), [g2], ["h", "h_out", "weight"]
        g2.set(make(np.ones((1, rows * hidden + hidden)), kind))
    elif case == "h_rows_overlap":  # a row stride shorter than the rows
        if is_torch(x):
            h_out = torch.empty(rows * hidden, dtype=x.dtype).as_strided((rows, hidden), (max(hidden - 1, 1), 1))
        else:
            h_out = np.lib.stride_tricks.as_strided(np.empty(rows * hidden, x.dtype), (rows, hidden), (max(hidden - 1, 1) * x.itemsize, x.itemsize))
        guards = []
    elif case == "h_not_viewable":  # 3-D, the first two dimensions not mergeable without a copy
        x, r = make(np.ones((2, rows, hidden)), kind), make(np.ones((2, rows, hidden)), kind)
        h_out, guards = make(np.zeros((2, rows + 1, hidden)), kind)[:, :rows, :], []
    elif case == "h_list":
        h_out, guards = [[0.0] * hidden] * rows, []
    elif case == "r_list":
        r, names = f64(r).tolist(), ["residual"]
    elif case == "w_len":
        w, names = make(np.ones(hidden + 1), kind), ["weight"]
    elif case == "eps_nan":
        kw, names = {"eps": float("nan")}, ["eps"]
    elif case == "eps_str":
        kw, names = {"eps": "0.1"}, ["eps"]
    elif case == "offset_inf":
        kw, names = {"weight_offset": -float("inf")}, ["weight_offset"]
    elif case == "x_int":
        x, names = (x.to(torch.int32) if is_torch(x) else x.astype(np.int32)), ["x"]
    elif case == "r_none":
        r, names = None, ["residual"]
    refused(lambda: encore.add_rms_norm(x, r, w, h_out=h_out, **kw), names, guards)


# --- qk_norm_ -----------------------------------------------------------------------------------------

def _qkv_guard(rng, kind, tokens, width, pad):
    """qkv [tokens, width] as a 16-byte aligned, row-strided view in a canary buffer (a row above and below)."""
    like = make(np.zeros(1), kind)
    g = Guard((tokens, width), like, pad=pad, offset=0)
    g.set(make(rng.standard_normal((tokens, width)), kind))
    return g


@VALID
@given(seed=SEEDS, kind=st.sampled_from(HALF_KINDS), head_dim=st.sampled_from([64, 128, 256]), nq=st.integers(1, 5), nkv=st.integers(1, 3),
       tokens=st.sampled_from([1, 2, 3, 5, 9, 17]), pad=st.sampled_from([0, 8, 24]), eps=_EPS, offset=_OFFSET, special=st.booleans())
@example(seed=1, kind=HALF_KINDS[0], head_dim=256, nq=5, nkv=3, tokens=17, pad=24, eps=0.0, offset=0.0, special=True)
def test_qk_norm_valid(seed, kind, head_dim, nq, nkv, tokens, pad, eps, offset, special):
    rng = np.random.default_rng(seed)
    width = (nq + 2 * nkv) * head_dim
    g = _qkv_guard(rng, kind, tokens, width, pad)
    if special:
        g.set(make(inject(f64(g.view), rng, 0.01), kind))
    qkv = g.view
    qw, kw = make(1 + 0.3 * rng.standard_normal(head_dim), kind), make(1 + 0.3 * rng.standard_normal(head_dim), kind)
    before = f64(qkv).copy()
    v_bits = bits(qkv[:, (nq + nkv) * head_dim:])
    assert encore.qk_norm_(qkv, qw, kw, nq, nkv, head_dim, eps=eps, weight_offset=offset) is qkv
    assert g.intact()
    assert np.array_equal(bits(qkv[:, (nq + nkv) * head_dim:]), v_bits)  # V heads bit-identical
    heads = before[:, :(nq + nkv) * head_dim].reshape(tokens, nq + nkv, head_dim)
    w = np.concatenate([np.repeat(f64(qw)[None], nq, 0), np.repeat(f64(kw)[None], nkv, 0)])
    ref = rms_ref(heads, w[None], eps, offset).reshape(tokens, -1)
    close(qkv[:, :(nq + nkv) * head_dim], ref, qkv.dtype)


@INVALID
@given(seed=SEEDS, kind=st.sampled_from(HALF_KINDS), case=st.sampled_from(
    ["head_dim_32", "head_dim_0", "head_dim_str", "nq_0", "nkv_neg", "nq_float", "width", "qkv_f32", "qkv_3d", "token_stride", "qw_len",
     "kw_dtype", "qw_alias", "kw_unaligned", "eps_neg", "offset_nan", "qkv_list", "kw_str", "qkv_unaligned"]))
def test_qk_norm_invalid(seed, kind, case):
    rng = np.random.default_rng(seed)
    hd, nq, nkv, tokens = int(rng.choice([64, 128])), int(rng.integers(1, 4)), int(rng.integers(1, 3)), int(rng.integers(2, 6))
    width = (nq + 2 * nkv) * hd
    g = _qkv_guard(rng, kind, tokens, width, 8)
    qkv, qw, kw = g.view, make(np.ones(hd), kind), make(np.ones(hd), kind)
    args, opts, names, guards = [nq, nkv, hd], {}, [], [g]
    if case == "head_dim_32":
        args[2], qw, kw, names = 32, make(np.ones(32), kind), make(np.ones(32), kind), ["head_dim"]
    elif case == "head_dim_0":
        args[2], names = 0, ["head_dim"]
    elif case == "head_dim_str":
        args[2], names = "64", ["head_dim"]
    elif case == "nq_0":
        args[0], names = 0, ["num_q_heads"]
    elif case == "nkv_neg":
        args[1], names = -1, ["num_kv_heads"]
    elif case == "nq_float":
        args[0], names = 1.5, ["num_q_heads"]
    elif case == "width":
        args[0], names = nq + 1, ["qkv"]
    elif case == "qkv_f32":
        qkv, qw, kw, names, guards = make(f64(qkv), "np32"), make(np.ones(hd), "np32"), make(np.ones(hd), "np32"), ["qkv"], []
    elif case == "qkv_3d":
        qkv, names, guards = make(f64(qkv), kind).reshape(1, tokens, width), ["qkv"], []
    elif case == "token_stride":  # rows 4 elements apart beyond the width: heads not 16-byte aligned
        g = Guard((tokens, width), qkv, pad=4, offset=0)
        qkv, names, guards = g.view, ["qkv"], [g]
    elif case == "qkv_unaligned":
        g = Guard((tokens, width), qkv, pad=8, offset=1)
        qkv, names, guards = g.view, ["qkv"], [g]
    elif case == "qw_len":
        qw, names = make(np.ones(hd + 8), kind), ["q_weight"]
    elif case == "kw_dtype":
        kw, names = (kw.float() if is_torch(kw) else kw.astype(np.float32)), ["k_weight"]
    elif case == "qw_alias":
        qw, names = qkv[0, :hd], ["q_weight"]
    elif case == "kw_unaligned":
        kw, names = make(np.ones(hd + 1), kind)[1:], ["k_weight"]
    elif case == "eps_neg":
        opts, names = {"eps": -1.0}, ["eps"]
    elif case == "offset_nan":
        opts, names = {"weight_offset": float("nan")}, ["weight_offset"]
    elif case == "qkv_list":
        qkv, names, guards = f64(qkv).tolist(), ["qkv"], []
    elif case == "kw_str":
        kw, names = "k", ["k_weight"]
    refused(lambda: encore.qk_norm_(qkv, qw, kw, *args, **opts), names, guards)


# --- regressions: the bugs these fuzzers found, as plain tests ----------------------------------------------

def test_regression_add_rms_norm_in_place_single_strided_row():
    """h_out=residual on a 1-row, row-strided view was refused as overlapping (the reshaped view's stride in
    the size-1 dimension differed); a size-1 dimension's stride no longer counts in the exact-alias test."""
    buf = np.zeros((1, 9), np.float32)
    r = buf[:, :4]
    r[...] = [1, 2, 3, 4]
    x, w = np.ones((1, 4), np.float32), np.ones(4, np.float32)
    y, h = encore.add_rms_norm(x, r, w, h_out=r)
    assert h is r and np.array_equal(r, [[2, 3, 4, 5]]) and np.all(buf[:, 4:] == 0)


def test_regression_non_arrays_and_read_only_arrays_name_the_argument():
    """A non-array (or a read-only numpy array) for an array argument raised nanobind's overload TypeError,
    which names no argument; a str eps was parsed, a float head count truncated."""
    x, w = np.ones((2, 8), np.float32), np.ones(8, np.float32)
    refused(lambda: encore.rms_norm(x, "weight"), ["weight"], kinds=(TypeError,))
    ro = x.copy()
    ro.flags.writeable = False
    refused(lambda: encore.rms_norm(ro, w), ["x"], kinds=(TypeError,))
    refused(lambda: encore.rms_norm(x, w, eps="1e-6"), ["eps"], kinds=(TypeError,))
    qkv = np.zeros((1, 4 * 64), np.float16)
    refused(lambda: encore.qk_norm_(qkv, np.ones(64, np.float16), np.ones(64, np.float16), 1.5, 1, 64), ["num_q_heads"], kinds=(TypeError,))


def test_regression_torch_native_path_mixed_or_missing_arguments():
    """The torch dispatcher path of the norm ops raised RuntimeError for a numpy weight beside a torch x
    (a CPU mix the Python launcher computes) and for weight=None (instead of naming it)."""
    if torch is None:
        return
    x, w = torch.randn(3, 16), np.ones(16, np.float32)
    close(encore.rms_norm(x, w), rms_ref(f64(x), f64(w), 1e-6, 0.0), x.dtype)
    refused(lambda: encore.rms_norm(x, None), ["weight"])
    refused(lambda: encore.add_rms_norm(x, None, torch.ones(16)), ["residual"])
