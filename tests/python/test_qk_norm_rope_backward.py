"""encore.qk_norm_rope_backward against torch autograd through an fp64 torch forward of the same math (per-head
RMSNorm of the Q and K heads times q/k weights, RoPE of adjacent column pairs by the turns of rope_freq_turns, V heads
untouched), on CPU tensors; CUDA bf16 against the CPU backend when a GPU is present; torch.compile; bad input."""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import encore  # noqa: E402

CUDA = encore.built_with_cuda() and encore.cuda_device_count() > 0 and torch.cuda.is_available()


def forward_fp64(x, wq, wk, pos, freq, nq, nkv, hd, eps):
    m = x.shape[0]
    heads = x.view(m, -1, hd)
    qk = heads[:, :nq + nkv]
    r = torch.rsqrt(qk.pow(2).mean(-1, keepdim=True) + eps)
    w = torch.cat([wq.expand(nq, hd), wk.expand(nkv, hd)])
    y = torch.cat([qk * r * w, heads[:, nq + nkv:]], 1).reshape(m, -1)
    f = freq[0::2].double() + freq[1::2].double()
    turns = pos.double()[:, None] * f[None]
    th = 2 * math.pi * (turns - torch.round(turns))
    a, b = y[:, 0::2], y[:, 1::2]
    c, s = th.cos(), th.sin()
    return torch.stack((a * c - b * s, b * c + a * s), -1).reshape(m, -1)


def case(m, nq, nkv, hd, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    n = (nq + 2 * nkv) * hd
    x = torch.randn(m, n, generator=g, dtype=torch.float64) * 2
    dy = torch.randn(m, n, generator=g, dtype=torch.float64)
    wq = 1 + 0.3 * torch.randn(hd, generator=g, dtype=torch.float64)
    wk = 1 + 0.3 * torch.randn(hd, generator=g, dtype=torch.float64)
    pos = torch.randint(0, 4096, (m,), generator=g, dtype=torch.int32)
    freq = torch.from_numpy(encore.rope_freq_turns(nq + 2 * nkv, nq + nkv, hd, 10000.0))
    to = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return to(x), to(dy), to(wq), to(wk), pos.to(device), freq.to(device)


def partials_of(x, hd):
    return x.double().view(x.shape[0], -1, hd).pow(2).sum(-1).float()


@pytest.mark.parametrize("m,nq,nkv,hd", [(5, 2, 1, 8), (33, 4, 2, 16), (1, 1, 1, 2)])
def test_matches_autograd_fp64_cpu(m, nq, nkv, hd):
    x, dy, wq, wk, pos, freq = case(m, nq, nkv, hd, torch.float32, seed=m)
    eps = 1e-5
    dx, dq, dk = encore.qk_norm_rope_backward(dy, x, partials_of(x, hd), wq, wk, pos, freq, nq, nkv, hd, eps)
    leaves = [t.double().requires_grad_(True) for t in (x, wq, wk)]
    y = forward_fp64(*leaves, pos, freq, nq, nkv, hd, eps)
    rx, rq, rk = torch.autograd.grad(y, leaves, dy.double())
    for got, want in ((dx, rx), (dq, rq), (dk, rk)):
        assert torch.isfinite(got).all()
        assert (got.double() - want).norm() <= 2e-6 * want.norm() + 1e-12, float((got.double() - want).norm() / want.norm())
    # the forward op's own output matches the fp64 forward (the same conventions)
    y32 = x.clone()
    encore.qk_norm_rope_(y32, partials_of(x, hd), wq, wk, pos, freq, nq, nkv, hd, eps)
    assert (y32.double() - y.detach()).norm() <= 1e-5 * y.norm()


def test_compiles_cpu():
    x, dy, wq, wk, pos, freq = case(9, 2, 1, 8, torch.float32)
    p = partials_of(x, 8)
    f = torch.compile(lambda *a: encore.qk_norm_rope_backward(*a, 2, 1, 8, 1e-6), backend="aot_eager", fullgraph=True)
    got = f(dy, x, p, wq, wk, pos, freq)
    want = encore.qk_norm_rope_backward(dy, x, p, wq, wk, pos, freq, 2, 1, 8, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_bad_input():
    x, dy, wq, wk, pos, freq = case(4, 2, 1, 8, torch.float32)
    with pytest.raises(ValueError, match="x"):
        encore.qk_norm_rope_backward(dy, x[:3], partials_of(x, 8), wq, wk, pos, freq, 2, 1, 8)
    with pytest.raises(ValueError, match="partials"):
        encore.qk_norm_rope_backward(dy, x, partials_of(x, 8)[:, :3], wq, wk, pos, freq, 2, 1, 8)
    with pytest.raises(ValueError, match="dy"):
        encore.qk_norm_rope_backward(dy, x, partials_of(x, 8), wq, wk, pos, freq, 3, 1, 8)


@pytest.mark.skipif(not CUDA, reason="needs encore built with CUDA and a GPU")
def test_cuda_bf16_matches_cpu_backend():
    m, nq, nkv, hd = 777, 8, 2, 128
    x, dy, wq, wk, pos, freq = case(m, nq, nkv, hd, torch.bfloat16)
    p = partials_of(x, hd)
    want = encore.qk_norm_rope_backward(dy.float(), x.float(), p, wq.float(), wk.float(), pos, freq, nq, nkv, hd)
    got = encore.qk_norm_rope_backward(*(t.cuda() for t in (dy, x, p, wq, wk, pos, freq)), nq, nkv, hd)
    dx = got[0].float().cpu()
    assert torch.isfinite(dx).all()
    assert (dx - want[0]).norm() <= 8e-3 * want[0].norm()
    for a, b in zip(got[1:], want[1:]):
        assert (a.cpu() - b).norm() <= 1e-4 * b.norm()
