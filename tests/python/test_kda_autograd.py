"""encore.kda.chunk_kda, fla's drop-in, through torch.autograd: fp64 gradcheck on the CPU backend,
the saved-residual backward (saved h and rematerialized) against the token-level one, varlen,
the gate options, torch.compile, fla's keyword arguments and bad input; on CUDA the gradients
against the fp64 CPU backend."""
import itertools

import pytest

torch = pytest.importorskip("torch")

import encore  # noqa: E402
from encore.kda import chunk_kda  # noqa: E402
from helpers import needs_torch_cuda  # noqa: E402


def make(b, t, h, kd, vd, dtype=torch.float64, gate=False, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, s=1.0):
        return (s * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype).to(device)

    q, k, v = rnd(b, t, h, kd), rnd(b, t, h, kd, s=0.4), rnd(b, t, h, vd)
    if gate:
        g = rnd(b, t, h, kd)
    else:
        g = torch.nn.functional.logsigmoid(rnd(b, t, h, kd)).div(4).to(dtype)
    beta = (0.1 + 0.8 * torch.rand(b, t, h, generator=gen, dtype=torch.float64)).to(dtype).to(device)
    return q, k, v, g, beta


def leaves(*ts):
    return [None if t is None else t.detach().clone().requires_grad_(True) for t in ts]


def rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def test_gradcheck_fp64_precomputed_gate_with_state():
    q, k, v, g, beta = leaves(*make(1, 9, 1, 4, 3))
    h0 = torch.randn(1, 1, 4, 3, dtype=torch.float64).requires_grad_(True)  # fp64 state: the exact mode

    def f(q, k, v, g, beta, h0):
        o, fin = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        return o, fin

    assert torch.autograd.gradcheck(f, (q, k, v, g, beta, h0), eps=1e-6, atol=1e-6, rtol=1e-5)


def test_gradcheck_fp64_in_kernel_gate_l2norm_varlen():
    q, k, v, g, beta = leaves(*make(1, 11, 1, 4, 3, gate=True, seed=1))
    A_log = torch.tensor([0.3], dtype=torch.float64, requires_grad=True)
    dt_bias = torch.randn(4, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 4, 4, 11], dtype=torch.int64)

    def f(q, k, v, g, beta, A_log, dt_bias):
        return chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                         cu_seqlens=cu)[0]

    assert torch.autograd.gradcheck(f, (q, k, v, g, beta, A_log, dt_bias), eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("rematerialize", [False, True])
@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_residual_backward_matches_token_level_fp32(rematerialize, lower_bound):
    # fp32 inputs save fp32 residuals (the chunked backward); fp64 copies take the token-level one.
    b, t, h, kd, vd = 2, 100, 2, 8, 6
    base = make(b, t, h, kd, vd, gate=True, seed=2)
    A_log = torch.tensor([0.2, -0.4], dtype=torch.float64)
    dt_bias = torch.randn(h * kd, dtype=torch.float64)
    h0 = torch.randn(b, h, kd, vd, dtype=torch.float64)
    d_o = torch.randn(b, t, h, vd, dtype=torch.float64)
    d_fin = torch.randn(b, h, kd, vd, dtype=torch.float64)
    grads = {}
    for dt in (torch.float32, torch.float64):
        ins = leaves(*(x.to(dt) for x in base), A_log.float(), dt_bias.float(), h0.float())
        q, k, v, g, beta, al, db, s0 = ins
        o, fin = chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                           use_gate_in_kernel=True, A_log=al, dt_bias=db, lower_bound=lower_bound, rematerialize=rematerialize)
        assert o.dtype == dt and fin.dtype == (dt if dt == torch.float64 else torch.float32)
        ((o.double() * d_o).sum() + (fin.double() * d_fin).sum()).backward()
        grads[dt] = [x.grad for x in ins]
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "h0")
    for name, a, ref in zip(names, grads[torch.float32], grads[torch.float64]):
        assert a is not None and torch.isfinite(a).all(), name
        assert rel(a, ref) < 1e-4, (name, rel(a, ref))


def test_outputs_match_kda_forward_and_fla_defaults():
    q, k, v, g, beta = make(1, 70, 2, 8, 8, dtype=torch.float32, seed=3)
    o, fin = chunk_kda(q, k, v, g, beta)
    assert fin is None
    ref, _ = encore.kda_forward(q, k, v, g, beta)
    torch.testing.assert_close(o, ref, rtol=0, atol=0)
    o2, _ = chunk_kda(q, k, v, g, beta, scale=8 ** -0.5, safe_gate=False, disable_recompute=True, chunk_size=64)
    torch.testing.assert_close(o2, ref, rtol=0, atol=0)


def test_no_grad_inputs_and_unused_final_state():
    q, k, v, g, beta = make(1, 20, 1, 4, 4, dtype=torch.float32, seed=4)
    v = v.requires_grad_(True)
    o, fin = chunk_kda(q, k, v, g, beta, output_final_state=True)
    o.sum().backward()  # fin unused: its cotangent is absent
    assert v.grad is not None and torch.isfinite(v.grad).all() and q.grad is None


def test_torch_compile_fullgraph_forward_backward():
    q, k, v, g, beta = make(1, 70, 2, 8, 8, dtype=torch.float32, seed=5)

    def step(q, k, v, g, beta):
        o, fin = chunk_kda(q, k, v, g, beta, output_final_state=True)
        return o.square().sum() + fin.sum()

    eager = leaves(q, k, v, g, beta)
    step(*eager).backward()
    compiled = leaves(q, k, v, g, beta)
    torch.compile(step, fullgraph=True, backend="aot_eager")(*compiled).backward()
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-6)


# fla-core 0.6.0's chunk_kda parameters, in order (fla/ops/kda/chunk.py), then **kwargs.
FLA_CHUNK_KDA_PARAMS = ["q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel",
                        "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "safe_gate", "lower_bound",
                        "disable_recompute", "return_intermediate_states", "state_v_first", "cu_seqlens", "cu_seqlens_cpu",
                        "cp_context", "use_graph", "max_num_seqs"]


def test_signature_is_flas():
    """The same parameters in the same positional order and defaults as fla's (and as the installed fla, where it is)."""
    import inspect

    ours = inspect.signature(chunk_kda).parameters
    names = [n for n, p in ours.items() if p.kind != p.VAR_KEYWORD]
    assert names == FLA_CHUNK_KDA_PARAMS
    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda
    except Exception:  # noqa: BLE001 (fla absent or without a GPU stack)
        return
    theirs = inspect.signature(fla_chunk_kda).parameters
    assert [n for n, p in theirs.items() if p.kind != p.VAR_KEYWORD] == names
    for n in names:
        assert ours[n].default == theirs[n].default or ours[n].default is theirs[n].default, n


def test_positional_arguments_as_fla_orders_them():
    """A call with fla's positional order: scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
    use_gate_in_kernel, ..., lower_bound at position 13."""
    q, k, v, g, beta = make(1, 12, 1, 4, 4)
    s0 = torch.randn(1, 1, 4, 4, dtype=torch.float64)
    o, fin = chunk_kda(q, k, v, g, beta, 0.3, s0, True, True, False, False, False, False, None)
    o2, fin2 = chunk_kda(q, k, v, g, beta, scale=0.3, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert torch.equal(o, o2) and torch.equal(fin, fin2)
    with pytest.raises(ValueError, match="`lower_bound` must be in the safe range"):
        chunk_kda(q, k, v, g, beta, use_gate_in_kernel=True, safe_gate=True, lower_bound=-7.0, A_log=torch.zeros(1))


def test_bad_input():
    q, k, v, g, beta = make(1, 10, 1, 4, 4, dtype=torch.float32)
    with pytest.raises(ValueError, match="allow_neg_eigval"):
        chunk_kda(q, k, v, g, beta, allow_neg_eigval=True)
    with pytest.raises(ValueError, match=r"initial_state: expected (shape )?\[N, HV, V, K\] \(state_v_first\)"):
        chunk_kda(q, k, v[..., :3], g, beta, initial_state=torch.zeros(1, 1, 4, 3), state_v_first=True)  # [K, V]
    with pytest.raises(ValueError, match="no_such_option"):
        chunk_kda(q, k, v, g, beta, no_such_option=1)
    with pytest.raises(ValueError, match="`chunk_size` must be either 32 or 64 for KDA, got 16"):
        chunk_kda(q, k, v, g, beta, chunk_size=16)
    with pytest.raises(ValueError, match="A_log"):
        chunk_kda(q, k, v, g, beta, use_gate_in_kernel=True)
    with pytest.raises(ValueError, match="torch tensors"):
        chunk_kda(q.numpy(), k.numpy(), v.numpy(), g.numpy(), beta.numpy())
    with pytest.raises(ValueError, match="residuals"):
        encore.kda_backward(q, k, v, g, beta, torch.zeros_like(v), residuals={"x": q})


def dA_log_terms(dg, x):
    """dA_log's terms per token and channel, dg * softplus(x) / sigmoid(x) for the softplus gate with x = g + dt_bias
    (dg with respect to the raw gate: dA_log[h] is their sum over tokens and channels)."""
    x = x.double()
    return dg.detach().double().cpu() * torch.nn.functional.softplus(x) / torch.sigmoid(x)


def dA_log_spread(dg, x):
    """sqrt(sum of squared terms) / sqrt(sum over heads of (sum of a head's terms) ** 2): the factor by which independent
    per-term errors of relative size d become dA_log's relative error (~d * spread); large where a head's terms cancel."""
    t = dA_log_terms(dg, x)
    return float(t.pow(2).sum().sqrt() / t.sum((0, 1, 3)).norm().clamp_min(1e-30))


@needs_torch_cuda
@pytest.mark.parametrize("dtype,groups", [(torch.bfloat16, 1), (torch.float32, 1), (torch.float16, 1), (torch.bfloat16, 2)])
@pytest.mark.parametrize("rematerialize", [False, True])
def test_cuda_gradients_match_fp64_cpu(dtype, groups, rematerialize):
    cu = torch.tensor([0, 1, 64, 129, 129, 1000], dtype=torch.int64)
    h, kd, vd = 2, 128, 128
    base = make(1, 1000, h, kd, vd, gate=True, seed=6)
    if groups > 1:  # grouped value heads: q, k with h // groups heads
        base = (base[0][:, :, ::groups].contiguous(), base[1][:, :, ::groups].contiguous(), *base[2:])
    A_log = torch.tensor([0.1, -0.5], dtype=torch.float64)
    torch.manual_seed(6)  # the draw reproduces whatever ran before in this process
    dt_bias = torch.randn(h * kd, dtype=torch.float64)
    h0 = torch.randn(5, h, kd, vd, dtype=torch.float64) * 0.1
    d_o = torch.randn(1, 1000, h, vd, dtype=torch.float64)
    d_fin = torch.randn(5, h, kd, vd, dtype=torch.float64)
    runs = {}
    for dev in ("cuda", "cpu"):
        dt = dtype if dev == "cuda" else torch.float64
        ins = leaves(*(x.to(dt).to(dev) for x in base), A_log.float().to(dev), dt_bias.float().to(dev), h0.float().to(dev))
        if dev == "cpu":  # the fp64 reference takes the bf16-rounded inputs
            ins = leaves(*(x.to(dtype).to(torch.float64) for x in base), A_log.float(), dt_bias.float(), h0.float())
        q, k, v, g, beta, al, db, s0 = ins
        o, fin = chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                           use_gate_in_kernel=True, A_log=al, dt_bias=db, cu_seqlens=cu.to(dev), rematerialize=rematerialize)
        ((o.double() * d_o.to(dev)).sum() + (fin.double() * d_fin.to(dev)).sum()).backward()
        runs[dev] = [x.grad for x in ins]
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "h0")
    for name, a, ref in zip(names, runs["cuda"], runs["cpu"]):
        assert torch.isfinite(a).all(), name
        # The second backward (bf16 tensor-core products) gets fla's bounds: bf16 inputs always take it (with
        # rematerialize the forward re-runs inside the backward to write its states), fp16 only with saved states
        # (rematerialize re-runs the recurrence in fp32).
        second = dtype == torch.bfloat16 or (dtype == torch.float16 and not rematerialize)
        tol = (2e-2 if second else 1e-2) if name in ("g", "beta", "A_log", "dt_bias") else (8e-3 if second else 5e-3)
        if name == "A_log":  # a sum over every token and channel of a head: bounded per term where they cancel
            x = base[3].to(dtype).double() + dt_bias.float().double().view(h, kd)
            spread, consistency = dA_log_spread(runs["cpu"][3], x), rel(a, dA_log_terms(runs["cuda"][3], x).sum((0, 1, 3)))
            # spread κ > 1: independent per-term errors of relative size δ give ~δ κ, so the bound is on δ:
            # 2e-2 κ, provided dA_log is the sum of the dg returned (within 3x bf16's ~1.1e-3 rounding, times κ)
            if spread > 1 and consistency <= (3.3e-3 if dtype != torch.float32 else 1e-5) * spread + 1e-6:
                tol = max(tol, 2e-2 * spread)
        assert rel(a, ref) < tol, (name, rel(a, ref))


def test_grouped_value_heads_equal_repeated_qk_heads():
    # HV = 2H: value head hv reads q/k head hv // 2; the same as repeating q, k per value head.
    q, k, _, _, _ = leaves(*make(1, 13, 2, 4, 3, seed=7))
    _, _, v, g, beta = leaves(*make(1, 13, 4, 4, 3, seed=8))
    o, _ = chunk_kda(q, k, v, g, beta)
    assert o.shape == (1, 13, 4, 3)
    q2, k2 = (x.detach().repeat_interleave(2, dim=2).requires_grad_(True) for x in (q, k))
    o2, _ = chunk_kda(q2, k2, v, g, beta)
    torch.testing.assert_close(o, o2, rtol=1e-12, atol=1e-12)
    d_o = torch.randn_like(o)
    gq, gk = torch.autograd.grad(o, (q, k), d_o)
    gq2, gk2 = torch.autograd.grad(o2, (q2, k2), d_o)
    torch.testing.assert_close(gq, gq2.view(1, 13, 2, 2, 4).sum(3), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gk, gk2.view(1, 13, 2, 2, 4).sum(3), rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(lambda q, k, v, g, beta: chunk_kda(q, k, v, g, beta)[0], (q, k, v, g, beta), eps=1e-6,
                                    atol=1e-6, rtol=1e-5)


def test_fp16_inputs_cpu():
    base = make(1, 40, 2, 8, 8, seed=9)
    ins = leaves(*(x.half() for x in base))
    o, _ = chunk_kda(*ins)
    assert o.dtype == torch.float16
    o.float().square().sum().backward()
    ref = leaves(*(x.half().double() for x in base))
    chunk_kda(*ref)[0].square().sum().backward()
    for a, b in zip(ins, ref):
        assert a.grad.dtype == torch.float16 and rel(a.grad, b.grad) < 5e-3


def test_fla_argument_forms():
    """fla's accepted forms: A_log with HV elements in any shape ([1, 1, HV, 1]) and dt_bias with HV * K
    ([HV, K]), gradients back in those shapes; safe_gate / lower_bound with a precomputed gate (a
    declaration, ignored); chunk_size 32 (the same math as 64)."""
    q, k, v, g, beta = make(1, 20, 2, 4, 3)
    raw = torch.randn_like(g)
    a1 = torch.randn(2, dtype=torch.float64, requires_grad=True)
    b1 = torch.randn(2 * 4, dtype=torch.float64, requires_grad=True)
    a4 = a1.detach().reshape(1, 1, 2, 1).clone().requires_grad_()
    b2 = b1.detach().reshape(2, 4).clone().requires_grad_()
    o1, _ = chunk_kda(q, k, v, raw, beta, use_gate_in_kernel=True, A_log=a1, dt_bias=b1)
    o2, _ = chunk_kda(q, k, v, raw, beta, use_gate_in_kernel=True, A_log=a4, dt_bias=b2)
    assert torch.equal(o1, o2)
    o1.sum().backward()
    o2.sum().backward()
    assert a4.grad.shape == (1, 1, 2, 1) and b2.grad.shape == (2, 4)
    assert torch.equal(a4.grad.reshape(-1), a1.grad) and torch.equal(b2.grad.reshape(-1), b1.grad)
    with pytest.raises(ValueError, match="A_log: expected 2 elements"):
        chunk_kda(q, k, v, raw, beta, use_gate_in_kernel=True, A_log=torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="dt_bias: expected 8 elements"):
        chunk_kda(q, k, v, raw, beta, use_gate_in_kernel=True, A_log=a1.detach(), dt_bias=torch.zeros(7, dtype=torch.float64))
    base, _ = chunk_kda(q, k, v, g, beta)
    declared, _ = chunk_kda(q, k, v, g, beta, safe_gate=True, lower_bound=-5.0)
    assert torch.equal(base, declared)
    c32, _ = chunk_kda(q, k, v, g, beta, chunk_size=32)
    assert torch.equal(base, c32)


@pytest.mark.parametrize("neg", [False, True])
def test_beta_sigmoid_in_kernel(neg):
    """use_beta_sigmoid_in_kernel: beta = sigmoid(raw) (2 sigmoid(raw) with allow_neg_eigval), the
    gradient with respect to the raw beta."""
    q, k, v, g, _ = make(1, 15, 2, 4, 3)
    raw = torch.randn(1, 15, 2, dtype=torch.float64, requires_grad=True)
    raw2 = raw.detach().clone().requires_grad_()
    o1, _ = chunk_kda(q, k, v, g, raw, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=neg)
    o2, _ = chunk_kda(q, k, v, g, torch.sigmoid(raw2) * (2.0 if neg else 1.0))
    assert torch.allclose(o1, o2, rtol=1e-12, atol=1e-12)
    o1.square().sum().backward()
    o2.square().sum().backward()
    assert torch.allclose(raw.grad, raw2.grad, rtol=1e-10, atol=1e-12)


def test_return_intermediate_states():
    """fla's inference form: (o, final_state, h) with h the chunk-start states [B, NT, HV, K, V] bf16:
    h of chunk 0 is the initial state, of chunk c the state after c chunks (the token recurrence's
    state at 64 c, from the fp64 reference on prefixes)."""
    q, k, v, g, beta = make(2, 130, 2, 4, 3)
    s0 = torch.randn(2, 2, 4, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="inference mode"):
        chunk_kda(q, k, v, g, beta, initial_state=s0, return_intermediate_states=True)
    with torch.inference_mode():
        o, fin, h = chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True, return_intermediate_states=True)
        o2, fin2 = chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)
        # the CPU backend's chunked forward (with residuals) against its token recurrence: equal to ~1e-12
        assert torch.allclose(o, o2, rtol=1e-10, atol=1e-12) and torch.allclose(fin, fin2, rtol=1e-10, atol=1e-12)
        assert h.shape == (2, 3, 2, 4, 3) and h.dtype == torch.bfloat16
        assert torch.allclose(h[:, 0].double(), s0, rtol=1e-2, atol=1e-2)
        _, s64 = chunk_kda(q[:, :64], k[:, :64], v[:, :64], g[:, :64], beta[:, :64], initial_state=s0, output_final_state=True)
        _, s128 = chunk_kda(q[:, :128], k[:, :128], v[:, :128], g[:, :128], beta[:, :128], initial_state=s0, output_final_state=True)
        assert torch.allclose(h[:, 1].double(), s64, rtol=1e-2, atol=1e-2)
        assert torch.allclose(h[:, 2].double(), s128, rtol=1e-2, atol=1e-2)
        # chunk_size 32: the states at every 32 tokens (the odd ones from the token recurrence over each 64-token
        # chunk's first half), against the final states of the prefixes
        o32, fin32, h32 = chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True, chunk_size=32,
                                    return_intermediate_states=True)
        assert h32.shape == (2, 5, 2, 4, 3) and h32.dtype == torch.bfloat16 and torch.equal(o32, o) and torch.equal(fin32, fin)
        for c in range(5):
            p = 32 * c
            ref = s0 if p == 0 else chunk_kda(q[:, :p], k[:, :p], v[:, :p], g[:, :p], beta[:, :p], initial_state=s0, output_final_state=True)[1]
            assert torch.allclose(h32[:, c].double(), ref, rtol=1e-2, atol=1e-2), c
        # varlen, with the in-kernel gate and L2 norm: sequences of 0, 31, 32, 33, 100 tokens
        lens = [0, 31, 32, 33, 100]
        cu = torch.tensor([0] + list(itertools.accumulate(lens)))
        qv, kv, vv, gv, bv = make(1, int(cu[-1]), 2, 4, 3)
        A_log, dt_bias = torch.tensor([0.1, -0.3], dtype=torch.float64), torch.randn(8, dtype=torch.float64)
        s0v = torch.randn(len(lens), 2, 4, 3, dtype=torch.float64)
        kw = dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True)
        _, _, hv = chunk_kda(qv, kv, vv, gv, bv, initial_state=s0v, chunk_size=32, cu_seqlens=cu, return_intermediate_states=True, **kw)
        assert hv.shape == (1, sum(-(-n // 32) for n in lens), 2, 4, 3)
        row = 0
        for i, n in enumerate(lens):
            a = int(cu[i])
            for c in range(-(-n // 32)):
                p = 32 * c
                ref = s0v[i] if p == 0 else chunk_kda(qv[:, a:a + p], kv[:, a:a + p], vv[:, a:a + p], gv[:, a:a + p], bv[:, a:a + p],
                                                      initial_state=s0v[i:i + 1], output_final_state=True, **kw)[1][0]
                assert torch.allclose(hv[0, row].double(), ref, rtol=1e-2, atol=1e-2), (i, c)
                row += 1


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_torch_cuda)])
@pytest.mark.parametrize("rematerialize", [True, False])
@pytest.mark.parametrize("gate_l2", [False, True])
def test_saved_residual_bytes(rematerialize, gate_l2, device):
    """What chunk_kda keeps for its backward beyond the caller's own tensors (issue 51's residual bound:
    the rematerialize path no larger than cudnn-frontend's, which keeps o and the final state only;
    both paths under fla-core 0.6.0's default, ~1077 B per token and head): with bf16 CUDA inputs
    rematerializing, nothing (the backward re-runs the forward for Aqk, Akk and the states); otherwise
    bf16 Aqk and Akk [.., 64] (256 B per token and head), plus the bf16 chunk-start states [NT, H, K, V]
    with saved h; no G, no normalized q / k copies, whatever the gate and L2-norm options."""
    lens = [70, 64, 1, 130]
    T, H, K, V = sum(lens), 2, 32, 48
    cu = torch.tensor([0, 70, 134, 135, 265], dtype=torch.int32)
    q, k, v, g, beta = make(1, T, H, K, V, dtype=torch.bfloat16, gate=gate_l2, device=device)
    A_log, dt_bias = (torch.randn(H, device=device), torch.randn(H * K, device=device)) if gate_l2 else (None, None)
    q, k, v, g, beta, A_log, dt_bias = leaves(q, k, v, g, beta, A_log, dt_bias)
    mine = {t.data_ptr() for t in (q, k, v, g, beta, A_log, dt_bias, cu) if t is not None}
    saved = {}

    def pack(t):
        if t.data_ptr() not in mine:
            saved[t.data_ptr()] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        o, _ = chunk_kda(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=gate_l2, use_gate_in_kernel=gate_l2,
                         A_log=A_log, dt_bias=dt_bias, rematerialize=rematerialize)
    chunks = sum((n + 63) // 64 for n in lens)
    expect = 0 if rematerialize and device == "cuda" else T * H * 64 * 2 * 2 + (0 if rematerialize else chunks * H * K * V * 2)
    assert sum(saved.values()) == expect, (saved, expect)
    o.float().sum().backward()  # the saved residuals serve the backward
    assert all(t.grad is not None and torch.isfinite(t.grad.float()).all() for t in (q, k, v, g, beta))
