"""Property-based fuzzing on CUDA of the GEMM family's finishers (the GPU machine; skipped elsewhere):
rms_final_reduce, partials_sum, lse_finish, cross_entropy_bwd / cross_entropy_bwd_, qk_norm_rope_ and
qk_norm_rope_backward. Valid draws: CUDA tensors against the CPU backend on the same values; fp32 partials
of 1-1000 rows and 1-40 tiles, contiguous or row-strided, -inf tiles (lse_finish), per-row and per-column
sums with a scale and a column count; logits of any width in bf16 / fp16 / fp32 with ignore_index rows and
an optional alpha, the gradient new, in a canary-guarded out= or in place over a guarded view; the QK-norm +
RoPE finish and its backward over 1-4 Q and 1-2 KV heads of 2-256 columns, partial rotary tables,
weights in qkv's dtype or fp32, qkv in a guarded row-strided buffer (the V heads and canaries untouched).
Outputs within the dtype's tolerance (fuzz_cuda_util.TOL), the weight gradients' fp32 sums within STAT_TOL.
Invalid draws: an operand on the CPU, column-major partials or logits, strided vectors, misaligned
frequency pairs, mismatched weight dtypes, head_dim past the CUDA kernel's 256: ValueError (invalid) or
RuntimeError (unsupported on CUDA) naming the argument, the guarded buffers untouched.

Seeds: hypothesis with derandomize=True (fuzz_util.VALID: 200 draws, INVALID: 100 draws per test)."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import encore
from fuzz_cuda_util import DT, STAT_TOL, CudaGuard, close_to_cpu, pair
from fuzz_util import INVALID, SEEDS, VALID, refused, torch  # noqa: F401
from helpers import needs_torch_cuda

pytestmark = needs_torch_cuda


def _both(values, dtype=np.float32):
    c = torch.from_numpy(np.ascontiguousarray(values, dtype))
    return c.cuda(), c


def _partials(rng, m, t, strided, neg_inf=0.0, positive=False):
    """(CUDA, CPU) fp32 partials [m, t]: a row-strided view (every row 3 elements longer) when `strided`."""
    v = 3 * rng.standard_normal((m, t + (3 if strided else 0)))
    v = np.abs(v) if positive else v
    v[rng.random(v.shape) < neg_inf] = -np.inf
    g, c = _both(v)
    return g[:, :t], c[:, :t]


@pytest.mark.parametrize("op", ["rms_final_reduce", "partials_sum", "lse_finish"])
@VALID
@given(seed=SEEDS, m=st.sampled_from([1, 2, 3, 17, 130, 1000]), t=st.sampled_from([1, 2, 3, 7, 40]), strided=st.booleans(),
       hidden=st.sampled_from([1, 7, 128, 4096]), eps=st.sampled_from([0.0, 1e-6, 1.0]), per_column=st.booleans(),
       scale=st.sampled_from([1.0, 0.5, -3.0, 0.0]), n_less=st.integers(0, 6), target=st.booleans(), ignore=st.sampled_from([-100, 0, 3]))
def test_finishers_cuda_equal_cpu(op, seed, m, t, strided, hidden, eps, per_column, scale, n_less, target, ignore):
    rng = np.random.default_rng(seed)
    if op == "rms_final_reduce":
        pg, pc = _partials(rng, m, t, strided, positive=True)
        close_to_cpu(encore.rms_final_reduce(pg, hidden, eps), encore.rms_final_reduce(pc, hidden, eps), "float32")
    elif op == "partials_sum":
        pg, pc = _partials(rng, m, t, strided)
        n = max(1, t - n_less) if per_column else None
        got = encore.partials_sum(pg, per_column=per_column, scale=scale, n=n)
        # CUDA sums in fp32 in order, the CPU in float64: the error scales with the sum of |terms| (up to 1000 rows
        # of either sign), not with the sum, which cancels (one output near 0): that is the floor.
        terms = pc.double().abs()
        size = terms[:, :n].sum(0) if per_column else terms.sum(1)
        close_to_cpu(got, encore.partials_sum(pc, per_column=per_column, scale=scale, n=n), "float32",
                     floor=max(abs(scale) * float(size.norm()), 1e-30))
    else:
        pg, pc = _partials(rng, m, t, strided, neg_inf=0.2)  # -inf tiles: no valid column (rows of them: lse -inf)
        mx = pc.double().amax(1)  # lse = max + log(sum): fp32 errors of |max| + 1's size on CUDA, where lse may be near 0
        floor = max(float((mx[torch.isfinite(mx)].abs() + 1).norm()), 1e-30)
        if not target:
            close_to_cpu(encore.lse_finish(pg, ignore_index=ignore), encore.lse_finish(pc, ignore_index=ignore), "float32", floor=floor)
            return
        tg = rng.integers(0, 5, m)
        tg[rng.random(m) < 0.3] = ignore
        tgg, tgc = _both(tg, np.int32)
        tlg, tlc = _both(rng.standard_normal(m))
        lse_g, loss_g = encore.lse_finish(pg, tgg, tlg, ignore_index=ignore)
        lse_c, loss_c = encore.lse_finish(pc, tgc, tlc, ignore_index=ignore)
        close_to_cpu(lse_g, lse_c, "float32", floor=floor)
        close_to_cpu(loss_g, loss_c, "float32", floor=max(float(lse_c[torch.isfinite(lse_c)].norm()), floor))


def _ce_case(rng, dt, m, n, ignore):
    """(CUDA, CPU) logits [m, n] in dt, lse [m] float32 (the logits' logsumexp, moved by up to 0.1), target [m] int32."""
    lg, lc = pair(rng, (m, n), dt, 2.0)
    lse = torch.logsumexp(lc.double(), 1) + torch.from_numpy(rng.uniform(-0.1, 0.1, m))
    t = rng.integers(0, n, m)
    t[rng.random(m) < 0.25] = ignore
    return (lg, lc), _both(lse.numpy()), _both(t, np.int32)


@pytest.mark.parametrize("mode", ["new", "out", "inplace"])
@VALID
@given(seed=SEEDS, dt=st.sampled_from(["bf16", "f16", "f32"]), m=st.sampled_from([1, 2, 5, 130]), n=st.sampled_from([1, 2, 5, 8, 33, 257, 1000]),
       alpha=st.sampled_from([None, 1.0, 0.25, -2.0]), ignore=st.sampled_from([-100, -1, 1]), row_pad=st.sampled_from([0, 3, 8]))
def test_cross_entropy_bwd_cuda_equals_cpu(mode, seed, dt, m, n, alpha, ignore, row_pad):
    dt = DT[dt]
    rng = np.random.default_rng(seed)
    (lg, lc), (sg, sc), (tg, tc) = _ce_case(rng, dt, m, n, ignore)
    ag, ac = _both([alpha]) if alpha is not None else (None, None)
    ref = encore.cross_entropy_bwd(lc, sc, tc, ac, ignore_index=ignore)
    if mode == "new":
        got = encore.cross_entropy_bwd(lg, sg, tg, ag, ignore_index=ignore)
        assert got.is_cuda and got is not lg
    else:
        g = CudaGuard((m, n), dt, row_pad=row_pad)
        if mode == "out":
            got = encore.cross_entropy_bwd(lg, sg, tg, ag, ignore_index=ignore, out=g.view)
        else:  # the logits overwritten by their gradient, in a row-strided view inside the canaries
            got = encore.cross_entropy_bwd_(g.set(lg), sg, tg, ag, ignore_index=ignore)
        assert got is g.view and g.intact()
    # alpha (e^(x - lse) - 1) cancels on a target column whose e^(x - lse) is near 1 (N = 1: lse moved by <= 0.1):
    # the CUDA exponential's fp32 error scales with e^(x - lse), the floor (the non-ignored rows' softmax terms).
    e = torch.exp(lc.double() - sc.double()[:, None])
    e[tc == ignore] = 0
    close_to_cpu(got, ref, dt, floor=max((1.0 if alpha is None else abs(alpha)) * float(e.norm()), 1e-30))


def _qk_case(rng, dt, m, nq, nkv, hd, w32):
    """(CUDA, CPU) pairs of qkv [m, (nq + 2 nkv) hd] in dt, partials [m, heads] (the sums of squares of the Q and K
    heads, 0 for V), q_weight / k_weight (dt or float32), pos int32, freq (rope_freq_turns, the V heads 0)."""
    heads = nq + 2 * nkv
    xg, xc = pair(rng, (m, heads * hd), dt, 2.0)
    sq = (xc.double().view(m, heads, hd) ** 2).sum(-1)
    sq[:, nq + nkv:] = 0
    wdt = "float32" if w32 else dt
    qw, kw = pair(rng, (hd,), wdt, 0.3), pair(rng, (hd,), wdt, 0.3)
    qw, kw = (qw[0] + 1, qw[1] + 1), (kw[0] + 1, kw[1] + 1)
    freq = encore.rope_freq_turns(heads, int(rng.integers(0, nq + nkv + 1)), hd, float(rng.choice([10000.0, 500000.0])))
    return (xg, xc), _both(sq.numpy()), qw, kw, _both(rng.integers(-5000, 70000, m), np.int32), _both(freq)


@VALID
@given(seed=SEEDS, dt=st.sampled_from(["bf16", "f16", "f32"]), m=st.sampled_from([1, 2, 3, 17, 130]), nq=st.integers(1, 4), nkv=st.integers(1, 2),
       hd=st.sampled_from([2, 8, 64, 128, 256]), w32=st.booleans(), eps=st.sampled_from([0.0, 1e-6, 1e-2]), row_pad=st.sampled_from([0, 1, 8]))
def test_qk_norm_rope_cuda_equals_cpu(seed, dt, m, nq, nkv, hd, w32, eps, row_pad):
    dt = DT[dt]
    rng = np.random.default_rng(seed)
    (xg, xc), part, qw, kw, pos, freq = _qk_case(rng, dt, m, nq, nkv, hd, w32)
    g = CudaGuard(tuple(xg.shape), dt, row_pad=row_pad)
    qkv = g.set(xg)
    v_before = qkv[:, (nq + nkv) * hd:].clone()
    assert encore.qk_norm_rope_(qkv, part[0], qw[0], kw[0], pos[0], freq[0], nq, nkv, hd, eps) is qkv
    ref = encore.qk_norm_rope_(xc.clone(), part[1], qw[1], kw[1], pos[1], freq[1], nq, nkv, hd, eps)
    assert g.intact() and torch.equal(qkv[:, (nq + nkv) * hd:], v_before)  # canaries and V heads untouched
    close_to_cpu(qkv, ref, dt)


@VALID
@given(seed=SEEDS, dt=st.sampled_from(["bf16", "f16", "f32"]), m=st.sampled_from([1, 3, 17, 130]), nq=st.integers(1, 3), nkv=st.integers(1, 2),
       hd=st.sampled_from([2, 8, 64, 256]), w32=st.booleans(), eps=st.sampled_from([1e-6, 1e-2]))
def test_qk_norm_rope_backward_cuda_equals_cpu(seed, dt, m, nq, nkv, hd, w32, eps):
    dt = DT[dt]
    rng = np.random.default_rng(seed)
    (xg, xc), part, qw, kw, pos, freq = _qk_case(rng, dt, m, nq, nkv, hd, w32)
    dyg, dyc = pair(rng, tuple(xc.shape), dt)
    got = encore.qk_norm_rope_backward(dyg, xg, part[0], qw[0], kw[0], pos[0], freq[0], nq, nkv, hd, eps)
    ref = encore.qk_norm_rope_backward(dyc, xc, part[1], qw[1], kw[1], pos[1], freq[1], nq, nkv, hd, eps)
    assert got[0].is_cuda and got[0].dtype == xg.dtype and got[1].dtype == torch.float32
    close_to_cpu(got[0], ref[0], dt)
    for a, b in zip(got[1:], ref[1:]):  # dq_weight, dk_weight: fp32 sums over every row and head
        close_to_cpu(a, b, dt, STAT_TOL)


def _strided(t):
    buf = torch.zeros(2 * t.shape[0], dtype=t.dtype, device=t.device)
    buf[::2] = t
    return buf[::2]


@pytest.mark.parametrize("op", ["rms_final_reduce", "partials_sum", "lse_finish"])
@INVALID
@given(seed=SEEDS, case=st.sampled_from(["col_major", "f16", "target_cpu", "target_logit_strided", "n_big", "partials_cpu_target"]))
def test_finishers_cuda_refusals(op, seed, case):
    rng = np.random.default_rng(seed)
    m, t = int(rng.integers(2, 9)), int(rng.integers(2, 5))
    pg, _ = _partials(rng, m, t, False)
    names, extra, kw = ["partials"], {}, {}
    if op == "lse_finish" and case in ("target_cpu", "target_logit_strided", "partials_cpu_target"):
        tg, tl = _both(rng.integers(0, 5, m), np.int32), _both(rng.standard_normal(m))
        extra = {"target": tg[0], "target_logit": tl[0]}
        if case == "target_cpu":
            extra["target"], names = tg[1], ["target"]
        elif case == "target_logit_strided":
            extra["target_logit"], names = _strided(tl[0]), ["target_logit"]
        else:  # host partials with CUDA targets: the targets are refused against them
            pg, names = pg.cpu(), ["target"]
    elif op == "partials_sum" and case == "n_big":
        kw, names = {"per_column": True, "n": t + 1}, ["n"]
    elif case == "f16":
        pg = pg.half()
    else:  # column-major storage: the CUDA kernels read rows of unit stride
        pg = _both(3 * rng.standard_normal((t, m)))[0].T
    calls = {"rms_final_reduce": lambda: encore.rms_final_reduce(pg, 128), "partials_sum": lambda: encore.partials_sum(pg, **kw),
             "lse_finish": lambda: encore.lse_finish(pg, **extra)}
    refused(calls[op], names)


@pytest.mark.parametrize("inplace", [False, True])
@INVALID
@given(seed=SEEDS, dt=st.sampled_from(["bf16", "f16", "f32"]),
       case=st.sampled_from(["lse_cpu", "target_cpu", "alpha_cpu", "out_cpu", "logits_col", "target_strided", "lse_strided", "out_dtype"]))
def test_cross_entropy_bwd_cuda_refusals(inplace, seed, dt, case):
    dt = DT[dt]
    rng = np.random.default_rng(seed)
    m, n = int(rng.integers(2, 6)), int(rng.integers(2, 40))
    (lg, _), (sg, sc), (tg, tc) = _ce_case(rng, dt, m, n, -100)
    logits_guard = CudaGuard((m, n), dt, row_pad=int(rng.integers(0, 9)))
    logits = logits_guard.set(lg)
    out_guard = CudaGuard((m, n), dt)
    a = {"lse": sg, "target": tg, "alpha": _both([0.5])[0]}
    out, names = out_guard.view, [case.split("_")[0]]
    if case in ("lse_cpu", "target_cpu"):
        a[names[0]] = {"lse": sc, "target": tc}[names[0]]
    elif case == "alpha_cpu":
        a["alpha"] = a["alpha"].cpu()
    elif case == "out_cpu" and not inplace:
        out = torch.empty(m, n, dtype=getattr(torch, dt))
    elif case == "logits_col":  # column-major logits: the kernel reads unit-stride rows
        logits = pair(rng, (n, m), dt)[0].T
    elif case in ("target_strided", "lse_strided"):
        a[names[0]] = _strided(a[names[0]])
    elif case == "out_dtype" and not inplace:
        out = CudaGuard((m, n), "float64").view
    else:  # out_cpu / out_dtype in place: the target on the CPU instead
        a["target"], names = tc, ["target"]
    if inplace:
        refused(lambda: encore.cross_entropy_bwd_(logits, a["lse"], a["target"], a["alpha"]), names)
    else:
        refused(lambda: encore.cross_entropy_bwd(logits, a["lse"], a["target"], a["alpha"], out=out), names)
    assert logits_guard.untouched() and out_guard.untouched()


@pytest.mark.parametrize("bwd", [False, True])
@INVALID
@given(seed=SEEDS, dt=st.sampled_from(["bf16", "f16"]),
       case=st.sampled_from(["partials_cpu", "weights_mixed", "freq_misaligned", "pos_strided", "qkv_col", "x_cpu", "x_col", "hd_258"]))
def test_qk_norm_rope_cuda_refusals(bwd, seed, dt, case):
    dt = DT[dt]
    rng = np.random.default_rng(seed)
    m, nq, nkv, hd = int(rng.integers(2, 6)), int(rng.integers(1, 3)), 1, int(rng.choice([8, 64]))
    if case == "hd_258":
        hd = 258
    (xg, xc), part, qw, kw, pos, freq = _qk_case(rng, dt, m, nq, nkv, hd, False)
    g = CudaGuard(tuple(xg.shape), dt)
    lead = g.set(xg)  # qkv (the forward's, in place) or dy (the backward's)
    a = {"partials": part[0], "q_weight": qw[0], "k_weight": kw[0], "pos": pos[0], "freq": freq[0]}
    x, kind, names = xg.clone(), ValueError, [case.split("_")[0]]
    if case == "partials_cpu":
        a["partials"] = part[1]
    elif case == "weights_mixed":  # q_weight fp32, k_weight in qkv's dtype: one weight dtype on CUDA
        a["q_weight"], names = qw[0].float(), ["k_weight"]
    elif case == "freq_misaligned":
        buf = torch.zeros(freq[0].shape[0] + 1, dtype=torch.float32, device="cuda")
        buf[1:] = freq[0]
        a["freq"] = buf[1:]
    elif case == "pos_strided":
        a["pos"] = _strided(pos[0])
    elif case == "qkv_col" or (case in ("x_cpu", "x_col") and not bwd):  # the qkv / dy tensor column-major
        lead, g, names = pair(rng, (xc.shape[1], m), dt)[0].T, None, ["dy" if bwd else "qkv"]
    elif case == "x_cpu":
        x = xc
    elif case == "x_col":
        x = pair(rng, (xc.shape[1], m), dt)[0].T
    else:  # hd_258: past the CUDA backward's 256 columns a head (the forward takes it: the backward only)
        if not bwd:
            a["pos"], names = pos[1], ["pos"]
        else:
            kind, names = RuntimeError, ["head_dim"]
    p = a
    if bwd:
        refused(lambda: encore.qk_norm_rope_backward(lead, x, p["partials"], p["q_weight"], p["k_weight"], p["pos"], p["freq"], nq, nkv, hd),
                names, kinds=(kind,))
    else:
        refused(lambda: encore.qk_norm_rope_(lead, p["partials"], p["q_weight"], p["k_weight"], p["pos"], p["freq"], nq, nkv, hd), names,
                kinds=(kind,))
    assert g is None or g.untouched()
