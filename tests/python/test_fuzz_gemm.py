"""Property-based fuzzing of the GEMM-epilogue family's public entry points on the CPU backend:
gemm_epilogue (every catalogue row), the named wrappers (gemm_row_scale, gemm_scalar_scale,
gemm_residual_rms_partial, gemm_swiglu, gemm_rope, gemm_qkv_head_sqsum, gemm_lse), the finishers
(rms_final_reduce, lse_finish, partials_sum, cross_entropy_bwd / cross_entropy_bwd_), the QK-norm +
RoPE finish and its backward (qk_norm_rope_, qk_norm_rope_backward) and the host helpers
(rope_freq_turns, interleave_gate_up). Valid draws: numpy (float32, float16) and CPU torch (float32,
bfloat16, float16) operands, M / N / K odd, 1 and up to a few hundred, row-strided views, optional
operands, partial tile widths, ignore_index rows, NaN / inf in the data where it is data; against
the float64 numpy math of include/encore/gemm_epilogues.def (docs/math/gemm_epilogues.md) and torch
autograd in float64 for the backward. Invalid draws: ValueError / TypeError naming the argument.

Seeds: hypothesis with derandomize=True (fuzz_util.VALID: 200 draws, INVALID: 100 draws per test and
parameter); array contents from a drawn numpy seed."""
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import encore
from fuzz_util import (  # noqa: F401 (one_torch_thread: an autouse fixture)
    INVALID, SEEDS, VALID, as_float64, close, f64, inject, is_torch, kinds, make, refused, strided, torch, one_torch_thread)

IO_KINDS = kinds("np32", "np16", "t32", "tbf16", "t16")
ROWS = [e.name for e in encore.Epilogue]
_M = st.sampled_from([1, 2, 3, 5, 9, 17, 33, 130])
_K = st.sampled_from([1, 3, 8, 16, 31, 64])
_N = st.sampled_from([1, 2, 3, 6, 8, 13, 64, 130, 258])
F32 = np.float32


def _f32(a, like):
    """A float32 array on like's framework."""
    return torch.from_numpy(np.ascontiguousarray(a, F32)) if is_torch(like) else np.ascontiguousarray(a, F32)


def _i32(a, like):
    return torch.from_numpy(np.ascontiguousarray(a, np.int32)) if is_torch(like) else np.ascontiguousarray(a, np.int32)


def silu(x):
    return x / (1 + np.exp(-x))


def rope_ref(z, pos, freq, inverse=False):
    """Column pairs rotated by 2*pi*pos*(freq[2j] + freq[2j+1]) turns (range-reduced), -theta for the inverse."""
    f = freq[0::2] + freq[1::2]
    turns = pos[:, None] * f[None]
    th = 2 * np.pi * (turns - np.rint(turns)) * (-1 if inverse else 1)
    a, b = z[:, 0::2], z[:, 1::2]
    out = np.empty_like(z)
    out[:, 0::2], out[:, 1::2] = a * np.cos(th) - b * np.sin(th), b * np.cos(th) + a * np.sin(th)
    return np.where(f[None].repeat(2, -1) == 0, z, out)  # frequency 0: untouched (V heads)


def tiles(v, t, f=np.sum):
    """f over consecutive column tiles of width t: [M, ceil(N / t)]."""
    return np.stack([f(v[:, j:j + t], axis=1) for j in range(0, v.shape[1], t)], 1)


def lse_tiles(z, t):
    def lse(x, axis):
        mx = x.max(axis)
        with np.errstate(all="ignore"):
            return np.where(np.isneginf(mx), -np.inf, mx + np.log(np.exp(x - mx[:, None]).sum(axis)))
    return tiles(z, t, lse)


def rows_ref(name, a, w, op, tile, head_dim, ignore_index):
    """The row's outputs {key: float64} from float64 operands (the catalogue's math)."""
    if name == "wgrad":
        acc = a.T @ w
    elif name in ("swiglu_bwd", "rmsnorm_bwd", "dgrad"):
        acc = a @ w
    else:
        acc = a @ w.T
    z = acc * (op["row_scale"][:, None] if op.get("row_scale") is not None else 1.0)
    if name in ("residual_sqsum_aux", "residual_add"):
        y = acc + op["c"]
        out = {"d": y}
        if name == "residual_sqsum_aux":
            out.update(aux=y * op["gamma"], partials=tiles(y * y, tile))
        return out
    if name in ("row_scale", "dgrad"):
        return {"d": z}
    if name in ("scalar_scale", "wgrad"):
        return {"d": acc * (op["alpha"][0] if op.get("alpha") is not None else 1.0)}
    if name == "swiglu":
        return {"d": z, "aux": silu(z[:, 0::2]) * z[:, 1::2]}
    if name in ("rope", "rope_bwd"):
        return {"d": rope_ref(z, op["pos"], op["freq"], inverse=name == "rope_bwd")}
    if name == "qkv_head_sqsum":
        return {"d": acc, "partials": tiles(acc * acc, head_dim)}
    if name == "lse":
        out = {"d": z, "partials": lse_tiles(z, tile)}
        if op.get("target") is not None:
            t = op["target"].astype(np.int64)
            ok = (t != ignore_index) & (t >= 0) & (t < z.shape[1])
            out["target_logit"] = np.where(ok, z[np.arange(len(t)), np.clip(t, 0, z.shape[1] - 1)], 0.0)
        return out
    if name == "ce_bwd":
        t, al = op["target"].astype(np.int64), (op["alpha"][0] if op.get("alpha") is not None else 1.0)
        onehot = np.arange(z.shape[1])[None] == t[:, None]
        d = al * (np.exp(z - op["lse"][:, None]) - onehot)
        return {"d": np.where((t == ignore_index)[:, None], 0.0, d)}
    if name == "swiglu_bwd":
        g, u = op["c"][:, 0::2], op["c"][:, 1::2]
        s = 1 / (1 + np.exp(-g))
        dg, du = acc * u * s * (1 + g * (1 - s)), acc * g * s
        aux = np.empty((acc.shape[0], 2 * acc.shape[1]))
        aux[:, 0::2], aux[:, 1::2] = dg, du
        return {"d": g * s * u, "aux": aux, "partials": tiles(g * dg + u * du, tile)}
    if name == "rmsnorm_bwd":
        da = acc * (op["alpha"][0] if op.get("alpha") is not None else 1.0)
        xh = op["row_scale"][:, None] * op["c"]
        d = (op["c2"] if op.get("c2") is not None else 0.0) + op["row_scale"][:, None] * (op["gamma"] * da - xh * op["zdz"][:, None])
        m, n = da.shape
        parts = np.zeros(((m + 127) // 128, -(-n // tile) * tile))
        for t in range(parts.shape[0]):
            parts[t, :n] = (da * xh)[128 * t:128 * t + 128].sum(0)
        return {"d": d, "aux": xh * op["gamma"], "partials": parts}
    raise AssertionError(name)


def _operands(name, rng, kind, m, n, k, pad, optional, ignore_index):
    """a, w and the operands row `name` reads (arrays of kind / float32 / int32), and their float64 values."""
    a_shape = (k, m) if name == "wgrad" else (m, k)
    w_shape = (k, n) if name in ("swiglu_bwd", "rmsnorm_bwd", "dgrad", "wgrad") else (n, k)
    a = strided(make(rng.standard_normal(a_shape), kind), pad)
    w = strided(make(rng.standard_normal(w_shape) / math.sqrt(k), kind), pad)
    op = {}
    mat = lambda cols: strided(make(rng.standard_normal((m, cols)), kind), pad)  # noqa: E731
    if name in ("residual_sqsum_aux", "residual_add", "rmsnorm_bwd"):
        op["c"] = mat(n)
    if name == "swiglu_bwd":
        op["c"] = mat(2 * n)
    if name in ("residual_sqsum_aux", "rmsnorm_bwd"):
        op["gamma"] = make(1 + 0.3 * rng.standard_normal(n), kind)
    if name in ("row_scale", "rmsnorm_bwd") or (name in ("swiglu", "rope", "lse", "rope_bwd", "ce_bwd") and optional[0]):
        op["row_scale"] = _f32(rng.uniform(0.5, 2, m), a)
    if name in ("rope", "rope_bwd"):
        op["pos"] = _i32(rng.integers(-100000, 100000, m), a)
        op["freq"] = _f32(np.where(rng.random(n) < 0.2, 0, rng.uniform(-0.2, 0.2, n)), a)
    if name == "scalar_scale" or (name in ("rmsnorm_bwd", "wgrad", "ce_bwd") and optional[1]):
        op["alpha"] = _f32([rng.uniform(-2, 2)], a)
    if name == "rmsnorm_bwd":
        op["zdz"] = _f32(rng.standard_normal(m), a)
        if optional[2]:
            op["c2"] = mat(n)
    if (name == "lse" and optional[2]) or name == "ce_bwd":
        t = rng.integers(0, n, m)
        t[rng.random(m) < 0.2] = ignore_index
        op["target"] = _i32(t, a)
    if name == "ce_bwd":
        op["lse"] = _f32(rng.standard_normal(m) + 2, a)
    return a, w, op


@VALID
@given(seed=SEEDS, name=st.sampled_from(ROWS), kind=st.sampled_from(IO_KINDS), m=_M, n=_N, k=_K, pad=st.sampled_from([0, 0, 3, 8]),
       optional=st.tuples(st.booleans(), st.booleans(), st.booleans()), tile=st.sampled_from([0, 0, 3, 16, 128, 256]),
       head_dim=st.sampled_from([1, 2, 3, 8]), ignore_index=st.sampled_from([-100, 0, 2]), store_d=st.booleans())
def test_gemm_epilogue_valid(seed, name, kind, m, n, k, pad, optional, tile, head_dim, ignore_index, store_d):
    rng = np.random.default_rng(seed)
    if name in ("swiglu", "rope", "rope_bwd") and n % 2:
        n += 1
    if name == "qkv_head_sqsum":
        n = head_dim * max(1, n // head_dim)
    if name == "ce_bwd" and ignore_index in (0, 2):
        ignore_index = -1
    a, w, op = _operands(name, rng, kind, m, n, k, pad, optional, ignore_index)
    store_d = store_d or name != "lse"
    out = encore.gemm_epilogue(name, a, w, partial_tile_n=tile, head_dim=head_dim, ignore_index=ignore_index, store_d=store_d, **op)
    t = tile or encore._encore.gemm_partial_tile_n(getattr(encore.Epilogue, name), m, n, k)
    ref = rows_ref(name, f64(a), f64(w), {key: f64(v) for key, v in op.items()}, t, head_dim, ignore_index)
    if name == "lse" and not store_d:
        ref.pop("d")
    assert set(out) == set(ref), (set(out), set(ref))
    for key, want in ref.items():
        got = out[key]
        assert type(got) is type(a)
        low = key in ("d", "aux")
        assert (got.dtype == a.dtype) if low else str(got.dtype).endswith("float32"), (key, got.dtype)
        scale = np.abs(want[np.isfinite(want)]).max(initial=0.0)
        close(got, want, a.dtype if low else "float32", rtol_ulps=4, atol=1e-12 * scale * k)


# --- the named wrappers ---------------------------------------------------------------------------------

WRAPPERS = ["gemm_row_scale", "gemm_scalar_scale", "gemm_residual_rms_partial", "gemm_swiglu", "gemm_rope", "gemm_qkv_head_sqsum", "gemm_lse"]


def _wrapper_call(op, rng, kind, m, n, k, pad, flags, special):
    """(call, row name, operands, extra options) of one wrapper call."""
    row = {"gemm_row_scale": "row_scale", "gemm_scalar_scale": "scalar_scale", "gemm_residual_rms_partial": "residual_sqsum_aux",
           "gemm_swiglu": "swiglu", "gemm_rope": "rope", "gemm_qkv_head_sqsum": "qkv_head_sqsum", "gemm_lse": "lse"}[op]
    if row in ("swiglu", "rope"):
        n += n % 2
    hd = 1 + n % 3 if row == "qkv_head_sqsum" else 128
    if row == "qkv_head_sqsum":
        n = hd * max(1, n // hd)
    a, w, o = _operands(row, rng, kind, m, n, k, pad, (flags[0], False, flags[1]), -100)
    if special:  # NaN / inf in the data: the refused-free path propagates them
        a = strided(make(inject(f64(a), rng, 0.02), kind), pad)
    ptile = int(rng.choice([0, 4, 128]))
    calls = {
        "row_scale": lambda: {"d": encore.gemm_row_scale(a, w, o["row_scale"])},
        "scalar_scale": lambda: {"d": encore.gemm_scalar_scale(a, w, o["alpha"])},
        "residual_sqsum_aux": lambda: dict(zip(("d", "aux", "partials"), encore.gemm_residual_rms_partial(a, w, o["c"], o["gamma"], ptile))),
        "swiglu": lambda: dict(zip(("d", "aux"), encore.gemm_swiglu(a, w, o.get("row_scale")))),
        "rope": lambda: {"d": encore.gemm_rope(a, w, o["pos"], o["freq"], o.get("row_scale"))},
        "qkv_head_sqsum": lambda: dict(zip(("d", "partials"), encore.gemm_qkv_head_sqsum(a, w, hd))),
        "lse": lambda: dict(zip(("partials", "d", "target_logit"), encore.gemm_lse(a, w, o.get("row_scale"), o.get("target"), flags[2],
                                                                                      partial_tile_n=ptile))),
    }
    return calls[row], row, a, w, o, (ptile or 128) if row in ("residual_sqsum_aux", "lse") else 0, hd


@pytest.mark.parametrize("op", WRAPPERS)
@VALID
@given(seed=SEEDS, kind=st.sampled_from(IO_KINDS), m=_M, n=_N, k=_K, pad=st.sampled_from([0, 0, 5]),
       flags=st.tuples(st.booleans(), st.booleans(), st.booleans()), special=st.booleans())
def test_gemm_wrapper_valid(op, seed, kind, m, n, k, pad, flags, special):
    rng = np.random.default_rng(seed)
    call, row, a, w, o, tile, hd = _wrapper_call(op, rng, kind, m, n, k, pad, flags, special)
    got = {key: v for key, v in call().items() if v is not None}
    with np.errstate(all="ignore"):
        ref = rows_ref(row, f64(a), f64(w), {key: f64(v) for key, v in o.items()}, tile, hd, -100)
    if row == "lse" and not flags[2]:
        ref.pop("d")
    assert set(got) == set(ref)
    for key, want in ref.items():  # NaN / inf rows of a (special draws) included: NaN and inf exactly where the math puts them
        low = key in ("d", "aux")
        scale = np.abs(want[np.isfinite(want)]).max(initial=0.0)
        close(got[key], want, a.dtype if low else "float32", rtol_ulps=4, atol=1e-12 * scale * k)


def _mutate(v, how, rng):
    """v (an operand) made invalid in one way."""
    if how == "f64":
        return as_float64(v)
    if how == "int":
        return v.to(torch.int64) if is_torch(v) else np.asarray(v).astype(np.int64)
    if how == "shape":  # one more row (element)
        vv = f64(v)
        grown = np.concatenate([vv, vv[:1]], 0)
        return torch.from_numpy(grown).to(v.dtype) if is_torch(v) else grown.astype(np.asarray(v).dtype)
    if how == "ndim":
        return v.reshape((1,) + tuple(v.shape)) if v.ndim < 2 else v.reshape(-1)
    if how == "list":
        return f64(v).tolist()
    if how == "str":
        return "array"
    if how == "col_stride":
        wide = np.repeat(f64(v), 2, axis=-1)
        wide = torch.from_numpy(wide).to(v.dtype) if is_torch(v) else wide.astype(np.asarray(v).dtype)
        return wide[..., ::2]
    raise AssertionError(how)


# The operands each wrapper may take as None (optional) and the names a message may use for them.
_OPTIONAL = {"gemm_swiglu": ("row_scale",), "gemm_rope": ("row_scale",), "gemm_lse": ("row_scale", "target")}
_ALIASES = {"c": ["c", "residual"], "row_scale": ["row_scale", "r"], "a": ["a", "a, w"], "w": ["w", "a, w"]}


@pytest.mark.parametrize("op", WRAPPERS)
@INVALID
@given(seed=SEEDS, kind=st.sampled_from(IO_KINDS), which=st.integers(0, 7),
       how=st.sampled_from(("f64", "int", "shape", "ndim", "list", "str", "col_stride", "none", "scalar")))
def test_gemm_wrapper_invalid(op, seed, kind, which, how):
    rng = np.random.default_rng(seed)
    m, n, k = int(rng.integers(2, 9)), 2 * int(rng.integers(1, 5)), int(rng.integers(2, 9))
    _, row, a, w, o, _, hd = _wrapper_call(op, rng, kind, m, n, k, 0, (True, True, False), False)
    c = {"a": a, "w": w, **o}
    if op == "gemm_lse":
        c["target"] = _i32(rng.integers(0, n, m), a)
    kw = {}
    if how in ("shape", "col_stride") and op == "gemm_qkv_head_sqsum":
        how = "scalar"  # (no operand beside a and w)
    if how == "scalar":  # a bad option instead of a bad array
        key, bad = {"gemm_qkv_head_sqsum": ("head_dim", 0), "gemm_lse": ("partial_tile_n", -1),
                    "gemm_residual_rms_partial": ("partial_tile_n", "4")}.get(op, ("tile", "largest"))
        kw[key], names = bad, [key]
    else:
        keys = [x for x in c if not (how == "shape" and x in ("a", "w")) and not (how == "none" and x in _OPTIONAL.get(op, ()))
                and not (how == "col_stride" and x not in ("a", "w"))]
        name = keys[which % len(keys)]
        c[name] = None if how == "none" else _mutate(c[name], how, rng)
        names = _ALIASES.get(name, [name])
    if op == "gemm_qkv_head_sqsum":
        kw.setdefault("head_dim", hd)
    fns = {"gemm_row_scale": lambda: encore.gemm_row_scale(c["a"], c["w"], c["row_scale"], **kw),
           "gemm_scalar_scale": lambda: encore.gemm_scalar_scale(c["a"], c["w"], c["alpha"], **kw),
           "gemm_residual_rms_partial": lambda: encore.gemm_residual_rms_partial(c["a"], c["w"], c["c"], c["gamma"], **kw),
           "gemm_swiglu": lambda: encore.gemm_swiglu(c["a"], c["w"], c.get("row_scale"), **kw),
           "gemm_rope": lambda: encore.gemm_rope(c["a"], c["w"], c["pos"], c["freq"], c.get("row_scale"), **kw),
           "gemm_qkv_head_sqsum": lambda: encore.gemm_qkv_head_sqsum(c["a"], c["w"], **kw),
           "gemm_lse": lambda: encore.gemm_lse(c["a"], c["w"], c.get("row_scale"), c.get("target"), **kw)}
    refused(fns[op], names)


@INVALID
@given(seed=SEEDS, name=st.sampled_from(ROWS), case=st.sampled_from(["unused", "missing", "k_mismatch", "odd_pairs", "epilogue", "tile",
                                                                   "tile_n", "head_dim", "target", "ignore_str", "a_f64", "a_3d"]))
def test_gemm_epilogue_invalid(seed, name, case):
    rng = np.random.default_rng(seed)
    m, n, k = int(rng.integers(1, 6)), 2 * int(rng.integers(1, 4)), int(rng.integers(1, 7))
    a, w, op = _operands(name, rng, "np32", m, n, k, 0, (True, True, True), -100)
    kw, names, ep = {}, [], name
    if case == "unused":
        extra = [x for x in ("c", "gamma", "pos", "zdz", "lse", "c2") if x not in op]
        key = extra[int(rng.integers(len(extra)))]
        op[key], names = np.ones((m, n), F32) if key in ("c", "c2") else np.ones(m, F32), [key]
    elif case == "missing" and op:
        key = sorted(op)[int(rng.integers(len(op)))]
        optional = {"row_scale": ("swiglu", "rope", "lse", "rope_bwd", "ce_bwd"), "alpha": ("rmsnorm_bwd", "wgrad", "ce_bwd"),
                    "c2": ("rmsnorm_bwd",), "target": ("lse",)}
        if name in optional.get(key, ()):
            op[key], names = np.ones(m + 1, F32), [key]  # present but of the wrong length instead
        else:
            op[key], names = None, [key]
        if key == "lse":
            names.append("lse")
    elif case == "k_mismatch":
        w, names = (w[:-1] if name in ("swiglu_bwd", "rmsnorm_bwd", "dgrad", "wgrad") else w[:, :-1]) if k > 1 else np.ones((n, k + 1), F32), ["w"]
    elif case == "odd_pairs" and name in ("swiglu", "rope", "rope_bwd"):
        w, names = np.ones((n + 1, k), F32), ["w"]
    elif case == "epilogue":
        ep, names = str(rng.choice(["Swiglu", "gemm", "", "residual"])), ["epilogue"]
    elif case == "tile":
        kw, names = {"tile": str(rng.choice(["pingpong", "64x256", "AUTO"]))}, ["tile"]
    elif case == "tile_n" and name in ("residual_sqsum_aux", "lse", "swiglu_bwd", "rmsnorm_bwd"):
        kw, names = {"partial_tile_n": int(rng.choice([-1, -128]))}, ["partial_tile_n"]
    elif case == "head_dim" and name == "qkv_head_sqsum":
        kw, names = {"head_dim": int(rng.choice([0, -2, n + 1]))}, ["head_dim"]
    elif case == "target" and "target" in op:
        t = f64(op["target"]).astype(np.int32)
        t[int(rng.integers(m))] = int(rng.choice([n, n + 5, -1, -99, 2**31 - 1]))
        op["target"], names = t, ["target"]
    elif case == "ignore_str":
        kw, names = {"ignore_index": "-100"}, ["ignore_index"]
    elif case == "a_f64":
        a, names = a.astype(np.float64), ["a"]
    elif case == "a_3d":
        a, names = a[None], ["a", "a, w"]
    else:  # the case does not apply to this row: a bad head_dim type instead
        kw, names = {"head_dim": 2.5}, ["head_dim"]
    refused(lambda: encore.gemm_epilogue(ep, a, w, **op, **kw), names)


# --- regressions: the bugs these fuzzers found, as plain tests ----------------------------------------------

def test_regression_lse_of_nan_logits_is_nan():
    """A tile of NaN logits gave log-sum-exp -inf on the CPU backend (std::max skips NaN; the CUDA epilogue
    writes NaN), and lse_finish turned rows of NaN tiles into -inf (CPU and CUDA)."""
    a, w = np.ones((3, 4), F32), np.ones((300, 4), F32)
    a[1, 2] = np.nan
    p, _, _ = encore.gemm_lse(a, w, partial_tile_n=128)
    assert np.isnan(p[1]).all() and np.isfinite(p[[0, 2]]).all()
    lse = encore.lse_finish(np.array([[np.nan, -np.inf], [np.nan, np.nan], [0.0, -np.inf]], F32))
    assert np.isnan(lse[:2]).all() and lse[2] == 0


def test_regression_bad_sizes_name_the_argument():
    """head_dim 0 raised ZeroDivisionError, negative sizes numpy's "negative dimensions are not allowed"."""
    a, w = np.ones((2, 4), F32), np.ones((6, 4), F32)
    refused(lambda: encore.gemm_qkv_head_sqsum(a, w, head_dim=0), ["head_dim"])
    refused(lambda: encore.gemm_qkv_head_sqsum(a, w, head_dim=-3), ["head_dim"])
    refused(lambda: encore.gemm_lse(a, w, partial_tile_n=-1), ["partial_tile_n"])
    refused(lambda: encore.gemm_residual_rms_partial(a, w, np.ones((2, 6), F32), np.ones(6, F32), partial_tile_n=-128), ["partial_tile_n"])
    refused(lambda: encore.gemm_scalar_scale(a, w, 2.0), ["alpha"], kinds=(TypeError,))
