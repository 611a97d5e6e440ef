"""The KDA wrappers on the CPU backend (numpy, fp32/fp64) against a numpy recurrence, finite
differences and bad input, and the forward on CUDA tensors when a GPU and torch are present."""
import numpy as np
import pytest

import encore
from helpers import needs_cuda_device, randn, rel, rng


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
    q = randn(1, 5, 1, 4)
    with pytest.raises(ValueError, match="cu_seqlens"):
        encore.kda_forward(q, q, q, q * 0, randn(1, 5, 1), cu_seqlens=np.array([0, 3, 4], np.int64))


@needs_cuda_device
def test_cuda_kda_matches_cpu():
    torch = pytest.importorskip("torch")
    dev = "cuda"
    # keys with β|k|² < 1 (the contractive regime; see tests/kda/test_kda_gpu.cpp)
    args = [torch.randn(1, 200, 2, 64), torch.randn(1, 200, 2, 64) * 0.1, torch.randn(1, 200, 2, 64),
            -torch.rand(1, 200, 2, 64) * 0.1, torch.rand(1, 200, 2)]
    o, fin = encore.kda_forward(*[t.to(dev) for t in args], output_final_state=True)
    o_cpu, fin_cpu = encore.kda_forward(*args, output_final_state=True)
    assert ((o.cpu() - o_cpu).norm() / o_cpu.norm()).item() < 5e-3
    assert ((fin.cpu() - fin_cpu).norm() / fin_cpu.norm()).item() < 5e-3


@needs_cuda_device
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


@needs_cuda_device
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
