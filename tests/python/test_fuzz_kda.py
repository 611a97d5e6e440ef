"""Property-based fuzzing of the KDA family's public entry points on the CPU backend (the fp64
reference): kda_forward (with out= buffers, residuals, varlen), kda_backward (token-level and chunked
on the forward's residuals), chunk_kda (torch autograd) and kda_forward_workspace_bytes. Valid draws:
numpy (float32, float16, float64) and CPU torch (float32, bfloat16, float16, float64) inputs, B 1-2,
T 1-150 (chunk edges 63 / 64 / 65 / 128), grouped value heads (HV = 1-2 x H), K, V 1-32, scale, initial state,
QK L2 norm, the precomputed / softplus / lower-bound gates, cu_seqlens with EMPTY segments, outputs
in canary-guarded buffers (final_state in place over initial_state too); against a float64 numpy
recurrence (docs/math/kda.md) and torch autograd through it for the gradients. Invalid draws:
ValueError / TypeError naming the argument, nothing written.

Seeds: hypothesis with derandomize=True (fuzz_util.VALID: 200 draws, INVALID: 100 draws per test);
array contents from a drawn numpy seed."""
import numpy as np
from hypothesis import example, given
from hypothesis import strategies as st

import encore
from fuzz_util import (  # noqa: F401 (one_torch_thread: an autouse fixture)
    INVALID, SEEDS, VALID, Guard, bits, close, f64, is_torch, kinds, make, refused, torch, one_torch_thread)

F32 = np.float32


def _kind_make(v, kind):
    return make(v, kind) if kind != "t64" else torch.from_numpy(np.asarray(v, np.float64).copy())


def _case(rng, kind, b, t, h, group, k, v, gate, l2, h0, cu):
    """Inputs of one KDA call (kind's framework / dtype; states, A_log, dt_bias float32 or float64)."""
    hv = h * group
    mk = lambda a: _kind_make(a, kind)  # noqa: E731
    ks = 1.0 if l2 else 0.6 / np.sqrt(k)  # beta |k|^2 < 2: the contractive regime
    x = {"q": mk(rng.standard_normal((b, t, h, k))), "k": mk(ks * rng.standard_normal((b, t, h, k))), "v": mk(rng.standard_normal((b, t, hv, v))),
         "beta": mk(rng.uniform(0.05, 0.95, (b, t, hv)))}
    st_kind = np.float64 if kind in ("np64", "t64") else F32
    lib = (lambda a: torch.from_numpy(np.ascontiguousarray(a, st_kind))) if kind.startswith("t") else (lambda a: np.ascontiguousarray(a, st_kind))
    opts = {}
    if gate == "log":
        x["g"] = mk(-0.3 * rng.random((b, t, hv, k)))
    else:
        x["g"] = mk(rng.standard_normal((b, t, hv, k)))
        opts["use_gate_in_kernel"] = True
        if gate == "softplus" or rng.random() < 0.5:
            opts["A_log"] = lib(rng.uniform(-2, 0.5, hv))
        if rng.random() < 0.5:
            opts["dt_bias"] = lib(0.3 * rng.standard_normal(hv * k))
        if gate == "lower":
            opts["lower_bound"] = float(rng.choice([-5.0, -1.0, -0.25]))
    if l2:
        opts["use_qk_l2norm"] = True
    n = b if cu is None else len(cu) - 1
    if h0:
        opts["initial_state"] = lib(0.5 * rng.standard_normal((n, hv, k, v)))
    if cu is not None:
        opts["cu_seqlens"] = np.asarray(cu, rng.choice([np.int32, np.int64]))
    return x, opts


def _cu(rng, t, empty):
    """cu_seqlens over T tokens: 1-4 sequences, some of them empty when `empty`."""
    cuts = sorted(rng.integers(0, t + 1, int(rng.integers(0, 4))).tolist())
    cu = [0] + cuts + [t]
    if empty:
        i = int(rng.integers(0, len(cu)))
        cu.insert(i, cu[i])  # a repeated boundary: an empty sequence
    return cu


def kda_ref(x, opts, scale):
    """(o [B, T, HV, V], final states [N, HV, K, V]) of the gated delta rule in float64 numpy."""
    q, k, v, g, beta = (f64(x[n]) for n in ("q", "k", "v", "g", "beta"))
    b, t, h, kd = q.shape
    hv = v.shape[2]
    grp = hv // h
    q, k = np.repeat(q, grp, 2), np.repeat(k, grp, 2)
    if opts.get("use_qk_l2norm"):
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    if opts.get("use_gate_in_kernel"):
        xg = g + (f64(opts["dt_bias"]).reshape(hv, kd) if "dt_bias" in opts else 0.0)
        ea = np.exp(f64(opts["A_log"]))[:, None] if "A_log" in opts else 1.0
        if "lower_bound" in opts:
            g = opts["lower_bound"] / (1 + np.exp(-ea * xg))
        else:
            g = -ea * np.where(xg > 20, xg, np.log1p(np.exp(np.minimum(xg, 20))))
    scale = kd ** -0.5 if scale is None else scale
    cu = opts.get("cu_seqlens")
    seqs = [(i, 0, t) for i in range(b)] if cu is None else [(0, int(s), int(e)) for s, e in zip(cu[:-1], cu[1:])]
    o = np.zeros(v.shape)
    fin = np.zeros((len(seqs), hv, kd, v.shape[3]))
    h0 = f64(opts["initial_state"]) if "initial_state" in opts else None
    for n, (bi, s0, s1) in enumerate(seqs):
        S = np.zeros((hv, kd, v.shape[3])) if h0 is None else h0[n].copy()
        for ti in range(s0, s1):
            S = np.exp(g[bi, ti])[:, :, None] * S
            e = v[bi, ti] - np.einsum("hkv,hk->hv", S, k[bi, ti])
            S = S + beta[bi, ti][:, None, None] * k[bi, ti][:, :, None] * e[:, None, :]
            o[bi, ti] = scale * np.einsum("hkv,hk->hv", S, q[bi, ti])
        fin[n] = S
    return o, fin


_T = st.sampled_from([1, 2, 7, 63, 64, 65, 100, 130, 150])
_KD = st.sampled_from([1, 2, 3, 8, 16, 32])
_GATE = st.sampled_from(["log", "log", "softplus", "lower"])
FWD_KINDS = kinds("np32", "np16", "np64", "t32", "tbf16", "t16") + (["t64"] if torch is not None else [])


@VALID
@given(seed=SEEDS, kind=st.sampled_from(FWD_KINDS), b=st.integers(1, 2), t=_T, h=st.integers(1, 2), group=st.integers(1, 2), k=_KD, v=_KD,
       gate=_GATE, l2=st.booleans(), h0=st.booleans(), fin=st.booleans(), varlen=st.sampled_from([None, "plain", "empty"]),
       scale=st.sampled_from([None, None, 0.3, 1.0]), out_mode=st.sampled_from(["new", "guard", "inplace_state"]),
       residuals=st.sampled_from([False, False, True, ("Aqk", "Akk")]))
def test_kda_forward_valid(seed, kind, b, t, h, group, k, v, gate, l2, h0, fin, varlen, scale, out_mode, residuals):
    rng = np.random.default_rng(seed)
    if b * t * h * group * k * v > 150 * 2 * 32 * 32 // 2:  # keep a draw under ~20 ms on the fp64 reference
        t = max(1, t // 4)
    cu = None if varlen is None else _cu(rng, t, varlen == "empty")
    b = 1 if cu is not None else b
    x, opts = _case(rng, kind, b, t, h, group, k, v, gate, l2, h0 or out_mode == "inplace_state", cu)
    if residuals and is_torch(x["q"]) and x["q"].dtype == torch.float64:
        residuals = False  # fp64 residual outputs are for the chunked C++ tests
    o_ref, fin_ref = kda_ref(x, opts, scale)
    n = fin_ref.shape[0]
    want_fin = fin or out_mode == "inplace_state"
    kw = dict(scale=scale, output_final_state=want_fin, **opts)
    guards = []
    if out_mode != "new":
        go = Guard(o_ref.shape, x["v"], pad=2, offset=1)
        gf = None
        if out_mode == "inplace_state":  # final_state written over initial_state itself
            state = opts["initial_state"]
            gf = Guard(state.shape, state, pad=1, offset=1)
            kw["initial_state"] = gf.set(state)
            fs = gf.view
        else:
            fs = Guard(fin_ref.shape, x["q"], dtype=(torch.float32 if is_torch(x["q"]) else F32), pad=1) if want_fin else None
            if fs is not None:
                gf, fs = fs, fs.view
        kw["out"] = (go.view, fs)
        guards = [g for g in (go, gf) if g is not None]
    out_ws = kw.get("out", (_kind_make(np.zeros(o_ref.shape), kind), None))  # the CPU backend needs no workspace
    assert encore.kda_forward_workspace_bytes(x["q"], x["k"], x["v"], x["g"], x["beta"], out_ws, opts.get("cu_seqlens")) == 0
    inputs_before = {key: bits(a) for key, a in x.items()}
    got = encore.kda_forward(x["q"], x["k"], x["v"], x["g"], x["beta"], return_residuals=residuals, **kw)
    o, fs = got[0], got[1]
    if out_mode != "new":
        assert o is kw["out"][0] and fs is kw["out"][1]
    assert all(g.intact() for g in guards)
    assert all(np.array_equal(bits(x[key]), inputs_before[key]) for key in x)
    assert o.dtype == x["v"].dtype and tuple(o.shape) == o_ref.shape
    scale_o = np.abs(o_ref).max(initial=0)
    close(o, o_ref, o.dtype, rtol_ulps=4, atol=1e-9 * scale_o)
    if want_fin:
        assert tuple(fs.shape) == (n,) + o_ref.shape[2:3] + (k, v)
        close(fs, fin_ref, fs.dtype, rtol_ulps=4, atol=1e-9 * np.abs(fin_ref).max(initial=0))
    else:
        assert fs is None
    if residuals:
        res = got[2]
        names = ("G", "Aqk", "Akk", "h") if residuals is True else residuals
        assert list(res) == list(names)
        assert tuple(res["Aqk"].shape) == tuple(x["v"].shape[:3]) + (64,)


BWD_KINDS = kinds("np32", "np64", "t32") + (["t64"] if torch is not None else [])


def _torch_ref_grads(x, opts, scale, d_o, d_fin, keys):
    """Gradients of sum(o * d_o) + sum(fin * d_fin) by torch autograd through the float64 recurrence."""
    leaves = {n: torch.tensor(f64(a), requires_grad=True) for n, a in list(x.items()) + [(n, opts[n]) for n in ("initial_state", "A_log", "dt_bias")
                                                                                        if n in opts]}
    q, k, v, g, beta = (leaves[n] for n in ("q", "k", "v", "g", "beta"))
    b, t, h, kd = q.shape
    hv = v.shape[2]
    q, k = q.repeat_interleave(hv // h, 2), k.repeat_interleave(hv // h, 2)
    if opts.get("use_qk_l2norm"):
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    if opts.get("use_gate_in_kernel"):
        xg = g + (leaves["dt_bias"].reshape(hv, kd) if "dt_bias" in leaves else 0.0)
        ea = torch.exp(leaves["A_log"])[:, None] if "A_log" in leaves else 1.0
        g = opts["lower_bound"] * torch.sigmoid(ea * xg) if "lower_bound" in opts else -ea * torch.nn.functional.softplus(xg)
    scale = kd ** -0.5 if scale is None else scale
    cu = opts.get("cu_seqlens")
    seqs = [(i, 0, t) for i in range(b)] if cu is None else [(0, int(s), int(e)) for s, e in zip(cu[:-1], cu[1:])]
    loss = 0
    for n, (bi, s0, s1) in enumerate(seqs):
        S = leaves["initial_state"][n] if "initial_state" in leaves else torch.zeros(hv, kd, v.shape[3], dtype=torch.float64)
        for ti in range(s0, s1):
            S = torch.exp(g[bi, ti])[:, :, None] * S
            e = v[bi, ti] - torch.einsum("hkv,hk->hv", S, k[bi, ti])
            S = S + beta[bi, ti][:, None, None] * k[bi, ti][:, :, None] * e[:, None, :]
            loss = loss + (scale * torch.einsum("hkv,hk->hv", S, q[bi, ti]) * torch.from_numpy(d_o[bi, ti])).sum()
        if d_fin is not None:
            loss = loss + (S * torch.from_numpy(d_fin[n])).sum()
    grads = torch.autograd.grad(loss, [leaves[n] for n in keys], allow_unused=True)
    return {n: (np.zeros(leaves[n].shape) if gr is None else gr.numpy()) for n, gr in zip(keys, grads)}


_GRAD_OF = {"dq": "q", "dk": "k", "dv": "v", "dg": "g", "dbeta": "beta", "dh0": "initial_state", "dA_log": "A_log", "ddt_bias": "dt_bias"}


@VALID
@given(seed=SEEDS, kind=st.sampled_from(BWD_KINDS), b=st.integers(1, 2), t=st.sampled_from([1, 2, 5, 17, 64, 65, 80]), h=st.integers(1, 2),
       group=st.integers(1, 2), k=st.sampled_from([1, 3, 8, 16]), v=st.sampled_from([1, 4, 16]), gate=_GATE, l2=st.booleans(), h0=st.booleans(),
       dfin=st.booleans(), varlen=st.sampled_from([None, "plain", "empty"]), residuals=st.sampled_from([None, None, "remat", "saved_h"]))
def test_kda_backward_valid(seed, kind, b, t, h, group, k, v, gate, l2, h0, dfin, varlen, residuals):
    if torch is None:
        return
    rng = np.random.default_rng(seed)
    cu = None if varlen is None else _cu(rng, t, varlen == "empty")
    b = 1 if cu is not None else b
    x, opts = _case(rng, kind, b, t, h, group, k, v, gate, l2, h0, cu)
    n = b if cu is None else len(cu) - 1
    d_o = rng.standard_normal((b, t, h * group, v))
    d_fin = rng.standard_normal((n, h * group, k, v)) if dfin else None
    mk = lambda a: _kind_make(a, kind)  # noqa: E731
    st_lib = (lambda a: torch.from_numpy(a)) if kind.startswith("t") else (lambda a: a)
    kw = dict(opts, d_final_state=None if d_fin is None else st_lib(d_fin.astype(np.float64 if kind in ("np64", "t64") else F32)))
    if residuals and kind not in ("np64", "t64"):
        names = ("G", "Aqk", "Akk") + (("h",) if residuals == "saved_h" else ())
        kw["residuals"] = encore.kda_forward(x["q"], x["k"], x["v"], x["g"], x["beta"], return_residuals=names, **opts)[2]
    grads = encore.kda_backward(x["q"], x["k"], x["v"], x["g"], x["beta"], mk(d_o), **kw)
    keys = [name for name, src in _GRAD_OF.items() if src in x or src in opts]
    assert sorted(grads) == sorted(keys)
    ref = _torch_ref_grads(x, opts, None, f64(mk(d_o)), None if d_fin is None else f64(kw["d_final_state"]), [_GRAD_OF[n] for n in keys])
    for name in keys:
        got, want = f64(grads[name]), ref[_GRAD_OF[name]]
        assert got.shape == want.shape, name
        tol = 1e-9 if str(grads[name].dtype).endswith("float64") else 1e-4 if "residuals" in kw else 2e-6  # float32 residuals: float32 round-off
        err, norm = np.linalg.norm(got - want), np.linalg.norm(want)
        assert err <= tol * norm + 1e-12, (name, err, norm)


@VALID
@given(seed=SEEDS, kind=st.sampled_from(kinds("t32", "tbf16") + (["t64"] if torch is not None else [])), t=st.sampled_from([1, 3, 40, 65]),
       h=st.integers(1, 2), group=st.integers(1, 2), k=st.sampled_from([2, 8]), v=st.sampled_from([1, 8]), gate=_GATE, l2=st.booleans(),
       h0=st.booleans(), fin=st.booleans(), varlen=st.sampled_from([None, "empty"]), remat=st.booleans())
def test_chunk_kda_valid(seed, kind, t, h, group, k, v, gate, l2, h0, fin, varlen, remat):
    if torch is None:
        return
    rng = np.random.default_rng(seed)
    cu = None if varlen is None else _cu(rng, t, True)
    x, opts = _case(rng, kind, 1, t, h, group, k, v, gate, l2, h0, cu)
    kw = {"A_log": opts.get("A_log"), "dt_bias": opts.get("dt_bias"), "lower_bound": opts.get("lower_bound"),
          "use_gate_in_kernel": opts.get("use_gate_in_kernel", False), "use_qk_l2norm_in_kernel": l2, "initial_state": opts.get("initial_state"),
          "output_final_state": fin, "disable_recompute": not remat}
    if cu is not None:
        kw["cu_seqlens"] = torch.from_numpy(np.asarray(cu, np.int64))
    leaves = {n: a.clone().requires_grad_(True) for n, a in x.items()}
    o, fs = encore.chunk_kda(*(leaves[n] for n in ("q", "k", "v", "g", "beta")), **kw)
    o_ref, fin_ref = kda_ref(x, opts, None)
    close(o.detach(), o_ref, o.dtype, rtol_ulps=4, atol=1e-9 * np.abs(o_ref).max(initial=0))
    assert (fs is None) == (not fin)
    d_o = torch.from_numpy(rng.standard_normal(tuple(o.shape))).to(o.dtype)
    o.backward(d_o)
    ref = _torch_ref_grads(x, opts, None, f64(d_o), None, ["q", "k", "v", "g", "beta"])
    tol = {"float64": 1e-9, "float32": 1e-4}.get(str(o.dtype).rsplit(".", 1)[-1], 2e-2)  # float32: the saved residuals' round-off
    for name in ("q", "k", "v", "g", "beta"):
        got, want = f64(leaves[name].grad), ref[name]
        assert np.linalg.norm(got - want) <= tol * np.linalg.norm(want) + 1e-9, name


# --- invalid draws -----------------------------------------------------------------------------------------

_FWD_BAD = ["q_3d", "q_list", "v_3d", "k_shape", "k_dtype", "v_heads", "g_shape", "beta_shape", "q_int", "q_col_stride", "T_0", "K_300",
            "scale_0", "scale_neg", "scale_nan", "scale_str", "cu_float", "cu_list", "cu_2d", "cu_start", "cu_end", "cu_decreasing", "cu_one", "cu_B2",
            "h0_shape", "h0_f16", "A_log_no_gate", "gate_no_A_log", "lower_bound", "lower_no_gate", "dt_bias_len", "out_1", "out_fin_missing",
            "out_fin_unwanted", "o_shape", "o_int", "o_alias_g", "fin_overlap_o", "fin_overlap_h0", "fin_shape", "fin_f16", "residuals_bad",
            "residual_dtype", "workspace_f32", "workspace_framework"]


def _f32_state(kind):
    """An fp32 contiguous array of the case's framework (torch for the t* kinds, numpy otherwise)."""
    if kind.startswith("t"):
        return lambda a: torch.from_numpy(np.ascontiguousarray(a, F32))
    return lambda a: np.ascontiguousarray(a, F32)


@INVALID
@given(seed=SEEDS, kind=st.sampled_from(kinds("np32", "t32")), case=st.sampled_from(_FWD_BAD))
@example(seed=0, kind="np32", case="fin_overlap_o").via("regression: final_state overlapping o was written over o")
@example(seed=0, kind="np32", case="scale_0").via("regression: scale 0 silently meant K ** -0.5")
def test_kda_forward_invalid(seed, kind, case):
    rng = np.random.default_rng(seed)
    b, t, h, k, v = 1, int(rng.integers(2, 20)), 2, 4, 3
    x, opts = _case(rng, kind, b, t, h, 1, k, v, "log", False, True, None)
    mk = lambda a: make(a, kind)  # noqa: E731
    st_lib = _f32_state(kind)
    go, gf = Guard((b, t, h, v), x["v"]), Guard((1, h, k, v), opts["initial_state"])
    kw = dict(opts, output_final_state=True, out=(go.view, gf.view))
    names, guards = [], [go, gf]
    arg = lambda key, val, *nm: (x.__setitem__(key, val), names.extend(nm or [key]))  # noqa: E731
    if case == "q_3d":
        arg("q", x["q"][0])
    elif case == "q_list":
        arg("q", f64(x["q"]).tolist())
    elif case == "v_3d":
        arg("v", x["v"][0])
    elif case == "k_shape":
        arg("k", mk(np.ones((b, t, h, k + 1))))
    elif case == "k_dtype":
        arg("k", make(np.ones((b, t, h, k)), "np64") if kind == "np32" else torch.ones((b, t, h, k), dtype=torch.float64))
    elif case == "v_heads":
        arg("v", mk(np.ones((b, t, 3, v))))
    elif case == "g_shape":
        arg("g", mk(-np.ones((b, t, h, k + 1))))
    elif case == "beta_shape":
        arg("beta", mk(np.ones((b, t, h, 1))))
    elif case == "q_int":
        arg("q", np.ones((b, t, h, k), np.int32) if kind == "np32" else torch.ones((b, t, h, k), dtype=torch.int32))
    elif case == "q_col_stride":
        arg("q", mk(np.ones((b, t, h, 2 * k)))[..., ::2])
    elif case == "T_0":
        for key in x:
            x[key] = x[key][:, :0]
        kw.pop("out")
        names.extend(["q", "o"])
        guards = []
    elif case == "K_300":
        x["q"], x["k"], x["g"] = mk(np.ones((b, t, h, 300))), mk(np.ones((b, t, h, 300))), mk(-np.ones((b, t, h, 300)))
        kw.pop("out"), kw.pop("initial_state")
        kw["output_final_state"], names, guards = False, ["q"], []
    elif case.startswith("scale"):
        kw["scale"], names = {"scale_0": 0.0, "scale_neg": -0.5, "scale_nan": float("nan"), "scale_str": "0.5"}[case], ["scale"]
    elif case.startswith("cu"):
        cu = {"cu_float": np.array([0, 1, t], F32), "cu_list": [0, 1, t], "cu_2d": np.array([[0, t]]), "cu_start": np.array([1, t]),
              "cu_end": np.array([0, t + 1]), "cu_decreasing": np.array([0, t, 1, t]), "cu_one": np.array([0]), "cu_B2": np.array([0, t])}[case]
        kw["cu_seqlens"], names = cu, ["cu_seqlens"]
        kw.pop("out"), kw.pop("initial_state")
        guards = []
        if case == "cu_B2":
            for key in x:
                x[key] = x[key].repeat(2, *([1] * (x[key].ndim - 1))) if is_torch(x[key]) else np.concatenate([x[key]] * 2)
            names = ["q", "cu_seqlens"]
    elif case == "h0_shape":
        kw["initial_state"], names, guards = st_lib(np.ones((2, h, k, v))), ["initial_state"], [go]
        kw["out"] = (go.view, None)
        kw["output_final_state"] = False
    elif case == "h0_f16":
        half = torch.ones((1, h, k, v), dtype=torch.float16) if kind != "np32" else np.ones((1, h, k, v), np.float16)
        kw["initial_state"], names = half, ["initial_state"]
    elif case == "A_log_no_gate":
        kw["A_log"], names = st_lib(np.zeros(h)), ["A_log"]
    elif case == "gate_no_A_log":
        kw["use_gate_in_kernel"], names = True, ["A_log"]
    elif case == "lower_bound":
        kw.update(use_gate_in_kernel=True, lower_bound=float(rng.choice([-6.0, 0.0, 0.5, np.nan])))
        names = ["lower_bound"]
    elif case == "lower_no_gate":
        kw["lower_bound"], names = -1.0, ["use_lower_bound", "lower_bound", "use_gate_in_kernel"]
    elif case == "dt_bias_len":
        kw.update(use_gate_in_kernel=True, A_log=st_lib(np.zeros(h)), dt_bias=st_lib(np.zeros(h * k + 1)))
        names = ["dt_bias"]
    elif case == "out_1":
        kw["out"], names = (go.view,), ["out"]
    elif case == "out_fin_missing":
        kw["out"], names = (go.view, None), ["out", "final_state"]
    elif case == "out_fin_unwanted":
        kw["output_final_state"], names = False, ["out", "final_state"]
    elif case == "o_shape":
        g2 = Guard((b, t, h, v + 1), x["v"])
        kw["out"], names, guards = (g2.view, gf.view), ["o"], [g2, gf]
    elif case == "o_int":
        g2 = Guard((b, t, h, v), x["v"], dtype=torch.int32 if kind != "np32" else np.int32)
        kw["out"], names, guards = (g2.view, gf.view), ["o"], [g2, gf]
    elif case == "o_alias_g":  # o over the gate input
        kw["out"], names, guards = (x["g"][..., :v], gf.view), ["o", "g"], [gf]
    elif case == "fin_overlap_o":  # final_state and o in one buffer, overlapping: the state would be written over o
        n_o, n_f = b * t * h * v, h * k * v
        flat = Guard((n_o + n_f,), x["v"], dtype=torch.float32 if kind != "np32" else F32)
        o_view, f_view = flat.view[:n_o].reshape(b, t, h, v), flat.view[n_o - 2:n_o - 2 + n_f].reshape(1, h, k, v)
        kw["out"], names, guards = (o_view, f_view), ["final_state", "o"], [flat, gf]
    elif case == "fin_overlap_h0":  # final_state a shifted view of the initial state's buffer
        n_f = h * k * v
        flat = Guard((n_f + 1,), opts["initial_state"])
        flat.set(np.concatenate([f64(opts["initial_state"]).ravel(), [0.0]]) if kind == "np32" else
                 torch.cat([opts["initial_state"].reshape(-1), torch.zeros(1)]))
        kw["initial_state"], kw["out"] = flat.view[:n_f].reshape(1, h, k, v), (go.view, flat.view[1:].reshape(1, h, k, v))
        names, guards = ["final_state", "initial_state"], [go, flat]
    elif case == "fin_shape":
        g2 = Guard((1, h, k, v + 1), opts["initial_state"])
        kw["out"], names, guards = (go.view, g2.view), ["final_state"], [go, g2]
    elif case == "fin_f16":
        g2 = Guard((1, h, k, v), opts["initial_state"], dtype=torch.float16 if kind != "np32" else np.float16)
        kw["out"], names, guards = (go.view, g2.view), ["final_state"], [go, g2]
    elif case == "residuals_bad":
        kw.pop("out")
        kw["return_residuals"], names, guards = ["X", ("G", "W"), ("Aqk", 1)][int(rng.integers(3))], ["return_residuals"], []
    elif case == "residual_dtype":
        kw.pop("out")
        kw.update(return_residuals=True, residual_dtype=str(rng.choice(["float16", "fp32"]))), names.append("residual_dtype")
        guards = []
    elif case == "workspace_f32":
        kw["workspace"], names = np.zeros(64, F32), ["workspace"]
    elif case == "workspace_framework":
        kw["workspace"], names = (np.zeros(64, np.uint8) if kind != "np32" else torch.zeros(64, dtype=torch.uint8)), ["workspace"]
    # K above the 256 the CPU reference takes is unsupported (RuntimeError, the binding's rule), not invalid
    exc = (ValueError, TypeError, RuntimeError) if case == "K_300" else (ValueError, TypeError)
    refused(lambda: encore.kda_forward(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw), names, guards, kinds=exc)


@INVALID
@given(seed=SEEDS, kind=st.sampled_from(kinds("np32", "t32")), case=st.sampled_from(
    ["d_o_shape", "d_o_dtype", "d_o_list", "dfin_shape", "dfin_f16", "residuals_dict", "residuals_tuple", "residuals_G_shape", "residuals_h_rows",
     "q_3d", "scale_neg", "cu_end", "h0_shape", "A_log_len", "beta_int"]))
def test_kda_backward_invalid(seed, kind, case):
    rng = np.random.default_rng(seed)
    b, t, h, k, v = 1, int(rng.integers(2, 12)), 2, 4, 3
    x, opts = _case(rng, kind, b, t, h, 1, k, v, "log", False, False, None)
    mk = lambda a: make(a, kind)  # noqa: E731
    st_lib = _f32_state(kind)
    d_o, kw, names = mk(np.ones((b, t, h, v))), dict(opts), []
    if case == "d_o_shape":
        d_o, names = mk(np.ones((b, t + 1, h, v))), ["d_o"]
    elif case == "d_o_dtype":
        d_o, names = (np.ones((b, t, h, v), np.int32) if kind == "np32" else torch.ones((b, t, h, v), dtype=torch.int32)), ["d_o"]
    elif case == "d_o_list":
        d_o, names = np.ones((b, t, h, v)).tolist(), ["d_o"]
    elif case == "dfin_shape":
        kw["d_final_state"], names = st_lib(np.ones((1, h, k, v + 1))), ["d_final_state"]
    elif case == "dfin_f16":
        half = np.ones((1, h, k, v), np.float16) if kind == "np32" else torch.ones((1, h, k, v), dtype=torch.float16)
        kw["d_final_state"], names = half, ["d_final_state"]
    elif case.startswith("residuals"):
        res = encore.kda_forward(x["q"], x["k"], x["v"], x["g"], x["beta"], return_residuals=True)[2]
        if case == "residuals_dict":
            res, names = dict(res, W=res["G"]), ["residuals"]
        elif case == "residuals_tuple":
            res, names = tuple(res.values()), ["residuals"]
        elif case == "residuals_G_shape":
            res, names = dict(res, G=res["G"][:, :-1]), ["residuals.G"]
        else:
            res, names = dict(res, h=mk(np.ones((3, h, k, v))).float() if kind != "np32" else np.ones((3, h, k, v), F32)), ["residuals.h"]
        kw["residuals"] = res
    elif case == "q_3d":
        x["q"], names = x["q"][0], ["q"]
    elif case == "scale_neg":
        kw["scale"], names = -1.0, ["scale"]
    elif case == "cu_end":
        kw["cu_seqlens"], names = np.array([0, t + 3]), ["cu_seqlens"]
    elif case == "h0_shape":
        kw["initial_state"], names = st_lib(np.ones((1, h + 1, k, v))), ["initial_state"]
    elif case == "A_log_len":
        kw.update(use_gate_in_kernel=True, A_log=st_lib(np.zeros(h + 1))), names.append("A_log")
    elif case == "beta_int":
        x["beta"], names = (np.ones((b, t, h), np.int32) if kind == "np32" else torch.ones((b, t, h), dtype=torch.int32)), ["beta"]
    refused(lambda: encore.kda_backward(x["q"], x["k"], x["v"], x["g"], x["beta"], d_o, **kw), names)


@INVALID
@given(seed=SEEDS, case=st.sampled_from(["numpy", "q_3d", "chunk_32", "unknown_kw", "neg_eigval", "state_v_first", "safe_gate",
                                        "gate_no_A_log", "scale_0", "cu_end", "cp_state"]))
def test_chunk_kda_invalid(seed, case):
    if torch is None:
        return
    rng = np.random.default_rng(seed)
    t, h, k, v = int(rng.integers(2, 12)), 2, 4, 3
    x, _ = _case(rng, "t32", 1, t, h, 1, k, v, "log", False, False, None)
    args, kw, names = [x[n] for n in ("q", "k", "v", "g", "beta")], {}, []
    if case == "numpy":
        args, names = [a.numpy() for a in args], ["q"]
    elif case == "q_3d":
        args[0], names = args[0][0], ["q"]
    elif case == "chunk_32":
        kw, names = {"chunk_size": 16}, ["chunk_size"]
    elif case == "unknown_kw":
        kw, names = {"foo": 1}, ["foo"]
    elif case == "neg_eigval":  # allow_neg_eigval without the beta sigmoid
        kw, names = {"allow_neg_eigval": True}, ["allow_neg_eigval"]
    elif case == "state_v_first":  # an initial state in the [K, V] layout (K != V)
        kw, names = {"state_v_first": True, "initial_state": torch.zeros(1, h, k, v)}, ["initial_state"]
    elif case == "safe_gate":
        kw, names = {"safe_gate": True, "use_gate_in_kernel": True, "lower_bound": -7.0}, ["lower_bound"]
    elif case == "gate_no_A_log":
        kw, names = {"use_gate_in_kernel": True}, ["A_log"]
    elif case == "scale_0":
        kw, names = {"scale": 0.0}, ["scale"]
    elif case == "cu_end":
        args = [a[:1] for a in args]
        kw, names = {"cu_seqlens": torch.tensor([0, t + 1])}, ["cu_seqlens"]
    elif case == "cp_state":
        kw, names = {"cp_group": object(), "output_final_state": True}, ["cp_group"]
    refused(lambda: encore.chunk_kda(*args, **kw), names)


@INVALID
@given(seed=SEEDS, kind=st.sampled_from(kinds("np32", "t32")), case=st.sampled_from(["out_1", "out_none", "out_3", "q_3d", "o_shape", "cu_end", "q_list"]))
def test_kda_forward_workspace_bytes_invalid(seed, kind, case):
    rng = np.random.default_rng(seed)
    t, h, k, v = int(rng.integers(2, 12)), 2, 4, 3
    x, _ = _case(rng, kind, 1, t, h, 1, k, v, "log", False, False, None)
    o = make(np.zeros((1, t, h, v)), kind)
    assert encore.kda_forward_workspace_bytes(x["q"], x["k"], x["v"], x["g"], x["beta"], (o, None)) == 0  # the CPU backend needs none
    out, cu, names = (o, None), None, []
    if case == "out_1":
        out, names = (o,), ["out"]
    elif case == "out_none":
        out, names = None, ["out"]
    elif case == "out_3":
        out, names = (o, None, None), ["out"]
    elif case == "q_3d":
        x["q"], names = x["q"][0], ["q"]
    elif case == "o_shape":
        out, names = (make(np.zeros((1, t, h, v + 1)), kind), None), ["o"]
    elif case == "cu_end":
        cu, names = np.array([0, t + 1]), ["cu_seqlens"]
    elif case == "q_list":
        x["q"], names = f64(x["q"]).tolist(), ["q"]
    refused(lambda: encore.kda_forward_workspace_bytes(x["q"], x["k"], x["v"], x["g"], x["beta"], out, cu), names)


# --- regressions: the bugs these fuzzers found, as plain tests ----------------------------------------------

def test_regression_kda_output_overlaps_and_scale():
    """out=(o, final_state) with final_state overlapping o (or o over an input such as g) was accepted: the
    state was written over o; scale 0 or negative silently meant K ** -0.5; a 3-D q raised an unpacking
    ValueError naming nothing; out=None for kda_forward_workspace_bytes a TypeError naming nothing."""
    rng = np.random.default_rng(0)
    x, opts = _case(rng, "np64", 1, 5, 1, 1, 2, 2, "log", False, False, None)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    buf = np.zeros(5 * 2 + 4)
    o, fin = buf[:10].reshape(1, 5, 1, 2), buf[8:12].reshape(1, 1, 2, 2)
    refused(lambda: encore.kda_forward(*args, output_final_state=True, out=(o, fin)), ["final_state", "o"])
    refused(lambda: encore.kda_forward(*args, out=(args[3][..., :2], None)), ["o", "g"])
    for s in (0.0, -0.5):
        refused(lambda: encore.kda_forward(*args, scale=s), ["scale"])
    refused(lambda: encore.kda_forward(args[0][0], *args[1:]), ["q"])
    refused(lambda: encore.kda_forward_workspace_bytes(*args, None), ["out"], kinds=(TypeError,))
    h0 = 0.5 * np.ones((1, 1, 2, 2))
    want = encore.kda_forward(*args, initial_state=h0.copy(), output_final_state=True)
    got = encore.kda_forward(*args, initial_state=h0, output_final_state=True, out=(np.zeros((1, 5, 1, 2)), h0))  # in place: allowed
    assert got[1] is h0 and np.array_equal(h0, want[1]) and np.array_equal(got[0], want[0])
