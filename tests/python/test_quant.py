"""The quant family's Python wrappers (fp8_group_quant, fp8_group_dequant) on the CPU backend
(numpy) against the e4m3 bounds, bad input, and CUDA tensors against the CPU backend bit for bit when
a GPU is visible."""
import numpy as np
import pytest

import encore
from helpers import needs_torch_cuda, torch


@pytest.mark.parametrize("column_major", [False, True])
@pytest.mark.parametrize("pow2", [False, True])
def test_fp8_group_quant_numpy(column_major, pow2):
    rng = np.random.default_rng()
    x = (3 * rng.standard_normal((5, 384))).astype(np.float32)
    q, s = encore.fp8_group_quant(x, column_major_scales=column_major, power_of_two_scales=pow2)
    assert q.dtype == np.uint8 and q.shape == x.shape and s.shape == (5, 3)
    amax = np.abs(x.reshape(5, 3, 128)).max(-1)
    if pow2:
        assert np.all(np.log2(s) == np.round(np.log2(s))) and np.all(s * 448 >= amax)
    else:
        np.testing.assert_allclose(s, amax / 448, rtol=1e-6)
    back = encore.fp8_group_dequant(q, s)
    err = np.abs(back - x)
    bound = np.maximum(np.abs(x) / 16, np.repeat(s, 128, axis=1) * 2.0**-10)
    assert np.all(err <= bound + 1e-12)


def test_fp8_group_quant_bad_k():
    with pytest.raises(ValueError, match="must be a multiple of group_size"):
        encore.fp8_group_quant(np.ones((2, 200), np.float32))


@needs_torch_cuda
def test_fp8_group_quant_torch_cuda_matches_cpu():
    x = torch.randn(33, 1024, dtype=torch.bfloat16, device="cuda") * 4
    q, s = encore.fp8_group_quant(x, column_major_scales=True)
    qc, sc = encore.fp8_group_quant(x.cpu(), column_major_scales=True)
    assert q.dtype == torch.float8_e4m3fn
    assert torch.equal(q.cpu().view(torch.uint8), qc.view(torch.uint8))
    assert torch.equal(s.cpu(), sc)


# ---- MXFP8 / NVFP4 (CPU backend) against a numpy implementation: nearest code, ties to the even code ----
def _e4m3_table():
    b = np.arange(256)
    e, m = (b >> 3) & 15, b & 7
    mag = np.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * 2.0 ** (e - 7))
    v = np.where(b & 0x80, -mag, mag)
    v[[0x7f, 0xff]] = np.nan
    return v


_E4M3 = _e4m3_table()
_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def _nearest(v, table, half, vmax):
    """Codes of v's sign nearest to v (|v| clamped to vmax), ties to the even code."""
    v = np.asarray(v, np.float64)
    a = np.minimum(np.abs(v), vmax)[..., None]
    mags = np.abs(table[:half])
    d = np.abs(mags - a)
    d[..., np.isnan(mags)] = np.inf
    best = d.min(-1, keepdims=True)
    cand = np.where(d == best, np.arange(half), 10**6)
    even = np.where(cand % 2 == 0, cand, 10**6).min(-1)
    code = np.where(even < 10**6, even, cand.min(-1))
    return (code + np.where(np.signbit(v), half, 0)).astype(np.uint8)


def _swizzle_index(m, sc):
    r, c = np.meshgrid(np.arange(m), np.arange(sc), indexing="ij")
    tiles = -(-sc // 4)
    return ((r // 128) * tiles + c // 4) * 512 + (r % 32) * 16 + (r % 128) // 32 * 4 + c % 4


def _mx_input(m, k, seed):
    rng = np.random.default_rng(seed)
    e = rng.integers(-12, 12, size=(m, k // 16, 1))
    x = rng.standard_normal((m, k // 16, 16)) * 2.0**e
    x[:, ::5] = 0
    return x.reshape(m, k).astype(np.float32)


@pytest.mark.parametrize("swizzled", [False, True])
@pytest.mark.parametrize("rounding", ["floor", "rceil"])
def test_mxfp8_numpy_bit_exact(swizzled, rounding):
    m, k = 130, 160
    x = _mx_input(m, k, 1)
    q, s = encore.mxfp8_quant(x, swizzled=swizzled, rounding=rounding)
    blocks = x.reshape(m, k // 32, 32).astype(np.float64)
    amax = np.abs(blocks).max(-1)
    with np.errstate(divide="ignore"):
        if rounding == "floor":
            e = np.floor(np.log2(amax)) - 8
        else:
            e = np.ceil(np.log2((amax.astype(np.float32) / np.float32(448)).astype(np.float64)))
    e = np.where(amax == 0, -127, np.clip(e, -127, 127)).astype(np.int64)
    ref_q = _nearest(blocks / 2.0 ** e[..., None], _E4M3, 128, 448.0).reshape(m, k)
    rows = s.reshape(-1)[_swizzle_index(m, k // 32)] if swizzled else s
    np.testing.assert_array_equal(rows, (e + 127).astype(np.uint8))
    np.testing.assert_array_equal(q, ref_q)
    back = encore.mxfp8_dequant(q, s, swizzled=swizzled)
    np.testing.assert_array_equal(back, (_E4M3[ref_q].reshape(m, k // 32, 32) * 2.0 ** e[..., None]).reshape(m, k).astype(np.float32))


@pytest.mark.parametrize("swizzled", [False, True])
def test_nvfp4_numpy_bit_exact(swizzled):
    m, k = 5, 96
    x = _mx_input(m, k, 2)
    q, s, g = encore.nvfp4_quant(x, swizzled=swizzled)
    f32 = np.float32
    glob = f32(np.abs(x).max()) / f32(2688)
    assert g.dtype == np.float32 and g.shape == (1,) and g[0] == glob
    blocks = x.reshape(m, k // 16, 16)
    bmax = np.abs(blocks).max(-1)
    ref_s = _nearest((bmax / f32(6) / glob).astype(f32), _E4M3, 128, 448.0)
    d = (_E4M3[ref_s].astype(f32) * glob).astype(f32)
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.where(d[..., None] > 0, _nearest((blocks / d[..., None]).astype(f32), _E2M1, 8, 6.0), 0).reshape(m, k)
    rows = s.reshape(-1)[_swizzle_index(m, k // 16)] if swizzled else s
    np.testing.assert_array_equal(rows, ref_s)
    np.testing.assert_array_equal(q, (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8))
    back = encore.nvfp4_dequant(q, s, g, swizzled=swizzled)
    np.testing.assert_allclose(back, _E2M1[codes] * np.repeat(d, 16, axis=1), rtol=1e-6)


def test_mx_bad_k():
    with pytest.raises(ValueError, match="must be a multiple of 32"):
        encore.mxfp8_quant(np.ones((2, 48), np.float32))
    with pytest.raises(ValueError, match="must be a multiple of 16"):
        encore.nvfp4_quant(np.ones((2, 40), np.float32))


@pytest.mark.skipif(torch is None, reason="torch not installed")
def test_mx_torch_cpu_matches_numpy():
    x = torch.randn(4, 64, dtype=torch.bfloat16) * 3
    q, s = encore.mxfp8_quant(x, swizzled=True)
    qn, sn = encore.mxfp8_quant(x.float().numpy(), swizzled=True)
    assert q.dtype == torch.float8_e4m3fn
    np.testing.assert_array_equal(q.view(torch.uint8).numpy(), qn)
    np.testing.assert_array_equal(s.numpy(), sn)
    q4, s4, g4 = encore.nvfp4_quant(x)
    q4n, s4n, g4n = encore.nvfp4_quant(x.float().numpy())
    assert s4.dtype == torch.float8_e4m3fn
    np.testing.assert_array_equal(q4.numpy(), q4n)
    np.testing.assert_array_equal(s4.view(torch.uint8).numpy(), s4n)
    np.testing.assert_allclose(encore.nvfp4_dequant(q4, s4, g4).numpy(), encore.nvfp4_dequant(q4n, s4n, g4n))
