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
