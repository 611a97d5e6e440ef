"""Property-based fuzzing of the quant family's public entry points on the CPU backend:
fp8_group_quant / fp8_group_dequant, mxfp8_quant / mxfp8_dequant, nvfp4_quant / nvfp4_dequant over
numpy (float32, float16) and CPU torch (float32, bfloat16, float16) inputs, odd and unit row counts,
K from one block up, 16-byte aligned row-strided views, both scale layouts and roundings, given and
computed global scales, NaN / inf in the data; bit-exact against a numpy reference of the formats
(the e4m3 / e2m1 tables and nearest-code rounding of tests/python/test_quant.py). Invalid draws
must raise ValueError / TypeError naming the argument.

Seeds: hypothesis with derandomize=True (fuzz_util.VALID: 200 draws, INVALID: 100 draws per test);
array contents from a drawn numpy seed."""
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import encore
from fuzz_util import (  # noqa: F401 (one_torch_thread: an autouse fixture)
    INVALID, SEEDS, VALID, as_float64, f64, inject, is_torch, kinds, make, refused, strided, torch, one_torch_thread)
from test_quant import _E2M1, _E4M3, _nearest, _swizzle_index

QUANT_KINDS = kinds("np32", "np16", "t32", "tbf16", "t16")
F32 = np.float32


def _codes(q):
    """q's bytes as a uint8 numpy array (torch float8 / uint8, numpy uint8)."""
    if is_torch(q):
        return q.view(torch.uint8).numpy() if q.dtype != torch.uint8 else q.numpy()
    return np.asarray(q)


def _e4m3(v):
    """Nearest e4m3 codes of float32 values (ties to even, saturating at 448; NaN -> 0x7f)."""
    v = np.asarray(v, np.float64)
    c = _nearest(np.where(np.isnan(v), 0, v), _E4M3, 128, 448.0)
    return np.where(np.isnan(v), np.uint8(0x7F), c).astype(np.uint8)


def _input(rng, m, k, kind, special, pad=0):
    e = rng.integers(-10, 10, size=(m, 1))
    v = rng.standard_normal((m, k)) * 2.0**e
    v[:, ::7] = 0
    x = make(inject(v, rng, 0.02) if special else v, kind)
    return strided(x, pad)


def _pad16(kind, rng):
    """A row padding in elements that keeps rows 16-byte aligned (the CPU backend's fp8 rule)."""
    size = {"np32": 4, "t32": 4}.get(kind, 2)
    return int(rng.choice([0, 0, 16 // size, 48 // size]))


_M = st.sampled_from([1, 2, 3, 5, 7, 13, 33, 130])


# --- fp8_group_quant / fp8_group_dequant --------------------------------------------------------------

def fp8_ref(x, pow2, eps):
    """(q bytes, scales) of fp8_group_quant in float32 arithmetic: s = max(amax, eps) / 448 (the next
    power of two), q = e4m3(x * (1 / s)); amax ignores NaN."""
    m, k = x.shape
    g = x.reshape(m, k // 128, 128).astype(F32)
    with np.errstate(all="ignore"):
        amax = np.fmax.reduce(np.abs(g), axis=-1).astype(F32)
        s = (np.maximum(amax, F32(eps)) / F32(448)).astype(F32)
        if pow2:
            f, e = np.frexp(s)
            s = np.where(np.isfinite(s), np.ldexp(F32(1), np.where(f == 0.5, e - 1, e)).astype(F32), s)
        inv = (F32(1) / s).astype(F32)
        q = _e4m3((g * inv[..., None]).astype(F32))
    return q.reshape(m, k), s


@VALID
@given(seed=SEEDS, kind=st.sampled_from(QUANT_KINDS), m=_M, groups=st.sampled_from([1, 2, 3, 5]), col=st.booleans(), pow2=st.booleans(),
       eps=st.sampled_from([1e-10, 1e-4, 1.0]), special=st.booleans())
def test_fp8_group_quant_valid(seed, kind, m, groups, col, pow2, eps, special):
    rng = np.random.default_rng(seed)
    x = _input(rng, m, 128 * groups, kind, special, _pad16(kind, rng))
    q, s = encore.fp8_group_quant(x, column_major_scales=col, power_of_two_scales=pow2, eps=eps)
    rq, rs = fp8_ref(f64(x), pow2, eps)
    assert tuple(q.shape) == (m, 128 * groups) and tuple(s.shape) == (m, groups)
    if is_torch(x):
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
        row_step = s.stride(0)
    else:
        assert q.dtype == np.uint8 and s.dtype == np.float32
        row_step = s.strides[0] // 4
    if m > 1 and groups > 1:
        assert (row_step == 1) == col  # column-major scales: [K // 128, M] storage
    np.testing.assert_array_equal(_codes(q), rq)
    np.testing.assert_array_equal(f64(s), rs)
    back = encore.fp8_group_dequant(q, s)  # the inverse: float(e4m3) * scale in float32
    with np.errstate(all="ignore"):  # (inf scales of groups holding inf: inf * 0 codes)
        want = (_E4M3[rq].astype(F32).reshape(m, groups, 128) * rs[..., None]).reshape(m, -1)
    np.testing.assert_array_equal(f64(back), want)


@VALID
@given(seed=SEEDS, torch_q=st.booleans(), m=_M, groups=st.sampled_from([1, 2, 3]), col=st.booleans(), pad=st.sampled_from([0, 16, 32]),
       special=st.booleans())
def test_fp8_group_dequant_valid(seed, torch_q, m, groups, col, pad, special):
    rng = np.random.default_rng(seed)
    k = 128 * groups
    codes = rng.integers(0, 256, (m, k + pad), dtype=np.uint8)[:, :k]  # every byte, NaN codes included; rows strided
    sv = np.abs(rng.standard_normal((m, groups))) * 2.0 ** rng.integers(-8, 8, (m, 1))
    s = np.ascontiguousarray((inject(sv, rng, 0.1) if special else sv).astype(F32).T).T if col else (inject(sv, rng, 0.1) if special else sv).astype(F32)
    q = codes
    if torch_q and torch is not None:
        q, s = torch.from_numpy(codes).view(torch.float8_e4m3fn), torch.from_numpy(np.asarray(s))
    out = encore.fp8_group_dequant(q, s)
    with np.errstate(all="ignore"):
        want = (_E4M3[codes].astype(F32).reshape(m, groups, 128) * np.asarray(f64(s), F32)[..., None]).reshape(m, k)
    np.testing.assert_array_equal(f64(out), want)


@INVALID
@given(seed=SEEDS, kind=st.sampled_from(QUANT_KINDS), case=st.sampled_from(
    ["x_f64", "x_int", "x_1d", "x_3d", "k_100", "k_0", "m_0", "eps_0", "eps_neg", "eps_nan", "eps_str", "x_col_stride", "x_row_unaligned",
     "x_list", "x_none"]))
def test_fp8_group_quant_invalid(seed, kind, case):
    rng = np.random.default_rng(seed)
    m = int(rng.integers(1, 6))
    x, kw, names = _input(rng, m, 256, kind, False), {}, ["x"]
    if case == "x_f64":
        x = as_float64(x)
    elif case == "x_int":
        x = x.to(torch.int32) if is_torch(x) else x.astype(np.int32)
    elif case == "x_1d":
        x = x[0]
    elif case == "x_3d":
        x = x.reshape(1, m, 256)
    elif case == "k_100":
        x = make(np.ones((m, 100)), kind)
    elif case == "k_0":
        x = make(np.ones((m, 0)), kind)
    elif case == "m_0":
        x = make(np.ones((0, 128)), kind)
    elif case.startswith("eps"):
        kw, names = {"eps": {"eps_0": 0.0, "eps_neg": -1.0, "eps_nan": float("nan"), "eps_str": "1e-10"}[case]}, ["eps"]
    elif case == "x_col_stride":
        x = make(np.ones((m, 512)), kind)[:, ::2]
    elif case == "x_row_unaligned":  # rows 2 elements longer: the row stride is no multiple of 16 bytes
        x = strided(make(np.ones((max(m, 2), 128)), kind), 2)
    elif case == "x_list":
        x = f64(x).tolist()
    elif case == "x_none":
        x = None
    refused(lambda: encore.fp8_group_quant(x, **kw), names)


@INVALID
@given(seed=SEEDS, torch_q=st.booleans(), case=st.sampled_from(
    ["q_f32", "q_1d", "q_3d", "q_list", "q_k", "q_col_stride", "s_rows", "s_groups", "s_f64", "s_1d", "s_overlapping", "s_list", "q_torch_f16",
     "q_i64"]))
@example(seed=0, torch_q=True, case="q_torch_f16")
def test_fp8_group_dequant_invalid(seed, torch_q, case):
    rng = np.random.default_rng(seed)
    m, g = int(rng.integers(2, 6)), int(rng.integers(2, 4))
    q, s = rng.integers(0, 256, (m, 128 * g), dtype=np.uint8), np.ones((m, g), F32)
    names = ["q"]
    if case == "q_f32":
        q = q.astype(F32)
    elif case == "q_1d":
        q = q[0]
    elif case == "q_3d":
        q = q[None]
    elif case == "q_list":
        q = q.tolist()
    elif case == "q_k":
        q = q[:, :100]
    elif case == "q_col_stride":
        q = np.repeat(q, 2, axis=1)[:, ::2]
    elif case == "q_i64":
        q = q.astype(np.int64)
    elif case == "s_rows":
        s, names = np.ones((m + 1, g), F32), ["scales"]
    elif case == "s_groups":
        s, names = np.ones((m, g + 1), F32), ["scales"]
    elif case == "s_f64":
        s, names = np.ones((m, g)), ["scales"]
    elif case == "s_1d":
        s, names = np.ones(m * g, F32), ["scales"]
    elif case == "s_overlapping":  # elements sharing memory: neither row- nor column-major
        s, names = np.lib.stride_tricks.as_strided(np.ones(m * g, F32), (m, g), (4, 4)), ["scales"]
    elif case == "s_list":
        s, names = s.tolist(), ["scales"]
    if torch is not None and torch_q:
        q = torch.from_numpy(q) if isinstance(q, np.ndarray) else q  # strides kept
        if case == "q_torch_f16":
            q = torch.ones((m, 128 * g), dtype=torch.float16)  # a float tensor is refused, not reinterpreted as bytes
        s = torch.from_numpy(np.ascontiguousarray(s)) if isinstance(s, np.ndarray) and case != "s_overlapping" else s
    elif case == "q_torch_f16":
        q = np.ones((m, 128 * g), np.float16)
    refused(lambda: encore.fp8_group_dequant(q, s), names)


# --- mxfp8 ---------------------------------------------------------------------------------------------

def mxfp8_ref(x, rceil):
    """(q bytes, e8m0 scale bytes [M, K/32]) of MXFP8: a block with NaN / inf gets scale 0xff and q 0x7f."""
    m, k = x.shape
    b = x.reshape(m, k // 32, 32).astype(F32).astype(np.float64)
    bad = ~np.isfinite(b).all(-1)
    amax = np.where(bad, 0, np.abs(np.where(np.isfinite(b), b, 0)).max(-1))
    with np.errstate(divide="ignore"):
        if rceil:
            d = (amax.astype(F32) / F32(448)).astype(F32)
            f, e = np.frexp(d)
            e = np.where(f == 0.5, e - 1, e)
            e = np.where(d == 0, -127, e)
        else:
            f, e = np.frexp(amax)
            e = np.where(amax == 0, -127, e - 1 - 8)
    e = np.clip(e, -127, 127).astype(np.int64)
    q = _nearest(np.where(bad[..., None], 0, b) / 2.0 ** e[..., None], _E4M3, 128, 448.0)
    q = np.where(bad[..., None], np.uint8(0x7F), q).reshape(m, k)
    return q, np.where(bad, 0xFF, e + 127).astype(np.uint8)


def _unswizzle(s, m, sc, swizzled):
    s = _codes(s)
    if not swizzled:
        return s
    assert s.shape == (-(-m // 128) * 128, -(-sc // 4) * 4)
    flat = s.reshape(-1)
    used = np.zeros(flat.size, bool)
    used[_swizzle_index(m, sc).ravel()] = True
    assert (flat[~used] == 0).all()  # the padding of the swizzled layout is zeroed
    return flat[_swizzle_index(m, sc)]


@VALID
@given(seed=SEEDS, kind=st.sampled_from(QUANT_KINDS), m=_M, blocks=st.sampled_from([1, 2, 3, 5, 9]), swizzled=st.booleans(),
       rceil=st.booleans(), special=st.booleans())
def test_mxfp8_valid(seed, kind, m, blocks, swizzled, rceil, special):
    rng = np.random.default_rng(seed)
    x = _input(rng, m, 32 * blocks, kind, special, int(rng.choice([0, 0, 1, 5])))
    q, s = encore.mxfp8_quant(x, swizzled=swizzled, rounding="rceil" if rceil else "floor")
    rq, rs = mxfp8_ref(f64(x), rceil)
    np.testing.assert_array_equal(_codes(q), rq)
    np.testing.assert_array_equal(_unswizzle(s, m, blocks, swizzled), rs)
    back = encore.mxfp8_dequant(q, s, swizzled=swizzled)
    with np.errstate(all="ignore"):
        scale = np.where(rs == 0xFF, np.nan, np.ldexp(F32(1), rs.astype(np.int64) - 127).astype(F32))
        want = (_E4M3[rq].astype(F32).reshape(m, blocks, 32) * scale[..., None].astype(F32)).reshape(m, -1)
    np.testing.assert_array_equal(f64(back), want)


@VALID
@given(seed=SEEDS, torch_q=st.booleans(), m=_M, blocks=st.sampled_from([1, 2, 3, 5]), swizzled=st.booleans(), pad=st.sampled_from([0, 3, 32]))
def test_mxfp8_dequant_valid(seed, torch_q, m, blocks, swizzled, pad):
    rng = np.random.default_rng(seed)
    k = 32 * blocks
    codes = rng.integers(0, 256, (m, k + pad), dtype=np.uint8)[:, :k]  # strided rows, NaN codes included
    sb = rng.integers(100, 156, (m, blocks), dtype=np.uint8)
    sb[rng.random((m, blocks)) < 0.05] = 0xFF  # NaN scales
    s = sb
    if swizzled:
        s = np.zeros((-(-m // 128) * 128, -(-blocks // 4) * 4), np.uint8)
        s.reshape(-1)[_swizzle_index(m, blocks)] = sb
    q = codes
    if torch_q and torch is not None:
        q, s = torch.from_numpy(codes).view(torch.float8_e4m3fn), torch.from_numpy(s)
    out = encore.mxfp8_dequant(q, s, swizzled=swizzled)
    with np.errstate(all="ignore"):
        scale = np.where(sb == 0xFF, np.nan, np.ldexp(F32(1), sb.astype(np.int64) - 127)).astype(F32)
        want = (_E4M3[codes].astype(F32).reshape(m, blocks, 32) * scale[..., None]).reshape(m, k)
    np.testing.assert_array_equal(f64(out), want)


def _invalid_start(cases, seed, kind, which):
    """An invalid MX / NVFP4 draw's start: (case, rng, m, a valid [m, 64] x, kwargs, the names a refusal may use)."""
    rng = np.random.default_rng(seed)
    m = int(rng.integers(2, 6))
    return cases[which % len(cases)], rng, m, _input(rng, m, 64, kind, False), {}, ["x"]


_MX_CASES = {"quant": ["x_f64", "x_1d", "k_48", "x_col_stride", "rounding", "rounding_none", "x_list"],
             "dequant": ["dq_q_f32", "dq_q_1d", "dq_q_k", "dq_s_shape", "dq_s_swizzled_shape", "dq_s_f32", "dq_s_strided_swizzled", "dq_q_list",
                         "dq_q_torch_bf16", "dq_s_list"]}


@pytest.mark.parametrize("op", ["quant", "dequant"])
@INVALID
@given(seed=SEEDS, kind=st.sampled_from(QUANT_KINDS), which=st.integers(0, 99))
@example(seed=0, kind=QUANT_KINDS[0], which=1)  # dequant: a 1-D q, once an IndexError / a message naming x
def test_mxfp8_invalid(op, seed, kind, which):
    case, rng, m, x, kw, names = _invalid_start(_MX_CASES[op], seed, kind, which)
    if not case.startswith("dq"):
        if case == "x_f64":
            x = as_float64(x)
        elif case == "x_1d":
            x = x[0]
        elif case == "k_48":
            x = make(np.ones((m, 48)), kind)
        elif case == "x_col_stride":
            x = make(np.ones((m, 128)), kind)[:, ::2]
        elif case == "rounding":
            kw, names = {"rounding": "nearest"}, ["rounding"]
        elif case == "rounding_none":
            kw, names = {"rounding": None}, ["rounding"]
        elif case == "x_list":
            x = f64(x).tolist()
        refused(lambda: encore.mxfp8_quant(x, **kw), names)
        return
    q, s = encore.mxfp8_quant(make(np.ones((m, 64)), "np32"))
    swizzled, names = False, ["q"]
    if case == "dq_q_f32":
        q = q.astype(F32)
    elif case == "dq_q_1d":
        q = q[0]
    elif case == "dq_q_k":
        q = np.ascontiguousarray(q[:, :40])
    elif case == "dq_s_shape":
        s, names = s[:, :1].copy(), ["scales"]
    elif case == "dq_s_swizzled_shape":
        swizzled, names = True, ["scales"]
    elif case == "dq_s_f32":
        s, names = s.astype(F32), ["scales"]
    elif case == "dq_s_strided_swizzled":
        swizzled, names = True, ["scales"]
        s = np.zeros((128, 8), np.uint8)[:, ::2]
    elif case == "dq_q_list":
        q = q.tolist()
    elif case == "dq_q_torch_bf16":
        q = torch.ones((m, 64), dtype=torch.bfloat16) if torch is not None else q.astype(np.float16)
        s = torch.from_numpy(s) if torch is not None else s
    elif case == "dq_s_list":
        s, names = s.tolist(), ["scales"]
    refused(lambda: encore.mxfp8_dequant(q, s, swizzled=swizzled), names)


# --- nvfp4 ---------------------------------------------------------------------------------------------

def nvfp4_ref(x, given):
    """(q packed bytes, e4m3 scale bytes, global) of NVFP4 in float32 arithmetic; a block with NaN /
    inf gets scale 0x7f and codes 0; the global scale ignores non-finite values."""
    m, k = x.shape
    x = x.astype(F32)
    fin = np.isfinite(x)
    if given:
        glob = F32(given)
    else:
        amax = F32(np.abs(np.where(fin, x, 0)).max())
        glob = F32(amax / F32(2688))
        glob = glob if glob > 0 else F32(1)
    b = x.reshape(m, k // 16, 16)
    bad = ~fin.reshape(m, k // 16, 16).all(-1)
    with np.errstate(all="ignore"):
        bmax = np.abs(np.where(bad[..., None], 0, b)).max(-1)
        sc = _nearest(((bmax / F32(6)).astype(F32) / glob).astype(F32), _E4M3, 128, 448.0)
        d = (_E4M3[sc].astype(F32) * glob).astype(F32)
        codes = np.where(d[..., None] > 0, _nearest((np.where(bad[..., None], 0, b) / d[..., None]).astype(F32), _E2M1, 8, 6.0), 0)
    codes = np.where(bad[..., None], 0, codes).reshape(m, k).astype(np.uint8)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8), np.where(bad, 0x7F, sc).astype(np.uint8), glob


@VALID
@given(seed=SEEDS, kind=st.sampled_from(QUANT_KINDS), m=_M, blocks=st.sampled_from([1, 2, 3, 5, 9]), swizzled=st.booleans(),
       given_global=st.sampled_from([None, None, 1e-3, 0.25, 0.0]), special=st.booleans())
def test_nvfp4_valid(seed, kind, m, blocks, swizzled, given_global, special):
    rng = np.random.default_rng(seed)
    x = _input(rng, m, 16 * blocks, kind, special, int(rng.choice([0, 0, 2, 7])))
    q, s, g = encore.nvfp4_quant(x, swizzled=swizzled, global_scale=given_global)
    rq, rs, rg = nvfp4_ref(f64(x), given_global)
    assert f64(g).shape == (1,) and f64(g)[0] == rg
    np.testing.assert_array_equal(_codes(q), rq)
    np.testing.assert_array_equal(_unswizzle(s, m, blocks, swizzled), rs)
    back = encore.nvfp4_dequant(q, s, g, swizzled=swizzled)
    codes = np.stack([rq & 0xF, rq >> 4], -1).reshape(m, -1)
    with np.errstate(all="ignore"):
        want = ((_E2M1[codes].astype(F32).reshape(m, blocks, 16) * _E4M3[rs].astype(F32)[..., None]).astype(F32) * rg).reshape(m, -1)
    np.testing.assert_array_equal(f64(back), want.astype(F32))


_NV_CASES = {"quant": ["x_f64", "x_3d", "k_40", "global_neg", "global_nan", "global_inf", "global_str", "x_list"],
             "dequant": ["dq_q_1d", "dq_q_k", "dq_q_f32", "dq_s_shape", "dq_s_f32", "dq_g_float", "dq_g_2", "dq_g_f64", "dq_g_none", "dq_q_list",
                         "dq_swizzled_rowmajor_s"]}


@pytest.mark.parametrize("op", ["quant", "dequant"])
@INVALID
@given(seed=SEEDS, kind=st.sampled_from(QUANT_KINDS), which=st.integers(0, 99))
@example(seed=0, kind=QUANT_KINDS[0], which=0)  # dequant: a 1-D q, once an IndexError
def test_nvfp4_invalid(op, seed, kind, which):
    case, rng, m, x, kw, names = _invalid_start(_NV_CASES[op], seed, kind, which)
    if not case.startswith("dq"):
        if case == "x_f64":
            x = as_float64(x)
        elif case == "x_3d":
            x = x.reshape(1, m, 64)
        elif case == "k_40":
            x = make(np.ones((m, 40)), kind)
        elif case.startswith("global"):
            kw = {"global_scale": {"global_neg": -1.0, "global_nan": float("nan"), "global_inf": float("inf"), "global_str": "0.5"}[case]}
            names = ["global_scale"]
        elif case == "x_list":
            x = f64(x).tolist()
        refused(lambda: encore.nvfp4_quant(x, **kw), names)
        return
    q, s, g = encore.nvfp4_quant(make(np.ones((m, 64)), "np32"))
    swizzled, names = False, ["q"]
    if case == "dq_q_1d":
        q = q[0]
    elif case == "dq_q_k":
        q = np.ascontiguousarray(q[:, :12])
    elif case == "dq_q_f32":
        q = q.astype(F32)
    elif case == "dq_s_shape":
        s, names = np.ascontiguousarray(s[:, :2]), ["scales"]
    elif case == "dq_s_f32":
        s, names = s.astype(F32), ["scales"]
    elif case == "dq_g_float":
        g, names = 1.0, ["global_scale"]
    elif case == "dq_g_2":
        g, names = np.ones(2, F32), ["global_scale"]
    elif case == "dq_g_f64":
        g, names = np.ones(1), ["global_scale"]
    elif case == "dq_g_none":
        g, names = None, ["global_scale"]
    elif case == "dq_q_list":
        q = q.tolist()
    elif case == "dq_swizzled_rowmajor_s":
        swizzled, names = True, ["scales"]
    refused(lambda: encore.nvfp4_dequant(q, s, g, swizzled=swizzled), names)


# --- regressions: the bugs these fuzzers found, as plain tests ----------------------------------------------

def test_regression_dequant_shapes_name_q():
    """A 1-D / 3-D q raised an unpacking ValueError or an IndexError naming nothing, or named the internal
    output x."""
    q, s = encore.fp8_group_quant(np.ones((2, 128), F32))
    for bad in (q[0], q[None], q.tolist()):
        refused(lambda: encore.fp8_group_dequant(bad, s), ["q"])
    mq, ms = encore.mxfp8_quant(np.ones((2, 64), F32))
    refused(lambda: encore.mxfp8_dequant(mq[0], ms), ["q"])
    refused(lambda: encore.mxfp8_dequant(np.ascontiguousarray(mq[:, :40]), ms), ["q"])
    nq, ns, ng = encore.nvfp4_quant(np.ones((2, 64), F32))
    refused(lambda: encore.nvfp4_dequant(nq[0], ns, ng), ["q"])
    refused(lambda: encore.nvfp4_dequant(nq, ns, 1.0), ["global_scale"], kinds=(TypeError,))


def test_regression_torch_codes_of_another_dtype_are_refused_not_reinterpreted():
    """A torch q (or NVFP4 scales) of a dtype other than float8_e4m3fn / uint8 was viewed as bytes: a
    float16 q [M, 16] with scales [M, 1] dequantized its raw bytes as [M, 32] e4m3 codes, silently."""
    if torch is None:
        return
    q, s = torch.ones((2, 16), dtype=torch.float16), torch.full((2, 1), 127, dtype=torch.uint8)
    refused(lambda: encore.mxfp8_dequant(q, s), ["q"])
    nq, ns, ng = encore.nvfp4_quant(torch.ones((2, 32)))
    refused(lambda: encore.nvfp4_dequant(nq, ns.view(torch.uint8).to(torch.float16), ng), ["scales"])
