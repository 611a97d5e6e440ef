"""The LLaMA-block wrapper on the CPU backend (numpy, fp32) against a textbook numpy forward, its
out= and workspace= buffers, and the same on CUDA tensors when a GPU and torch are present."""
import numpy as np
import pytest

import encore
from helpers import needs_cuda_device, randn, rel, rope_ref


def block_args(m=9, d=32, f=48, heads=4, hd=8):
    """A small LLaMA block's inputs (numpy fp32): y0, x0, w0, w1, w2, w3, g0, g1, pos, freq."""
    y0, x0 = randn(m, d), randn(m, d)
    w0, w1, w2, w3 = randn(d, d, scale=0.2), randn(2 * f, d, scale=0.2), randn(d, f, scale=0.2), randn(heads * hd, d, scale=0.2)
    g0, g1 = 1 + randn(d, scale=0.1), 1 + randn(d, scale=0.1)
    pos = np.arange(m, dtype=np.int32) * 7
    return y0, x0, w0, w1, w2, w3, g0, g1, pos, encore.rope_freq_turns(heads, 3, hd, 10000.0)


def test_llama_block_matches_textbook():
    y0, x0, w0, w1, w2, w3, g0, g1, pos, freq = block_args()
    x1, x2, z1, qkv, r1, r2 = encore.llama_block_forward(y0, x0, w0, w1, w2, w3, g0, g1, pos, freq, eps=1e-5)
    X0 = y0.astype(np.float64) @ w0.T + x0

    def rms(x, g):
        return x / np.sqrt((x * x).mean(1, keepdims=True) + 1e-5) * g

    Z1 = rms(X0, g0) @ w1.T
    Y1 = Z1[:, 0::2] / (1 + np.exp(-Z1[:, 0::2])) * Z1[:, 1::2]
    X2 = Y1 @ w2.T + X0
    Q = rope_ref(rms(X2, g1) @ w3.T, pos, freq)
    for out, ref in ((x1, X0), (x2, X2), (z1, Z1), (qkv, Q)):
        assert rel(out, ref) < 2e-5


def test_llama_block_out_and_workspace():
    args = block_args()
    want = encore.llama_block_forward(*args)
    out = tuple(np.empty(a.shape, dtype=a.dtype) for a in want)
    nbytes = encore.llama_block_workspace_bytes(*args, out)
    ws = np.zeros(nbytes, dtype=np.uint8)
    for _ in range(2):  # the same buffers twice, poisoned before each call
        for o in out:
            o.fill(np.nan)
        got = encore.llama_block_forward(*args, out=out, workspace=ws)
        assert all(g is o for g, o in zip(got, out))  # written in place, returned as given
        for g, w in zip(got, want):
            assert np.array_equal(g, w)
    with pytest.raises(ValueError, match="workspace"):
        encore.llama_block_forward(*args, out=out, workspace=np.zeros(nbytes - 257, dtype=np.uint8))
    with pytest.raises(ValueError, match="workspace"):
        encore.llama_block_forward(*args, out=out, workspace=np.zeros(nbytes, dtype=np.float32))
    with pytest.raises(ValueError, match="out"):
        encore.llama_block_forward(*args, out=out[:5], workspace=ws)


@needs_cuda_device
def test_cuda_llama_block_out_and_workspace():
    torch = pytest.importorskip("torch")
    dev, bf = "cuda", torch.bfloat16
    m, d, f, heads, rotary, hd = 300, 256, 320, 8, 6, 64
    t = lambda *s, scale=1.0: (torch.randn(*s, device=dev) * scale).to(bf)  # noqa: E731
    args = (t(m, d), t(m, d), t(d, d, scale=d ** -0.5), t(2 * f, d, scale=d ** -0.5), t(d, f, scale=f ** -0.5),
            t(heads * hd, d, scale=d ** -0.5), t(d, scale=0.1) + 1, t(d, scale=0.1) + 1,
            torch.arange(m, device=dev, dtype=torch.int32), torch.from_numpy(encore.rope_freq_turns(heads, rotary, hd, 500000.0)).to(dev))
    want = encore.llama_block_forward(*args)
    out = tuple(torch.empty_like(a) for a in want)
    ws = torch.empty(encore.llama_block_workspace_bytes(*args, out), dtype=torch.uint8, device=dev)
    for _ in range(2):  # the same buffers twice, poisoned before each call
        for t_ in out:
            t_.fill_(float("nan"))
        got = encore.llama_block_forward(*args, out=out, workspace=ws)
        torch.cuda.synchronize()
        assert all(g is o for g, o in zip(got, out))
        for g, w in zip(got, want):
            assert torch.equal(g, w)
    with pytest.raises(ValueError, match="workspace"):
        encore.llama_block_forward(*args, out=out, workspace=ws.cpu())
