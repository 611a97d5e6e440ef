"""The GEMM-epilogue wrappers on the CPU backend (numpy, fp32) against numpy references, bad input,
and the same ops on CUDA tensors when a GPU and torch are present."""
import numpy as np
import pytest

import encore
from helpers import needs_cuda_device, randn, rel, rng, rope_ref


def test_scales_and_residual_partials():
    a, w = randn(37, 24), randn(40, 24, scale=0.2)
    r, alpha = (0.5 + rng.random(37)).astype(np.float32), np.array([-1.5], np.float32)
    acc = a.astype(np.float64) @ w.T.astype(np.float64)
    assert rel(encore.gemm_row_scale(a, w, r), r[:, None] * acc) < 1e-6
    assert rel(encore.gemm_scalar_scale(a, w, alpha), -1.5 * acc) < 1e-6
    res, gamma = randn(37, 40), randn(40)
    y, aux, parts = encore.gemm_residual_rms_partial(a, w, res, gamma)
    y_ref = acc + res
    assert rel(y, y_ref) < 1e-6 and rel(aux, y_ref * gamma) < 1e-6
    r2 = encore.rms_final_reduce(parts, 40, eps=1e-6)
    assert rel(r2, 1 / np.sqrt((y_ref ** 2).mean(1) + 1e-6)) < 1e-6


def test_swiglu_rope_heads_lse():
    a, w = randn(20, 32), randn(64, 32, scale=0.2)
    acc = a.astype(np.float64) @ w.T.astype(np.float64)
    z, y = encore.gemm_swiglu(a, w)
    g, u = acc[:, 0::2], acc[:, 1::2]
    assert rel(z, acc) < 1e-6 and rel(y, g / (1 + np.exp(-g)) * u) < 1e-6
    pos = rng.integers(0, 100000, 20).astype(np.int32)
    freq = encore.rope_freq_turns(4, 3, 16, 10000.0)
    assert rel(encore.gemm_rope(a, w, pos, freq), rope_ref(acc, pos, freq)) < 1e-5
    d, heads = encore.gemm_qkv_head_sqsum(a, w, head_dim=16)
    assert rel(heads, (acc ** 2).reshape(20, 4, 16).sum(-1)) < 1e-6
    target = rng.integers(0, 64, 20).astype(np.int32)
    target[3] = -100
    parts, logits, tl = encore.gemm_lse(a, w, target=target, store_logits=True)
    lse, loss = encore.lse_finish(parts, target, tl)
    lse_ref = np.log(np.exp(acc).sum(1))
    assert rel(lse, lse_ref) < 1e-6 and rel(logits, acc) < 1e-6
    loss_ref = lse_ref - acc[np.arange(20), np.clip(target, 0, 63)]
    loss_ref[3] = 0.0
    assert rel(loss, loss_ref) < 1e-5


def test_qkv_head_sqsum_then_qk_norm_rope():
    hq, hkv, hd = 2, 1, 8
    n = (hq + 2 * hkv) * hd
    a, w = randn(6, 16), randn(n, 16, scale=0.3)
    qkv, parts = encore.gemm_qkv_head_sqsum(a, w, head_dim=hd)
    qw, kw = 1 + randn(hd, scale=0.1), 1 + randn(hd, scale=0.1)
    pos = np.arange(6, dtype=np.int32) * 11
    freq = encore.rope_freq_turns(hq + 2 * hkv, hq + hkv, hd, 10000.0)
    encore.qk_norm_rope_(qkv, parts, qw, kw, pos, freq, hq, hkv, hd)
    acc = (a.astype(np.float64) @ w.T.astype(np.float64)).reshape(6, -1, hd)
    ref = acc.copy()
    ref[:, :hq + hkv] /= np.sqrt((acc[:, :hq + hkv] ** 2).mean(-1, keepdims=True) + 1e-6)
    ref[:, :hq] *= qw
    ref[:, hq:hq + hkv] *= kw
    ref = rope_ref(ref.reshape(6, n), pos, freq)
    assert rel(qkv, ref) < 1e-5


def test_bad_inputs_raise_value_error():
    a, w = randn(4, 16), randn(8, 12)
    with pytest.raises(ValueError, match="w: expected"):
        encore.gemm_row_scale(a, w, np.ones(4, np.float32))
    with pytest.raises(ValueError, match="tile"):
        encore.gemm_row_scale(a, randn(8, 16), np.ones(4, np.float32), tile="huge")


@needs_cuda_device
def test_cuda_gemm_matches_cpu():
    torch = pytest.importorskip("torch")
    dev = "cuda"
    a, w = torch.randn(300, 256, device=dev, dtype=torch.bfloat16), (torch.randn(512, 256, device=dev) * 0.06).bfloat16()
    r = torch.rand(300, device=dev) + 0.5
    d = encore.gemm_row_scale(a, w, r)
    ref = r[:, None] * (a.float() @ w.float().T)
    assert ((d.float() - ref).norm() / ref.norm()).item() < 8e-3
    z, y = encore.gemm_swiglu(a, w)
    z_cpu, y_cpu = encore.gemm_swiglu(a.cpu(), w.cpu())
    assert ((y.cpu().float() - y_cpu.float()).norm() / y_cpu.float().norm()).item() < 1e-2
