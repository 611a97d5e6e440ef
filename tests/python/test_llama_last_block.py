"""encore.blocks.llama_last_block_forward / llama_last_block_backward (the last layer + loss,
include/encore/blocks/llama_last.hpp) on numpy fp32 arrays (the CPU backend): the loss and lse against
a numpy fp64 textbook layer, every gradient against its central finite differences; an all-ignored
batch; bad input raises ValueError naming the argument."""
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
