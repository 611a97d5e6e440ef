"""Property-based fuzzing on CUDA (the GPU machine; skipped elsewhere): valid draws of CUDA tensors
compared with the CPU backend on the same values (the CPU backend is the reference the CUDA kernels
are tested against), outputs in canary-guarded CUDA buffers where the API takes them; invalid draws
(CPU and CUDA tensors mixed, unsupported dtypes or alignments on CUDA) refused with a ValueError naming
the argument, the canaries intact. Here: rms_norm, add_rms_norm, qk_norm_, fp8_group_quant,
moe_routing, moe_dispatch (with and without the fused FP8 quantization) and moe_combine (bit for bit),
the MXFP8 / NVFP4 quantizations (bit for bit), the row_scale / residual_add / swiglu GEMM
epilogues, kda_forward, the KDA decode step and the prefill on a state pool; every other public op in
test_fuzz_cuda_quant.py, test_fuzz_cuda_gemm.py, test_fuzz_cuda_finishers.py, test_fuzz_cuda_blocks.py
and test_fuzz_cuda_kda_moe.py (the helpers they share: fuzz_cuda_util.py).

Seeds: hypothesis with derandomize=True (fuzz_util.VALID: 200 draws, INVALID: 100 draws per test)."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import encore
from fuzz_cuda_util import DT, TOL, close_to_cpu, guarded, pair, rel
from fuzz_util import INVALID, SEEDS, VALID, torch  # noqa: F401
from helpers import needs_torch_cuda

pytestmark = needs_torch_cuda


@VALID
@given(seed=SEEDS, dt=st.sampled_from(["bf16", "f16", "f32"]), rows=st.sampled_from([1, 2, 3, 7, 16, 33, 257]),
       hidden=st.sampled_from([1, 7, 8, 64, 127, 128, 1000, 4096, 5184]), eps=st.sampled_from([1e-6, 1e-5, 0.1]),
       add=st.booleans(), pad=st.sampled_from([0, 8, 13]))
def test_norm_cuda_equals_cpu(seed, dt, rows, hidden, eps, add, pad):
    dt = DT[dt]
    rng = np.random.default_rng(seed)
    xg, xc = pair(rng, (rows, hidden + pad), dt)
    xg, xc = xg[:, :hidden], xc[:, :hidden]  # row-strided when pad > 0
    wg, wc = pair(rng, (hidden,), dt, 0.3)
    if not add:
        close_to_cpu(encore.rms_norm(xg, wg, eps=eps), encore.rms_norm(xc, wc, eps=eps), dt)
        return
    rg, rc = pair(rng, (rows, hidden), dt)
    h, check = guarded((rows, hidden), dt)
    yg, _ = encore.add_rms_norm(xg, rg, wg, eps=eps, h_out=h)
    yc, hc = encore.add_rms_norm(xc, rc, wc, eps=eps)
    close_to_cpu(yg, yc, dt)
    close_to_cpu(h, hc, dt)
    check()


@VALID
@given(seed=SEEDS, dt=st.sampled_from(["bf16", "f16"]), tokens=st.sampled_from([1, 2, 5, 64, 129]),
       heads=st.sampled_from([(1, 1), (4, 1), (8, 2), (32, 8)]), hd=st.sampled_from([64, 128, 256]))
def test_qk_norm_cuda_equals_cpu(seed, dt, tokens, heads, hd):
    dt = DT[dt]
    rng = np.random.default_rng(seed)
    hq, hkv = heads
    qg, qc = pair(rng, (tokens, (hq + 2 * hkv) * hd), dt)
    wq, wqc = pair(rng, (hd,), dt, 0.3)
    wk, wkc = pair(rng, (hd,), dt, 0.3)
    v_before = qg[:, (hq + hkv) * hd:].clone()
    encore.qk_norm_(qg, wq, wk, hq, hkv, hd)
    encore.qk_norm_(qc, wqc, wkc, hq, hkv, hd)
    close_to_cpu(qg, qc, dt)
    assert torch.equal(qg[:, (hq + hkv) * hd:], v_before)  # V heads untouched


@VALID
@given(seed=SEEDS, dt=st.sampled_from(["bf16", "f16", "f32"]), rows=st.sampled_from([1, 3, 17, 128, 300]),
       groups=st.sampled_from([1, 2, 7, 56]), col=st.booleans(), pow2=st.booleans())
def test_fp8_group_quant_cuda_equals_cpu(seed, dt, rows, groups, col, pow2):
    dt = DT[dt]
    rng = np.random.default_rng(seed)
    xg, xc = pair(rng, (rows, 128 * groups), dt, 3.0)
    qg, sg = encore.fp8_group_quant(xg, column_major_scales=col, power_of_two_scales=pow2)
    qc, sc = encore.fp8_group_quant(xc, column_major_scales=col, power_of_two_scales=pow2)
    assert torch.equal(qg.view(torch.uint8).cpu(), qc.view(torch.uint8)), "e4m3 codes differ from the CPU backend"
    assert torch.equal(sg.cpu(), sc)


@VALID
@given(seed=SEEDS, dt=st.sampled_from(["bf16", "f16", "f32"]), rows=st.sampled_from([1, 5, 128, 130]),
       blocks=st.sampled_from([1, 3, 8, 224]), swizzled=st.booleans(), fmt=st.sampled_from(["mxfp8", "nvfp4"]))
def test_mx_quant_cuda_equals_cpu(seed, dt, rows, blocks, swizzled, fmt):
    dt = DT[dt]
    rng = np.random.default_rng(seed)
    xg, xc = pair(rng, (rows, 32 * blocks), dt, 3.0)
    as_bytes = lambda t: t.view(torch.uint8) if t.dtype != torch.uint8 else t  # noqa: E731
    if fmt == "mxfp8":
        outs_g, outs_c = encore.mxfp8_quant(xg, swizzled=swizzled), encore.mxfp8_quant(xc, swizzled=swizzled)
    else:
        outs_g, outs_c = encore.nvfp4_quant(xg, swizzled=swizzled), encore.nvfp4_quant(xc, swizzled=swizzled)
    for g, c in zip(outs_g, outs_c):
        assert torch.equal(as_bytes(g).cpu(), as_bytes(c)), f"{fmt}: differs from the CPU backend"


@VALID
@given(seed=SEEDS, tokens=st.sampled_from([1, 2, 7, 64, 333]), experts=st.sampled_from([8, 64, 128, 256]),
       k=st.sampled_from([1, 2, 4, 8]), scoring=st.sampled_from(["softmax", "sigmoid"]), renorm=st.booleans())
def test_moe_routing_cuda_equals_cpu(seed, tokens, experts, k, scoring, renorm):
    rng = np.random.default_rng(seed)
    lg, lc = pair(rng, (tokens, experts), "float32")
    ig, wg = encore.moe_routing(lg, k, scoring=scoring, renormalize=renorm)
    ic, wc = encore.moe_routing(lc, k, scoring=scoring, renormalize=renorm)
    assert torch.equal(ig.cpu(), ic), "top-k ids differ from the CPU backend"
    close_to_cpu(wg, wc, "float32")


@VALID
@given(seed=SEEDS, dt=st.sampled_from(["bf16", "f16"]), m=st.sampled_from([1, 3, 64, 129, 1000]),
       n=st.sampled_from([8, 64, 136, 512]), k=st.sampled_from([8, 64, 200, 1024]), row=st.sampled_from(["row_scale", "residual_add", "swiglu"]))
def test_gemm_epilogue_cuda_equals_cpu(seed, dt, m, n, k, row):
    dt = DT[dt]
    rng = np.random.default_rng(seed)
    ag, ac = pair(rng, (m, k), dt)
    wg, wc = pair(rng, (n, k), dt, k ** -0.5)
    if row == "row_scale":
        rc = torch.from_numpy(0.5 + rng.random(m)).float()
        close_to_cpu(encore.gemm_row_scale(ag, wg, rc.cuda()), encore.gemm_row_scale(ac, wc, rc), dt)
    elif row == "residual_add":
        cg, cc = pair(rng, (m, n), dt)
        close_to_cpu(encore.gemm_epilogue("residual_add", ag, wg, c=cg)["d"], encore.gemm_epilogue("residual_add", ac, wc, c=cc)["d"], dt)
    else:
        zg, yg = encore.gemm_swiglu(ag, wg)
        zc, yc = encore.gemm_swiglu(ac, wc)
        close_to_cpu(zg, zc, dt)
        close_to_cpu(yg, yc, dt)


@VALID
@given(seed=SEEDS, lens=st.sampled_from([(1,), (63,), (64, 65), (0, 130), (200, 0, 37)]), h=st.sampled_from([1, 2]),
       kv=st.sampled_from([(64, 64), (128, 128), (48, 40)]), gate=st.booleans(), l2=st.booleans(), h0=st.booleans())
def test_kda_forward_cuda_equals_cpu(seed, lens, h, kv, gate, l2, h0):
    rng = np.random.default_rng(seed)
    kd, vd = kv
    t = sum(lens)
    if t == 0:
        return
    cu = torch.tensor(np.cumsum((0,) + lens), dtype=torch.int64)
    n = len(lens)
    q, qc = pair(rng, (1, t, h, kd), "bfloat16")
    k, kc = pair(rng, (1, t, h, kd), "bfloat16", 1.0 if l2 else 0.1)
    v, vc = pair(rng, (1, t, h, vd), "bfloat16")
    graw = rng.standard_normal((1, t, h, kd))
    gc = torch.from_numpy(graw if gate else -np.abs(graw) / 4).float()
    bc = torch.from_numpy(rng.random((1, t, h))).to(torch.bfloat16)
    extra = dict(use_gate_in_kernel=gate, use_qk_l2norm=l2, cu_seqlens=cu, output_final_state=True)
    if gate:
        extra["A_log"] = torch.from_numpy(0.3 * rng.standard_normal(h)).float()
    if h0:
        extra["initial_state"] = torch.from_numpy(0.1 * rng.standard_normal((n, h, kd, vd))).float()
    cuda_extra = {key: (val.cuda() if torch.is_tensor(val) and key != "cu_seqlens" else val) for key, val in extra.items()}
    og, fg = encore.kda_forward(q, k, v, gc.cuda(), bc.cuda(), **cuda_extra)
    oc, fc = encore.kda_forward(qc.double(), kc.double(), vc.double(), gc.double(), bc.double(),
                                **{key: (val.double() if torch.is_tensor(val) and val.is_floating_point() else val) for key, val in extra.items()})
    if not l2:
        close_to_cpu(og, oc.to(torch.bfloat16), "bfloat16")
        close_to_cpu(fg, fc.float(), "bfloat16")  # fp32 states from bf16 inputs: the inputs' precision
        return
    # With the L2 norm the kernel's products take the normalized q, k in bf16: on short sequences q.k
    # cancels, and that rounding alone moves o by more than 1e-2 (one token: 2^-9 |q||k| / |q.k|). The
    # bound is then the error of the fp64 CPU backend fed the normalized q, k rounded to bf16, doubled,
    # plus bf16's 1e-2.
    def unit(x):
        return torch.nn.functional.normalize(x.double(), dim=-1).to(torch.bfloat16).double()
    plain = {key: val for key, val in extra.items() if key != "use_qk_l2norm"}
    orr, frr = encore.kda_forward(unit(qc), unit(kc), vc.double(), gc.double(), bc.double(),
                                  **{key: (val.double() if torch.is_tensor(val) and val.is_floating_point() else val) for key, val in plain.items()})
    for got, ref, rounded in ((og, oc, orr), (fg, fc, frr)):
        err = rel(got, ref)
        assert err <= 2 * rel(rounded, ref) + TOL["bfloat16"], (err, rel(rounded, ref))


def _serving_case(rng, n, t, h, hv, kd, vd, gate, l2, sig, pool, s_cols, two_d=False):
    """Inputs of one serving call as (CUDA, CPU float64) pairs from the same bf16 values, a pool of `pool`
    dtype with slots for every index and three more, and indices [N] or (two_d) [N, S] (20% -1)."""
    bf = "bfloat16"
    q, qc = pair(rng, (n, t, h, kd), bf)
    k, kc = pair(rng, (n, t, h, kd), bf, 1.0 if l2 else 0.1)
    v, vc = pair(rng, (n, t, hv, vd), bf)
    graw = rng.standard_normal((n, t, hv, kd))
    g, gc = pair(rng, (n, t, hv, kd), bf) if gate else (None, None)
    if not gate:
        gc = torch.from_numpy(-np.abs(graw) / 4).to(torch.bfloat16)
        g = gc.cuda()
    bc = torch.from_numpy(rng.standard_normal((n, t, hv)) if sig else rng.random((n, t, hv))).to(torch.bfloat16)
    kw = dict(use_qk_l2norm_in_kernel=l2, use_gate_in_kernel=gate, use_beta_sigmoid_in_kernel=sig)
    if gate:
        kw["A_log"] = torch.from_numpy(0.3 * rng.standard_normal(hv)).float()
        kw["dt_bias"] = torch.from_numpy(0.3 * rng.standard_normal(hv * kd)).float()
    slots = n * s_cols + 3
    idx = rng.permutation(slots)[:n * s_cols].reshape((n, s_cols) if two_d else (n,))
    idx[rng.random(idx.shape) < 0.2] = -1
    pool_c = torch.from_numpy(0.5 * rng.standard_normal((slots, hv, kd, vd))).to(getattr(torch, pool))
    gpu = (q, k, v, g, bc.cuda())
    cpu = tuple(x.double() for x in (qc, kc, vc, gc, bc))
    return gpu, cpu, kw, idx, pool_c


def _pool_checks(pool_g, pool_c, before, touched, pool, fp32_tol=1e-3):
    """Written slots: the CUDA pool against the CPU backend's (each in the pool's dtype; fp32_tol for an fp32
    pool); every other slot bit-identical to its value before the call."""
    touched = sorted(touched)
    if touched:
        err = rel(pool_g[touched], pool_c[touched])
        assert err <= (1e-2 if pool == "bfloat16" else fp32_tol), err
    rest = sorted(set(range(before.shape[0])) - set(touched))
    assert torch.equal(pool_g[rest].cpu(), before[rest])


@VALID
@given(seed=SEEDS, n=st.sampled_from([1, 3, 8, 33]), t=st.sampled_from([1, 2, 4]), h=st.sampled_from([1, 2]), group=st.sampled_from([1, 2]),
       kv=st.sampled_from([(128, 128), (64, 64), (37, 50)]), spec=st.booleans(), nat=st.booleans(),
       pool=st.sampled_from(["float32", "bfloat16"]), gate=st.booleans(), l2=st.booleans(), sig=st.booleans())
def test_kda_decode_on_the_pool_cuda_equals_cpu(seed, n, t, h, group, kv, spec, nat, pool, gate, l2, sig):
    """fused_recurrent_kda_fwd on a state pool (the CUDA decode kernel) against the CPU backend on the
    same values: o, the written slots, every other slot bit-identical."""
    from encore.kda import fused_recurrent_kda_fwd

    rng = np.random.default_rng(seed)
    kd, vd = kv
    hv, s_cols = h * group, (t if spec else 1)
    gpu, cpu, kw, idx, pool_c = _serving_case(rng, n, t, h, hv, kd, vd, gate, l2, sig, pool, s_cols, two_d=spec)
    before = pool_c.clone()
    nat_v = torch.from_numpy(rng.integers(1, s_cols + 1, n)).int() if spec and nat else None
    idx_t = torch.from_numpy(idx).int()
    cuda_kw = {key: (val.cuda() if torch.is_tensor(val) else val) for key, val in kw.items()}
    pool_g = pool_c.cuda()
    og, _ = fused_recurrent_kda_fwd(*gpu, initial_state=pool_g, ssm_state_indices=idx_t.cuda(),
                                    num_accepted_tokens=None if nat_v is None else nat_v.cuda(), **cuda_kw)
    oc, _ = fused_recurrent_kda_fwd(*cpu, initial_state=pool_c, ssm_state_indices=idx_t, num_accepted_tokens=nat_v,
                                    **{key: (val.double() if torch.is_tensor(val) else val) for key, val in kw.items()})
    torch.cuda.synchronize()
    close_to_cpu(og, oc.to(torch.bfloat16), "bfloat16")
    if spec:
        starts = [int(idx[i, (int(nat_v[i]) - 1) if nat_v is not None else 0]) for i in range(n)]
        touched = {int(idx[i, c]) for i in range(n) if starts[i] >= 0 for c in range(t) if idx[i, c] >= 0}
    else:
        touched = {int(s) for s in idx if s >= 0}
    _pool_checks(pool_g.cpu(), pool_c, before, touched, pool)


@VALID
@given(seed=SEEDS, lens=st.sampled_from([(1,), (63,), (64, 65), (0, 130), (200, 0, 37), (5, 5, 5, 5, 5)]), h=st.sampled_from([1, 2]),
       group=st.sampled_from([1, 2]), kv=st.sampled_from([(128, 128), (64, 64), (48, 40)]), pool=st.sampled_from(["float32", "bfloat16"]),
       gate=st.booleans())
def test_kda_prefill_on_the_pool_cuda_equals_cpu(seed, lens, h, group, kv, pool, gate):
    """chunk_kda(ssm_state_indices=) (the CUDA forward reading and writing pool slots) against the CPU
    backend on the same values; no L2 norm (its bf16 rounding of the normalized q, k on CUDA has its own
    bound in test_kda_forward_cuda_equals_cpu)."""
    from encore.kda import chunk_kda

    rng = np.random.default_rng(seed)
    kd, vd = kv
    hv, t, n = h * group, sum(lens), len(lens)
    gpu, cpu, kw, idx, pool_c = _serving_case(rng, 1, t, h, hv, kd, vd, gate, False, False, pool, 1)
    idx = rng.permutation(n + 3)[:n]
    idx[rng.random(n) < 0.2] = -1
    pool_c = torch.from_numpy(0.5 * rng.standard_normal((n + 3, hv, kd, vd))).to(getattr(torch, pool))
    before = pool_c.clone()
    cu = torch.tensor(np.cumsum((0,) + lens), dtype=torch.int64)
    idx_t = torch.from_numpy(idx).long()
    kw.pop("use_beta_sigmoid_in_kernel")
    cuda_kw = {key: (val.cuda() if torch.is_tensor(val) else val) for key, val in kw.items()}
    pool_g = pool_c.cuda()
    with torch.no_grad():
        og, _ = chunk_kda(*gpu, initial_state=pool_g, ssm_state_indices=idx_t.cuda(), cu_seqlens=cu, **cuda_kw)
        oc, _ = chunk_kda(*cpu, initial_state=pool_c, ssm_state_indices=idx_t, cu_seqlens=cu,
                          **{key: (val.double() if torch.is_tensor(val) else val) for key, val in kw.items()})
    torch.cuda.synchronize()
    close_to_cpu(og, oc.to(torch.bfloat16), "bfloat16")
    touched = {int(idx[i]) for i in range(n) if idx[i] >= 0 and lens[i] > 0}
    _pool_checks(pool_g.cpu(), pool_c, before, touched, pool, fp32_tol=5e-3)  # the chunked forward's bf16 products


@VALID
@given(seed=SEEDS, tokens=st.sampled_from([1, 3, 64, 257]), experts=st.sampled_from([4, 16, 128]), k=st.sampled_from([1, 2, 8]),
       align=st.sampled_from([1, 8, 128]), fp8=st.booleans(), dim=st.sampled_from([128, 256, 1024]))
def test_moe_dispatch_combine_cuda_equals_cpu(seed, tokens, experts, k, align, fp8, dim):
    rng = np.random.default_rng(seed)
    k = min(k, experts)
    ids = torch.from_numpy(np.stack([rng.choice(experts, k, replace=False) for _ in range(tokens)]).astype(np.int32))
    xg, xc = pair(rng, (tokens, dim), "bfloat16")
    dg = encore.moe_dispatch(ids.cuda(), experts, xg, align_m=align, fp8=fp8)
    dc = encore.moe_dispatch(ids, experts, xc, align_m=align, fp8=fp8)
    end = int(dc["expert_offsets"][-1])  # rows past the last expert's block are unspecified
    for key in dc:
        g, c = dg[key].cpu(), dc[key]
        if key in ("row_slots", "x_permuted", "x_scales"):
            g, c = g[:end], c[:end]
        g = g.view(torch.uint8) if g.dtype == torch.float8_e4m3fn else g
        c = c.view(torch.uint8) if c.dtype == torch.float8_e4m3fn else c
        assert torch.equal(g, c), key
    weights = torch.from_numpy(rng.random((tokens, k))).float()
    yg, yc = pair(rng, (int(dc["row_slots"].shape[0]), dim), "bfloat16")
    og = encore.moe_combine(yg, dg["slot_rows"], weights.cuda())
    oc = encore.moe_combine(yc, dc["slot_rows"], weights)
    assert torch.equal(og.cpu(), oc), "combine differs from the CPU backend (both sum in fp32 in slot order)"


@INVALID
@given(seed=SEEDS, case=st.sampled_from(["weight_cpu", "residual_cpu", "h_out_cpu", "qk_weight_cpu", "qk_f32", "quant_k", "routing_cpu_bias"]))
def test_cuda_mixes_and_limits_refused(seed, case):
    rng = np.random.default_rng(seed)
    x, _ = pair(rng, (4, 128), "bfloat16")
    w, wc = pair(rng, (128,), "bfloat16")
    if case == "weight_cpu":
        call, name = (lambda: encore.rms_norm(x, wc)), "weight"
    elif case == "residual_cpu":
        call, name = (lambda: encore.add_rms_norm(x, x.cpu(), w)), "residual"
    elif case == "h_out_cpu":
        call, name = (lambda: encore.add_rms_norm(x, x.clone(), w, h_out=torch.empty(4, 128, dtype=torch.bfloat16))), "h"
    elif case == "qk_weight_cpu":
        q, _ = pair(rng, (2, 3 * 64), "bfloat16")
        call, name = (lambda: encore.qk_norm_(q, wc[:64], w[:64], 1, 1, 64)), "q_weight"
    elif case == "qk_f32":
        q, _ = pair(rng, (2, 3 * 64), "float32")
        call, name = (lambda: encore.qk_norm_(q, w[:64].float(), w[:64].float(), 1, 1, 64)), "qkv"
    elif case == "quant_k":
        xq, _ = pair(rng, (3, 100), "bfloat16")
        call, name = (lambda: encore.fp8_group_quant(xq)), "x"
    else:
        lg, _ = pair(rng, (5, 8), "float32")
        call, name = (lambda: encore.moe_routing(lg, 2, correction_bias=torch.zeros(8))), "correction_bias"
    with pytest.raises(ValueError, match=name):
        call()
