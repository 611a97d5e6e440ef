"""fla's KDA entry points take tensors of any strides (fla's input_guard copies them contiguous): encore's
chunk_kda and fused_recurrent_kda take the same views, the kernels reading what they can in place (batch,
token and head strides) and the layer copying the rest (a strided last dimension; a non-contiguous initial
state, which these calls only read). Outputs and gradients equal those of the contiguous tensors (bit for bit
on the CPU backend; on CUDA within 1e-3 relative RMS, a strided view taking the kernels' global-load path instead
of TMA); the gradient of a view reaches its base. What must not be copied stays refused naming the argument: a
state pool (ssm_state_indices) and an initial state updated in place (fused_recurrent_kda_fwd's
inplace_final_state). The checks take a device: the CUDA run is the last test."""
import pytest

torch = pytest.importorskip("torch")

import encore  # noqa: E402
from encore.kda import chunk_kda, fused_recurrent_kda, fused_recurrent_kda_fwd  # noqa: E402

B, T, H, HV, K, V = 2, 70, 1, 2, 16, 8


def inputs(dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype).to(device)  # noqa: E731
    q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, HV, V)
    g = -(torch.rand(B, T, HV, K, generator=gen, dtype=torch.float64) * 0.5).to(dtype).to(device)
    beta = torch.rand(B, T, HV, generator=gen, dtype=torch.float64).to(dtype).to(device)
    h0 = r(B, HV, K, V).float()
    return q, k, v, g, beta, h0


# Views with the same values: heads before tokens in memory, the last dimension strided, batch rows apart.
def head_major(x):
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def last_strided(x):
    return x.transpose(-1, -2).contiguous().transpose(-1, -2)


def batch_apart(x):
    return torch.stack([x, torch.full_like(x, float("nan"))], 1).flatten(0, 1)[::2]


VIEWS = {"head_major": head_major, "last_strided": last_strided, "batch_apart": batch_apart}


def same(got, want, exact, what):
    if exact:
        assert torch.equal(got, want), what
        return
    a, b = got.double(), want.double()
    assert torch.isfinite(a).all() and ((a - b).norm() / b.norm().clamp_min(1e-30)).item() <= 1e-3, what


def check(device, dtype):
    exact = device == "cpu"
    q, k, v, g, beta, h0 = inputs(dtype, device)
    kw = dict(use_qk_l2norm_in_kernel=True, output_final_state=True)
    base = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    o, fin = chunk_kda(*base[:5], initial_state=base[5], **kw)
    (o.float().square().sum() + fin.square().sum()).backward()
    want = [x.grad for x in base]
    for name, view in VIEWS.items():
        for i, arg in enumerate(("q", "k", "v", "g", "beta")):
            leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
            args = list(leaves)
            args[i] = view(leaves[i])
            got_o, got_fin = chunk_kda(*args[:5], initial_state=args[5], **kw)
            same(got_o, o, exact, f"chunk_kda: {arg} as a {name} view changes o")
            same(got_fin, fin, exact, f"chunk_kda: {arg} as a {name} view changes final_state")
            (got_o.float().square().sum() + got_fin.square().sum()).backward()
            for j, x in enumerate(leaves):
                same(x.grad, want[j], exact, f"chunk_kda: {arg} as a {name} view changes gradient {j}")
            with torch.no_grad():
                ro, rfin = fused_recurrent_kda(*[a.detach() for a in args[:5]], initial_state=h0, **kw)
                wo, wfin = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, **kw)
            same(ro, wo, exact, f"fused_recurrent_kda: {arg} as a {name} view changes o")
            same(rfin, wfin, exact, f"fused_recurrent_kda: {arg} as a {name} view changes final_state")
    # A transposed view of the initial state (read only): copied, its gradient back in the view's layout.
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    h0t = h0.transpose(-1, -2).contiguous().requires_grad_()  # the base, [B, HV, V, K]
    got_o, got_fin = chunk_kda(*leaves, initial_state=h0t.transpose(-1, -2), **kw)
    same(got_o, o, exact, "chunk_kda: a transposed initial state changes o")
    same(got_fin, fin, exact, "chunk_kda: a transposed initial state changes final_state")
    (got_o.float().square().sum() + got_fin.square().sum()).backward()
    same(h0t.grad.transpose(-1, -2), want[5], exact, "chunk_kda: dh0 through a transposed view")
    with torch.no_grad():
        ro, rfin = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0.transpose(-1, -2).contiguous().transpose(-1, -2), **kw)
        wo, wfin = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, **kw)
    same(ro, wo, exact, "fused_recurrent_kda: a transposed initial state changes o")
    same(rfin, wfin, exact, "fused_recurrent_kda: a transposed initial state changes final_state")


def refusals(device, dtype):
    q, k, v, g, beta, h0 = inputs(dtype, device)
    strided = h0.transpose(-1, -2).contiguous().transpose(-1, -2)
    idx = torch.tensor([1, 0], dtype=torch.int32, device=device)
    with torch.no_grad():
        with pytest.raises(ValueError, match="pool: each slot"):  # a pool is never copied
            chunk_kda(q, k, v, g, beta, initial_state=strided, ssm_state_indices=idx)
        before = strided.clone()
        with pytest.raises(ValueError, match="initial_state"):  # updated in place: never copied
            fused_recurrent_kda_fwd(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], initial_state=strided)
        assert torch.equal(strided, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_views_cpu(dtype):
    check("cpu", dtype)


def test_refusals_cpu():
    refusals("cpu", torch.float32)


@pytest.mark.skipif(not (encore.built_with_cuda() and encore.cuda_device_count() > 0 and torch.cuda.is_available()), reason="needs CUDA")
def test_views_and_refusals_cuda():
    check("cuda", torch.bfloat16)
    refusals("cuda", torch.bfloat16)
