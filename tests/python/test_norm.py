"""The norm family's Python wrappers (rms_norm, add_rms_norm, qk_norm_) on the CPU backend (numpy,
and torch CPU tensors when torch is present), plus CUDA tensors when a GPU is visible."""
import numpy as np
import pytest

import encore
from helpers import needs_torch_cuda, torch


def ref_rms_norm(x, w, eps, off):
    x64 = x.astype(np.float64)
    r = 1.0 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + eps)
    return x64 * r * (w.astype(np.float64) + off)


TOL = {np.float32: 1e-5, np.float16: 2e-3}


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 5, 129), (64, 4096)])
def test_rms_norm_numpy(dtype, shape):
    rng = np.random.default_rng()
    x = rng.standard_normal(shape).astype(dtype)
    w = (1 + 0.5 * rng.standard_normal(shape[-1])).astype(dtype)
    y = encore.rms_norm(x, w, eps=1e-5, weight_offset=0.5)
    assert y.shape == x.shape and y.dtype == x.dtype
    ref = ref_rms_norm(x, w, 1e-5, 0.5)
    err = np.linalg.norm(y.astype(np.float64) - ref) / np.linalg.norm(ref)
    assert np.isfinite(y).all() and err < TOL[dtype]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_add_rms_norm_numpy(dtype):
    rng = np.random.default_rng()
    x = rng.standard_normal((9, 300)).astype(dtype)
    r = rng.standard_normal((9, 300)).astype(dtype)
    w = rng.standard_normal(300).astype(dtype)
    y, h = encore.add_rms_norm(x, r, w)
    h_ref = (x.astype(np.float32) + r.astype(np.float32)).astype(dtype)
    np.testing.assert_array_equal(h, h_ref)
    ref = ref_rms_norm(h_ref, w, 1e-6, 0.0)
    assert np.linalg.norm(y.astype(np.float64) - ref) / np.linalg.norm(ref) < TOL[dtype]


def test_add_rms_norm_in_place_residual():
    rng = np.random.default_rng()
    x = rng.standard_normal((4, 64)).astype(np.float32)
    r = rng.standard_normal((4, 64)).astype(np.float32)
    w = np.ones(64, np.float32)
    expected = x + r
    y, h = encore.add_rms_norm(x, r, w, h_out=r)
    assert h is r
    np.testing.assert_array_equal(r, expected)


def test_strided_rows_numpy():
    rng = np.random.default_rng()
    big = rng.standard_normal((10, 80)).astype(np.float32)
    x = big[:, :64]  # row stride 80
    w = np.ones(64, np.float32)
    y = encore.rms_norm(x, w)
    ref = ref_rms_norm(x, w, 1e-6, 0.0)
    assert np.abs(y - ref).max() < 1e-5


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: (np.ones((4, 8), np.int32), np.ones(8, np.int32)), "x: dtype must be one of"),
        (lambda: (np.ones((4, 8), np.float32), np.ones(7, np.float32)), "weight: dimension 0 is 7"),
        (lambda: (np.ones((4, 8), np.float32), np.ones(8, np.float16)), "weight: dtype fp16 must match"),
        (lambda: (np.ones((4, 16), np.float32)[:, ::2], np.ones(8, np.float32)), "x: last dimension must be contiguous"),
        (lambda: (np.ones((0, 8), np.float32), np.ones(8, np.float32)), "x: empty tensor"),
    ],
)
def test_bad_input_raises_value_error(make, match):
    x, w = make()
    with pytest.raises(ValueError, match=match):
        encore.rms_norm(x, w)


def test_negative_eps_raises():
    with pytest.raises(ValueError, match="eps"):
        encore.rms_norm(np.ones((2, 8), np.float32), np.ones(8, np.float32), eps=-1.0)


@pytest.mark.skipif(torch is None, reason="torch not installed")
def test_torch_cpu_bf16():
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    w = torch.randn(256, dtype=torch.bfloat16)
    y = encore.rms_norm(x, w)
    ref = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)) * w.double()
    assert ((y.double() - ref).norm() / ref.norm()).item() < 8e-3


@needs_torch_cuda
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_torch_cuda_matches_cpu(dtype):
    dt = getattr(torch, dtype)
    x = torch.randn(37, 4096, dtype=dt, device="cuda")
    r = torch.randn(37, 4096, dtype=dt, device="cuda")
    w = torch.randn(4096, dtype=dt, device="cuda")
    y, h = encore.add_rms_norm(x, r, w)
    y_cpu, h_cpu = encore.add_rms_norm(x.cpu(), r.cpu(), w.cpu())
    assert torch.isfinite(y).all()
    assert torch.equal(h.cpu(), h_cpu)
    tol = {"bfloat16": 8e-3, "float16": 1e-3, "float32": 1e-5}[dtype]
    assert ((y.cpu().double() - y_cpu.double()).norm() / y_cpu.double().norm()).item() < tol


@pytest.mark.skipif(torch is None, reason="torch not installed")
def test_torch_autograd_refused():
    x = torch.randn(2, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="autograd"):
        encore.rms_norm(x, torch.ones(8))


def ref_qk_norm(qkv, wq, wk, hq, hkv, d, eps, off):
    out = qkv.astype(np.float64).copy()
    T = qkv.shape[0]
    heads = out[:, : (hq + hkv) * d].reshape(T, hq + hkv, d)
    r = 1.0 / np.sqrt((heads * heads).mean(-1, keepdims=True) + eps)
    w = np.concatenate([np.broadcast_to(wq, (hq, d)), np.broadcast_to(wk, (hkv, d))]).astype(np.float64) + off
    out[:, : (hq + hkv) * d] = (heads * r * w).reshape(T, -1)
    return out


@pytest.mark.parametrize("d", [64, 128, 256])
def test_qk_norm_numpy_in_place(d):
    rng = np.random.default_rng()
    hq, hkv, T = 4, 2, 5
    qkv = rng.standard_normal((T, (hq + 2 * hkv) * d)).astype(np.float16)
    wq = (1 + 0.3 * rng.standard_normal(d)).astype(np.float16)
    wk = (1 + 0.3 * rng.standard_normal(d)).astype(np.float16)
    ref = ref_qk_norm(qkv, wq, wk, hq, hkv, d, 1e-6, 1.0)
    v_before = qkv[:, (hq + hkv) * d:].copy()
    out = encore.qk_norm_(qkv, wq, wk, hq, hkv, d, weight_offset=1.0)
    assert out is qkv
    np.testing.assert_array_equal(qkv[:, (hq + hkv) * d:], v_before)
    err = np.linalg.norm(qkv.astype(np.float64) - ref) / np.linalg.norm(ref)
    assert err < 1e-3


def test_qk_norm_bad_head_dim():
    qkv = np.zeros((2, 4 * 96), np.float16)
    with pytest.raises(ValueError, match="head_dim: must be 64, 128 or 256"):
        encore.qk_norm_(qkv, np.ones(96, np.float16), np.ones(96, np.float16), 2, 1, 96)


@needs_torch_cuda
def test_qk_norm_torch_cuda_matches_cpu():
    hq, hkv, d, T = 32, 8, 128, 77
    qkv = torch.randn(T, (hq + 2 * hkv) * d, dtype=torch.bfloat16, device="cuda")
    wq = torch.rand(d, dtype=torch.bfloat16, device="cuda") + 0.5
    wk = torch.rand(d, dtype=torch.bfloat16, device="cuda") + 0.5
    cpu = qkv.cpu()
    encore.qk_norm_(qkv, wq, wk, hq, hkv, d)
    encore.qk_norm_(cpu, wq.cpu(), wk.cpu(), hq, hkv, d)
    assert torch.isfinite(qkv).all()
    assert ((qkv.cpu().double() - cpu.double()).norm() / cpu.double().norm()).item() < 8e-3
