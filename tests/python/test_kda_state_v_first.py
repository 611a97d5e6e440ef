"""fla's state_v_first (every caller state stored transposed, [.., HV, V, K]) through the Python layer on the
CPU backend: chunk_kda forward and backward (the chunked backward on saved residuals, with and without h, and
the token-level one), return_intermediate_states, fused_recurrent_kda, fused_recurrent_kda_fwd in place and
on a pool ([N] slots with padding, [N, S] slots with num_accepted_tokens; fp32 and bf16 pools), the prefill on
a pool, kda_forward / kda_backward on numpy arrays, torch.compile (the fake kernels' transposed shapes): each
against state_v_first=False on the same inputs with the states transposed, outputs and gradients
bit-identical, states exact transposes. fla's deprecated transpose_state_layout; states in the [K, V] layout
refused naming the argument. The checks take a device: test_kda_state_v_first_cuda.py runs them on CUDA."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import encore  # noqa: E402
from encore.kda import chunk_kda, fused_recurrent_kda, fused_recurrent_kda_fwd  # noqa: E402

H, HV = 2, 4  # grouped value heads
KW = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)


def tr(x):
    """A state tensor in the other layout ([.., K, V] <-> [.., V, K]), contiguous."""
    return x.transpose(-1, -2).contiguous()


def same(got, want, tol, what):
    """got equals want: bit for bit (tol 0), or within tol relative RMS."""
    assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: {got.shape} {got.dtype} vs {want.shape} {want.dtype}"
    if tol == 0:
        assert torch.equal(got, want), f"{what}: not bit-identical (max |diff| {(got.double() - want.double()).abs().max().item():.3e})"
        return
    a, b = got.double().cpu(), want.double().cpu()
    err = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
    assert err <= tol, f"{what}: relative RMS {err:.3e} > {tol:.0e}"


def inputs(b, t, kd, vd, dtype=torch.float32, device="cpu", seed=0):
    """(q, k, v, g (raw gate), beta (raw)) and the gate's {A_log, dt_bias}."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s, sd=1.0: (sd * torch.randn(*s, generator=gen, dtype=torch.float64)).to(dtype).to(device)  # noqa: E731
    x = (r(b, t, H, kd), r(b, t, H, kd), r(b, t, HV, vd), r(b, t, HV, kd), r(b, t, HV))
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    gate = dict(A_log=torch.log(torch.rand(HV, generator=gen, dtype=torch.float64) + 0.5).to(wide).to(device),
                dt_bias=(0.5 * torch.randn(HV * kd, generator=gen, dtype=torch.float64)).to(wide).to(device))
    return x, gate


def states(n, kd, vd, device="cpu", dtype=torch.float32, seed=9, sd=0.5):
    return (sd * torch.randn(n, HV, kd, vd, generator=torch.Generator().manual_seed(seed))).to(dtype).to(device)


# --- the checks (device-generic) ----------------------------------------------------------------------------

def check_chunk_kda(device, dtype, kd, vd, rematerialize, tol):
    """chunk_kda forward + backward, varlen with an empty sequence, initial and final state: o and every
    gradient the same, final_state and dh0 the transposes."""
    x, gate = inputs(1, 150, kd, vd, dtype, device, seed=1)
    cu = torch.tensor([0, 70, 70, 150])
    sdt = torch.float64 if dtype == torch.float64 else torch.float32
    h0 = states(3, kd, vd, device, sdt)
    gen = torch.Generator().manual_seed(2)
    d_o = torch.randn(x[2].shape, generator=gen).to(dtype).to(device)
    d_fin = torch.randn(3, HV, kd, vd, generator=gen).to(sdt).to(device)

    def run(vf):
        leaves = [t.detach().clone().requires_grad_(True) for t in (*x, gate["A_log"], gate["dt_bias"], tr(h0) if vf else h0)]
        q, k, v, g, beta, A_log, dt_bias, s0 = leaves
        o, fin = chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu,
                           state_v_first=vf, rematerialize=rematerialize, **KW)
        assert tuple(fin.shape) == ((3, HV, vd, kd) if vf else (3, HV, kd, vd))
        ((o.double() * d_o.double()).sum() + (fin.double() * (tr(d_fin) if vf else d_fin).double()).sum()).backward()
        return o.detach(), fin.detach(), [t.grad for t in leaves]

    o, fin, grads = run(False)
    o_vf, fin_vf, grads_vf = run(True)
    same(o_vf, o, tol, "o")
    same(fin_vf, tr(fin), tol, "final_state")
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias"), grads_vf, grads):
        same(a, b, tol, name)
    same(grads_vf[7], tr(grads[7]), tol, "dh0")


def check_intermediate_states(device, dtype, kd, vd, tol):
    """return_intermediate_states: h [B, NT, HV, V, K] with state_v_first, the transpose of the default's."""
    x, gate = inputs(2, 100, kd, vd, dtype, device, seed=3)
    h0 = states(2, kd, vd, device)
    with torch.inference_mode():
        o, fin, h = chunk_kda(*x, initial_state=h0, output_final_state=True, return_intermediate_states=True, **gate, **KW)
        o2, fin2, h2 = chunk_kda(*x, initial_state=tr(h0), output_final_state=True, return_intermediate_states=True, state_v_first=True,
                                 **gate, **KW)
    assert tuple(h2.shape) == (2, 2, HV, vd, kd) and h2.is_contiguous()
    same(o2, o, tol, "o")
    same(fin2, tr(fin), tol, "final_state")
    same(h2, tr(h), tol, "h")
    # fla's deprecated name alone reads as state_v_first (its value used, not only its presence)
    with torch.inference_mode(), pytest.warns(DeprecationWarning, match="transpose_state_layout"):
        o3, fin3 = chunk_kda(*x, initial_state=tr(h0), output_final_state=True, transpose_state_layout=True, **gate, **KW)
    assert torch.equal(o3, o2) and torch.equal(fin3, fin2)
    with torch.inference_mode(), pytest.warns(DeprecationWarning, match="transpose_state_layout"):
        o4, fin4 = chunk_kda(*x, initial_state=h0, output_final_state=True, transpose_state_layout=False, **gate, **KW)
    assert torch.equal(o4, o) and torch.equal(fin4, fin)


def check_fused_recurrent(device, dtype, kd, vd, tol):
    """fused_recurrent_kda (initial -> new final states, varlen with an empty sequence), fla's deprecated
    transpose_state_layout, fused_recurrent_kda_fwd in place without indices and with new final states."""
    x, gate = inputs(1, 9, kd, vd, dtype, device, seed=4)
    cu = torch.tensor([0, 2, 3, 3, 9])
    h0 = states(4, kd, vd, device)
    o, fin = fused_recurrent_kda(*x, **gate, initial_state=h0, output_final_state=True, cu_seqlens=cu, **KW)
    o2, fin2 = fused_recurrent_kda(*x, **gate, initial_state=tr(h0), output_final_state=True, cu_seqlens=cu, state_v_first=True, **KW)
    assert tuple(fin2.shape) == (4, HV, vd, kd)
    same(o2, o, tol, "o")
    same(fin2, tr(fin), tol, "final_state")
    with pytest.warns(DeprecationWarning, match="transpose_state_layout"):
        o3, fin3 = fused_recurrent_kda(*x, **gate, initial_state=tr(h0), output_final_state=True, cu_seqlens=cu,
                                       transpose_state_layout=True, **KW)
    assert torch.equal(o3, o2) and torch.equal(fin3, fin2)
    # fused_recurrent_kda_fwd: in place (fla's default) and new final states
    a, b = h0.clone(), tr(h0)
    oa, ra = fused_recurrent_kda_fwd(*x, **gate, initial_state=a, cu_seqlens=cu, **KW)
    ob, rb = fused_recurrent_kda_fwd(*x, **gate, initial_state=b, cu_seqlens=cu, state_v_first=True, **KW)
    assert ra is a and rb is b
    same(ob, oa, tol, "o (in place)")
    same(b, tr(a), tol, "initial_state updated in place")
    _, new = fused_recurrent_kda_fwd(*x, **gate, initial_state=tr(h0), inplace_final_state=False, output_final_state=True,
                                     cu_seqlens=cu, state_v_first=True, **KW)
    same(new, fin2, tol, "new final_state")


def check_pool(device, dtype, kd, vd, pool_dtype, tol):
    """fused_recurrent_kda_fwd on a pool: [N] slots with padding and [N, S] slots with num_accepted_tokens,
    in place; the pool the transpose of the default layout's after each call, untouched slots untouched."""
    calls = [(inputs(5, 1, kd, vd, dtype, device, seed=5), 8, torch.tensor([5, -1, 2, 7, 0], dtype=torch.int32), None),
             (inputs(3, 4, kd, vd, dtype, device, seed=6), 12, torch.tensor([[0, 1, 2, 3], [4, 5, -1, 6], [-1, 8, 9, 10]]),
              torch.tensor([2, 1, 1]))]
    for (x, gate), slots, idx, nat in calls:
        pool = states(slots, kd, vd, device, pool_dtype, seed=slots)
        a, b = pool.clone(), tr(pool)
        extra = dict(ssm_state_indices=idx.to(device), num_accepted_tokens=None if nat is None else nat.to(device))
        oa, ra = fused_recurrent_kda_fwd(*x, **gate, initial_state=a, **extra, **KW)
        ob, rb = fused_recurrent_kda_fwd(*x, **gate, initial_state=b, state_v_first=True, **extra, **KW)
        assert ra is a and rb is b
        what = f"{list(idx.shape)} slots, {pool_dtype} pool"
        same(ob, oa, tol, f"o, {what}")
        same(b, tr(a), tol, f"pool, {what}")
        used = set(idx.flatten().tolist())
        for s in range(slots):
            if s not in used:
                assert torch.equal(b[s], tr(pool)[s]), f"untouched slot {s} changed ({what})"
        assert not torch.equal(b, tr(pool))


def check_prefill(device, dtype, kd, vd, pool_dtype, tol):
    """chunk_kda(..., initial_state=pool, ssm_state_indices=...): the prefill on a [P, HV, V, K] pool, a padding sequence."""
    x, gate = inputs(1, 150, kd, vd, dtype, device, seed=7)
    cu = torch.tensor([0, 70, 100, 150])
    idx = torch.tensor([3, -1, 1]).to(device)
    pool = states(5, kd, vd, device, pool_dtype, seed=8)
    a, b = pool.clone(), tr(pool)
    with torch.no_grad():
        oa, ra = chunk_kda(*x, initial_state=a, ssm_state_indices=idx, cu_seqlens=cu, **gate, **KW)
        ob, rb = chunk_kda(*x, initial_state=b, ssm_state_indices=idx, cu_seqlens=cu, state_v_first=True, **gate, **KW)
    assert ra is a and rb is b
    same(ob, oa, tol, "o")
    same(b, tr(a), tol, "pool")
    for s in (0, 2, 4):
        assert torch.equal(b[s], tr(pool)[s]), f"untouched slot {s} changed"


# --- the CPU backend --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,rematerialize", [(torch.float64, False), (torch.float32, False), (torch.float32, True)],
                         ids=["fp64-token-level", "fp32-saved-h", "fp32-rematerialize"])
def test_chunk_kda_forward_backward(dtype, rematerialize):
    check_chunk_kda("cpu", dtype, 16, 8, rematerialize, 0)


def test_return_intermediate_states():
    check_intermediate_states("cpu", torch.float32, 16, 8, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_recurrent_kda(dtype):
    check_fused_recurrent("cpu", dtype, 16, 8, 0)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_decode_on_the_pool(pool_dtype):
    check_pool("cpu", torch.float32, 16, 8, pool_dtype, 0)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_prefill_on_the_pool(pool_dtype):
    check_prefill("cpu", torch.float32, 16, 8, pool_dtype, 0)


def test_kda_forward_backward_numpy():
    """kda_forward / kda_backward on numpy arrays (the launchers directly): states, d_final_state and dh0 transposed."""
    (q, k, v, g, beta), _ = inputs(2, 40, 6, 5, seed=10)
    x = [t.numpy() for t in (q, k, v, -0.2 * g.abs(), beta.sigmoid())]
    h0 = states(2, 6, 5).numpy()
    d_o, d_fin = np.random.default_rng(0).standard_normal(v.shape), np.random.default_rng(1).standard_normal(h0.shape)
    o, fin = encore.kda_forward(*x, initial_state=h0, output_final_state=True)
    o2, fin2 = encore.kda_forward(*x, initial_state=np.ascontiguousarray(h0.swapaxes(2, 3)), output_final_state=True, state_v_first=True)
    assert fin2.shape == (2, HV, 5, 6)
    np.testing.assert_array_equal(o2, o)
    np.testing.assert_array_equal(fin2, fin.swapaxes(2, 3))
    d_o, d_fin = d_o.astype(np.float32), d_fin.astype(np.float32)
    gr = encore.kda_backward(*x, d_o, d_fin, initial_state=h0)
    gr2 = encore.kda_backward(*x, d_o, np.ascontiguousarray(d_fin.swapaxes(2, 3)), initial_state=np.ascontiguousarray(h0.swapaxes(2, 3)),
                              state_v_first=True)
    for name in ("dq", "dk", "dv", "dg", "dbeta"):
        np.testing.assert_array_equal(gr2[name], gr[name], err_msg=name)
    np.testing.assert_array_equal(gr2["dh0"], gr["dh0"].swapaxes(2, 3))


def test_torch_compile_fullgraph():
    """torch.compile(fullgraph=True) of chunk_kda forward + backward with state_v_first (the fake kernels give
    final_state [N, HV, V, K]) and of a decode step on a transposed pool: the eager results."""
    x, gate = inputs(1, 70, 8, 4, seed=11)
    h0 = tr(states(1, 8, 4))

    def step(q, k, v, g, beta, s0):
        o, fin = chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True, state_v_first=True, **gate, **KW)
        return o.square().sum() + (fin * torch.arange(fin.numel()).reshape(fin.shape)).sum()

    eager = [t.clone().requires_grad_(True) for t in (*x, h0)]
    step(*eager).backward()
    compiled = [t.clone().requires_grad_(True) for t in (*x, h0)]
    torch.compile(step, fullgraph=True, backend="aot_eager")(*compiled).backward()
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-6)
    (d, dg), pool = inputs(3, 1, 8, 4, seed=12), tr(states(4, 8, 4))

    def decode(p):
        return fused_recurrent_kda_fwd(*d, **dg, initial_state=p, ssm_state_indices=torch.tensor([2, -1, 0]), state_v_first=True, **KW)[0]

    pe, pc = pool.clone(), pool.clone()
    oe = decode(pe)
    oc = torch.compile(decode, fullgraph=True, backend="aot_eager")(pc)
    assert torch.equal(oe, oc) and torch.equal(pe, pc)


def test_bad_layouts_refused():
    """States in the [K, V] layout with state_v_first (K != V) are refused naming the argument and nothing is
    written; state_v_first together with transpose_state_layout is fla's ValueError."""
    (q, k, v, g, beta), gate = inputs(2, 4, 16, 8, seed=13)
    kv = states(2, 16, 8)
    vf = dict(state_v_first=True, **gate, **KW)
    msg = r"initial_state: expected (shape )?\[N, HV, V, K\] \(state_v_first\) = \[2, 4, 8, 16\], got \[2, 4, 16, 8\]"
    with pytest.raises(ValueError, match=msg):
        chunk_kda(q, k, v, g, beta, initial_state=kv, **vf)
    with pytest.raises(ValueError, match=msg):
        fused_recurrent_kda(q, k, v, g, beta, initial_state=kv, **vf)
    pool = states(6, 16, 8)
    before = pool.clone()
    for extra in (dict(), dict(ssm_state_indices=torch.tensor([0, 3]))):
        with pytest.raises(ValueError, match=r"initial_state: expected \[[NP], HV, V, K\] \(state_v_first\)"):
            fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool[:2] if not extra else pool, **extra, **vf)
    with torch.no_grad(), pytest.raises(ValueError, match=r"pool: expected \[P, HV, V, K\] \(state_v_first\)"):
        chunk_kda(q, k, v, g, beta, initial_state=pool, ssm_state_indices=torch.tensor([0, 3]), **vf)
    assert torch.equal(pool, before)
    # the backward: d_final_state in the [K, V] layout
    x = (q, k, v, -0.2 * g.abs(), beta.sigmoid())
    with pytest.raises(ValueError, match=r"d_final_state: expected \[N, HV, V, K\] \(state_v_first\)"):
        encore.kda_backward(*x, torch.ones_like(v), kv, initial_state=tr(kv), state_v_first=True)
    # a [V, K] state without state_v_first
    with pytest.raises(ValueError, match=r"initial_state: expected (shape )?\[N, HV, K, V\]"):
        chunk_kda(q, k, v, g, beta, initial_state=tr(kv), **gate, **KW)
    for fn in (chunk_kda, fused_recurrent_kda):
        with pytest.raises(ValueError, match="Cannot pass both `state_v_first` and the deprecated `transpose_state_layout`"):
            fn(q, k, v, g, beta, initial_state=tr(kv), state_v_first=True, transpose_state_layout=True)
    # fla's fused_recurrent_kda_fwd ignores the deprecated name: refused there, not read as state_v_first
    with pytest.raises(ValueError, match="fused_recurrent_kda_fwd: not supported by encore: transpose_state_layout"):
        fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=tr(kv), transpose_state_layout=True)
