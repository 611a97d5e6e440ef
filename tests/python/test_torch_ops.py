"""torch.ops.encore: opcheck of every op (CPU backend; CUDA when present), the wrappers' dispatch to
the ops, and torch.compile(fullgraph=True) of a module of encore calls against eager."""
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import encore  # noqa: E402
from encore import _kda_args  # noqa: E402
from helpers import dispatch_recorder  # noqa: E402
OPS = encore.register_torch_ops()  # noqa: E402  (torch.ops.encore.<op>.default by name)

HAS_CUDA = encore.built_with_cuda() and encore.cuda_device_count() > 0 and torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
F32, BF16 = torch.float32, torch.bfloat16


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def make(dev, dtype):
    """randn(*shape, scale=) on `dev` in `dtype` (drawn in fp32 on the host, reproducibly)."""
    g = gen()

    def randn(*shape, scale=1.0, dt=None):
        return (torch.randn(*shape, generator=g) * scale).to(dt or dtype).to(dev)
    return randn


def freq_turns(heads, rotary, hd, dev):
    return torch.from_numpy(encore.rope_freq_turns(heads, rotary, hd, 10000.0)).to(dev)


# Each case: (op name, build(dev) -> the op's arguments). The CPU shapes are small; CUDA ones meet
# the CUDA kernels' limits (bf16, K and N multiples of 8, head_dim 128 for the head sums, KDA K = V = 64).
def norm_cases(dev):
    dt = BF16 if dev == "cuda" else F32
    r = make(dev, dt)
    n = 4096 if dev == "cuda" else 96
    x, res, w = r(2, 3, n), r(2, 3, n), r(n, scale=0.3) + 1
    hd, hq, hkv = 128, 4, 2
    half = BF16 if dev == "cuda" else torch.float16
    qkv = make(dev, half)(7, (hq + 2 * hkv) * hd)
    qw, kw = make(dev, half)(hd, scale=0.2) + 1, make(dev, half)(hd, scale=0.2) + 1
    q = r(33, 1024 if dev == "cuda" else 384, scale=4)
    cases = [("rms_norm", (x, w, 1e-6, 0.5)),
             ("add_rms_norm", (x, res, w, 1e-5, 0.0)),
             ("add_rms_norm_", (x, res, w, 1e-5, 0.0)),
             ("add_rms_norm_out", (x, res, w, 1e-5, 0.0, torch.empty_like(x))),
             ("qk_norm_", (qkv, qw, kw, hq, hkv, hd, 1e-6, 1.0)),
             ("fp8_group_quant", (q, False, False, 1e-10)),
             ("fp8_group_quant", (q, True, True, 1e-10))]
    if dev == "cpu":
        qq, s = encore.fp8_group_quant(q.float())
        cases.append(("fp8_group_dequant", (qq.view(torch.uint8), s)))
    return cases


def gemm_cases(dev):
    cuda = dev == "cuda"
    dt = BF16 if cuda else F32
    r = make(dev, dt)
    m, k, n = (300, 256, 512) if cuda else (37, 24, 48)
    a, w = r(m, k), r(n, k, scale=k ** -0.5)
    rs = make(dev, F32)(m, scale=0.1) + 1
    pos = torch.arange(m, dtype=torch.int32, device=dev) * 3
    hd = 128 if cuda else 16
    heads = n // hd
    target = torch.randint(0, n, (m,), generator=gen(1), dtype=torch.int32).to(dev)
    target[3] = -100
    parts, _, tl = encore.gemm_lse(a, w, target=target)
    _, logits, _ = encore.gemm_lse(a, w, store_logits=True)
    lse = encore.lse_finish(parts)
    hq, hkv = heads - 2, 1
    qkv, hparts = encore.gemm_qkv_head_sqsum(a, w, head_dim=hd)
    qw, kw = r(hd, scale=0.1) + 1, r(hd, scale=0.1) + 1
    return [("gemm_row_scale", (a, w, rs, "auto")),
            ("gemm_scalar_scale", (a, w, torch.tensor([-1.5], device=dev), "auto")),
            ("gemm_residual_rms_partial", (a, w, r(m, n), r(n), 0)),
            ("gemm_residual_rms_partial", (a, w, r(m, n), r(n), 256 if cuda else 16)),
            ("rms_final_reduce", (make(dev, F32)(m, 4).abs(), n, 1e-6)),
            ("gemm_swiglu", (a, w, None, "auto")),
            ("gemm_swiglu", (a, w, rs, "auto")),
            ("gemm_rope", (a, w, pos, freq_turns(heads, heads - 1, hd, dev), rs, "auto")),
            ("gemm_qkv_head_sqsum", (a, w, hd)),
            ("qk_norm_rope_", (qkv, hparts, qw, kw, pos, freq_turns(heads, hq + hkv, hd, dev), hq, hkv, hd, 1e-6)),
            ("gemm_lse", (a, w, rs, target, True, -100, 0)),
            ("gemm_lse", (a, w, None, None, False, -100, 0)),
            ("gemm_epilogue", ("residual_add", a, w, r(m, n), None, None, None, None, None, None, True, 0, 128, -100, "auto")),
            ("gemm_epilogue", ("lse", a, w, None, None, rs, None, None, None, target, False, 0, 128, -100, "auto")),
            ("lse_finish", (parts, target, tl, -100)),
            ("lse_finish", (parts, None, None, -100)),
            # the backward rows: w [K, N] un-transposed, Z / dZ packed [M, 2N], c2 and zdz
            ("gemm_epilogue", ("swiglu_bwd", a, r(k, n, scale=k ** -0.5), r(m, 2 * n), None, None, None, None, None, None, True, 0,
                               128, -100, "auto")),
            ("gemm_epilogue", ("rmsnorm_bwd", a, r(k, n, scale=k ** -0.5), r(m, n), r(n, scale=0.1) + 1, rs, None, None, None, None,
                               True, 0, 128, -100, "auto", r(m, n), make(dev, F32)(m))),
            ("partials_sum", (make(dev, F32)(m, 4), False, 0.5, 4)),
            ("partials_sum", (make(dev, F32)(3, 256), True, 1.0, 200)),
            # the cross-entropy backward: ce_bwd (recomputed logits; N odd: D rows padded), cross_entropy_bwd (stored)
            ("gemm_epilogue", ("ce_bwd", a, w, None, None, rs, None, None, torch.tensor([0.5], device=dev), target, True, 0, 128, -100,
                               "auto", None, None, lse)),
            ("gemm_epilogue", ("ce_bwd", a, w[:n - 3], None, None, None, None, None, None, target.clamp(max=n - 4), True, 0, 128, -100,
                               "auto", None, None, lse)),
            ("gemm_lse", (a, w[:n - 3], None, None, True, -100, 0)),
            ("cross_entropy_bwd", (logits, lse, target, torch.tensor([0.5], device=dev), -100)),
            ("cross_entropy_bwd", (logits, lse, target, None, -100)),
            ("cross_entropy_bwd_", (logits.clone(), lse, target, None, -100)),
            # the QK-norm + RoPE backward on the forward's input (qkv before qk_norm_rope_) and its partials
            ("qk_norm_rope_backward", (r(m, n), qkv, hparts, qw, kw, pos, freq_turns(heads, hq + hkv, hd, dev), hq, hkv, hd, 1e-6))]


def block_inputs(dev):
    cuda = dev == "cuda"
    r = make(dev, BF16 if cuda else F32)
    m, d, f, heads, rotary, hd = (300, 256, 320, 8, 6, 64) if cuda else (9, 32, 48, 4, 3, 8)
    return (r(m, d), r(m, d), r(d, d, scale=d ** -0.5), r(2 * f, d, scale=d ** -0.5), r(d, f, scale=f ** -0.5),
            r(heads * hd, d, scale=d ** -0.5), r(d, scale=0.1) + 1, r(d, scale=0.1) + 1,
            torch.arange(m, dtype=torch.int32, device=dev), freq_turns(heads, rotary, hd, dev))


def block_cases(dev):
    ins = block_inputs(dev)
    outs = [torch.empty_like(t) for t in encore.llama_block_forward(*ins)]
    ws = torch.empty(encore.llama_block_workspace_bytes(*ins, outs), dtype=torch.uint8, device=dev)
    # the backward over this forward's saved tensors, random incoming gradients
    x1, x2, z1, qkv, r1, r2 = encore.llama_block_forward(*ins)
    y0, _, w0, w1, w2, w3, g0, g1, pos, freq = ins
    bins = (y0, w0, w1, w2, w3, g0, g1, pos, freq, x1, x2, z1, qkv, r1, r2, torch.randn_like(qkv), torch.randn_like(x2))
    bouts = list(encore.llama_block_backward(*bins))
    qins = (x2, g1, w3, pos, freq, r2, qkv, bins[15], bins[16])
    qouts = list(encore.qkv_norm_backward(*qins))
    return [("llama_block_forward", (*ins, 1e-5, None)),
            ("llama_block_forward", (*ins, 1e-5, ws)),
            ("llama_block_forward_out", (*ins, 1e-5, *outs, ws)),
            ("llama_block_backward", (*bins, None)),
            ("llama_block_backward_out", (*bins, *[torch.empty_like(t) for t in bouts], None)),
            ("qkv_norm_backward", (*qins, None)),
            ("qkv_norm_backward", (*qins[:8], None, None)),
            ("qkv_norm_backward_out", (*qins, *[torch.empty_like(t) for t in qouts], None))] + last_block_cases(dev, ins)


def last_block_cases(dev, ins):
    """The last layer + loss over the block's y0, x0, w0, w1, w2, gamma0 with gamma1 as the final norm and a
    head of V = 37 (odd), two ignored rows."""
    y0, x0, w0, w1, w2, _, g0, g1, _, _ = ins
    w_lm = make(dev, y0.dtype)(37, y0.shape[1], scale=y0.shape[1] ** -0.5)
    target = torch.arange(y0.shape[0], dtype=torch.int32, device=dev) % 37
    target[1::4] = -100
    fins = (y0, x0, w0, w1, w2, g0, g1, w_lm, target, 1e-5, -100)
    x1, x2, z1, h2, r1, r2, lse, _ = encore.blocks.llama_last_block_forward(*fins[:9])
    d_loss = torch.full((1,), 0.5, device=dev)
    bins = (y0, w0, w1, w2, g0, g1, w_lm, target, x1, x2, z1, h2, r1, r2, lse, d_loss, -100)
    return [("llama_last_block_forward", (*fins, None)), ("llama_last_block_backward", (*bins, None))]


def kda_inputs(dev, b=1, t=100, h=2, kd=8, vd=6):
    if dev == "cuda":
        kd = vd = 64
    r = make(dev, BF16 if dev == "cuda" else F32)
    beta = (torch.rand(b, t, h, generator=gen(2)) * 0.8 + 0.1).to(BF16 if dev == "cuda" else F32).to(dev)
    return r(b, t, h, kd), r(b, t, h, kd, scale=0.1), r(b, t, h, vd), -0.1 * r(b, t, h, kd).abs(), beta


def kda_cases(dev):
    q, k, v, g, beta = kda_inputs(dev)
    cu = torch.tensor([0, 30, 100], dtype=torch.int64)
    word = _kda_args._op_flags  # the options word: (final state, l2 norm, gate in kernel, state_v_first, residual dtype, residuals)
    ins = lambda final, cu_, vfirst=False, res=(): (q, k, v, g, beta,  # noqa: E731
                                                    word(final, False, False, vfirst, "float32" if res else None, res), None, None,
                                                    None, cu_, None, None)
    o, fin = torch.empty_like(v), torch.empty(2, q.shape[2], q.shape[3], v.shape[3], device=dev)
    nbytes = encore.kda_forward_workspace_bytes(q, k, v, g, beta, (o, fin), cu_seqlens=cu)
    ws = torch.empty(nbytes, dtype=torch.uint8, device=dev) if nbytes else None
    cases = [("kda_forward", ins(False, None)),
             ("kda_forward", ins(True, None, res=("G", "Aqk", "Akk", "h"))),
             ("kda_forward", (q, k, v, g, beta, word(True, False, False, False, "bfloat16" if dev == "cuda" else "float32", ("Aqk", "h")),
                              None, None, None, cu)),
             ("kda_forward_out", (*ins(True, cu), o, fin, ws)),
             ("kda_forward_out", (*ins(False, None), o, None, None))]
    # state_v_first: the states [N, HV, V, K] (the fakes' final_state so)
    vk = lambda x: x.transpose(2, 3).contiguous()  # noqa: E731
    h0n = make(dev, F32)(2, q.shape[2], q.shape[3], v.shape[3], scale=0.1)
    cases += [("kda_forward", (q, k, v, g, beta, word(True, False, False, True, "float32", ("G", "h")), vk(h0n), None, None, cu)),
              ("kda_forward_out", (*ins(True, cu, True), o, vk(fin), ws))]
    if dev == "cpu":
        d_o = make(dev, F32)(*v.shape)
        h0 = make(dev, F32)(1, q.shape[2], q.shape[3], v.shape[3], scale=0.1)
        _, _, res = encore.kda_forward(q, k, v, g, beta, use_qk_l2norm=True, return_residuals=True)
        none4 = (None,) * 4
        cases.append(("kda_backward", (q, k, v, g, beta, d_o, None, None, None, True, False, None, None, None, None, *none4)))
        cases.append(("kda_backward", (q, k, v, g, beta, d_o, None, None, None, True, False, None, None, None, None,
                                       res["G"], res["Aqk"], res["Akk"], res["h"])))
        cases.append(("kda_backward", (q, k, v, g, beta, d_o, None, 0.3, h0, False, True, make(dev, F32)(2), None, None, None,
                                       *none4)))
        cases.append(("kda_backward", (q, k, v, g, beta, d_o, vk(h0), None, vk(h0), True, False, None, None, None, None,
                                       res["G"], res["Aqk"], res["Akk"], None, True)))
        # Serving (CPU only until the CUDA kernels exist): the recurrent step on a pool (decode, speculative slots),
        # without a pool (new final state, in place), the prefill on the pool.
        hv, kd, vd = q.shape[2], q.shape[3], v.shape[3]
        pool = make(dev, F32)(6, hv, kd, vd, scale=0.1)
        dec = [x[0, :3].unsqueeze(1).contiguous() for x in (q, k, v, g, beta)]
        two = [x[0, :6].reshape(3, 2, *x.shape[2:]).contiguous() for x in (q, k, v, g, beta)]
        rec = lambda xs, *rest: ("kda_recurrent", (*xs, *rest))  # noqa: E731
        cases += [rec(dec, None, None, None, pool, True, torch.tensor([3, -1, 0]), None, None, True, False, None, False, False,
                      torch.empty_like(dec[2]), None),
                  rec(two, make(dev, F32)(hv), None, 0.5, pool, True, torch.tensor([[0, 1], [2, 3], [-1, 4]], dtype=torch.int32),
                      torch.tensor([2, 1, 1]), None, False, True, None, True, True, torch.empty_like(two[2]), None),
                  rec(two, None, None, None, h0.expand(3, -1, -1, -1).clone(), False, None, None, None, True, False, None, False,
                      False, torch.empty_like(two[2]), torch.empty(3, hv, kd, vd)),
                  rec(two, None, None, None, h0.expand(3, -1, -1, -1).clone(), True, None, None, None, False, False, None, True,
                      False, torch.empty_like(two[2]), None),
                  ("kda_forward_pool", (q, k, v, g, beta, None, pool, torch.tensor([4, -1]), True, False, None, None, None, cu,
                                        torch.empty_like(v))),
                  rec(dec, None, None, None, vk(pool), True, torch.tensor([3, -1, 0]), None, None, True, False, None, False, False,
                      torch.empty_like(dec[2]), None, True, True),
                  ("kda_forward_pool", (q, k, v, g, beta, None, vk(pool), torch.tensor([4, -1]), True, False, None, None, None, cu,
                                        torch.empty_like(v), True, True))]
    else:  # the CUDA backward reads the forward's residuals (saved h, and rematerialized without it)
        d_o = make(dev, BF16)(*v.shape)
        _, _, res = encore.kda_forward(q, k, v, g, beta, use_qk_l2norm=True, return_residuals=True, residual_dtype="bfloat16")
        for names in (("G", "Aqk", "Akk", "h"), ("G", "Aqk", "Akk")):
            cases.append(("kda_backward", (q, k, v, g, beta, d_o, None, None, None, True, False, None, None, None, None,
                                           *(res.get(x) if x in names else None for x in ("G", "Aqk", "Akk", "h")))))
    return cases


def moe_cases(dev):
    g = torch.Generator().manual_seed(17)
    logits = torch.randn(29, 16, generator=g).to(dev)
    bias = torch.randn(16, generator=g).to(dev)
    ids, w = encore.moe_routing(logits, 4)
    x = torch.randn(29, 64, generator=g).to(dev).to(BF16 if dev == "cuda" else F32)
    d = encore.moe_dispatch(ids, 16, x=x, align_m=8)
    y = torch.randn(d["x_permuted"].shape, generator=g).to(dev).to(x.dtype)
    return [("moe_routing", (logits, None, 4, "softmax", True, 1, 1, 1.0)),
            ("moe_routing", (logits, bias, 4, "sigmoid", True, 4, 2, 2.5)),
            ("moe_dispatch", (ids, 16, x, 8)),
            ("moe_dispatch", (ids, 16, None, 1)),
            ("moe_combine", (y, d["slot_rows"], w)),
            ("moe_forward", (x, logits.to(x.dtype), (torch.randn(16, 64, 64, generator=g) / 8).to(dev).to(x.dtype),
                             (torch.randn(16, 64, 32, generator=g) / 6).to(dev).to(x.dtype), 4, "softmax", True, 1, 1, None, 1.0, 8))]


def all_cases(dev):
    return norm_cases(dev) + gemm_cases(dev) + block_cases(dev) + kda_cases(dev) + moe_cases(dev)


def case_ids(dev):
    return [f"{dev}-{i}-{name}" for i, (name, _) in enumerate(all_cases(dev))]


REGISTERED = {name for name in vars(OPS) if not name.startswith("_")}


def test_every_op_is_covered():
    tested = {name for dev in DEVICES for name, _ in all_cases(dev)}
    assert tested == REGISTERED


@pytest.mark.parametrize("dev", DEVICES)
def test_opcheck(dev):
    failures = []
    for i, (name, args) in enumerate(all_cases(dev)):
        try:
            torch.library.opcheck(getattr(torch.ops.encore, name).default, args)
        except Exception as e:  # collect all, report together
            failures.append(f"{i} {name}: {type(e).__name__}: {str(e)[:400]}")
    assert not failures, "\n".join(failures)


def test_import_does_not_load_torch():
    import subprocess

    code = "import sys, encore; assert 'torch' not in sys.modules; encore.rms_norm(__import__('numpy').ones((2, 8), 'f'), " \
           "__import__('numpy').ones(8, 'f')); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env={"PYTHONPATH": ":".join(sys.path)})


def test_module_exports_only_its_init():
    """_encore exports PyInit__encore and none of the static libraries linked into it (hidden visibility,
    --exclude-libs): exported, cudart_static's entry points (__cudaRegisterFatBinary, cudaLaunchKernel, ...)
    could be interposed by torch's libcudart, which torch loads RTLD_GLOBAL after an `import encore`, so that
    encore's later CUDA calls (its fatbinaries' unregistration at exit included) would go to another runtime
    than the one its kernels were registered with (the segfault at exit of test_torch_imported_after_encore
    on an H200); encore's GNU unique symbols would bind process-wide."""
    import ctypes
    import shutil
    import subprocess

    lib = ctypes.CDLL(encore._encore.__file__)  # already loaded: the same handle
    assert hasattr(lib, "PyInit__encore")
    for name in ("__cudaRegisterFatBinary", "__cudaUnregisterFatBinary", "cudaLaunchKernel", "cudaGetDeviceCount",
                 "_ZN6encore4gemm3kIoE"):  # encore::gemm::kIo
        assert not hasattr(lib, name), f"_encore exports {name}"
    if not shutil.which("nm"):
        pytest.skip("nm (binutils) missing: the full scan of the exported symbols is skipped (the named ones were checked)")
    # every defined dynamic symbol beyond PyInit__encore, weak type information (V: RTTI of the bound enums and of
    # nanobind's exceptions, shared by design) and libstdc++'s to_chars digits (u)
    out = subprocess.run(["nm", "-D", "--defined-only", encore._encore.__file__], capture_output=True, text=True, check=True).stdout
    extra = [ln.split()[-1] for ln in out.splitlines() if len(ln.split()) == 3 and ln.split()[1] not in "VA"
             and ln.split()[-1] != "PyInit__encore" and not (ln.split()[1] == "u" and "to_chars" in ln)]
    assert not extra, f"_encore exports {len(extra)} symbols of its static libraries, e.g. {extra[:3]}"


def test_torch_imported_after_encore():
    """encore imported before torch, the first call on torch tensors one whose output is allocated
    before anything else looks at torch (fused_recurrent_kda): a torch tensor out, not a numpy
    allocation with torch's dtype (found by tests/python/test_fuzz_kda_serving.py)."""
    import subprocess

    code = ("import encore, torch\nfrom encore.kda import fused_recurrent_kda\nq, v = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 3)\n"
            "o, _ = fused_recurrent_kda(q, q.clone(), v, -torch.rand(1, 2, 1, 4), torch.rand(1, 2, 1))\n"
            "assert isinstance(o, torch.Tensor), type(o)")
    subprocess.run([sys.executable, "-c", code], check=True, env={"PYTHONPATH": ":".join(sys.path)})


@pytest.mark.parametrize("dev", DEVICES)
def test_wrappers_dispatch_to_ops_and_match_direct(dev):
    """Torch tensors go through torch.ops.encore (a dispatch mode sees the op); an explicit stream takes
    the direct path; both give the same bits."""
    r = make(dev, BF16 if dev == "cuda" else F32)
    x, res, w = r(5, 256), r(5, 256), r(256)
    direct = encore.add_rms_norm(x, res, w, stream=torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else 0)
    with dispatch_recorder() as seen:
        y, h = encore.add_rms_norm(x, res, w)
    assert "encore.add_rms_norm.default" in seen.ops
    assert torch.equal(y, direct[0]) and torch.equal(h, direct[1])
    # The in-place forms: h written over residual (or x), or into h_out.
    for which in ("residual", "x", "other"):
        xc, rc = x.clone(), res.clone()
        h_out = {"residual": rc, "x": xc, "other": torch.empty_like(x)}[which]
        y2, h2 = encore.add_rms_norm(xc, rc, w, h_out=h_out)
        assert h2 is h_out and torch.equal(h_out, direct[1]) and torch.equal(y2, direct[0])
    x3, r3 = r(2, 3, 256), r(2, 3, 256)
    with pytest.raises(ValueError, match="h_out"):  # written in place, not viewable as rows
        encore.add_rms_norm(x3, r3, w, h_out=torch.empty(3, 2, 256, dtype=x.dtype, device=dev).transpose(0, 1))


def test_optional_outputs_and_dicts():
    a, w = torch.randn(20, 32), torch.randn(64, 32) * 0.2
    p, logits, tl = encore.gemm_lse(a, w)
    assert logits is None and tl is None and p.shape == (20, 1)
    target = torch.randint(0, 64, (20,), dtype=torch.int32)
    p, logits, tl = encore.gemm_lse(a, w, target=target, store_logits=True)
    lse, loss = encore.lse_finish(p, target, tl)
    assert logits.shape == (20, 64) and tl.shape == (20,) and loss.shape == (20,)
    assert torch.allclose(lse, torch.logsumexp(a.double() @ w.double().T, 1).float(), rtol=1e-5)
    q, k, v, g, beta = kda_inputs("cpu")
    o, fin, res = encore.kda_forward(q, k, v, g, beta, output_final_state=True, return_residuals=("h", "G"))
    assert list(res) == ["h", "G"] and res["h"].shape == (2, 2, 8, 6)
    o2, fin2, res2 = encore.kda_forward(q.numpy(), k.numpy(), v.numpy(), g.numpy(), beta.numpy(), output_final_state=True,
                                        return_residuals=("h", "G"))
    assert np.array_equal(o.numpy(), o2) and np.array_equal(res["h"].numpy(), res2["h"])
    cu = np.array([0, 30, 100], np.int64)  # a host numpy cu_seqlens with torch tensors
    o3, fin3 = encore.kda_forward(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu)
    assert fin3.shape == (2, 2, 8, 6)
    out = (torch.empty_like(o3), torch.empty_like(fin3))
    got = encore.kda_forward(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu, out=out)
    assert got[0] is out[0] and got[1] is out[1] and torch.equal(out[0], o3)
    grads = encore.kda_backward(q, k, v, g, beta, torch.randn_like(v), A_log=torch.zeros(2), use_gate_in_kernel=True)
    assert sorted(grads) == ["dA_log", "dbeta", "dg", "dk", "dq", "dv"]


def test_autograd_still_refused():
    x = torch.randn(2, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="autograd"):
        encore.rms_norm(x, torch.ones(8))
    with torch.no_grad():
        assert encore.rms_norm(x, torch.ones(8)).shape == (2, 8)


class Block(torch.nn.Module):
    """add_rms_norm -> gemm_row_scale -> gemm_swiglu (rows scaled by a final reduce) -> rms_norm, and
    qk_norm_ on a slice of the result: several encore ops, in place and allocating, in one graph."""

    def __init__(self, dev, d=256, f=128, hd=64):
        super().__init__()
        r = make(dev, BF16 if dev == "cuda" else F32)
        self.hd = hd
        self.gamma = torch.nn.Parameter(r(d, scale=0.1) + 1, requires_grad=False)
        self.w_in = torch.nn.Parameter(r(d, d, scale=d ** -0.5), requires_grad=False)
        self.w_gu = torch.nn.Parameter(r(2 * f, d, scale=d ** -0.5), requires_grad=False)
        self.w_qk = torch.nn.Parameter((r(hd, scale=0.1) + 1).to(torch.bfloat16), requires_grad=False)

    def forward(self, x, residual):
        y, h = encore.add_rms_norm(x, residual, self.gamma, h_out=residual)
        ones = torch.ones(x.shape[0], device=x.device, dtype=torch.float32)
        z = encore.gemm_row_scale(y, self.w_in, ones * 0.5)
        _, s = encore.gemm_swiglu(z, self.w_gu)
        qkv = torch.cat([s, s], 1).to(torch.bfloat16)  # [M, 4 * hd]: 2 q heads, 1 k, 1 v (qk_norm_: 16-bit)
        encore.qk_norm_(qkv, self.w_qk, self.w_qk, 2, 1, self.hd)
        return encore.rms_norm(qkv + 1, torch.ones_like(qkv[0])) * 2, h


@pytest.mark.parametrize("dev", DEVICES)
def test_compile_fullgraph_matches_eager(dev):
    torch._dynamo.reset()
    model = Block(dev)
    r = make(dev, BF16 if dev == "cuda" else F32)
    x, res = r(24, 256), r(24, 256)
    res_eager, res_comp = res.clone(), res.clone()
    want, h_want = model(x, res_eager)
    backend = "inductor" if dev == "cuda" else "aot_eager"
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    got, h_got = compiled(x, res_comp)
    assert torch.equal(h_got, h_want) and torch.equal(res_comp, res_eager)  # the residual updated in place, as eager
    tol = 2e-2 if dev == "cuda" else 1e-5
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)
    # A second shape of M: recompiles (or runs dynamically) without graph breaks.
    x2, res2 = r(40, 256), r(40, 256)
    w2, _ = model(x2, res2.clone())
    g2, _ = compiled(x2, res2.clone())
    assert torch.allclose(g2.float(), w2.float(), rtol=tol, atol=tol)


def test_compile_inductor_cpu():
    """The default inductor backend on the CPU backend (generated C++ around the encore calls)."""
    torch._dynamo.reset()

    def f(a, w, residual, gamma, target):
        y, aux, parts = encore.gemm_residual_rms_partial(a, w, residual, gamma)
        r = encore.rms_final_reduce(parts, w.shape[0])
        p, _, tl = encore.gemm_lse(aux, w.T.contiguous(), r, target)
        lse, loss = encore.lse_finish(p, target, tl)
        return y.sum(1) + loss, lse

    a, w, residual, gamma = torch.randn(20, 32), torch.randn(48, 32) * 0.2, torch.randn(20, 48), torch.randn(48)
    target = torch.randint(0, 32, (20,), dtype=torch.int32)
    want = f(a, w, residual, gamma, target)
    got = torch.compile(f, fullgraph=True)(a, w, residual, gamma, target)
    for g_, w_ in zip(got, want):
        assert torch.allclose(g_, w_, rtol=1e-5, atol=1e-5)


def test_compile_kda_and_block_fullgraph():
    torch._dynamo.reset()
    q, k, v, g, beta = kda_inputs("cpu")
    ins = block_inputs("cpu")

    def f(q, k, v, g, beta, *ins):
        o, fin, res = encore.kda_forward(q, k, v, g, beta, output_final_state=True, return_residuals=("Aqk",))
        blk = encore.llama_block_forward(*ins)
        return o, fin, res["Aqk"], blk[3]

    want = f(q, k, v, g, beta, *ins)
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, g, beta, *ins)
    for g_, w_ in zip(got, want):
        assert torch.equal(g_, w_)


def test_partial_tile_n_reads_k_only():
    """The partials' fakes ask gemm_partial_tile_n with M = N = 1 for symbolic sizes (no specialization)."""
    from encore import gemm

    for e in (gemm._RESIDUAL, gemm._LSE):
        for k in (8, 4096, 12288, 16384):
            widths = {encore._encore.gemm_partial_tile_n(e, m, n, k) for m in (1, 77, 1 << 20) for n in (1, 512, 128256)}
            assert len(widths) == 1, (e, k, widths)


def test_compile_dynamic_m_does_not_recompile():
    """Token counts vary: after the first recompile (automatic dynamic shapes) a new M reuses the graph."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()

    def f(x, residual, gamma, w):
        y, h = encore.add_rms_norm(x, residual, gamma)
        d, aux, parts = encore.gemm_residual_rms_partial(y, w, h, gamma)
        p, _, _ = encore.gemm_lse(aux, w, encore.rms_final_reduce(parts, w.shape[0]))
        return encore.lse_finish(p), encore.gemm_swiglu(d, w)[1]

    counter = CompileCounter()
    cf = torch.compile(f, fullgraph=True, backend=counter)
    w, gamma = torch.randn(64, 64) * 0.1, torch.randn(64)
    for m in (5, 9, 17, 33):
        x, residual = torch.randn(m, 64), torch.randn(m, 64)
        for got, want in zip(cf(x, residual, gamma, w), f(x, residual, gamma, w)):
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 2


@pytest.mark.parametrize("dev", DEVICES)
def test_moe_ops_compile_fullgraph(dev):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(33, 8, generator=g).to(dev)
    x = torch.randn(33, 32, generator=g).to(dev).to(BF16 if dev == "cuda" else F32)

    def route_dispatch_combine(logits, x):
        ids, w = encore.moe_routing(logits, 2)
        d = encore.moe_dispatch(ids, 8, x=x, align_m=4)
        return encore.moe_combine(d["x_permuted"] * 2, d["slot_rows"], w)

    eager = route_dispatch_combine(logits, x)
    compiled = torch.compile(route_dispatch_combine, fullgraph=True, backend="aot_eager")(logits, x)
    torch.testing.assert_close(compiled, eager)


def test_native_kernels_load_where_built():
    """encore._encore_torch, where the build made it for this torch, loads and serves its ops: a library that
    does not load (an unresolved symbol, say) leaves every op on its Python kernel, and test_torch_native,
    which compares the two kernels, then skips."""
    import glob
    import os

    from encore import _core

    here = os.path.dirname(_core.__file__)
    try:
        with open(os.path.join(here, "_encore_torch.version")) as f:
            built_for = f.read().strip()
    except OSError:
        pytest.skip("encore._encore_torch not built")
    if built_for != torch.__version__ or not glob.glob(os.path.join(here, "_encore_torch*.so")):
        pytest.skip(f"encore._encore_torch built for torch {built_for}, not {torch.__version__}")
    encore.register_torch_ops()
    assert {"rms_norm", "gemm_row_scale", "kda_forward", "kda_forward_out"} <= set(_core.NATIVE), sorted(_core.NATIVE)
