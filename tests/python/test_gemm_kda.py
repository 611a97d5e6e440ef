"""The GEMM-epilogue, LLaMA-block and KDA wrappers on the CPU backend (numpy, fp32) against numpy
references, bad input, and the same ops on CUDA tensors when a GPU and torch are present."""
import numpy as np
import pytest

import encore

rng = np.random.default_rng()


def randn(*shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(np.float32)


def rel(a, b):
    return np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(b), 1e-30)


def rope_ref(z, pos, freq):
    f = freq[0::2].astype(np.float64) + freq[1::2].astype(np.float64)
    th = 2 * np.pi * pos[:, None].astype(np.float64) * f[None, :]
    a, b = z[:, 0::2], z[:, 1::2]
    out = np.empty_like(z)
    out[:, 0::2] = a * np.cos(th) - b * np.sin(th)
    out[:, 1::2] = b * np.cos(th) + a * np.sin(th)
    return out


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


def kda_ref(q, k, v, g, beta, scale):
    b, t, h, kd = q.shape
    o = np.zeros(v.shape)
    fin = np.zeros((b, h, kd, v.shape[3]))
    for bi in range(b):
        for hi in range(h):
            s = np.zeros((kd, v.shape[3]))
            for ti in range(t):
                s = np.exp(g[bi, ti, hi])[:, None] * s
                e = v[bi, ti, hi] - s.T @ k[bi, ti, hi]
                s = s + beta[bi, ti, hi] * np.outer(k[bi, ti, hi], e)
                o[bi, ti, hi] = scale * s.T @ q[bi, ti, hi]
            fin[bi, hi] = s
    return o, fin


def test_kda_forward_numpy():
    b, t, h, kd, vd = 2, 70, 2, 8, 6
    q, k, v = randn(b, t, h, kd), randn(b, t, h, kd, scale=0.4), randn(b, t, h, vd)
    g = np.log(1 / (1 + np.exp(-randn(b, t, h, kd)))).astype(np.float32) / 4
    beta = (0.1 + 0.8 * rng.random((b, t, h))).astype(np.float32)
    o, fin = encore.kda_forward(q, k, v, g, beta, output_final_state=True)
    o_ref, fin_ref = kda_ref(q.astype(np.float64), k, v, g, beta, kd ** -0.5)
    assert rel(o, o_ref) < 1e-5 and rel(fin, fin_ref) < 1e-5


def test_kda_forward_out_and_workspace_numpy():
    b, t, h, kd, vd = 1, 70, 2, 8, 6
    q, k, v = randn(b, t, h, kd), randn(b, t, h, kd, scale=0.4), randn(b, t, h, vd)
    g = -0.2 * rng.random((b, t, h, kd)).astype(np.float32)
    beta = (0.1 + 0.8 * rng.random((b, t, h))).astype(np.float32)
    want_o, want_fin = encore.kda_forward(q, k, v, g, beta, output_final_state=True)
    out = (np.full(want_o.shape, np.nan, np.float32), np.full(want_fin.shape, np.nan, np.float32))
    ws = np.zeros(max(encore.kda_forward_workspace_bytes(q, k, v, g, beta, out), 1), np.uint8)
    o, fin = encore.kda_forward(q, k, v, g, beta, output_final_state=True, out=out, workspace=ws)
    assert o is out[0] and fin is out[1]
    assert np.array_equal(o, want_o) and np.array_equal(fin, want_fin)
    with pytest.raises(ValueError, match="final_state"):
        encore.kda_forward(q, k, v, g, beta, output_final_state=False, out=out)
    with pytest.raises(ValueError, match="out"):
        encore.kda_forward(q, k, v, g, beta, out=(out[0],))
    with pytest.raises(ValueError, match="workspace"):
        encore.kda_forward(q, k, v, g, beta, workspace=np.zeros(16, np.float32))


def test_kda_residuals_numpy():
    b, t, h, kd, vd = 1, 100, 2, 8, 6  # two chunks, the second ragged
    q, k, v = randn(b, t, h, kd), randn(b, t, h, kd, scale=0.3), randn(b, t, h, vd)
    g = -0.2 * rng.random((b, t, h, kd)).astype(np.float32)
    beta = (0.1 + 0.8 * rng.random((b, t, h))).astype(np.float32)
    o, fin, res = encore.kda_forward(q, k, v, g, beta, output_final_state=True, return_residuals=True)
    assert res["G"].shape == (b, t, h, kd) and res["Aqk"].shape == (b, t, h, 64) and res["h"].shape == (2, h, kd, vd)
    scale, q64, k64, g64 = kd ** -0.5, q.astype(np.float64), k.astype(np.float64), g.astype(np.float64)
    G, Aqk, Akk = np.zeros((b, t, h, kd)), np.zeros((b, t, h, 64)), np.zeros((b, t, h, 64))
    for c0 in range(0, t, 64):
        c1 = min(t, c0 + 64)
        gn = np.cumsum(g64[0, c0:c1], axis=0)  # natural-log cumsum [rows, h, kd]
        G[0, c0:c1] = gn / np.log(2)
        for hi in range(h):
            decay = np.exp(gn[:, None, hi, :] - gn[None, :, hi, :])  # [i, j, kd]
            kk = np.einsum("ic,jc,ijc->ij", k64[0, c0:c1, hi], k64[0, c0:c1, hi], decay)
            qk = np.einsum("ic,jc,ijc->ij", q64[0, c0:c1, hi], k64[0, c0:c1, hi], decay)
            rows = c1 - c0
            Aqk[0, c0:c1, hi, :rows] = scale * np.tril(qk)
            L = beta[0, c0:c1, hi, None].astype(np.float64) * np.tril(kk, -1)
            Akk[0, c0:c1, hi, :rows] = np.linalg.inv(np.eye(rows) + L)
    assert rel(res["G"], G) < 1e-6 and rel(res["Aqk"], Aqk) < 1e-5 and rel(res["Akk"], Akk) < 1e-5
    _, h_mid = kda_ref(q.astype(np.float64)[:, :64], k[:, :64], v[:, :64], g[:, :64], beta[:, :64], scale)
    assert np.abs(res["h"][0]).max() == 0 and rel(res["h"][1], h_mid[0]) < 1e-5
    with pytest.raises(ValueError, match="bfloat16"):
        encore.kda_forward(q, k, v, g, beta, return_residuals=True, residual_dtype="bfloat16")
    # A subset: only those are returned, with the same values.
    o2, _, sub = encore.kda_forward(q, k, v, g, beta, output_final_state=True, return_residuals=("Aqk", "Akk"))
    assert sorted(sub) == ["Akk", "Aqk"] and np.array_equal(sub["Aqk"], res["Aqk"]) and np.array_equal(sub["Akk"], res["Akk"])
    assert np.array_equal(o2, o)
    assert list(encore.kda_forward(q, k, v, g, beta, return_residuals="Akk")[2]) == ["Akk"]
    for bad in (("Aqk", "W"), "g"):
        with pytest.raises(ValueError, match="return_residuals"):
            encore.kda_forward(q, k, v, g, beta, return_residuals=bad)


def test_kda_backward_numpy_matches_finite_differences():
    b, t, h, kd, vd = 1, 9, 1, 4, 3
    f64 = lambda a: a.astype(np.float64)  # noqa: E731
    q, k, v = f64(randn(b, t, h, kd)), f64(randn(b, t, h, kd, scale=0.3)), f64(randn(b, t, h, vd))
    g, beta, d_o = -0.2 * rng.random((b, t, h, kd)), 0.1 + 0.8 * rng.random((b, t, h)), f64(randn(b, t, h, vd))
    grads = encore.kda_backward(q, k, v, g, beta, d_o)
    inputs = {"dq": q, "dk": k, "dv": v, "dg": g, "dbeta": beta}

    def loss():
        return float((encore.kda_forward(q, k, v, g, beta)[0] * d_o).sum())

    eps = 1e-6
    for name, x in inputs.items():
        flat = x.reshape(-1)
        for idx in rng.choice(flat.size, size=3, replace=False):
            x0 = flat[idx]
            flat[idx] = x0 + eps
            up = loss()
            flat[idx] = x0 - eps
            down = loss()
            flat[idx] = x0
            fd = (up - down) / (2 * eps)
            assert abs(grads[name].reshape(-1)[idx] - fd) <= 1e-6 * max(1.0, abs(fd)), (name, idx)


def test_bad_inputs_raise_value_error():
    a, w = randn(4, 16), randn(8, 12)
    with pytest.raises(ValueError, match="w: expected"):
        encore.gemm_row_scale(a, w, np.ones(4, np.float32))
    with pytest.raises(ValueError, match="tile"):
        encore.gemm_row_scale(a, randn(8, 16), np.ones(4, np.float32), tile="huge")
    q = randn(1, 5, 1, 4)
    with pytest.raises(ValueError, match="cu_seqlens"):
        encore.kda_forward(q, q, q, q * 0, randn(1, 5, 1), cu_seqlens=np.array([0, 3, 4], np.int64))


@pytest.mark.skipif(not (encore.built_with_cuda() and encore.cuda_device_count() > 0), reason="needs a CUDA device")
def test_cuda_gemm_and_kda_match_cpu():
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
    # keys with β|k|² < 1 (the contractive regime; see tests/gpu/test_kda_gpu.cpp)
    args = [torch.randn(1, 200, 2, 64), torch.randn(1, 200, 2, 64) * 0.1, torch.randn(1, 200, 2, 64),
            -torch.rand(1, 200, 2, 64) * 0.1, torch.rand(1, 200, 2)]
    o, fin = encore.kda_forward(*[t.to(dev) for t in args], output_final_state=True)
    o_cpu, fin_cpu = encore.kda_forward(*args, output_final_state=True)
    assert ((o.cpu() - o_cpu).norm() / o_cpu.norm()).item() < 5e-3
    assert ((fin.cpu() - fin_cpu).norm() / fin_cpu.norm()).item() < 5e-3


@pytest.mark.skipif(not (encore.built_with_cuda() and encore.cuda_device_count() > 0), reason="needs a CUDA device")
def test_cuda_kda_varlen_gate_in_kernel_matches_cpu():
    """The call bench/peers/kda_peers.py makes (fla's chunk_kda contract): varlen B = 1 with cu_seqlens
    given as a host array, a CUDA tensor and a CPU tensor, the softplus gate in the kernel with A_log
    and dt_bias, q/k L2 norm, bf16 inputs, final state and bf16 residuals; against the CPU backend
    (fp64) on the same bf16 values."""
    torch = pytest.importorskip("torch")
    dev, bf = "cuda", torch.bfloat16
    lens = [1, 63, 64, 65, 130]
    t, h, kd, vd = sum(lens), 3, 128, 128
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    gen = torch.Generator().manual_seed(7)
    q, k, v, g = (torch.randn(1, t, h, d, generator=gen).to(bf) for d in (kd, kd, vd, kd))
    beta = torch.rand(1, t, h, generator=gen).to(bf)
    A_log, dt_bias = torch.randn(h, generator=gen), torch.randn(h * kd, generator=gen)
    kw = dict(output_final_state=True, use_qk_l2norm=True, use_gate_in_kernel=True)
    o_cpu, fin_cpu = encore.kda_forward(*(x.double() for x in (q, k, v, g, beta)), A_log=A_log.double(), dt_bias=dt_bias.double(),
                                        cu_seqlens=cu, **kw)
    for cu_arg in (cu, torch.from_numpy(cu).to(dev), torch.from_numpy(cu).to(torch.int32)):
        o, fin, res = encore.kda_forward(*(x.to(dev) for x in (q, k, v, g, beta)), A_log=A_log.to(dev), dt_bias=dt_bias.to(dev),
                                         cu_seqlens=cu_arg, return_residuals=True, residual_dtype="bfloat16", **kw)
        assert o.dtype == bf and o.shape == (1, t, h, vd) and fin.shape == (len(lens), h, kd, vd)
        assert torch.isfinite(o.float()).all() and torch.isfinite(fin).all()
        e_o = ((o.cpu().double() - o_cpu).norm() / o_cpu.norm()).item()
        e_f = ((fin.cpu().double() - fin_cpu).norm() / fin_cpu.norm()).item()
        assert e_o < 5e-3 and e_f < 5e-3, (e_o, e_f)
        assert set(res) == {"G", "Aqk", "Akk", "h"} and res["Akk"].dtype == bf and res["G"].dtype == torch.float32


@pytest.mark.skipif(not (encore.built_with_cuda() and encore.cuda_device_count() > 0), reason="needs a CUDA device")
def test_cuda_kda_forward_out_and_workspace():
    torch = pytest.importorskip("torch")
    dev, bf = "cuda", torch.bfloat16
    gen = torch.Generator().manual_seed(3)
    b, t, h, kd = 1, 200, 2, 64
    q, k, v = (torch.randn(b, t, h, kd, generator=gen).to(bf).to(dev) for _ in range(3))
    g = (-torch.rand(b, t, h, kd, generator=gen) * 0.1).to(bf).to(dev)
    beta = torch.rand(b, t, h, generator=gen).to(bf).to(dev)
    cu = np.array([0, 63, 200], np.int64)
    kw = dict(output_final_state=True, use_qk_l2norm=True, cu_seqlens=cu)
    want_o, want_fin = encore.kda_forward(q, k, v, g, beta, **kw)
    out = (torch.empty_like(want_o), torch.empty_like(want_fin))
    nbytes = encore.kda_forward_workspace_bytes(q, k, v, g, beta, out, cu_seqlens=cu)
    assert nbytes >= 4 * h * 96 * 1024  # 4 chunk slots (1 + 3) x heads x a record of 96.5 KB
    ws = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    for _ in range(2):  # the same buffers twice, poisoned before each call
        for t_ in out:
            t_.fill_(float("nan"))
        o, fin = encore.kda_forward(q, k, v, g, beta, out=out, workspace=ws, **kw)
        torch.cuda.synchronize()
        assert o is out[0] and fin is out[1]
        assert torch.equal(o, want_o) and torch.equal(fin, want_fin)
    with pytest.raises(ValueError, match="workspace"):
        encore.kda_forward(q, k, v, g, beta, out=out, workspace=ws[: nbytes - 17], **kw)


@pytest.mark.skipif(not (encore.built_with_cuda() and encore.cuda_device_count() > 0), reason="needs a CUDA device")
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
