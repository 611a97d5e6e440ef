"""Property-based fuzzing on CUDA of the GEMM-epilogue wrappers (the GPU machine; skipped elsewhere):
gemm_scalar_scale, gemm_residual_rms_partial (finished by rms_final_reduce on each backend's partials),
gemm_rope on rope_freq_turns' table, gemm_qkv_head_sqsum, gemm_lse (finished by lse_finish) and
gemm_swiglu on interleave_gate_up's weights. Valid draws: bf16 / fp16 CUDA tensors against the CPU backend
on the same values; M 1-130 (the 128-row tile's edge), N multiples of 8 up to 136 (qkv_head_sqsum: heads of
128; gemm_lse: any N up to 300, its logits' rows padded), K multiples of 8 up to 96, a, w and the residual
row-strided (16-byte rows), partial_tile_n 128 / 256 (the CUDA tiles') or the default, optional row scales,
targets with ignore_index rows and stored logits; d / aux within the dtype's tolerance, the fp32 statistics
within fuzz_cuda_util.STAT_TOL. Invalid draws: an operand on the CPU, fp32 operands, K or N not a multiple
of 8, rows not 16-byte aligned, strided or misaligned vectors, gamma in another dtype, the CUDA kernels'
head_dim and partial tile widths, interleave_gate_up of CUDA tensors: ValueError (invalid) or RuntimeError
(unsupported on CUDA) naming the argument. rope_freq_turns takes no array (a host table): its invalid draws
are tests/python/test_fuzz_gemm_finishers.py's, the same on every machine.

Seeds: hypothesis with derandomize=True (fuzz_util.VALID: 200 draws, INVALID: 100 draws per test and op)."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import encore
from fuzz_cuda_util import DT, STAT_TOL, close_to_cpu, pair
from fuzz_util import INVALID, SEEDS, VALID, refused, torch  # noqa: F401
from helpers import needs_torch_cuda

pytestmark = needs_torch_cuda

OPS = ["gemm_scalar_scale", "gemm_residual_rms_partial", "gemm_rope", "gemm_qkv_head_sqsum", "gemm_lse", "gemm_swiglu"]
_STATS = ("partials", "target_logit", "r", "lse", "loss")  # fp32 outputs


def _mat(rng, rows, cols, dt, scale=1.0, pad=0):
    """(CUDA, CPU) [rows, cols] of the same values, each a view of rows `pad` elements longer (pad 0: contiguous)."""
    g, c = pair(rng, (rows, cols + pad), dt, scale)
    return g[:, :cols], c[:, :cols]


def _f32(values):
    c = torch.from_numpy(np.ascontiguousarray(values, np.float32))
    return c.cuda(), c


def _i32(values):
    c = torch.from_numpy(np.ascontiguousarray(values, np.int32))
    return c.cuda(), c


def _operands(op, rng, dt, m, n, k, pad, flags, n_any):
    """({name: (CUDA, CPU)} of one wrapper call: a, w and what the op reads) and the call's N."""
    if op == "gemm_qkv_head_sqsum":
        n = 128 * (1 + (n + flags[2]) % 3)  # 1-3 of the CUDA kernel's heads of 128 columns
    elif op == "gemm_lse":
        n = n_any  # any vocabulary width
    x = {"a": _mat(rng, m, k, dt, 1.0, pad)}
    if op == "gemm_swiglu":
        f = n // 2
        gate, up = _mat(rng, f, k, dt, k ** -0.5), _mat(rng, f, k, dt, k ** -0.5)
        w13 = encore.interleave_gate_up(gate[1], up[1])  # the host layout gemm_swiglu reads: rows 2j gate, 2j+1 up
        assert torch.equal(w13[0::2], gate[1]) and torch.equal(w13[1::2], up[1])
        x["w"], x["gate"] = (w13.cuda(), w13), gate
    else:
        x["w"] = _mat(rng, n, k, dt, k ** -0.5, pad)
    if op == "gemm_scalar_scale":
        x["alpha"] = _f32([rng.uniform(-2, 2)])
    if op == "gemm_residual_rms_partial":
        x["residual"] = _mat(rng, m, n, dt, 1.0, pad)
        x["gamma"] = pair(rng, (n,), dt, 0.3)
        x["gamma"] = (x["gamma"][0] + 1, x["gamma"][1] + 1)
    if op in ("gemm_rope", "gemm_lse", "gemm_swiglu") and flags[0]:
        x["r"] = _f32(rng.uniform(0.5, 2, m))
    if op == "gemm_rope":
        hd = int(rng.choice([8, 16, 32, 64]))
        heads = max(1, n // hd)
        freq = encore.rope_freq_turns(heads, int(rng.integers(0, heads + 1)), hd, float(rng.choice([10000.0, 500000.0])))
        x["freq"] = (torch.from_numpy(freq).cuda(), torch.from_numpy(freq))
        assert torch.equal(x["freq"][0].cpu(), x["freq"][1])  # the host table, as the CUDA epilogue reads it
        x["pos"] = _i32(rng.integers(-1000, 70000, m))
        n = heads * hd
        x["w"] = _mat(rng, n, k, dt, k ** -0.5, pad)
    if op == "gemm_lse" and flags[1]:
        t = rng.integers(0, n, m)
        t[rng.random(m) < 0.2] = -100
        x["target"] = _i32(t)
    return x, n


def _call(op, x, side, tile, store, eps):
    """The op on one side (0: CUDA, 1: CPU) of the operands: {output name: array}, finished by rms_final_reduce /
    lse_finish on that side's own partials."""
    o = {name: v[side] for name, v in x.items()}
    if op == "gemm_scalar_scale":
        return {"d": encore.gemm_scalar_scale(o["a"], o["w"], o["alpha"])}
    if op == "gemm_residual_rms_partial":
        y, aux, p = encore.gemm_residual_rms_partial(o["a"], o["w"], o["residual"], o["gamma"], tile)
        return {"d": y, "aux": aux, "partials": p, "r": encore.rms_final_reduce(p, y.shape[1], eps)}
    if op == "gemm_rope":
        return {"d": encore.gemm_rope(o["a"], o["w"], o["pos"], o["freq"], o.get("r"))}
    if op == "gemm_qkv_head_sqsum":
        d, p = encore.gemm_qkv_head_sqsum(o["a"], o["w"])
        return {"d": d, "partials": p}
    if op == "gemm_lse":
        p, d, tl = encore.gemm_lse(o["a"], o["w"], o.get("r"), o.get("target"), store, partial_tile_n=tile)
        out = {"partials": p, "d": d, "target_logit": tl}
        if tl is None:
            out["lse"] = encore.lse_finish(p)
        else:
            out["lse"], out["loss"] = encore.lse_finish(p, o["target"], tl)
        return {key: v for key, v in out.items() if v is not None}
    z, y = encore.gemm_swiglu(o["a"], o["w"], o.get("r"))
    return {"d": z, "aux": y}


@pytest.mark.parametrize("op", OPS)
@VALID
@given(seed=SEEDS, dt=st.sampled_from(["bf16", "f16"]), m=st.sampled_from([1, 2, 7, 33, 128, 130]), n=st.sampled_from([8, 16, 40, 128, 136]),
       k=st.sampled_from([8, 24, 64, 96]), pad=st.sampled_from([0, 0, 8]), flags=st.tuples(st.booleans(), st.booleans(), st.booleans()),
       tile=st.sampled_from([0, 128, 256]), n_any=st.sampled_from([1, 3, 8, 100, 257, 300]), eps=st.sampled_from([1e-6, 1e-5, 0.1]))
def test_gemm_wrappers_cuda_equal_cpu(op, seed, dt, m, n, k, pad, flags, tile, n_any, eps):
    dt = DT[dt]
    rng = np.random.default_rng(seed)
    x, n = _operands(op, rng, dt, m, n, k, pad, flags, n_any)
    got, ref = _call(op, x, 0, tile, flags[2], eps), _call(op, x, 1, tile, flags[2], eps)
    torch.cuda.synchronize()
    assert set(got) == set(ref), (set(got), set(ref))
    for key, want in ref.items():
        assert got[key].is_cuda and got[key].dtype == want.dtype, key
        if key == "loss":  # lse - target_logit: 0 on ignored rows, the lse's size elsewhere
            close_to_cpu(got[key], want, dt, STAT_TOL, floor=float(ref["lse"].norm()))
        else:
            close_to_cpu(got[key], want, dt, STAT_TOL if key in _STATS else None)
    if op == "gemm_swiglu":  # the interleaved layout on CUDA: z's even columns are a @ gate.T (times r)
        gate = x["gate"][1]
        r = x["r"][1] if "r" in x else torch.ones(m)
        close_to_cpu(got["d"][:, 0::2], encore.gemm_row_scale(x["a"][1], gate, r), dt)


def _strided(t):
    """t (a CUDA vector) as a view of stride 2: the same values, not contiguous."""
    buf = torch.zeros(2 * t.shape[0], dtype=t.dtype, device=t.device)
    buf[::2] = t
    return buf[::2]


_VECTORS = {"gemm_scalar_scale": (), "gemm_residual_rms_partial": ("gamma",), "gemm_rope": ("pos", "freq", "r"), "gemm_qkv_head_sqsum": (),
            "gemm_lse": ("r", "target"), "gemm_swiglu": ("r",)}
_NAMES = {"residual": ["c", "residual"], "r": ["row_scale", "r"]}


def _cuda_call(op, o, kw):
    calls = {"gemm_scalar_scale": lambda: encore.gemm_scalar_scale(o["a"], o["w"], o["alpha"]),
             "gemm_residual_rms_partial": lambda: encore.gemm_residual_rms_partial(o["a"], o["w"], o["residual"], o["gamma"], **kw),
             "gemm_rope": lambda: encore.gemm_rope(o["a"], o["w"], o["pos"], o["freq"], o.get("r")),
             "gemm_qkv_head_sqsum": lambda: encore.gemm_qkv_head_sqsum(o["a"], o["w"], **kw),
             "gemm_lse": lambda: encore.gemm_lse(o["a"], o["w"], o.get("r"), o.get("target"), True, **kw),
             "gemm_swiglu": lambda: encore.gemm_swiglu(o["a"], o["w"], o.get("r"))}
    return calls[op]


@pytest.mark.parametrize("op", OPS)
@INVALID
@given(seed=SEEDS, dt=st.sampled_from(["bf16", "f16"]),
       case=st.sampled_from(["cpu_operand", "w_cpu", "f32", "k_odd", "n_odd", "a_rows", "vec_strided", "freq_misaligned", "head_dim", "tile_n",
                             "gamma_f32"]))
def test_gemm_wrappers_cuda_refusals(op, seed, dt, case):
    dt = DT[dt]
    rng = np.random.default_rng(seed)
    m, n, k = int(rng.integers(2, 9)), 8 * int(rng.integers(1, 4)), 8 * int(rng.integers(1, 4))
    if case == "n_odd" and op != "gemm_lse":
        n = 12  # N = 12: 24 bytes a row of D (rope: 3 heads of 4, swiglu: F = 6, qkv_head_sqsum: heads of 4)
    if case == "k_odd":
        k = 12
    x, n = _operands(op, rng, dt, m, n, k, 0, (True, True, True), 24)
    if case == "n_odd" and op in ("gemm_rope", "gemm_qkv_head_sqsum"):
        x["w"] = _mat(rng, 12, k, dt)
        if op == "gemm_rope":
            freq = torch.from_numpy(encore.rope_freq_turns(3, 2, 4, 10000.0))
            x["freq"] = (freq.cuda(), freq)
    o = {name: v[0] for name, v in x.items()}
    kw, kind, names = {}, ValueError, []
    extra = [name for name in o if name not in ("a", "w", "gate")]
    vectors = _VECTORS[op]
    applies = {"cpu_operand": bool(extra), "n_odd": op != "gemm_lse", "vec_strided": bool(vectors), "freq_misaligned": op == "gemm_rope",
               "head_dim": op == "gemm_qkv_head_sqsum", "tile_n": op in ("gemm_residual_rms_partial", "gemm_lse"),
               "gamma_f32": op == "gemm_residual_rms_partial"}
    if not applies.get(case, True):
        case = "w_cpu"  # the case does not apply to this op: w on the CPU instead
    if case == "cpu_operand":
        name = extra[int(rng.integers(len(extra)))]
        o[name], names = x[name][1], _NAMES.get(name, [name])
    elif case == "w_cpu":
        o["w"], names = x["w"][1], ["w"]
    elif case == "f32":  # fp32 on CUDA: the CUDA GEMMs take bf16 / fp16
        for name in ("a", "w", "residual", "gamma"):
            if name in o:
                o[name] = o[name].float()
        names = ["a"]
    elif case == "k_odd":  # 24-byte rows of a and w: not the 16 bytes TMA moves
        kind, names = RuntimeError, ["a"]
    elif case == "n_odd":
        kind, names = RuntimeError, ["w"]
        if op == "gemm_qkv_head_sqsum":
            kw["head_dim"] = 4
    elif case == "a_rows":  # a's rows 8 elements longer than K + 4: 16-byte multiples no more
        o["a"], names = _mat(rng, m, k, dt, 1.0, 4)[0], ["a"]
    elif case == "vec_strided":
        name = vectors[int(rng.integers(len(vectors)))]
        o[name], names = _strided(o[name]), _NAMES.get(name, [name])
    elif case == "freq_misaligned":  # (hi, lo) pairs read as float2: 8-byte aligned on CUDA
        buf = torch.zeros(n + 1, dtype=torch.float32, device="cuda")
        buf[1:] = o["freq"]
        o["freq"], names = buf[1:], ["freq"]
    elif case == "head_dim":  # the CUDA kernel's heads are 128 columns
        kw["head_dim"], kind, names = int(rng.choice([8, 64])), RuntimeError, ["head_dim"]
    elif case == "tile_n":  # the CUDA kernels' partials are per tile N: 128 or 256
        kw["partial_tile_n"], kind, names = int(rng.choice([8, 64, 512])), RuntimeError, ["partial_tile_n"]
    elif case == "gamma_f32":
        o["gamma"], names = o["gamma"].float(), ["gamma"]
    refused(_cuda_call(op, o, kw), names, kinds=(kind,))


@INVALID
@given(seed=SEEDS, dt=st.sampled_from(["bf16", "f16", "f32"]), case=st.sampled_from(["both_cuda", "gate_cpu", "up_cpu", "up_shape", "gate_1d"]))
def test_interleave_gate_up_cuda_refusals(seed, dt, case):
    """interleave_gate_up builds the host layout gemm_swiglu reads (its valid draws: every gemm_swiglu draw above):
    CUDA tensors are refused (unsupported: RuntimeError naming gate), a mix of devices or a wrong shape is invalid."""
    dt = DT[dt]
    rng = np.random.default_rng(seed)
    f, k = int(rng.integers(1, 9)), int(rng.integers(1, 33))
    gate, up = pair(rng, (f, k), dt)[0], pair(rng, (f, k), dt)[0]
    kind, names = ValueError, ["up"]
    if case == "both_cuda":
        kind, names = RuntimeError, ["gate"]
    elif case == "gate_cpu":  # the output on the host with gate: the CUDA up refused against it
        gate = gate.cpu()
    elif case == "up_cpu":
        up = up.cpu()
    elif case == "up_shape":
        up = pair(rng, (f + 1, k), dt)[0]
    else:
        gate, names = gate[0], ["gate"]
    refused(lambda: encore.interleave_gate_up(gate, up), names, kinds=(kind,))
