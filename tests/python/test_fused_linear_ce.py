"""encore.nn.FusedLinearCrossEntropyLoss (Liger's interface: forward(lin_weight, _input, target, bias=None)):
loss and gradients against an fp64 torch reference on the CPU backend and on CUDA, the three backward modes
(recompute: the ce_bwd GEMM over chunks of rows; stored logits: cross_entropy_bwd in place; grad_in_forward:
the gradients computed in the forward chunk by chunk and scaled by grad_output in the backward), every
reduction, ignore_index rows, an all-ignored batch, V odd, fp32 gradcheck on the CPU backend (it takes
bf16 / fp16 / fp32, not fp64), torch.compile, and bad input. Also the ce_bwd row and the
cross_entropy_bwd finisher directly."""
import pytest

torch = pytest.importorskip("torch")

import encore  # noqa: E402
import encore.nn  # noqa: E402
from encore.nn import FusedLinearCrossEntropyLoss  # noqa: E402
from helpers import needs_torch_cuda  # noqa: E402


def make(m, h, v, dtype=torch.float32, seed=0, device="cpu", ignore_every=5, ignore_index=-100):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, h, generator=gen, dtype=torch.float64)
    w = torch.randn(v, h, generator=gen, dtype=torch.float64) / h ** 0.5 * 2
    t = torch.randint(0, v, (m,), generator=gen)
    if ignore_every:
        t[::ignore_every] = ignore_index
    return x.to(dtype).to(device), w.to(dtype).to(device), t.to(device)


def reference(w, x, t, ignore_index=-100, reduction="mean"):
    """fp64 torch: loss and (dW, dx) from the inputs as rounded to their dtype."""
    w64 = w.detach().double().cpu().requires_grad_(True)
    x64 = x.detach().double().cpu().requires_grad_(True)
    loss = torch.nn.functional.cross_entropy(x64 @ w64.T, t.cpu(), ignore_index=ignore_index, reduction=reduction)
    g = torch.ones_like(loss) if reduction != "none" else torch.linspace(0.5, 1.5, loss.numel(), dtype=torch.float64)
    loss.backward(g)
    return loss.detach(), w64.grad, x64.grad, g


def rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


MODES = {"recompute": dict(recompute=True), "stored": dict(recompute=False), "in_forward": dict(grad_in_forward=True)}


def run(w, x, t, g=None, **kw):
    w = w.detach().clone().requires_grad_(True)
    x = x.detach().clone().requires_grad_(True)
    loss = FusedLinearCrossEntropyLoss(**kw)(w, x, t)
    loss.backward(torch.ones_like(loss) if g is None else g.to(loss.dtype).to(loss.device))
    return loss.detach(), w.grad, x.grad


# fp32 on the CPU backend: the epilogue math is fp64 there, so only the fp32 roundings remain.
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cpu_fp32_against_fp64(mode, reduction):
    x, w, t = make(77, 64, 1001)  # V odd
    ref_loss, ref_dw, ref_dx, g = reference(w, x, t, reduction=reduction)
    loss, dw, dx = run(w, x, t, g if reduction == "none" else None, reduction=reduction, chunk_rows=32, **MODES[mode])
    assert loss.dtype == torch.float32
    assert rel(loss, ref_loss) < 1e-5
    assert rel(dw, ref_dw) < 1e-5 and rel(dx, ref_dx) < 1e-5
    assert torch.all(dx[::5] == 0)  # ignored rows


def unfused_bf16(w, x, t, ignore_index=-100):
    """The same computation unfused in bf16 with fp32 accumulation (the issue's numerics bar): bf16
    logits, fp32 softmax, bf16 dlogits, bf16 GEMMs."""
    wb = w.detach().bfloat16().requires_grad_(True)
    xb = x.detach().bfloat16().requires_grad_(True)
    loss = torch.nn.functional.cross_entropy((xb @ wb.T).float(), t, ignore_index=ignore_index)
    loss.backward()
    return loss.detach(), wb.grad, xb.grad


@pytest.mark.parametrize("mode", sorted(MODES))
def test_cpu_bf16_within_2x_of_unfused(mode):
    x, w, t = make(300, 128, 1001, dtype=torch.bfloat16, seed=1)
    ref_loss, ref_dw, ref_dx, _ = reference(w, x, t)
    u_loss, u_dw, u_dx = unfused_bf16(w, x, t)
    loss, dw, dx = run(w, x, t, chunk_rows=64, **MODES[mode])  # 5 chunks: dW accumulated 5 times in bf16
    for name, got, unf, ref in (("loss", loss, u_loss, ref_loss), ("dW", dw, u_dw, ref_dw), ("dx", dx, u_dx, ref_dx)):
        e, eu = rel(got, ref), rel(unf, ref)
        assert e <= 2 * eu + 1e-6, f"{name}: rel error {e:.3g} against the unfused bf16 {eu:.3g}"


def test_default_chunks_cover_every_row():
    x, w, t = make(1000, 32, 257, seed=2)  # default chunk_rows: 256 rows, 4 chunks, the last ragged
    ref_loss, ref_dw, ref_dx, _ = reference(w, x, t)
    loss, dw, dx = run(w, x, t)
    assert rel(loss, ref_loss) < 1e-5 and rel(dw, ref_dw) < 1e-5 and rel(dx, ref_dx) < 1e-5


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_ignored_batch(mode, reduction):
    x, w, t = make(20, 16, 33)
    t[:] = -100
    loss, dw, dx = run(w, x, t, reduction=reduction, **MODES[mode])
    assert float(loss) == 0.0
    assert torch.all(dw == 0) and torch.all(dx == 0)
    assert torch.isfinite(dw).all() and torch.isfinite(dx).all()


def test_custom_ignore_index_and_leading_dims():
    x, w, t = make(24, 16, 40, ignore_index=7, ignore_every=3)
    t[1] = 7
    ref_loss, ref_dw, ref_dx, _ = reference(w, x, t, ignore_index=7)
    loss, dw, dx = run(w, x.reshape(4, 6, 16), t.reshape(4, 6), ignore_index=7)
    assert rel(loss, ref_loss) < 1e-5 and rel(dw, ref_dw) < 1e-5 and rel(dx.reshape(24, 16), ref_dx) < 1e-5
    loss_rows = FusedLinearCrossEntropyLoss(ignore_index=7, reduction="none")(w, x.reshape(4, 6, 16), t.reshape(4, 6))
    assert loss_rows.shape == (4, 6) and float(loss_rows.reshape(-1)[1]) == 0.0


# The recomputing mode (its backward may run twice); the stored-logits mode overwrites the logits it
# keeps, so its second backward raises (gradcheck runs two).
def test_gradcheck_fp32_cpu():
    x, w, t = make(6, 8, 11, ignore_every=4)
    w = w.clone().requires_grad_(True)
    x = x.clone().requires_grad_(True)
    fn = lambda w_, x_: FusedLinearCrossEntropyLoss(reduction="sum", chunk_rows=4)(w_, x_, t)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (w, x), eps=1e-2, atol=2e-3, rtol=2e-2, fast_mode=False)


def test_stored_logits_backward_runs_once():
    x, w, t = make(6, 8, 11)
    w = w.clone().requires_grad_(True)
    loss = FusedLinearCrossEntropyLoss(recompute=False)(w, x, t)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_grad_in_forward_scaled_by_grad_output_and_one_sided(reduction):
    """The gradients computed in the forward are scaled by grad_output in the backward (here 0.7, and a loss
    used twice in the graph sums both); only the inputs that require grad get one; a second backward is
    refused (it would scale them again); without grad mode nothing is computed beyond the loss."""
    x, w, t = make(50, 32, 97, seed=3)
    ref_loss, ref_dw, ref_dx, _ = reference(w, x, t, reduction=reduction)
    fn = FusedLinearCrossEntropyLoss(reduction=reduction, grad_in_forward=True, chunk_rows=16)
    loss, dw, dx = run(w, x, t, torch.tensor(0.7), reduction=reduction, grad_in_forward=True, chunk_rows=16)
    assert rel(loss, ref_loss) < 1e-5 and rel(dw, 0.7 * ref_dw) < 1e-5 and rel(dx, 0.7 * ref_dx) < 1e-5
    xg = x.clone().requires_grad_(True)  # the weight frozen (adapter training): dx only
    fn(w, xg, t).backward()
    assert rel(xg.grad, ref_dx) < 1e-5
    wg = w.clone().requires_grad_(True)
    loss = fn(wg, x, t)
    loss.backward(retain_graph=True)
    assert rel(wg.grad, ref_dw) < 1e-5
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    with torch.no_grad():
        assert rel(fn(wg, x, t), ref_loss) < 1e-5
    wg2 = w.clone().requires_grad_(True)
    with pytest.raises(RuntimeError, match="no double backward"):
        torch.autograd.grad(fn(wg2, x, t), wg2, create_graph=True)


def test_grad_in_forward_not_taken_for_fp16_or_no_rows():
    """fp16 takes the recompute mode (its dlogits need the loss scale the forward does not know): its backward
    may run twice (the grad-in-forward one is refused the second time) and a loss scaled by 65536 gets the
    recompute mode's gradients bit for bit; no rows: the same error as the other modes."""
    x, w, t = make(64, 32, 97, dtype=torch.float16, seed=4)
    ref_loss, ref_dw, ref_dx, _ = reference(w, x, t)
    loss, dw, dx = run(w, x, t, torch.tensor(65536.0), grad_in_forward=True)
    want, want_dw, want_dx = run(w, x, t, torch.tensor(65536.0))
    assert torch.equal(loss, want) and torch.equal(dw, want_dw) and torch.equal(dx, want_dx)
    assert rel(dw.float() / 65536, ref_dw) < 5e-3 and rel(dx.float() / 65536, ref_dx) < 5e-3
    wg = w.clone().requires_grad_(True)
    twice = FusedLinearCrossEntropyLoss(grad_in_forward=True)(wg, x, t)
    twice.backward(retain_graph=True)
    twice.backward()  # the recompute mode's backward: no in-place scaling to refuse
    xe, we = x[:0].float().requires_grad_(True), w.float().requires_grad_(True)
    errors = []
    for kw in (dict(), dict(grad_in_forward=True)):
        with pytest.raises(ValueError) as e:
            FusedLinearCrossEntropyLoss(**kw)(we, xe, t[:0])
        errors.append(str(e.value))
    assert errors[0] == errors[1]


def test_grad_output_applied_in_fp32():
    """grad_output scales the saved bf16 gradients in fp32 (1 / 3 rounded to bf16 first would be 2^-9 off)."""
    from encore._ce_autograd import _scale_

    t = torch.randn(1000, generator=torch.Generator().manual_seed(0)).bfloat16()
    g = torch.tensor(1 / 3)
    want, naive = (t.float() * g).bfloat16(), t * g.bfloat16()
    _scale_(t, g, block=300)  # blocks of 300 elements, the last ragged
    assert torch.equal(t, want) and not torch.equal(t, naive)


def test_bad_input():
    x, w, t = make(8, 16, 40)
    loss_fn = FusedLinearCrossEntropyLoss()
    bad = t.clone()
    bad[2] = 40  # == V, not ignore_index
    with pytest.raises(ValueError, match="target"):
        loss_fn(w, x, bad)
    bad[2] = -3
    with pytest.raises(ValueError, match="target"):
        loss_fn(w, x, bad)
    with pytest.raises(ValueError, match="_input"):
        loss_fn(w, x[:, :8], t)
    with pytest.raises(ValueError, match="target"):
        loss_fn(w, x, t[:5])
    with pytest.raises(ValueError, match="dtype"):
        loss_fn(w, x.double(), t)
    with pytest.raises(ValueError, match="target"):
        loss_fn(w, x, t.float())
    with pytest.raises(NotImplementedError, match="bias"):
        loss_fn(w, x, t, torch.zeros(40))
    with pytest.raises(ValueError, match="reduction"):
        FusedLinearCrossEntropyLoss(reduction="avg")
    with pytest.raises(ValueError):  # the CPU backend takes bf16 / fp16 / fp32
        loss_fn(w.double(), x.double(), t)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_torch_compile_fullgraph(mode):
    x, w, t = make(40, 16, 67)
    loss_fn = FusedLinearCrossEntropyLoss(**MODES[mode])
    compiled = torch.compile(lambda w_, x_, t_: loss_fn(w_, x_, t_), fullgraph=True)
    wc, xc = w.clone().requires_grad_(True), x.clone().requires_grad_(True)
    loss = compiled(wc, xc, t)
    loss.backward()
    ref_loss, ref_dw, ref_dx, _ = reference(w, x, t)
    assert rel(loss, ref_loss) < 1e-5 and rel(wc.grad, ref_dw) < 1e-5 and rel(xc.grad, ref_dx) < 1e-5


# ---- the ce_bwd row and the cross_entropy_bwd finisher directly -------------------------------------------


def softmax_grad(z, t, alpha, ignore_index=-100):
    z = z.double()
    g = torch.softmax(z, 1)
    rows = torch.nonzero(t != ignore_index).flatten()
    g[rows, t[rows].long()] -= 1
    g[t == ignore_index] = 0
    return alpha * g


def test_ce_bwd_row_and_finisher_cpu():
    x, w, t = make(37, 64, 1001)
    t32 = t.to(torch.int32)
    p, _, tl = encore.gemm_lse(x, w, target=t32)
    lse, _ = encore.lse_finish(p, t32, tl)
    r = torch.linspace(0.5, 1.5, 37)
    p_r, logits_r, _ = encore.gemm_lse(x, w, r=r, store_logits=True)
    lse_r = encore.lse_finish(p_r)
    alpha = torch.tensor([0.25])
    d = encore.gemm_epilogue("ce_bwd", x, w, lse=lse_r, target=t32, alpha=alpha, row_scale=r)["d"]
    z = r.double()[:, None] * (x.double() @ w.double().T)
    assert d.shape == (37, 1001) and d.stride() == (1008, 1)  # rows padded to 8 elements
    assert rel(d, softmax_grad(z, t32, 0.25)) < 1e-6
    d1 = encore.gemm_epilogue("ce_bwd", x, w, lse=lse, target=t32)["d"]  # alpha absent: 1
    assert rel(d1, softmax_grad(x.double() @ w.double().T, t32, 1.0)) < 1e-6
    assert logits_r.stride() == (1008, 1)
    g = encore.cross_entropy_bwd(logits_r, lse_r, t32, alpha)
    assert rel(g, softmax_grad(z, t32, 0.25)) < 1e-6
    encore.cross_entropy_bwd_(logits_r, lse_r, t32, alpha)  # in place
    assert torch.equal(logits_r, g)
    with pytest.raises(ValueError, match="lse"):
        encore.gemm_epilogue("ce_bwd", x, w, target=t32)
    with pytest.raises(ValueError, match="lse"):
        encore.gemm_epilogue("ce_bwd", x, w, lse=lse[:10], target=t32)
    with pytest.raises(ValueError, match="target"):
        encore.cross_entropy_bwd(g, lse, t32[:5])
    with pytest.raises(ValueError, match="dlogits"):
        encore.cross_entropy_bwd(g, lse, t32, out=torch.empty(37, 1001, dtype=torch.float16))


# ---- CUDA ------------------------------------------------------------------------------------------


@needs_torch_cuda
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("v", [1001, 4096])
def test_cuda_bf16_against_fp64(mode, reduction, v):
    x, w, t = make(300, 128, v, dtype=torch.bfloat16, device="cuda", seed=3)
    ref_loss, ref_dw, ref_dx, g = reference(w, x, t, reduction=reduction)
    u_loss, u_dw, u_dx = unfused_bf16(w.cpu(), x.cpu(), t.cpu()) if reduction == "mean" else (None, None, None)
    loss, dw, dx = run(w, x, t, g if reduction == "none" else None, reduction=reduction, chunk_rows=128, **MODES[mode])
    assert rel(loss, ref_loss) < 1e-3
    assert rel(dw, ref_dw) < 1.5e-2 and rel(dx, ref_dx) < 1.5e-2
    if u_dw is not None:
        assert rel(dw, ref_dw) <= 2 * rel(u_dw, ref_dw) + 1e-6 and rel(dx, ref_dx) <= 2 * rel(u_dx, ref_dx) + 1e-6
    assert torch.all(dx[::5] == 0)


@needs_torch_cuda
def test_cuda_all_ignored_and_compile():
    x, w, t = make(64, 64, 333, dtype=torch.bfloat16, device="cuda")
    t[:] = -100
    loss, dw, dx = run(w, x, t)
    assert float(loss) == 0.0 and torch.all(dw == 0) and torch.all(dx == 0)
    x, w, t = make(64, 64, 333, dtype=torch.bfloat16, device="cuda", seed=4)
    loss_fn = FusedLinearCrossEntropyLoss(recompute=False)
    compiled = torch.compile(lambda w_, x_, t_: loss_fn(w_, x_, t_), fullgraph=True)
    wc, xc = w.clone().requires_grad_(True), x.clone().requires_grad_(True)
    compiled(wc, xc, t).backward()
    _, ref_dw, ref_dx, _ = reference(w, x, t)
    assert rel(wc.grad, ref_dw) < 1.5e-2 and rel(xc.grad, ref_dx) < 1.5e-2


@needs_torch_cuda
def test_cuda_ce_bwd_row_and_finisher_against_cpu():
    x, w, t = make(130, 64, 50257, dtype=torch.bfloat16, seed=5)  # V = 50257: GPT-2's vocabulary
    t32 = t.to(torch.int32)
    p, _, tl = encore.gemm_lse(x, w, target=t32)
    lse, _ = encore.lse_finish(p, t32, tl)
    alpha = torch.tensor([0.5])
    ref = softmax_grad(x.double() @ w.double().T, t32, 0.5)
    xc, wc, tc, lc, ac = x.cuda(), w.cuda(), t32.cuda(), lse.cuda(), alpha.cuda()
    d = encore.gemm_epilogue("ce_bwd", xc, wc, lse=lc, target=tc, alpha=ac)["d"]
    assert d.stride() == (50264, 1)
    assert rel(d, ref) < 1e-2
    pc, logits, tlc = encore.gemm_lse(xc, wc, target=tc, store_logits=True)
    assert rel(tlc, tl) < 1e-3 and rel(logits, x.double() @ w.double().T) < 1e-2
    g = encore.cross_entropy_bwd(logits, lc, tc, ac)
    assert rel(g, ref) < 1e-2
    encore.cross_entropy_bwd_(logits, lc, tc, ac)
    assert torch.equal(logits, g)
    bad = tc.clone()
    bad[3] = 50257  # out of range on the device: that row is NaN, the others intact
    d_bad = encore.gemm_epilogue("ce_bwd", xc, wc, lse=lc, target=bad, alpha=ac)["d"]
    assert torch.isnan(d_bad[3]).all() and torch.isfinite(d_bad[4]).all()
    with pytest.raises(RuntimeError, match="d: row stride"):  # a contiguous D of odd N on CUDA: unsupported, not invalid
        encore.gemm._run(encore.Epilogue.ce_bwd, xc, wc, d=torch.empty(130, 50257, dtype=torch.bfloat16, device="cuda"), target=tc,
                         lse=lc)


@needs_torch_cuda
def test_cuda_recompute_peak_memory_far_below_the_logits():
    """recompute=True: the extra peak memory of forward + backward (beyond the inputs and their gradients)
    stays far below the M x V x 2 bytes of bf16 logits (one chunk of dlogits: M / 8 rows by default)."""
    m, h, v = 4096, 256, 32000
    x, w, t = make(m, h, v, dtype=torch.bfloat16, device="cuda", seed=6)
    w.requires_grad_(True)
    x.requires_grad_(True)
    # A first GEMM of this process and stream allocates cuBLAS's workspace (32 MiB on Hopper) from the caching
    # allocator and keeps it: taken once here (a small loss), so the count below is the loss's own memory
    # whichever tests this worker ran before.
    xs, ws = x[:256].detach().requires_grad_(True), w[:512].detach().requires_grad_(True)
    FusedLinearCrossEntropyLoss()(ws, xs, t[:256] % 512).backward()
    del xs, ws
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    FusedLinearCrossEntropyLoss()(w, x, t).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - 2 * (w.numel() + x.numel())  # the bf16 gradients
    assert extra < m * v * 2 / 4, f"extra peak {extra / 2**20:.1f} MiB against {m * v * 2 / 2**20:.1f} MiB of logits"
