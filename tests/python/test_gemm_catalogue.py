"""The GEMM-epilogue catalogue from Python: the enums come from encore/gemm_epilogues.def, the
generic gemm_epilogue entry allocates what each row writes, bad names and values are refused."""
import numpy as np
import pytest

import encore


def test_enum_lists_the_catalogue_in_order():
    names = [e.name for e in encore.Epilogue]
    assert names[:8] == ["residual_sqsum_aux", "row_scale", "swiglu", "rope", "qkv_head_sqsum", "lse", "scalar_scale",
                         "residual_add"]
    assert [int(e.value) for e in encore.Epilogue] == list(range(len(names)))
    assert {t.name for t in encore.GemmTile} == {"auto", "cooperative_128x256", "pingpong_128x128", "pingpong_64x256"}


def test_residual_add_matches_numpy():
    rng = np.random.default_rng(7)
    a, w, c = (rng.standard_normal(s).astype(np.float32) for s in ((13, 24), (10, 24), (13, 10)))
    out = encore.gemm_epilogue("residual_add", a, w, c=c)
    assert set(out) == {"d"}
    ref = a.astype(np.float64) @ w.T.astype(np.float64) + c
    np.testing.assert_allclose(out["d"], ref, rtol=1e-6, atol=1e-6)  # fp64 accumulation, one fp32 rounding
    out2 = encore.gemm_epilogue(encore.Epilogue.residual_add, a, w, c=c)
    np.testing.assert_array_equal(out2["d"], out["d"])


def test_generic_entry_equals_the_named_wrappers():
    rng = np.random.default_rng(3)
    a, w = rng.standard_normal((9, 32)).astype(np.float32), rng.standard_normal((16, 32)).astype(np.float32)
    r = rng.uniform(0.5, 2.0, 9).astype(np.float32)
    np.testing.assert_array_equal(encore.gemm_epilogue("row_scale", a, w, row_scale=r)["d"], encore.gemm_row_scale(a, w, r))
    z, y = encore.gemm_swiglu(a, w, r)
    out = encore.gemm_epilogue("swiglu", a, w, row_scale=r)
    np.testing.assert_array_equal(out["d"], z)
    np.testing.assert_array_equal(out["aux"], y)
    p, _, _ = encore.gemm_lse(a, w)
    out = encore.gemm_epilogue("lse", a, w, store_d=False)
    assert set(out) == {"partials"}
    np.testing.assert_array_equal(out["partials"], p)


def test_bad_epilogues_and_operands_are_refused():
    a, w, c = np.ones((4, 8), np.float32), np.ones((6, 8), np.float32), np.ones((4, 6), np.float32)
    with pytest.raises(ValueError, match="epilogue: one of"):
        encore.gemm_epilogue("no_such_epilogue", a, w)
    with pytest.raises(TypeError):
        encore._encore.gemm_partial_tile_n(99, 4, 6, 8)  # an int is no Epilogue
    with pytest.raises(ValueError, match="c: not used by the row_scale epilogue"):
        encore.gemm_epilogue("row_scale", a, w, c=c, row_scale=np.ones(4, np.float32))
    with pytest.raises(ValueError, match="c: "):
        encore.gemm_epilogue("residual_add", a, w)  # c missing
    with pytest.raises(ValueError, match="tile: one of"):
        encore.gemm_epilogue("residual_add", a, w, c=c, tile="huge")


def test_generic_entry_through_torch_ops_and_compile():
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(5)
    a, w, c = (torch.randn(s, generator=g) for s in ((7, 16), (12, 16), (7, 12)))
    eager = encore.gemm_epilogue("residual_add", a, w, c=c)
    np.testing.assert_allclose(eager["d"].numpy(), a.double().numpy() @ w.double().numpy().T + c.numpy(), rtol=1e-6, atol=1e-6)

    def f(a, w, c):
        return encore.gemm_epilogue("residual_add", a, w, c=c)["d"] * 2

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(a, w, c), eager["d"] * 2)
    out = encore.gemm_epilogue("lse", a, w, store_d=False)
    assert set(out) == {"partials"} and out["partials"].dtype == torch.float32


def test_tiles_by_enum_or_name():
    a, w = np.ones((4, 8), np.float32), np.ones((6, 8), np.float32)
    r = np.ones(4, np.float32)
    np.testing.assert_array_equal(encore.gemm_row_scale(a, w, r, tile=encore.GemmTile.pingpong_128x128),
                                  encore.gemm_row_scale(a, w, r, tile="pingpong_128x128"))
    torch = pytest.importorskip("torch")
    ta, tw, tr = torch.from_numpy(a), torch.from_numpy(w), torch.from_numpy(r)

    def f(a, w, r):
        return encore.gemm_row_scale(a, w, r, tile=encore.GemmTile.cooperative_128x256)

    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="aot_eager")(ta, tw, tr), torch.from_numpy(a @ w.T))


# ---- every row, and the backward rows (w [K, N] un-transposed, packed pairs, c2, zdz, column partials) ----

def _row_inputs(name, m, k, n, rng, head_dim=16):
    """The inputs row `name` reads, built from its operand flags (float32, CPU)."""
    uses = encore.gemm._ROWS[name][1]
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    a = f32(k, m) if uses["a_transposed"] else f32(m, k)  # wgrad: a stored [K, M]
    w = f32(k, n) if uses["weight_kn"] else f32(n, k)
    kw = {}
    if uses["c"] or uses["c_pairs"]:
        kw["c"] = f32(m, 2 * n if uses["c_pairs"] else n)
    if uses["c2_optional"]:
        kw["c2"] = f32(m, n)
    if uses["zdz"]:
        kw["zdz"] = f32(m)
    if uses["gamma"]:
        kw["gamma"] = 1 + 0.2 * f32(n)
    if uses["row_scale"] or uses["row_scale_optional"]:
        kw["row_scale"] = rng.uniform(0.5, 2.0, m).astype(np.float32)
    if uses["pos"]:
        kw["pos"] = np.arange(m, dtype=np.int32) * 3
    if uses["freq"]:
        kw["freq"] = encore.rope_freq_turns(n // head_dim, n // head_dim, head_dim)
    if uses["alpha"] or uses["alpha_optional"]:
        kw["alpha"] = np.array([-1.25], np.float32)
    if uses["target"]:
        kw["target"] = rng.integers(0, n, m).astype(np.int32)
    if uses["lse"]:  # ce_bwd: the forward's lse and the targets
        kw["target"] = rng.integers(0, n, m).astype(np.int32)
        kw["lse"] = np.full(m, np.log(n) + 2.0, np.float32)
    return a, w, kw


@pytest.mark.parametrize("name", [e.name for e in encore.Epilogue])
def test_every_row_runs_on_the_cpu(name):
    rng = np.random.default_rng(11)
    m, k, n = 37, 24, 32
    a, w, kw = _row_inputs(name, m, k, n, rng)
    out = encore.gemm_epilogue(name, a, w, head_dim=16, **kw)
    outs, _ = encore.gemm._epilogue_outputs(name, a, w, True, 0, 16, "target" in kw)
    assert [key for key, _, _ in outs] == list(out)
    for key, shape, _ in outs:
        assert out[key].shape == tuple(shape), (name, key)
        assert np.isfinite(out[key]).all(), (name, key)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def test_swiglu_bwd_matches_numpy():
    rng = np.random.default_rng(5)
    m, d, f = 45, 24, 40  # F not a multiple of the partials' tile
    dx, w_down = rng.standard_normal((m, d)).astype(np.float32), rng.standard_normal((d, f)).astype(np.float32)
    z = rng.standard_normal((m, 2 * f)).astype(np.float32)
    out = encore.gemm_epilogue("swiglu_bwd", dx, w_down, c=z, partial_tile_n=16)
    assert set(out) == {"d", "aux", "partials"}
    dy = dx.astype(np.float64) @ w_down.astype(np.float64)
    g, u = z[:, 0::2].astype(np.float64), z[:, 1::2].astype(np.float64)
    s = _sigmoid(g)
    dg, du = dy * u * s * (1 + g * (1 - s)), dy * g * s
    np.testing.assert_allclose(out["d"], g * s * u, rtol=1e-5, atol=1e-5)
    assert out["aux"].shape == (m, 2 * f)
    np.testing.assert_allclose(out["aux"][:, 0::2], dg, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["aux"][:, 1::2], du, rtol=1e-5, atol=1e-5)
    zdz = g * dg + u * du
    tiles = [zdz[:, t:t + 16].sum(1) for t in range(0, f, 16)]
    assert out["partials"].shape == (m, 3)
    np.testing.assert_allclose(out["partials"], np.stack(tiles, 1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(encore.gemm.partials_sum(out["partials"], scale=1 / d), zdz.sum(1) / d, rtol=1e-5, atol=1e-5)


def test_rmsnorm_bwd_matches_numpy():
    rng = np.random.default_rng(6)
    m, k, d = 300, 24, 40  # 3 M-tiles of 128 rows, d rounded up to the tile in the partials
    dz, w = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, d)).astype(np.float32)
    x, c2 = rng.standard_normal((m, d)).astype(np.float32), rng.standard_normal((m, d)).astype(np.float32)
    gamma, r = (1 + 0.2 * rng.standard_normal(d)).astype(np.float32), rng.uniform(0.5, 2, m).astype(np.float32)
    zdz, alpha = rng.standard_normal(m).astype(np.float32), np.array([0.5], np.float32)
    out = encore.gemm_epilogue("rmsnorm_bwd", dz, w, c=x, c2=c2, gamma=gamma, row_scale=r, zdz=zdz, alpha=alpha)
    assert set(out) == {"d", "aux", "partials"}
    da = 0.5 * (dz.astype(np.float64) @ w.astype(np.float64))
    xh = r[:, None].astype(np.float64) * x
    np.testing.assert_allclose(out["d"], c2 + r[:, None] * (gamma * da - xh * zdz[:, None]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["aux"], xh * gamma, rtol=1e-5, atol=1e-5)
    tile = encore._encore.gemm_partial_tile_n(encore.Epilogue.rmsnorm_bwd, m, d, k)
    assert out["partials"].shape == ((m + 127) // 128, (d + tile - 1) // tile * tile)
    ref = np.stack([(da * xh)[t:t + 128].sum(0) for t in range(0, m, 128)])
    np.testing.assert_allclose(out["partials"][:, :d], ref, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(out["partials"][:, d:], 0)
    dgamma = encore.gemm.partials_sum(out["partials"], per_column=True, n=d)
    np.testing.assert_allclose(dgamma, (da * xh).sum(0), rtol=1e-5, atol=1e-4)
    # without c2 and alpha: c2 = 0, alpha = 1
    out2 = encore.gemm_epilogue("rmsnorm_bwd", dz, w, c=x, gamma=gamma, row_scale=r, zdz=zdz)
    np.testing.assert_allclose(out2["d"], r[:, None] * (gamma * 2 * da - xh * zdz[:, None]), rtol=1e-5, atol=1e-5)


def test_backward_rows_refuse_bad_operands():
    rng = np.random.default_rng(2)
    dx, w_down = rng.standard_normal((8, 16)).astype(np.float32), rng.standard_normal((16, 24)).astype(np.float32)
    z = rng.standard_normal((8, 48)).astype(np.float32)
    with pytest.raises(ValueError, match=r"w: expected \[K, N\]"):
        encore.gemm_epilogue("swiglu_bwd", dx, w_down.T.copy(), c=z)  # a forward-layout weight [N, K]
    with pytest.raises(ValueError, match="c: "):
        encore.gemm_epilogue("swiglu_bwd", dx, w_down, c=z[:, :24].copy())  # Z not packed [M, 2N]
    with pytest.raises(ValueError, match="zdz: "):
        encore.gemm_epilogue("rmsnorm_bwd", dx, w_down, c=z[:, :24].copy(), gamma=np.ones(24, np.float32),
                             row_scale=np.ones(8, np.float32))
    with pytest.raises(ValueError, match="c2: not used by the swiglu_bwd epilogue"):
        encore.gemm_epilogue("swiglu_bwd", dx, w_down, c=z, c2=np.ones((8, 24), np.float32))
    with pytest.raises(ValueError, match="out: "):
        encore._encore.partials_sum_run(encore._encore.PartialsSumArgs(partials=np.ones((2, 8), np.float32), out=np.ones(9, np.float32)),
                                        axis=encore._encore.PartialsSum.per_column, scale=1.0)


def test_backward_rows_through_torch_ops_and_compile():
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(9)
    m, k, n = 130, 16, 24
    dz, w, x, c2 = (torch.randn(s, generator=g) for s in ((m, k), (k, n), (m, n), (m, n)))
    gamma, r, zdz = torch.randn(n, generator=g) * 0.1 + 1, torch.rand(m, generator=g) + 0.5, torch.randn(m, generator=g)
    eager = encore.gemm_epilogue("rmsnorm_bwd", dz, w, c=x, c2=c2, gamma=gamma, row_scale=r, zdz=zdz)
    assert eager["partials"].shape == (2, 128) and eager["partials"].dtype == torch.float32

    def f(dz, w, x, c2, gamma, r, zdz):
        out = encore.gemm_epilogue("rmsnorm_bwd", dz, w, c=x, c2=c2, gamma=gamma, row_scale=r, zdz=zdz)
        return out["d"], out["aux"], encore.gemm.partials_sum(out["partials"], per_column=True, n=n)

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(dz, w, x, c2, gamma, r, zdz)
    torch.testing.assert_close(got[0], eager["d"])
    torch.testing.assert_close(got[1], eager["aux"])
    torch.testing.assert_close(got[2], eager["partials"][:, :n].sum(0))


def test_rope_bwd_inverts_rope_and_is_its_adjoint():
    rng = np.random.default_rng(8)
    m, heads, hd = 6, 3, 16
    n = heads * hd
    eye = np.eye(n, dtype=np.float32)
    x, dy = rng.standard_normal((m, n)).astype(np.float32), rng.standard_normal((m, n)).astype(np.float32)
    pos = np.array([0, 1, 7, 1000, 65535, 524287], np.int32)
    freq = encore.rope_freq_turns(heads, heads - 1, hd, 500000.0)  # the last head passes through
    y = encore.gemm_rope(x, eye, pos, freq)
    back = encore.gemm_epilogue("rope_bwd", y, eye, pos=pos, freq=freq)["d"]
    np.testing.assert_allclose(back, x, rtol=1e-5, atol=1e-5)
    dx = encore.gemm_epilogue("rope_bwd", dy, eye, pos=pos, freq=freq)["d"]
    np.testing.assert_allclose((dy.astype(np.float64) * y).sum(), (dx.astype(np.float64) * x).sum(), rtol=1e-5)
    np.testing.assert_array_equal(dx[:, -hd:], dy[:, -hd:])
    r = rng.uniform(0.5, 2, m).astype(np.float32)
    np.testing.assert_allclose(encore.gemm_epilogue("rope_bwd", dy, eye, pos=pos, freq=freq, row_scale=r)["d"], r[:, None] * dx,
                               rtol=1e-5, atol=1e-5)
