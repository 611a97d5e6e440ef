"""encore.nn.LlamaBlock (python/encore/_block_autograd.py over torch.ops.encore.llama_block_forward /
llama_block_backward): gradients of every input and parameter against a plain-torch fp64 block on
CPU tensors (fp32, the CPU backend) and on CUDA (bf16, skipped without CUDA); the backward op's and
qkv_norm_backward's bad-input errors; the first layer's qkv_norm_backward against torch autograd."""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import encore  # noqa: E402
import encore.nn  # noqa: E402
from helpers import needs_torch_cuda  # noqa: E402

EPS = 1e-5


def rms(x, g, eps=EPS):
    return x * torch.rsqrt((x * x).mean(1, keepdim=True) + eps) * g


def rope(p, pos, freq):
    f = freq[0::2].double() + freq[1::2].double()
    t = pos.double()[:, None] * f[None, :]
    th = 2 * math.pi * (t - torch.round(t))
    c, s = torch.cos(th), torch.sin(th)
    a, b = p[:, 0::2], p[:, 1::2]
    out = torch.empty_like(p)
    out[:, 0::2] = a * c - b * s
    out[:, 1::2] = b * c + a * s
    return out


def torch_block(y0, x0, w0, w1, w2, w3, g0, g1, pos, freq):
    """The textbook block in plain torch (math of include/encore/blocks/llama.hpp)."""
    x1 = y0 @ w0.T + x0
    z1 = rms(x1, g0) @ w1.T
    y1 = torch.nn.functional.silu(z1[:, 0::2]) * z1[:, 1::2]
    x2 = y1 @ w2.T + x1
    return x2, rope(rms(x2, g1) @ w3.T, pos, freq)


def check_block(device, dtype, m, d, f, heads, kv, hd, tol, use_x2=True):
    torch.manual_seed(0)
    blk = encore.nn.LlamaBlock(d, f, heads, kv, hd, device=device, dtype=dtype)
    with torch.no_grad():
        blk.gamma0.copy_(1 + 0.2 * torch.randn(d))
        blk.gamma1.copy_(1 + 0.2 * torch.randn(d))
    y0 = torch.randn(m, d, device=device, dtype=dtype, requires_grad=True)
    x0 = torch.randn(m, d, device=device, dtype=dtype, requires_grad=True)
    pos = torch.randint(0, 50000, (m,), dtype=torch.int32, device=device)
    nq = (heads + 2 * kv) * hd
    px, pq = torch.randn(m, d, device=device), torch.randn(m, nq, device=device)
    x2, qkv = blk(y0, x0, pos)
    assert x2.shape == (m, d) and qkv.shape == (m, nq) and x2.dtype == dtype
    loss = (qkv.float() * pq).sum() + ((x2.float() * px).sum() if use_x2 else 0)
    loss.backward()
    names = ["y0", "x0", "w0", "w1", "w2", "w3", "gamma0", "gamma1"]
    ours = [y0.grad, x0.grad] + [getattr(blk, n).grad for n in names[2:]]
    # the reference: the same values in fp64, torch autograd
    leaves = [t.detach().double().cpu().requires_grad_() for t in (y0, x0, blk.w0, blk.w1, blk.w2, blk.w3, blk.gamma0, blk.gamma1)]
    rx2, rq = torch_block(*leaves, pos.cpu(), blk.freq.cpu())
    # forward agreement first (to the dtype)
    assert (x2.double().cpu() - rx2).norm() / rx2.norm() < tol
    assert (qkv.double().cpu() - rq).norm() / rq.norm() < tol
    rloss = (rq * pq.double().cpu()).sum() + ((rx2 * px.double().cpu()).sum() if use_x2 else 0)
    rloss.backward()
    for name, g, leaf in zip(names, ours, leaves):
        assert g is not None, name
        assert g.shape == leaf.shape and g.dtype == dtype, name
        err = ((g.double().cpu() - leaf.grad).norm() / leaf.grad.norm()).item()
        assert err < tol, f"{name}: rel err {err:.3g}"


def test_cpu_fp32_gradients_match_fp64_torch():
    check_block("cpu", torch.float32, 37, 32, 24, 2, 1, 8, 1e-4)
    check_block("cpu", torch.float32, 130, 48, 136, 3, 1, 8, 1e-4)  # several 128-row dγ and 128-column zdz tiles


def test_cpu_only_qkv_used():
    check_block("cpu", torch.float32, 19, 16, 8, 2, 1, 8, 1e-4, use_x2=False)  # d_x2 arrives as None: zeros


@needs_torch_cuda
def test_cuda_bf16_gradients_match_fp64_torch():
    check_block("cuda", torch.bfloat16, 200, 256, 688, 4, 2, 64, 2e-2)
    check_block("cuda", torch.bfloat16, 1000, 512, 688, 8, 2, 64, 2e-2)


def saved_case(m=21, d=16, f=8, heads=2, kv=1, hd=8):
    torch.manual_seed(1)
    blk = encore.nn.LlamaBlock(d, f, heads, kv, hd, dtype=torch.float32)
    y0, x0 = torch.randn(m, d), torch.randn(m, d)
    pos = torch.arange(m, dtype=torch.int32)
    w = (blk.w0.detach(), blk.w1.detach(), blk.w2.detach(), blk.w3.detach(), blk.gamma0.detach(), blk.gamma1.detach())
    x1, x2, z1, qkv, r1, r2 = encore.llama_block_forward(y0, x0, *w, pos, blk.freq)
    d_qkv, d_x2 = torch.randn_like(qkv), torch.randn_like(x2)
    return [y0, *w[:4], w[4], w[5], pos, blk.freq, x1, x2, z1, qkv, r1, r2, d_qkv, d_x2]


def test_backward_op_refuses_bad_input():
    args = saved_case()
    grads = encore.llama_block_backward(*args)
    assert len(grads) == 8 and grads[6].dtype == torch.float32
    bad = list(args)
    bad[15] = args[15][:, :-2].contiguous()  # d_qkv too narrow
    with pytest.raises(Exception, match="d_qkv"):
        encore.llama_block_backward(*bad)
    bad = list(args)
    bad[16] = args[16].double()  # d_x2 in another dtype
    with pytest.raises(Exception, match="d_x2"):
        encore.llama_block_backward(*bad)
    bad = list(args)
    bad[11] = torch.randn(21, 32)  # z1 of another forward (F = 16)
    with pytest.raises(Exception, match="z1"):
        encore.llama_block_backward(*bad)
    bad = list(args)
    bad[13] = args[13].to(torch.float16)  # r1 not float32
    with pytest.raises(Exception, match="r1"):
        encore.llama_block_backward(*bad)
    # through the torch op too
    with pytest.raises(Exception, match="d_qkv"):
        torch.ops.encore.llama_block_backward(*args[:15], args[15][:, :-2].contiguous(), args[16], None)


def test_residual_gradient_in_place():
    args = saved_case()
    want = encore.llama_block_backward(*args)
    d_x2 = args[16].clone()
    out = tuple(torch.empty_like(t) for t in want)
    out = (out[0], d_x2, *out[2:])  # d_x0 over d_x2
    got = encore.llama_block_backward(*args[:16], d_x2, out=out)
    assert got[1] is d_x2
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=1e-6, atol=1e-6)


def test_qkv_norm_backward_matches_torch_autograd():
    torch.manual_seed(2)
    m, d, heads, kv, hd = 33, 24, 2, 1, 8
    nq = (heads + 2 * kv) * hd
    x = torch.randn(m, d, dtype=torch.float64, requires_grad=True)
    g = (1 + 0.2 * torch.randn(d, dtype=torch.float64)).requires_grad_()
    w3 = (torch.randn(nq, d, dtype=torch.float64) / math.sqrt(d)).requires_grad_()
    pos = torch.randint(0, 1000, (m,), dtype=torch.int32)
    freq = torch.from_numpy(encore.rope_freq_turns(heads + 2 * kv, heads + kv, hd, 10000.0))
    qkv = rope(rms(x, g) @ w3.T, pos, freq)
    d_qkv, d_prev = torch.randn(m, nq, dtype=torch.float64), torch.randn(m, d, dtype=torch.float64)
    ((qkv * d_qkv).sum() + (x * d_prev).sum()).backward()
    f32 = lambda t: t.detach().float().contiguous()  # noqa: E731
    r = torch.rsqrt((x.detach() ** 2).mean(1) + EPS).float()
    dx, dw3, dg = encore.qkv_norm_backward(f32(x), f32(g), f32(w3), pos, freq, r, f32(qkv), f32(d_qkv), f32(d_prev))
    for name, ours, ref in (("dx", dx, x.grad), ("dw3", dw3, w3.grad), ("dgamma", dg, g.grad)):
        err = ((ours.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-5, f"{name}: {err:.3g}"
    with pytest.raises(Exception, match="d_qkv"):
        encore.qkv_norm_backward(f32(x), f32(g), f32(w3), pos, freq, r, f32(qkv), f32(d_qkv)[:-1], None)


def test_wgrad_and_dgrad_rows():
    a, w = np.random.randn(7, 12).astype(np.float32), np.random.randn(7, 5).astype(np.float32)  # a stored [K, M]
    alpha = np.array([0.5], dtype=np.float32)
    d = encore.gemm_epilogue("wgrad", a, w, alpha=alpha)["d"]
    assert d.shape == (12, 5)
    assert np.allclose(d, 0.5 * a.T.astype(np.float64) @ w, rtol=1e-5, atol=1e-5)
    b = np.random.randn(7, 12).astype(np.float32)
    w2 = np.random.randn(12, 9).astype(np.float32)  # [K, N]
    assert np.allclose(encore.gemm_epilogue("dgrad", b, w2)["d"], b.astype(np.float64) @ w2, rtol=1e-5, atol=1e-5)


def test_module_compiles_fullgraph_cpu():
    torch.manual_seed(3)
    blk = encore.nn.LlamaBlock(32, 24, 2, 1, 8)
    y0, x0 = torch.randn(17, 32, requires_grad=True), torch.randn(17, 32, requires_grad=True)
    pos = torch.arange(17, dtype=torch.int32)

    def f(y0, x0, pos):
        x2, qkv = blk(y0, x0, pos)
        return x2.sum() + (qkv * qkv).sum()

    f(y0, x0, pos).backward()
    want = [y0.grad.clone(), x0.grad.clone()] + [p.grad.clone() for p in blk.parameters()]
    y0.grad = x0.grad = None
    blk.zero_grad()
    torch.compile(f, backend="aot_eager", fullgraph=True)(y0, x0, pos).backward()
    got = [y0.grad, x0.grad] + [p.grad for p in blk.parameters()]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
