"""encore.blocks.llama_last_block_forward / llama_last_block_backward (the last layer + loss,
include/encore/blocks/llama_last.hpp) on numpy fp32 arrays (the CPU backend): the loss and lse against
a numpy fp64 textbook layer, every gradient against its central finite differences; an all-ignored
batch; bad input raises ValueError naming the argument. encore.nn.LlamaLastLayer (autograd over the
torch ops): loss and every gradient against plain-torch fp64 (CPU fp32; CUDA bf16, skipped without
CUDA), all-ignored, torch.compile(fullgraph=True)."""
import numpy as np
import pytest

import encore.blocks as blocks

EPS = 1e-5


def textbook(p, target, ignore_index=-100):
    y0, x0, w0, w1, w2, g0, gf, wlm = (p[k] for k in ("y0", "x0", "w0", "w1", "w2", "g0", "gf", "wlm"))

    def rms(x, g):
        return x / np.sqrt((x * x).mean(1, keepdims=True) + EPS) * g

    x1 = y0 @ w0.T + x0
    z = rms(x1, g0) @ w1.T
    g, u = z[:, 0::2], z[:, 1::2]
    x2 = (g / (1 + np.exp(-g)) * u) @ w2.T + x1
    logits = rms(x2, gf) @ wlm.T
    mx = logits.max(1, keepdims=True)
    lse = (mx + np.log(np.exp(logits - mx).sum(1, keepdims=True)))[:, 0]
    keep = target != ignore_index
    if not keep.any():
        return 0.0, lse
    rows = lse[keep] - logits[keep, target[keep]]
    return rows.mean(), lse


def make(m=6, d=8, f=8, v=13, seed=0, ignore_every=4):
    rng = np.random.default_rng(seed)
    p = {"y0": rng.normal(size=(m, d)), "x0": rng.normal(size=(m, d)), "w0": rng.normal(size=(d, d)) / np.sqrt(d),
         "w1": rng.normal(size=(2 * f, d)) / np.sqrt(d), "w2": rng.normal(size=(d, f)) / np.sqrt(f),
         "g0": rng.normal(1.0, 0.2, size=d), "gf": rng.normal(1.0, 0.2, size=d), "wlm": rng.normal(size=(v, d)) * 2 / np.sqrt(d)}
    p = {k: a.astype(np.float32).astype(np.float64) for k, a in p.items()}  # fp32-exact values
    target = rng.integers(0, v, size=m).astype(np.int32)
    if ignore_every:
        target[1::ignore_every] = -100
    return p, target


def run(p, target, d_loss=1.0):
    f32 = {k: a.astype(np.float32) for k, a in p.items()}
    fwd = blocks.llama_last_block_forward(f32["y0"], f32["x0"], f32["w0"], f32["w1"], f32["w2"], f32["g0"], f32["gf"], f32["wlm"], target)
    x1, x2, z1, h2, r1, r2, lse, loss = fwd
    grads = blocks.llama_last_block_backward(f32["y0"], f32["w0"], f32["w1"], f32["w2"], f32["g0"], f32["gf"], f32["wlm"], target,
                                             x1, x2, z1, h2, r1, r2, lse, np.array([d_loss], np.float32))
    return fwd, grads


def test_loss_and_gradients_match_fp64_finite_differences():
    p, target = make()
    (x1, x2, z1, h2, r1, r2, lse, loss), grads = run(p, target, d_loss=0.5)
    want, want_lse = textbook(p, target)
    assert abs(float(loss[0]) - want) <= 1e-5 * max(1.0, abs(want))
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
    h = 1e-5
    for key, g in zip(("y0", "x0", "w0", "w1", "w2", "wlm", "g0", "gf"), grads):
        fd = np.zeros_like(p[key])
        flat = p[key].reshape(-1)
        for i in range(flat.size):
            x = flat[i]
            flat[i] = x + h
            lp = textbook(p, target)[0]
            flat[i] = x - h
            lm = textbook(p, target)[0]
            flat[i] = x
            fd.reshape(-1)[i] = (lp - lm) / (2 * h)
        fd *= 0.5
        err = np.abs(g.astype(np.float64) - fd).max() / max(np.abs(fd).max(), 1e-30)
        assert err <= 1e-4, (key, err)


def test_all_ignored_gives_zero_loss_and_gradients():
    p, target = make(ignore_every=0)
    target[:] = -100
    (*_, loss), grads = run(p, target)
    assert loss[0] == 0.0
    for g in grads:
        assert np.all(g == 0.0)


def test_bad_input_names_the_argument():
    p, target = make()
    bad = target.copy()
    bad[2] = 13  # = V
    with pytest.raises(ValueError, match="target"):
        run(p, bad)
    f32 = {k: a.astype(np.float32) for k, a in p.items()}
    with pytest.raises(ValueError, match="gamma_final"):
        blocks.llama_last_block_forward(f32["y0"], f32["x0"], f32["w0"], f32["w1"], f32["w2"], f32["g0"], f32["gf"][:5], f32["wlm"], target)


# ---- encore.nn.LlamaLastLayer (autograd over torch.ops.encore.llama_last_block_forward / _backward) ----

def torch_layer(y0, x0, w0, w1, w2, g0, gf, wlm, target, eps=EPS):
    import torch
    import torch.nn.functional as F

    def rms(x, g):
        return x * torch.rsqrt((x * x).mean(1, keepdim=True) + eps) * g

    x1 = y0 @ w0.T + x0
    z = rms(x1, g0) @ w1.T
    x2 = (F.silu(z[:, 0::2]) * z[:, 1::2]) @ w2.T + x1
    logits = rms(x2, gf) @ wlm.T
    if (target != -100).sum() == 0:
        return logits.sum() * 0
    return F.cross_entropy(logits, target.long(), ignore_index=-100)


def check_module(device, dtype, m, d, f, v, tol, all_ignored=False):
    torch = pytest.importorskip("torch")
    import encore.nn

    dtype = dtype or torch.float32
    torch.manual_seed(0)
    layer = encore.nn.LlamaLastLayer(d, f, v, device=device, dtype=dtype)
    with torch.no_grad():
        layer.gamma0.copy_(1 + 0.2 * torch.randn(d))
        layer.gamma_final.copy_(1 + 0.2 * torch.randn(d))
    y0 = torch.randn(m, d, device=device, dtype=dtype, requires_grad=True)
    x0 = torch.randn(m, d, device=device, dtype=dtype, requires_grad=True)
    target = torch.randint(0, v, (m,), device=device)
    target[1::5] = -100
    if all_ignored:
        target[:] = -100
    loss = layer(y0, x0, target)
    assert loss.shape == () and loss.dtype == torch.float32
    (2.0 * loss).backward()
    names = ["y0", "x0", "w0", "w1", "w2", "gamma0", "gamma_final", "w_lm"]
    ours = [y0.grad, x0.grad] + [getattr(layer, n).grad for n in names[2:]]
    leaves = [t.detach().double().cpu().requires_grad_() for t in
              (y0, x0, layer.w0, layer.w1, layer.w2, layer.gamma0, layer.gamma_final, layer.w_lm)]
    rloss = torch_layer(*leaves, target.cpu())
    assert abs(loss.item() - rloss.item()) <= tol * max(1.0, abs(rloss.item()))
    (2.0 * rloss).backward()
    for name, g, leaf in zip(names, ours, leaves):
        assert g is not None and g.shape == leaf.shape and g.dtype == dtype, name
        if all_ignored:
            assert torch.all(g == 0), name
            continue
        err = ((g.double().cpu() - leaf.grad).norm() / leaf.grad.norm()).item()
        assert err < tol, f"{name}: rel err {err:.3g}"


def test_module_cpu_fp32_matches_fp64_torch():
    check_module("cpu", None, 37, 32, 24, 1001, 1e-4)
    check_module("cpu", None, 130, 16, 136, 264, 1e-4)
    check_module("cpu", None, 20, 16, 8, 37, 1e-4, all_ignored=True)


def test_module_cuda_bf16_matches_fp64_torch():
    torch = pytest.importorskip("torch")
    import encore

    if not torch.cuda.is_available() or not encore.built_with_cuda():
        pytest.skip("needs torch with CUDA and a CUDA build of encore")
    check_module("cuda", torch.bfloat16, 200, 256, 688, 1001, 2e-2)
    check_module("cuda", torch.bfloat16, 1000, 256, 688, 1024, 2e-2)


def test_module_compiles_fullgraph_cpu():
    torch = pytest.importorskip("torch")
    import encore.nn

    torch.manual_seed(3)
    layer = encore.nn.LlamaLastLayer(32, 24, 41)
    y0, x0 = torch.randn(17, 32, requires_grad=True), torch.randn(17, 32, requires_grad=True)
    target = torch.randint(0, 41, (17,))
    layer(y0, x0, target).backward()
    want = [y0.grad.clone(), x0.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
    y0.grad = x0.grad = None
    layer.zero_grad()
    torch.compile(layer, backend="aot_eager", fullgraph=True)(y0, x0, target).backward()
    got = [y0.grad, x0.grad] + [p.grad for p in layer.parameters()]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
