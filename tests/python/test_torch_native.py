"""encore._encore_torch's C++ kernels against the Python kernels they replace (CPU backend): for each op with a
C++ kernel, the same arguments through both give the same outputs (shapes, strides, dtypes, bits) or the same
exception (type and message), valid and invalid arguments alike; and the public functions take the C++ kernel
for plain eager tensors."""
import math

import pytest

torch = pytest.importorskip("torch")

import encore  # noqa: E402
from encore import _core, _kda_args, gemm, kda, norm  # noqa: E402
from helpers import dispatch_recorder  # noqa: E402

encore.register_torch_ops()
if "gemm_row_scale" not in _core.NATIVE:
    pytest.skip("encore._encore_torch not built (or built for another torch)", allow_module_level=True)

F32, BF16 = torch.float32, torch.bfloat16


def randn(*shape, scale=1.0, dt=F32, seed=[0]):
    seed[0] += 1
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed[0])) * scale).to(dt)


def outcome(fn, args, mutated):
    """(outputs, the mutated arguments after the call) or the exception's (type, message)."""
    args = [a.clone() if i in mutated and a is not None else a for i, a in enumerate(args)]
    try:
        got = fn(*args)
    except Exception as e:  # noqa: BLE001 (compared below)
        return type(e).__name__, str(e)
    if got is None:
        got = []
    elif isinstance(got, torch.Tensor):
        got = [got]
    return list(got) + [args[i] for i in mutated]


def same(want, got, type_only=False):
    if isinstance(want, tuple):  # an exception
        return want == got or (type_only and isinstance(got, tuple) and want[0] == got[0])
    if isinstance(got, tuple) or len(want) != len(got):
        return False
    for x, y in zip(want, got):
        if x is None or y is None:
            if x is not y:
                return False
            continue
        if (x.shape, x.stride(), x.dtype, x.device) != (y.shape, y.stride(), y.dtype, y.device):
            return False
        if not torch.equal(torch.nan_to_num(x, 7.0), torch.nan_to_num(y, 7.0)):
            return False
    return True


def check(name, kernel, cases, mutated=(), type_only=()):
    """Each case's arguments through the C++ op and through the Python kernel: the same outcome (for the
    cases `type_only`, an int argument outside C++ int's range, the same exception type: nanobind's message
    names no argument, the C++ kernel's does)."""
    op = getattr(torch.ops.encore, name).default
    assert name in _core.NATIVE
    bad = []
    for i, args in enumerate(cases):
        want, got = outcome(kernel, args, mutated), outcome(op, args, mutated)
        if not same(want, got, i in type_only):
            bad.append(f"case {i}: python {want if isinstance(want, tuple) else 'ok'}, C++ {got if isinstance(got, tuple) else 'ok'}")
    assert not bad, f"{name}:\n" + "\n".join(bad)


M, K, N = 37, 24, 48


def test_gemm_ops_match_python_kernels():
    a, w, r = randn(M, K), randn(N, K, scale=K ** -0.5), randn(M, scale=0.1) + 1
    a16 = a.to(torch.float16)
    vec = randn(M)
    check("gemm_row_scale", gemm._gemm_row_scale,
          [(a, w, r, "auto"), (a, w, r, "pingpong_128x128"), (a, w, r, "bogus"), (a[0], w, r, "auto"), (a, w, r.double(), "auto"),
           (a, w, r.to(torch.int8), "auto"), (a, w, r[:5], "auto"), (a16, w.half(), r, "auto"), (a.bool(), w, r, "auto")])
    check("gemm_scalar_scale", gemm._gemm_scalar_scale, [(a, w, torch.tensor([-1.5]), "auto"), (a, w, torch.tensor([1.0, 2.0]), "auto")])
    res, gamma = randn(M, N), randn(N)
    check("gemm_residual_rms_partial", gemm._gemm_residual_rms_partial,
          [(a, w, res, gamma, 0), (a, w, res, gamma, 16), (a, w, res, gamma, 20), (a, w, res, gamma, -1), (a, w, res[:3], gamma, 0),
           (a, w, res, gamma, 2 ** 40), (a, w, res, gamma, 2 ** 63 - 1)], type_only=(5, 6))
    check("rms_final_reduce", gemm._rms_final_reduce, [(randn(M, 4).abs(), N, 1e-6), (randn(M), N, 1e-6), (randn(M, 4).double(), N, 0.1)])
    check("gemm_swiglu", gemm._gemm_swiglu, [(a, w, None, "auto"), (a, w, r, "auto"), (a, w[:7], r, "auto"), (a, w, None, "x")])
    pos = torch.arange(M, dtype=torch.int32) * 3
    freq = torch.from_numpy(encore.rope_freq_turns(3, 2, 16, 10000.0))
    check("gemm_rope", gemm._gemm_rope, [(a, w, pos, freq, r, "auto"), (a, w, pos, freq, None, "auto"), (a, w, pos.long(), freq, None, "auto")])
    check("gemm_qkv_head_sqsum", gemm._gemm_qkv_head_sqsum, [(a, w, 16), (a, w, 0), (a, w, -3), (a, w, 7), (a, w.t(), 16)])
    target = torch.randint(0, N, (M,), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    target[3] = -100
    check("gemm_lse", gemm._gemm_lse,
          [(a, w, r, target, True, -100, 0), (a, w, None, None, False, -100, 0), (a, w[:N - 3], None, None, True, -100, 0),
           (a, w, None, target, False, 5, 16), (a, w, None, target.long(), False, -100, 0), (a, w, None, None, False, -100, -2),
           (a, w, None, None, False, -100, 2 ** 63 - 1)], type_only=(6,))
    parts, _, tl = gemm.gemm_lse(a, w, target=target)
    check("lse_finish", gemm._lse_finish,
          [(parts, target, tl, -100), (parts, None, None, -100), (parts, target, None, -100), (parts[0], None, None, -100),
           (parts, target, tl, 2 ** 33)], type_only=(4,))
    check("partials_sum", gemm._partials_sum,
          [(randn(M, 4), False, 0.5, 4), (randn(3, 256), True, 1.0, 200), (randn(3, 256), True, 1.0, 0), (randn(3, 256), True, 1.0, 257),
           (randn(3, 256), False, 1.0, -5), (randn(256), False, 1.0, 1)])
    _, logits, _ = gemm.gemm_lse(a, w, store_logits=True)
    lse = gemm.lse_finish(parts)
    ce = [(logits, lse, target, torch.tensor([0.5]), -100), (logits, lse, target, None, -100), (logits, lse, target.long(), None, -100),
          (logits.t(), lse, target, None, -100), (logits[0], lse, target, None, -100), (logits, lse[:4], target, None, -100)]
    check("cross_entropy_bwd", gemm._cross_entropy_bwd, ce)
    check("cross_entropy_bwd_", gemm._cross_entropy_bwd_inplace, ce, mutated=(0,))
    hd, heads = 16, N // 16
    qkv, hparts = gemm.gemm_qkv_head_sqsum(a, w, head_dim=hd)
    qw, kw = randn(hd, scale=0.1) + 1, randn(hd, scale=0.1) + 1
    f2 = torch.from_numpy(encore.rope_freq_turns(heads, 2, hd, 10000.0))
    check("qk_norm_rope_", gemm._qk_norm_rope,
          [(qkv, hparts, qw, kw, pos, f2, 1, 1, hd, 1e-6), (qkv, hparts, qw, kw, pos, f2, 2, 1, hd, 1e-6),
           (qkv, hparts, qw, kw, pos, f2, 1, 1, 2 ** 31, 1e-6)], mutated=(0,), type_only=(2,))
    check("qk_norm_rope_backward", gemm._qk_norm_rope_backward,
          [(randn(M, N), qkv, hparts, qw, kw, pos, f2, 1, 1, hd, 1e-6), (randn(M, N), qkv, hparts, qw, kw, pos, f2, 1, 1, -4, 1e-6),
           (randn(M * N), qkv, hparts, qw, kw, pos, f2, 1, 1, hd, 1e-6), (randn(M, N), qkv, hparts, qw, kw, pos, f2, 5, 1, hd, 1e-6)])
    del vec


def test_gemm_epilogue_matches_python_kernel():
    a, w, r = randn(M, K), randn(N, K, scale=K ** -0.5), randn(M, scale=0.1) + 1
    wkn = randn(K, N, scale=K ** -0.5)
    target = torch.randint(0, N, (M,), generator=torch.Generator().manual_seed(4), dtype=torch.int32)
    lse = gemm.lse_finish(gemm.gemm_lse(a, w)[0])
    pos = torch.arange(M, dtype=torch.int32)
    freq = torch.from_numpy(encore.rope_freq_turns(3, 3, 16, 10000.0))

    def row(name, a_=a, w_=w, c=None, gamma=None, rs=None, pos_=None, freq_=None, alpha=None, target_=None, store_d=True, ptn=0, hd=128,
            ii=-100, tile="auto", c2=None, zdz=None, lse_=None):
        return (name, a_, w_, c, gamma, rs, pos_, freq_, alpha, target_, store_d, ptn, hd, ii, tile, c2, zdz, lse_)

    cases = [row("residual_add", c=randn(M, N)), row("residual_sqsum_aux", c=randn(M, N), gamma=randn(N), ptn=16),
             row("row_scale", rs=r), row("swiglu", rs=r), row("rope", pos_=pos, freq_=freq), row("qkv_head_sqsum", hd=16),
             row("qkv_head_sqsum", hd=0), row("lse", rs=r, target_=target), row("lse", store_d=False),
             row("scalar_scale", alpha=torch.tensor([2.0])), row("swiglu_bwd", w_=wkn, c=randn(M, 2 * N)),
             row("rmsnorm_bwd", w_=wkn, c=randn(M, N), gamma=randn(N), rs=r, c2=randn(M, N), zdz=randn(M)),
             row("rope_bwd", pos_=pos, freq_=freq), row("dgrad", w_=wkn), row("wgrad", a_=randn(K, M), w_=wkn),
             row("ce_bwd", rs=r, alpha=torch.tensor([0.5]), target_=target, lse_=lse), row("ce_bwd", w_=w[:N - 3], target_=target.clamp(max=N - 4),
                                                                                              lse_=lse),
             row("nope"), row("row_scale"), row("row_scale", rs=r, tile="nope"), row("residual_sqsum_aux", c=randn(M, N), gamma=randn(N),
                                                                                    ptn=-1),
             row("row_scale", a_=a[0], rs=r), row("swiglu_bwd", a_=a[0], w_=wkn)]
    check("gemm_epilogue", gemm._gemm_epilogue, cases)


def test_norm_ops_refuse_ints_past_cpp_int():
    """qk_norm_'s head counts and head_dim past C++ int: TypeError as from the launcher (the C++ kernel truncated
    them: 2**32 + 1 Q heads ran as 1)."""
    hd = 64
    qkv, qw = randn(3, 3 * hd, dt=BF16), randn(hd, dt=BF16) + 1
    check("qk_norm_", norm._qk_norm,
          [(qkv, qw, qw, 1, 1, hd, 1e-6, 0.0), (qkv, qw, qw, 2 ** 32 + 1, 1, hd, 1e-6, 0.0), (qkv, qw, qw, 1, 2 ** 32 + 1, hd, 1e-6, 0.0),
           (qkv, qw, qw, 1, 1, 2 ** 32 + hd, 1e-6, 0.0), (qkv, qw, qw, 1, 1, -hd, 1e-6, 0.0), (qkv[0], qw, qw, 1, 1, hd, 1e-6, 0.0)],
          mutated=(0,), type_only=(1, 2, 3))


def _native_cases():
    """(op name, arguments, indices of the tensor arguments) of valid CPU calls of every C++ op."""
    a, w, r = randn(M, K), randn(N, K, scale=K ** -0.5), randn(M, scale=0.1) + 1
    pos = torch.arange(M, dtype=torch.int32)
    freq = torch.from_numpy(encore.rope_freq_turns(3, 3, 16, 10000.0))
    target = torch.randint(0, N, (M,), generator=torch.Generator().manual_seed(5), dtype=torch.int32)
    parts, logits, tl = gemm.gemm_lse(a, w, store_logits=True, target=target)
    lse = gemm.lse_finish(parts)
    hd, heads = 16, N // 16
    qkv, hparts = gemm.gemm_qkv_head_sqsum(a, w, head_dim=hd)
    qw = randn(hd, scale=0.1) + 1
    f2 = torch.from_numpy(encore.rope_freq_turns(heads, 2, hd, 10000.0))
    x, nw = randn(4, N), randn(N)
    q, k, v, g, beta = kda_inputs(t=70)
    return [("gemm_row_scale", (a, w, r, "auto"), (0, 1, 2)), ("gemm_scalar_scale", (a, w, torch.tensor([2.0]), "auto"), (0, 1, 2)),
            ("gemm_residual_rms_partial", (a, w, randn(M, N), randn(N), 0), (0, 1, 2, 3)), ("gemm_swiglu", (a, w, r, "auto"), (0, 1, 2)),
            ("gemm_rope", (a, w, pos, freq, r, "auto"), (0, 1, 2, 3, 4)), ("gemm_qkv_head_sqsum", (a, w, hd), (0, 1)),
            ("gemm_lse", (a, w, r, target, True, -100, 0), (0, 1, 2, 3)),
            ("gemm_epilogue", ("rmsnorm_bwd", a, randn(K, N), randn(M, N), randn(N), r, None, None, None, None, True, 0, 128, -100, "auto",
                               randn(M, N), randn(M), None), (1, 2, 3, 4, 5, 15, 16)),
            ("rms_final_reduce", (parts.abs(), N, 1e-6), (0,)), ("lse_finish", (parts, target, tl, -100), (0, 1, 2)),
            ("partials_sum", (randn(3, 16), True, 1.0, 10), (0,)),
            ("cross_entropy_bwd", (logits, lse, target, torch.tensor([0.5]), -100), (0, 1, 2, 3)),
            ("cross_entropy_bwd_", (logits.clone(), lse, target, torch.tensor([0.5]), -100), (0, 1, 2, 3)),
            ("qk_norm_rope_", (qkv.clone(), hparts, qw, qw, pos, f2, 1, 1, hd, 1e-6), (0, 1, 2, 3, 4, 5)),
            ("qk_norm_rope_backward", (randn(M, N), qkv, hparts, qw, qw, pos, f2, 1, 1, hd, 1e-6), (0, 1, 2, 3, 4, 5, 6)),
            ("rms_norm", (x, nw, 1e-6, 0.0), (0, 1)), ("add_rms_norm", (x, randn(4, N), nw, 1e-6, 0.0), (0, 1, 2)),
            ("add_rms_norm_", (x, randn(4, N), nw, 1e-6, 0.0), (0, 1, 2)),
            ("add_rms_norm_out", (x, randn(4, N), nw, 1e-6, 0.0, torch.empty(4, N)), (0, 1, 2, 5)),
            ("qk_norm_", (randn(3, 3 * 64, dt=BF16), randn(64, dt=BF16), randn(64, dt=BF16), 1, 1, 64, 1e-6, 0.0), (0, 1, 2)),
            ("kda_forward", (q, k, v, g, beta, 1 | 32 | 256), (0, 1, 2, 3, 4)),
            ("kda_forward_out", (q, k, v, g, beta, 0, None, None, None, None, None, None, torch.empty_like(v), None, None),
             (0, 1, 2, 3, 4, 12))]


def _variants(t):
    """t made invalid in the ways the fuzzers draw (dtype, dimensions, empty, column stride, expanded)."""
    out = [t.double(), t.long(), t.to(torch.int32), t.bool(), t.reshape(-1)[0].clone(), t.reshape(-1).clone(),
           t.reshape((1,) + tuple(t.shape)).clone(), t.new_empty((0,) + tuple(t.shape[1:])), torch.cat([t, t[:1]], 0),
           torch.repeat_interleave(t, 2, dim=-1)[..., ::2], t.reshape(-1)[:1].expand(t.shape)]
    return out + [t.reshape(1, -1).clone()] if t.dim() != 2 else out


def test_native_ops_refuse_invalid_tensors():
    """Each C++ op with each tensor argument made invalid in one way: a ValueError or TypeError (or, for a mutation
    the launcher takes as well, a result), never a crash or another exception (the process would die on a crash:
    the fuzzers' refusal draws reach these kernels only through the public functions)."""
    bad = []
    for name, args, tensors in _native_cases():
        op = getattr(torch.ops.encore, name).default
        op(*[x.clone() if isinstance(x, torch.Tensor) and name.endswith("_") else x for x in args])  # the unmutated call is valid
        for i in tensors:
            for j, t in enumerate(_variants(args[i])):
                call = [x.clone() if isinstance(x, torch.Tensor) and name.endswith("_") else x for x in args]
                call[i] = t
                try:
                    op(*call)
                except (ValueError, TypeError):
                    pass
                except Exception as e:  # noqa: BLE001 (collected below)
                    bad.append(f"{name} argument {i} variant {j}: {type(e).__name__}: {str(e)[:120]}")
    assert not bad, "\n".join(bad)


@pytest.mark.skipif(not torch.cuda.is_available() or not encore.built_with_cuda(), reason="needs CUDA")
def test_native_ops_refuse_mixed_devices():
    """One tensor argument of a valid call on the other device (CUDA among CPU tensors, or the CPU one among
    CUDA tensors): ValueError naming the devices (encore's run checks every operand's device before it reads or
    launches anything), never a crash."""
    bad = []
    for name, args, tensors in _native_cases():
        op = getattr(torch.ops.encore, name).default
        for i in tensors if len(tensors) > 1 else ():  # (one tensor argument: nothing to mix)
            for where in ("cuda", "cpu"):
                call = [x.clone() if isinstance(x, torch.Tensor) and name.endswith("_") else x for x in args]
                if where == "cpu":  # all on CUDA but argument i
                    call = [x.cuda() if isinstance(x, torch.Tensor) else x for x in call]
                call[i] = call[i].to(where)
                try:
                    op(*call)
                    bad.append(f"{name} argument {i} on {where}: accepted")
                except ValueError as e:
                    if "cpu" not in str(e) and "device" not in str(e):
                        bad.append(f"{name} argument {i} on {where}: {e}")
                except Exception as e:  # noqa: BLE001 (collected below)
                    bad.append(f"{name} argument {i} on {where}: {type(e).__name__}: {str(e)[:120]}")
    assert not bad, "\n".join(bad)


def kda_inputs(b=1, t=100, h=2, kd=8, vd=6, dt=F32):
    beta = (torch.rand(b, t, h, generator=torch.Generator().manual_seed(2)) * 0.8 + 0.1).to(dt)
    return randn(b, t, h, kd, dt=dt), randn(b, t, h, kd, scale=0.1, dt=dt), randn(b, t, h, vd, dt=dt), -0.1 * randn(b, t, h, kd, dt=dt).abs(), beta


def test_kda_forward_matches_python_kernel():
    q, k, v, g, beta = kda_inputs()
    cu = torch.tensor([0, 30, 100], dtype=torch.int64)
    h0 = randn(2, 2, 8, 6, scale=0.1)
    A_log, dt_bias = randn(2), randn(16, scale=0.1)

    def call(final=True, cu_=None, res=(), rdt=None, scale=None, h0_=None, l2=False, gate=False, A=None, dtb=None, lb=None, ins=None,
             vf=False, flags=None):
        word = _kda_args._op_flags(final, l2, gate, vf, rdt, res) if flags is None else flags
        return (*(ins or (q, k, v, g, beta)), word, h0_, A, dtb, cu_, scale, lb)

    h0t = h0.transpose(2, 3).contiguous()  # state_v_first: [N, HV, V, K]

    cases = [call(), call(final=False), call(res=("G", "Aqk", "Akk", "h")), call(res=("h", "G"), rdt="float32"), call(res=("G", "G")),
             call(res=("Aqk", "h"), cu_=cu), call(res=("Akk",), rdt="bfloat16"), call(cu_=cu, h0_=h0), call(scale=0.3, l2=True),
             call(gate=True, A=A_log, dtb=dt_bias), call(gate=True, lb=-3.0), call(gate=True, A=A_log, lb=-3.0),
             call(ins=kda_inputs(dt=torch.float64)), call(ins=kda_inputs(dt=torch.float64), res=("G", "h"), rdt="bfloat16"), call(vf=False),
             call(vf=True), call(cu_=cu, h0_=h0t, vf=True), call(cu_=cu, h0_=h0t, res=("G", "Aqk", "h"), vf=True),
             call(final=False, cu_=cu, h0_=h0t, vf=True), call(flags=1 | 32 | 64 | 128 | 256),
             # refused
             call(cu_=cu, h0_=h0, vf=True), call(cu_=cu, h0_=h0t, vf=False),
             call(flags=512), call(flags=-1), call(scale=-1.0), call(scale=0.0), call(scale=math.nan),
             call(scale=math.inf), call(scale=-2.5e-7), call(cu_=torch.tensor(3)), call(cu_=cu.float()), call(ins=(q[0], k, v, g, beta)),
             call(ins=(q, k, v[0], g, beta)), call(ins=(q, k[:, :50], v, g, beta)), call(gate=True), call(h0_=h0[:1].double()),
             call(res=("h",), ins=(q, k[..., :4], v, g, beta))]
    check("kda_forward", kda._kda_forward, cases)


@pytest.mark.skipif(not torch.cuda.is_available() or not encore.built_with_cuda(), reason="needs CUDA")
def test_kda_forward_on_cuda_matches_python_kernel():
    """CUDA: sizes that change and come back (the op keeps the last fixed-length workspace size per thread),
    varlen between them, and refusals at remembered sizes: the same outputs and errors as the Python kernel."""
    def ins(t, kd=8, vd=6, dt=BF16):
        return [x.cuda() for x in kda_inputs(t=t, kd=kd, vd=vd, dt=dt)]

    a, b, c = ins(100), ins(200), ins(100, kd=16)
    cu = torch.tensor([0, 30, 100], dtype=torch.int64)
    g_half = [*a[:3], a[3].half(), a[4]]  # g in float16 at remembered sizes
    g_int = [*a[:3], a[3].to(torch.int32), a[4]]  # refused at remembered sizes
    k_short = [a[0], a[1][..., :4], *a[2:]]

    def call(x, final=True, cu_=None, res=()):
        word = _kda_args._op_flags(final, False, False, False, "bfloat16" if res else None, res)
        return (*x, word) if cu_ is None else (*x, word, None, None, None, cu_)

    cases = [call(a), call(b), call(a, cu_=cu), call(a, final=False), call(g_int), call(k_short), call(a), call(c), call(g_half),
             call(a, res=("Aqk", "Akk")), call(b, final=False)]
    check("kda_forward", kda._kda_forward, cases)


@pytest.mark.skipif(not torch.cuda.is_available() or not encore.built_with_cuda(), reason="needs CUDA")
def test_kda_forward_views_at_one_address():
    """Two views of one buffer with the same address and sizes but other token strides, one call after the
    other (the forward keeps its TMA descriptors per thread, keyed by address, sizes and strides): each gives
    what its contiguous copy (another address) gives, and the two differ."""
    K, T, H = 64, 64, 2
    bufs = [torch.randn(1, 2 * T, H, K, device="cuda", dtype=BF16) * s for s in (1.0, 0.1, 1.0)]  # q, k, v

    def views(wide):  # [1, T, H, K] at each buffer's address: token stride 2 H K (wide) or H K
        return [b.view(1, T, 2 * H, K)[:, :, :H] if wide else b.view(1, 2 * T, H, K)[:, :T] for b in bufs]

    g = -0.1 * torch.rand(1, T, H, K, device="cuda")
    beta = torch.rand(1, T, H, device="cuda", dtype=BF16) * 0.8 + 0.1
    run = torch.ops.encore.kda_forward.default
    narrow, wide = views(False), views(True)
    assert narrow[0].data_ptr() == wide[0].data_ptr() and narrow[0].stride() != wide[0].stride()
    got = [run(*narrow, g, beta, 1), run(*wide, g, beta, 1)]
    want = [run(*[x.contiguous() for x in ins], g, beta, 1) for ins in (narrow, wide)]
    for o, ref in zip(got, want):
        for x, y in zip(o, ref):
            torch.testing.assert_close(x, y, rtol=1e-2, atol=1e-2)
    assert not torch.allclose(got[0][0].float(), got[1][0].float(), rtol=1e-2, atol=1e-2)


def test_kda_forward_out_matches_python_kernel():
    q, k, v, g, beta = kda_inputs()
    cu = torch.tensor([0, 30, 100], dtype=torch.int64)
    o, fin = torch.empty_like(v), torch.empty(2, 2, 8, 6)
    ws = torch.zeros(64, dtype=torch.uint8)

    def call(final, cu_, o_, fin_, ws_, scale=None, vf=False, flags=None):
        word = _kda_args._op_flags(final, False, False, vf) if flags is None else flags
        return (q, k, v, g, beta, word, None, None, None, cu_, scale, None, o_, fin_, ws_)

    cases = [call(True, cu, o, fin, None), call(False, None, o, None, None), call(True, cu, o, fin, ws), call(False, None, o, None, ws[1:]),
             call(True, cu, o, None, None), call(False, None, o, fin, None), call(False, None, o, None, ws.float()),
             call(False, None, o, None, ws.view(8, 8)), call(False, None, o, None, None, scale=-1.0), call(True, None, o, fin[:1], None),
             call(True, cu, o, fin.transpose(2, 3).contiguous(), None, vf=True), call(True, cu, o, fin, ws, vf=False),
             call(True, cu, o, fin, None, vf=True), call(True, cu, o, fin.transpose(2, 3).contiguous(), None, vf=False),
             call(True, cu, o, fin, None, flags=33)]
    check("kda_forward_out", kda._kda_forward_out, cases, mutated=(12, 13))


def test_public_functions_take_the_native_kernels():
    """Plain eager tensors: the public functions call the C++ kernels (seen by a dispatch mode as the op: the
    launcher would not show), with the results of the launcher (an explicit stream)."""
    a, w, r = randn(M, K), randn(N, K, scale=K ** -0.5), randn(M, scale=0.1) + 1
    q, k, v, g, beta = kda_inputs()
    calls = {"gemm_row_scale": lambda **s: encore.gemm_row_scale(a, w, r, **s),
             "gemm_swiglu": lambda **s: encore.gemm_swiglu(a, w, **s),
             "gemm_lse": lambda **s: encore.gemm_lse(a, w, r, store_logits=True, **s)[:2],
             "gemm_epilogue": lambda **s: list(encore.gemm_epilogue("residual_add", a, w, c=a @ w.T, **s).values()),
             "kda_forward": lambda **s: encore.kda_forward(q, k, v, g, beta, output_final_state=True, return_residuals=("h", "G"), **s),
             "kda_forward_out": lambda **s: encore.kda_forward(q, k, v, g, beta, workspace=torch.zeros(16, dtype=torch.uint8), **s)}
    for name, fn in calls.items():
        direct = fn(stream=0)
        with dispatch_recorder() as seen:
            fn()  # under a mode: the traced path (torch.ops), which the mode sees
        assert f"encore.{name}.default" in seen.ops
        native_calls = []
        real = _core.NATIVE[name]
        _core.NATIVE[name] = lambda *args, _real=real: native_calls.append(name) or _real(*args)
        try:
            got = fn()
        finally:
            _core.NATIVE[name] = real
        assert native_calls == [name], name
        flat = lambda x: [t for y in (x if isinstance(x, (tuple, list)) else [x])  # noqa: E731
                          for t in (y.values() if isinstance(y, dict) else [y]) if t is not None]
        assert all(torch.equal(x, y) for x, y in zip(flat(direct), flat(got), strict=True)), name


def test_native_library_exports_no_encore_symbols():
    """_encore_torch keeps its copy of the encore libraries private (hidden visibility, --exclude-libs):
    exported, its encore:: symbols were shared with _encore's copy (encore::gemm::kIo, a GNU unique
    symbol, bound process-wide to the first loaded definition even under RTLD_LOCAL) or open to
    interposition by any other library of the process."""
    import ctypes
    import glob
    import os

    (path,) = glob.glob(os.path.join(os.path.dirname(_core.__file__), "_encore_torch*.so"))
    lib = ctypes.CDLL(path)  # already loaded: the same handle
    for name in ("_ZN6encore4gemm3kIoE",  # encore::gemm::kIo
                 "_ZN6encore3runERKNS_16GemmEpilogueArgsERKNS_19GemmEpilogueOptionsEPvS6_",  # encore::run(GemmEpilogueArgs ...)
                 "_ZN6encore8validateERKNS_16GemmEpilogueArgsERKNS_19GemmEpilogueOptionsE"):  # encore::validate(GemmEpilogueArgs ...)
        assert not hasattr(lib, name), f"_encore_torch exports {name}"
