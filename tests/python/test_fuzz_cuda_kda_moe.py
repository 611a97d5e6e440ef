"""Property-based fuzzing on CUDA of the KDA backward, the token recurrence and the MoE layer (the GPU
machine; skipped elsewhere): kda_backward on the CUDA forward's residuals (saved-h and rematerialize, float32
or bfloat16 residuals; none on the token-recurrent path of K or V past 128), encore.kda.fused_recurrent_kda
(fla's token recurrence: varlen, initial and final states in both layouts), moe_forward (plain, into a
canary-guarded out=, on persistent buffers sized by moe_buffers_bytes) and moe_permuted_rows (the CUDA
dispatch's rows). Valid draws: CUDA tensors against the CPU backend on the same values: B 1-2 or varlen with
empty sequences, T 1-100 (chunk edges 63 / 64 / 65), H 1-2, grouped value heads, K, V 16-192, the
precomputed / softplus / lower-bound gates, L2 norm, beta sigmoid; the KDA backward within the bounds of
tests/kda/test_kda_bwd_gpu.cpp against the CPU backend's chunked backward on the CUDA forward's residuals
(the token-level one on the recurrent path), plus the problem's sensitivity to bf16 rounding of q, k, v, dO
for 16-bit inputs, dg against the size of its terms where they cancel; the MoE layer under the 2x rule (fuzz_cuda_util.within_2x). Invalid draws: an operand on the
CPU, dtypes and sizes the CUDA kernels refuse, missing residuals: ValueError (invalid) or RuntimeError
(unsupported on CUDA) naming the argument, the guarded out= untouched. moe_permuted_rows takes no array:
its invalid draws are tests/python/test_fuzz_moe.py's, the same on every machine.

Seeds: hypothesis with derandomize=True (fuzz_util.VALID: 200 draws, INVALID: 100 draws per test)."""
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import encore
from fuzz_cuda_util import DT, TOL, CudaGuard, close_to_cpu, pair, rel, within_2x
from fuzz_util import INVALID, SEEDS, VALID, refused, torch  # noqa: F401
from helpers import needs_torch_cuda

pytestmark = needs_torch_cuda

_LENS = st.sampled_from([None, None, (1,), (63,), (64, 65), (0, 100), (37, 0, 26)])  # None: B fixed-length sequences of T
_GRADS = {"dq": "q", "dk": "k", "dv": "v", "dg": "g", "dbeta": "beta", "dh0": "initial_state", "dA_log": "A_log", "ddt_bias": "dt_bias"}
_FRAGILE = ("dg", "dbeta", "dA_log", "ddt_bias")  # sums over tokens and channels, with cancellation


def _both(values, dtype=np.float32):
    c = torch.from_numpy(np.ascontiguousarray(values, dtype))
    return c.cuda(), c


def _kda_case(rng, dt, b, t, h, group, kd, vd, gate, l2, h0, lens):
    """({name: (CUDA, CPU)} of one KDA call's arrays, options): q, k [B, T, H, K], v [B, T, HV, V] and beta in dt,
    g [B, T, HV, K], A_log, dt_bias, initial_state float32; cu_seqlens (a host array) and the gate's options."""
    hv = h * group
    if lens is not None:
        b, t = 1, sum(lens)
    x = {"q": pair(rng, (b, t, h, kd), dt), "k": pair(rng, (b, t, h, kd), dt, 1.0 if l2 else 0.6 / np.sqrt(kd)),
         "v": pair(rng, (b, t, hv, vd), dt), "beta": _both(rng.uniform(0.05, 0.95, (b, t, hv)))}
    x["beta"] = tuple(a.to(getattr(torch, dt)) for a in x["beta"])
    opts = {"use_qk_l2norm": l2}
    if gate == "log":
        x["g"] = _both(-0.3 * rng.random((b, t, hv, kd)))
    else:
        x["g"] = _both(rng.standard_normal((b, t, hv, kd)))
        opts["use_gate_in_kernel"] = True
        if gate == "softplus":
            x["A_log"] = _both(rng.uniform(-2, 0.5, hv))
        else:
            opts["lower_bound"] = float(rng.choice([-5.0, -1.0, -0.25]))
        if rng.random() < 0.5:
            x["dt_bias"] = _both(0.3 * rng.standard_normal(hv * kd))
    if lens is not None:
        opts["cu_seqlens"] = torch.tensor(np.cumsum((0,) + tuple(lens)), dtype=torch.int64)
    if h0:
        x["initial_state"] = _both(0.5 * rng.standard_normal((b if lens is None else len(lens), hv, kd, vd)))
    return x, opts


def _cpu64(x):
    """The CPU side's arrays in float64 (the CPU backend's exact mode), keyed as kda_forward / kda_backward take them."""
    return {name: v[1].double() for name, v in x.items()}


def _path(dt, kd, vd, saved_h):
    """The CUDA backward's kernels (kda_backward_kernels, src/kda/plan.cpp): recurrent past 128, the second
    backward (bf16 tensor-core products) for bf16 or fp16 with saved states, the first otherwise."""
    if kd > 128 or vd > 128:
        return "recurrent"
    return "second" if dt == "bfloat16" or (dt == "float16" and saved_h) else "first"


def _tol(path, dt, name):
    """tests/kda/test_kda_bwd_gpu.cpp's bounds against the CPU backward on the same residuals (the second backward:
    fla's 8e-3 / 2e-2; the first: 4e-3 / 8e-3 in 16-bit, 2e-4 / 1e-3 in fp32) and
    tests/kda/test_kda_large_dims_gpu.cpp's against the token-level backward (recurrent: 5e-3 / 1e-2)."""
    fragile = name in _FRAGILE
    if path == "second":
        return 2e-2 if fragile else 8e-3
    if path == "recurrent":
        return 1e-2 if fragile else 5e-3
    if dt != "float32":
        return 8e-3 if fragile else 4e-3
    return 1e-3 if fragile else 2e-4


def _rounding_sensitivity(rng, c, opts, d_o, d_fin):
    """{gradient: relative change} of the CPU token-level backward (float64) when q, k, v and dO move by half a
    bf16 unit (2^-9, relative, random signs). The CUDA kernels round what their products read to bf16 (the
    L2-normalized q, k; Vnew, dVnew, the gated q, k), which the CPU backend does not; where a gradient is a
    short sum that cancels (T = 1: a row of dq is one dot product over V times k) that rounding is the whole
    error, beyond the bounds set on long sequences."""
    kw = dict(opts, d_final_state=d_fin, initial_state=c.get("initial_state"), A_log=c.get("A_log"), dt_bias=c.get("dt_bias"))
    base = encore.kda_backward(c["q"], c["k"], c["v"], c["g"], c["beta"], d_o, **kw)
    move = lambda x: x * (1 + torch.from_numpy(rng.uniform(-2.0**-9, 2.0**-9, tuple(x.shape))))  # noqa: E731
    other = encore.kda_backward(move(c["q"]), move(c["k"]), move(c["v"]), c["g"], c["beta"], move(d_o), **kw)
    return {n: rel(other[n], base[n]) for n in base}


def _dg_floor(c, ref):
    """The size of dg's terms (q^ . dq and k^ . dk, before the gate's cumulative sum): dg's denominator where its
    terms cancel (with one token and no initial state dg is exactly 0, and the CUDA sums leave ~1e-9 of the terms)."""
    return float((c["q"] * ref["dq"]).norm() + (c["k"] * ref["dk"]).norm())


@VALID
@given(seed=SEEDS, dt=st.sampled_from(["bf16", "f16", "f32"]), b=st.integers(1, 2), lens=_LENS, t=st.sampled_from([1, 2, 63, 64, 65, 100]),
       h=st.integers(1, 2), group=st.integers(1, 2), kv=st.sampled_from([(64, 64), (128, 128), (48, 40), (16, 24), (160, 136)]),
       gate=st.sampled_from(["log", "log", "softplus", "lower"]), l2=st.booleans(), h0=st.booleans(), dfin=st.booleans(),
       saved_h=st.booleans(), res_dt=st.sampled_from(["float32", "bfloat16"]))
def test_kda_backward_cuda_equals_cpu(seed, dt, b, lens, t, h, group, kv, gate, l2, h0, dfin, saved_h, res_dt):
    from test_kda_autograd import dA_log_spread, dA_log_terms

    dt = DT[dt]
    rng = np.random.default_rng(seed)
    kd, vd = kv
    x, opts = _kda_case(rng, dt, b, t, h, group, kd, vd, gate, l2, h0, lens)
    g = {n: v[0] for n, v in x.items()}
    c = _cpu64(x)
    path = _path(dt, kd, vd, saved_h)
    if dt == "float32" or path == "recurrent":  # the bounds below hold with residuals in the inputs' precision (bf16 for 16-bit ones)
        res_dt = "float32" if dt == "float32" else "bfloat16"
    o_shape = tuple(x["v"][1].shape)
    dog, doc = pair(rng, o_shape, dt)
    n_seq = o_shape[0] if lens is None else len(lens)
    dfg, dfc = _both(rng.standard_normal((n_seq, o_shape[2], kd, vd))) if dfin else (None, None)
    res = None
    if path != "recurrent" or saved_h:  # the recurrent path reads none (rematerialize) or all of them (saved-h)
        names = ("G", "Aqk", "Akk", "h") if saved_h else ("Aqk", "Akk")
        res = encore.kda_forward(g["q"], g["k"], g["v"], g["g"], g["beta"], initial_state=g.get("initial_state"), A_log=g.get("A_log"),
                                 dt_bias=g.get("dt_bias"), return_residuals=names, residual_dtype=res_dt, **opts)[2]
    fwd = dict(opts, initial_state=g.get("initial_state"), A_log=g.get("A_log"), dt_bias=g.get("dt_bias"))
    got = encore.kda_backward(g["q"], g["k"], g["v"], g["g"], g["beta"], dog, d_final_state=dfg, residuals=res, **fwd)
    torch.cuda.synchronize()
    # The reference: the CPU backward on the same values in float64, reading the CUDA forward's residuals (the
    # chunked paths: the stages the CUDA kernels run), or without them (the recurrent path: the exact BPTT).
    ref_res = {n: r.cpu() for n, r in res.items()} if res is not None and path != "recurrent" else None
    cpu = dict(opts, initial_state=c.get("initial_state"), A_log=c.get("A_log"), dt_bias=c.get("dt_bias"))
    d_fin = None if dfc is None else dfc.double()
    ref = encore.kda_backward(c["q"], c["k"], c["v"], c["g"], c["beta"], doc.double(), d_final_state=d_fin, residuals=ref_res, **cpu)
    assert sorted(got) == sorted(ref) == sorted(n for n, src in _GRADS.items() if src in x)
    sens = _rounding_sensitivity(rng, c, opts, doc.double(), d_fin) if dt != "float32" else {}
    for name, want in ref.items():
        assert got[name].is_cuda and got[name].dtype == x[_GRADS[name]][0].dtype, name
        tol = _tol(path, dt, name) + 4 * sens.get(name, 0.0)
        if name == "dA_log":  # a sum over a head's tokens and channels: bounded per term where they cancel (as KdaBwdGpu)
            xs = c["g"] + (c["dt_bias"].view(-1, kd) if "dt_bias" in c else 0.0)
            spread = dA_log_spread(ref["dg"], xs)
            consistent = rel(got[name], dA_log_terms(got["dg"], xs).sum((0, 1, 3))) <= (3.3e-3 if dt != "float32" else 1e-5) * spread + 1e-6
            if spread > 1 and consistent:
                tol = max(tol, 2e-2 * spread)
        err = rel(got[name], want, _dg_floor(c, ref) if name == "dg" else 1e-30)
        assert err <= tol, (name, path, err, tol)


@VALID
@given(seed=SEEDS, dt=st.sampled_from(["bf16", "f16", "f32"]), b=st.integers(1, 3), lens=_LENS, t=st.sampled_from([1, 2, 5, 64, 100]),
       h=st.integers(1, 2), group=st.integers(1, 2), kv=st.sampled_from([(128, 128), (64, 64), (37, 50), (16, 8)]),
       gate=st.sampled_from(["log", "log", "softplus", "lower"]), l2=st.booleans(), sig=st.booleans(), neg=st.booleans(),
       h0=st.sampled_from([None, "float32", "bfloat16"]), fin=st.booleans(), vfirst=st.booleans())
def test_fused_recurrent_kda_cuda_equals_cpu(seed, dt, b, lens, t, h, group, kv, gate, l2, sig, neg, h0, fin, vfirst):
    """fla's fused_recurrent_kda on CUDA (the decode kernel over every token) against the CPU backend in float64
    on the same values: o within the dtype's rounding (at least 1e-3: the fp32 state against float64, as the decode
    test on a pool), the float32 final state within 1e-3."""
    from encore.kda import fused_recurrent_kda

    dt = DT[dt]
    rng = np.random.default_rng(seed)
    kd, vd = kv
    x, opts = _kda_case(rng, dt, b, t, h, group, kd, vd, gate, l2, False, lens)
    if sig:  # the raw beta, sigmoid in the kernel (2 sigmoid with allow_neg_eigval)
        x["beta"] = pair(rng, tuple(x["beta"][1].shape), dt)
    n_seq = x["q"][1].shape[0] if lens is None else len(lens)
    hv = h * group
    state = None
    if h0:
        state = torch.from_numpy(0.5 * rng.standard_normal((n_seq, hv) + ((vd, kd) if vfirst else (kd, vd)))).to(getattr(torch, h0))
    kw = {"use_qk_l2norm_in_kernel": l2, "use_beta_sigmoid_in_kernel": sig, "allow_neg_eigval": sig and neg, "output_final_state": fin,
          "state_v_first": vfirst, "cu_seqlens": opts.get("cu_seqlens")}
    if opts.get("use_gate_in_kernel"):
        kw.update(use_gate_in_kernel=True, lower_bound=opts.get("lower_bound"))
    gk = {n: x[n][0] for n in ("A_log", "dt_bias") if n in x}
    ck = {n: x[n][1].double() for n in gk}
    og, fg = fused_recurrent_kda(*(x[n][0] for n in ("q", "k", "v", "g", "beta")), initial_state=None if state is None else state.cuda(),
                                 **gk, **kw)
    oc, fc = fused_recurrent_kda(*(x[n][1].double() for n in ("q", "k", "v", "g", "beta")), initial_state=state, **ck, **kw)
    torch.cuda.synchronize()
    assert og.is_cuda and og.dtype == x["v"][0].dtype
    close_to_cpu(og, oc.to(og.dtype), dt, max(TOL[dt], 1e-3))
    assert (fg is None) == (not fin)
    if fin:
        assert fg.dtype == torch.float32 and fg.shape == fc.shape
        close_to_cpu(fg, fc, "float32", 1e-3)


@VALID
@given(seed=SEEDS, t=st.sampled_from([1, 2, 5, 33, 130]), e=st.sampled_from([1, 4, 8, 64]), kfrac=st.floats(0, 1), d=st.sampled_from([8, 64, 128]),
       f=st.sampled_from([8, 24, 64]), sigmoid=st.booleans(), renorm=st.booleans(), align=st.sampled_from([1, 8, 16, 128]), grouped=st.booleans(),
       bias=st.booleans(), rsf=st.sampled_from([1.0, 2.5]), mode=st.sampled_from(["plain", "out", "buffers"]))
def test_moe_forward_cuda_equals_cpu(seed, t, e, kfrac, d, f, sigmoid, renorm, align, grouped, bias, rsf, mode):
    """moe_forward on CUDA (bf16: routing, dispatch, the grouped GEMMs or the decode GEMV, combine) under the 2x
    rule: the CPU backend in float32 on the same values the reference, the CPU backend in bf16 the error scale;
    the same fp32 router logits on every run (the same experts picked)."""
    rng = np.random.default_rng(seed)
    n_group = int(rng.choice([g for g in (1, 2, 4, 8) if e % g == 0])) if grouped else 1
    topk_group = int(rng.integers(1, n_group + 1))
    k = 1 + int(kfrac * (topk_group * e // n_group - 1))
    xg, xc = pair(rng, (t, d), "bfloat16")
    lg, lc = pair(rng, (t, e), "float32", 2.0)
    w13g, w13c = pair(rng, (e, 2 * f, d), "bfloat16", d ** -0.5)
    w2g, w2c = pair(rng, (e, d, f), "bfloat16", f ** -0.5)
    bg, bc = pair(rng, (e,), "float32", 0.1) if bias else (None, None)
    kw = dict(top_k=k, scoring="sigmoid" if sigmoid else "softmax", renormalize=renorm, n_group=n_group, topk_group=topk_group,
              routed_scaling_factor=rsf, align_m=align)
    extra, guard = {}, None
    if mode == "out":
        guard = CudaGuard((t, d), "bfloat16", row_pad=8)
        extra["out"] = guard.view
    elif mode == "buffers":  # persistent buffers for up to max_tokens tokens
        max_tokens = t + int(rng.integers(0, 40))
        nbytes = encore.moe_buffers_bytes(max_tokens, d, f, e, k, xg, align) + 256
        extra.update(max_tokens=max_tokens, buffers=torch.zeros(nbytes, dtype=torch.uint8, device="cuda"))
    got = encore.moe_forward(xg, lg, w13g, w2g, correction_bias=bg, **kw, **extra)
    torch.cuda.synchronize()
    if guard is not None:
        assert got is guard.view and guard.intact()
    ref = encore.moe_forward(xc, lc, w13c, w2c, correction_bias=bc, **kw)
    ref32 = encore.moe_forward(xc.float(), lc, w13c.float(), w2c.float(), correction_bias=bc, **kw)
    assert got.is_cuda and got.dtype == torch.bfloat16
    within_2x(got, ref, ref32, "bfloat16")


@VALID
@given(seed=SEEDS, t=st.sampled_from([1, 3, 64, 257]), e=st.sampled_from([1, 5, 16, 128]), kfrac=st.floats(0, 1),
       align=st.sampled_from([1, 2, 8, 128, 1024]))
def test_moe_permuted_rows_bounds_the_cuda_dispatch(seed, t, e, kfrac, align):
    """moe_permuted_rows (a host size) is the CUDA dispatch's row count, and every expert's block ends within it."""
    rng = np.random.default_rng(seed)
    k = 1 + int(kfrac * (e - 1))
    ids = torch.from_numpy(np.stack([rng.permutation(e)[:k] for _ in range(t)]).astype(np.int32))
    rows = encore.moe_permuted_rows(t, k, e, align)
    r = encore.moe_dispatch(ids.cuda(), e, align_m=align)
    offsets = r["expert_offsets"].cpu()
    assert r["row_slots"].shape[0] == rows and int(offsets[-1]) <= rows
    assert torch.equal(offsets, encore.moe_dispatch(ids, e, align_m=align)["expert_offsets"])
    assert int(r["slot_rows"].max()) < int(offsets[-1])


_KDA_BAD = ["no_residuals", "d_o_cpu", "residual_cpu", "G_bf16", "h0_bf16", "dfin_cpu", "K_300", "A_log_f16"]


@INVALID
@given(seed=SEEDS, dt=st.sampled_from(["bf16", "f16", "f32"]), case=st.sampled_from(_KDA_BAD))
def test_kda_backward_cuda_refusals(seed, dt, case):
    dt = DT[dt]
    if case == "no_residuals" and dt == torch.bfloat16:  # bf16: the backward re-runs the forward for absent residuals
        dt = torch.float16
    rng = np.random.default_rng(seed)
    kd = 300 if case == "K_300" else 16
    x, opts = _kda_case(rng, dt, 1, int(rng.integers(2, 20)), 2, 1, kd, 8, "softplus" if case == "A_log_f16" else "log", False,
                        case == "h0_bf16", None)
    g = {n: v[0] for n, v in x.items()}
    d_o = pair(rng, tuple(x["v"][1].shape), dt)[0]
    kw = dict(opts, initial_state=g.get("initial_state"), A_log=g.get("A_log"))
    kind, names = ValueError, ["residuals"]
    res = None
    if case not in ("no_residuals", "K_300"):
        res = encore.kda_forward(g["q"], g["k"], g["v"], g["g"], g["beta"], return_residuals=("G", "Aqk", "Akk"), **kw)[2]
    if case == "d_o_cpu":
        d_o, names = d_o.cpu(), ["d_o"]
    elif case == "residual_cpu":
        res["Aqk"], names = res["Aqk"].cpu(), ["residuals.Aqk"]
    elif case == "G_bf16":
        res["G"], names = res["G"].to(torch.bfloat16), ["residuals.G"]
    elif case == "h0_bf16":  # the states are float32 (float64 on the CPU backend)
        kw["initial_state"], names = kw["initial_state"].to(torch.bfloat16), ["initial_state", "dh0"]
    elif case == "dfin_cpu":
        kw["d_final_state"], names = torch.zeros(1, 2, kd, 8), ["d_final_state"]
    elif case == "K_300":  # past the token-recurrent path's 256
        kind, names = RuntimeError, ["q"]
    elif case == "A_log_f16":
        kw["A_log"], names = kw["A_log"].half(), ["A_log", "dA_log"]
    refused(lambda: encore.kda_backward(g["q"], g["k"], g["v"], g["g"], g["beta"], d_o, residuals=res, **kw), names, kinds=(kind,))


@INVALID
@given(seed=SEEDS, dt=st.sampled_from(["bf16", "f16", "f32"]), case=st.sampled_from(["h0_cpu", "v_cpu", "beta_cpu", "g_f64", "h0_f16", "A_log_f16",
                                                                                     "dt_bias_cpu", "state_layout"]))
def test_fused_recurrent_kda_cuda_refusals(seed, dt, case):
    from encore.kda import fused_recurrent_kda

    dt = DT[dt]
    rng = np.random.default_rng(seed)
    kd, vd = 16, 8
    x, opts = _kda_case(rng, dt, 2, int(rng.integers(1, 9)), 2, 1, kd, vd, "softplus", False, True, None)
    a = {n: v[0] for n, v in x.items()}
    names = [case.split("_")[0]]
    if case in ("h0_cpu", "v_cpu", "beta_cpu", "dt_bias_cpu"):
        key = {"h0": "initial_state"}.get(names[0], names[0]) if case != "dt_bias_cpu" else "dt_bias"
        a[key] = x[key][1] if key in x else _both(np.zeros(2 * kd))[1]
        names = [key]
    elif case == "g_f64":
        a["g"] = a["g"].double()
    elif case == "h0_f16":
        a["initial_state"], names = a["initial_state"].half(), ["initial_state"]
    elif case == "A_log_f16":
        a["A_log"], names = a["A_log"].half(), ["A_log"]
    else:  # state_v_first with a [K, V] state (K != V)
        names = ["initial_state"]
    refused(lambda: fused_recurrent_kda(a["q"], a["k"], a["v"], a["g"], a["beta"], A_log=a["A_log"], dt_bias=a.get("dt_bias"),
                                        initial_state=a["initial_state"], output_final_state=True, use_gate_in_kernel=True,
                                        state_v_first=case == "state_layout"), names)


@INVALID
@given(seed=SEEDS, case=st.sampled_from(["x_f32", "d_not_8", "f_not_8", "w13_cpu", "w2_cpu", "logits_cpu", "bias_cpu", "out_cpu", "buffers_cpu",
                                        "e_600"]))
def test_moe_forward_cuda_refusals(seed, case):
    rng = np.random.default_rng(seed)
    t, e, d, f = int(rng.integers(1, 9)), (600 if case == "e_600" else 8), (12 if case == "d_not_8" else 16), (12 if case == "f_not_8" else 8)
    dt = "float32" if case == "x_f32" else "bfloat16"
    xg, xc = pair(rng, (t, d), dt)
    lg, lc = pair(rng, (t, e), "float32")
    w13g, w13c = pair(rng, (e, 2 * f, d), dt, d ** -0.5)
    w2g, w2c = pair(rng, (e, d, f), dt, f ** -0.5)
    a = {"x": xg, "router_logits": lg, "w13": w13g, "w2": w2g, "correction_bias": pair(rng, (e,), "float32", 0.1)[0]}
    guard = CudaGuard((t, d), dt)
    out, kw = guard.view, {}
    kind, names = ValueError, [case.split("_")[0]]
    if case in ("x_f32", "d_not_8", "f_not_8"):  # the CUDA layer: bf16, D and F multiples of 8 (its grouped GEMMs)
        kind, names = RuntimeError, ["x"]
    elif case in ("w13_cpu", "w2_cpu"):
        a[names[0]] = {"w13": w13c, "w2": w2c}[names[0]]
    elif case == "logits_cpu":
        a["router_logits"], names = lc, ["router_logits", "logits", "topk_ids", "correction_bias"]
    elif case == "bias_cpu":
        a["correction_bias"], names = a["correction_bias"].cpu(), ["correction_bias"]
    elif case == "out_cpu":
        out = torch.empty(t, d, dtype=torch.bfloat16)
    elif case == "buffers_cpu":
        kw["buffers"] = torch.zeros(encore.moe_buffers_bytes(t, d, f, e, 2, xg) + 256, dtype=torch.uint8)
    else:  # e_600: past the CUDA routing kernel's 512 experts
        kind, names = RuntimeError, ["logits", "router_logits"]
    refused(lambda: encore.moe_forward(a["x"], a["router_logits"], a["w13"], a["w2"], 2, correction_bias=a["correction_bias"], out=out, **kw),
            names, kinds=(kind,))
    assert guard.untouched()

