"""fla's own KDA test matrix, forward and backward, run against encore.kda.chunk_kda on CUDA: the case lists of
fla-org/flash-linear-attention tests/ops/test_kda.py (test_chunk: fp16, scales 0.1 / 1, gate normalizers
0.1 / 1 / 10, masked gates, q/k L2 norm in and out of the kernel, the in-kernel gate with A_log / dt_bias;
test_chunk_varlen: fp16, K = V = 60 / 64 / 100 / 128 / 256 with cu_seqlens), fla's reference (its installed
naive_recurrent_kda and naive_kda_gate, the loss sum(o * do) + sum(ht * dht) through torch.autograd) and
fla's tolerances on the relative RMS error (o, ht 5e-3; dq, dk, dv, dh0 7e-3 to 8e-3; dg, dbeta 1.5e-2 to
2e-2; dA_log, ddt_bias 1e-3). Needs a GPU, encore built with CUDA and fla-core (the GPU runs install it from
.whl); skipped otherwise."""
import pytest

torch = pytest.importorskip("torch")
import encore  # noqa: E402

try:
    from fla.ops.kda.gate import naive_kda_gate
    from fla.ops.kda.naive import naive_recurrent_kda
    HAVE_FLA = True
except Exception:  # noqa: BLE001 (fla absent, or without its GPU stack)
    HAVE_FLA = False

pytestmark = pytest.mark.skipif(not (HAVE_FLA and torch.cuda.is_available() and encore.built_with_cuda()),
                                reason="needs fla-core, a GPU and encore built with CUDA")
F = torch.nn.functional
DEVICE, DTYPE = "cuda", torch.float16  # fla's cases (module constants, so a debugging run can point them elsewhere)


def rel(ref, got):
    """RMS of the difference over the RMS of the reference (fla's error ratio)."""
    ref, got = ref.detach().double(), got.detach().double()
    assert torch.isfinite(got).all(), "NaN or inf"
    return float((ref - got).square().mean().sqrt() / (ref.square().mean().sqrt() + 1e-8))


def grads(loss, leaves):
    out = torch.autograd.grad(loss, leaves, retain_graph=True)  # the shared F.normalize graph is walked twice
    return [g.detach() for g in out]


# (B, T, H, D, scale, gate_logit_normalizer, mask_p, use_qk_l2norm_in_kernel, use_gate_in_kernel), fp16.
CHUNK = [(1, 63, 1, 64, 1, 1, 0, False, False), (2, 500, 3, 60, 1, 1, 0, False, False), (2, 1000, 3, 64, 0.1, 1, 0.5, False, False),
         (3, 1024, 4, 100, 1, 0.1, 0, False, False), (4, 1024, 4, 128, 0.1, 1, 0, False, False),
         (4, 1024, 4, 128, 0.1, 1, 0, True, False), (2, 1500, 4, 128, 0.1, 10, 0, False, True), (4, 2048, 8, 64, 0.1, 1, 0, False, True)]


@pytest.mark.parametrize("case", CHUNK, ids=lambda c: "B{}-T{}-H{}-D{}-scale{}-norm{}-mask{}-l2{}-gate{}".format(*c))
def test_chunk(case):
    B, T, H, D, scale, normalizer, mask_p, l2, gate = case
    dev, dt = DEVICE, DTYPE
    gen = torch.Generator().manual_seed(42)
    q, k, v = (torch.rand(B, T, H, D, generator=gen, dtype=dt) for _ in range(3))
    g = torch.randn(B, T, H, D, generator=gen)
    A_log = dt_bias = None
    if gate:
        A_log, dt_bias = torch.randn(H, generator=gen), torch.randn(H * D, generator=gen)
    else:
        g = F.logsigmoid(g) / normalizer
        g = g * (torch.rand(g.shape, generator=gen) > mask_p)
    beta = torch.randn(B, T, H, generator=gen, dtype=dt).sigmoid()
    h0 = torch.randn(B, H, D, D, generator=gen)
    do, dht = torch.randn(B, T, H, D, generator=gen, dtype=dt), torch.randn(B, H, D, D, generator=gen)
    leaves = [t.to(dev).requires_grad_(True) for t in (q, k, v, g, beta, h0)]
    extra = [t.to(dev).requires_grad_(True) for t in (A_log, dt_bias)] if gate else []
    do, dht = do.to(dev), dht.to(dev)
    q, k, v, g, beta, h0 = leaves

    qn, kn = F.normalize(q, p=2, dim=-1), F.normalize(k, p=2, dim=-1)
    ref, ref_ht = naive_recurrent_kda(q=qn, k=kn, v=v, g=naive_kda_gate(g, *extra) if gate else g, beta=beta, scale=scale,
                                      initial_state=h0, output_final_state=True)
    ref_g = grads((ref * do).sum() + (ref_ht * dht).sum(), leaves + extra)

    kw = dict(A_log=extra[0], dt_bias=extra[1]) if gate else {}
    tri, tri_ht = encore.kda.chunk_kda(q if l2 else qn, k if l2 else kn, v, g, beta, scale=scale, initial_state=h0,
                                       output_final_state=True, use_qk_l2norm_in_kernel=l2, use_gate_in_kernel=gate, **kw)
    assert tri.dtype == v.dtype and tri_ht.dtype == torch.float32
    tri_g = grads((tri * do).sum() + (tri_ht * dht).sum(), leaves + extra)

    names = ["dq", "dk", "dv", "dg", "db", "dh0", "dA", "dbias"]
    tols = [8e-3, 8e-3, 8e-3, 2e-2, 2e-2, 8e-3, 1e-3, 1e-3]
    errs = {"o": rel(ref, tri), "ht": rel(ref_ht, tri_ht)}
    errs.update({n: rel(a, b) for n, a, b in zip(names, ref_g, tri_g)})
    bounds = {"o": 5e-3, "ht": 5e-3, **dict(zip(names, tols))}
    bad = {n: e for n, e in errs.items() if not e <= bounds[n]}
    assert not bad, f"over fla's tolerance: {bad} (all: {errs})"


# (H, D, mask_p, cu_seqlens), fp16.
VARLEN = [(4, 60, 0, [0, 15]), (4, 64, 0, [0, 256, 500, 1000]), (4, 128, 0.5, [0, 256, 500, 1000]),
          (4, 100, 0, [0, 15, 100, 300, 1200, 2000]), (4, 256, 0, [0, 100, 300, 1200, 3000, 4096])]


@pytest.mark.parametrize("case", VARLEN, ids=lambda c: "H{}-D{}-mask{}-cu{}".format(*c))
def test_chunk_varlen(case):
    H, D, mask_p, cu = case
    dev, dt = DEVICE, DTYPE
    gen = torch.Generator().manual_seed(42)
    T, N = cu[-1], len(cu) - 1
    q = torch.randn(1, T, H, D, generator=gen, dtype=dt)
    k = F.normalize(torch.randn(1, T, H, D, generator=gen), p=2, dim=-1).to(dt)
    v = torch.randn(1, T, H, D, generator=gen, dtype=dt)
    g = F.logsigmoid(torch.randn(1, T, H, D, generator=gen))
    g = g * (torch.rand(g.shape, generator=gen) > mask_p)
    beta = torch.rand(1, T, H, generator=gen, dtype=dt).sigmoid()
    h0 = torch.randn(N, H, D, D, generator=gen)
    do, dht = torch.randn(1, T, H, D, generator=gen, dtype=dt), torch.rand(N, H, D, D, generator=gen)
    leaves = [t.to(dev).requires_grad_(True) for t in (q, k, v, g, beta, h0)]
    do, dht = do.to(dev), dht.to(dev)
    q, k, v, g, beta, h0 = leaves
    cu_t = torch.tensor(cu, dtype=torch.long, device=dev)

    tri, tri_ht = encore.kda.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu_t)
    tri_g = grads((tri * do).sum() + (tri_ht * dht).sum(), leaves)
    outs, states = [], []
    for i in range(N):
        s = slice(cu[i], cu[i + 1])
        o_i, ht_i = naive_recurrent_kda(q=q[:, s], k=k[:, s], v=v[:, s], g=g[:, s], beta=beta[:, s], initial_state=h0[i],
                                        output_final_state=True)
        outs.append(o_i)
        states.append(ht_i)
    ref, ref_ht = torch.cat(outs, 1), torch.cat(states, 0)
    ref_g = grads((ref * do).sum() + (ref_ht * dht).sum(), leaves)

    names, tols = ["dq", "dk", "dv", "dg", "db", "dh0"], [7e-3, 8e-3, 7e-3, 1.5e-2, 1.5e-2, 7e-3]
    errs = {"o": rel(ref, tri), "ht": rel(ref_ht, tri_ht)}
    errs.update({n: rel(a, b) for n, a, b in zip(names, ref_g, tri_g)})
    bounds = {"o": 5e-3, "ht": 5e-3, **dict(zip(names, tols))}
    bad = {n: e for n, e in errs.items() if not e <= bounds[n]}
    assert not bad, f"over fla's tolerance: {bad} (all: {errs})"
