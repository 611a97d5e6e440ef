"""Property-based fuzzing on CUDA of the quant family's inverses (the GPU machine; skipped elsewhere):
mxfp8_dequant and nvfp4_dequant on CUDA tensors against the CPU backend on the same bytes, bit for bit
(include/encore/quant.hpp: fp32, left to right on both), over codes from the quantizations and over
random bytes (every e4m3 / e2m1 code, NaN and huge scales included), row-major and swizzled scales;
fp8_group_dequant, the CPU backend's only (CUDA codes refused with a RuntimeError naming q), on the host
copies of the CUDA quantization's outputs: bit-identical to the CPU quantization's round trip and within
e4m3's rounding of x. Invalid draws: CPU and CUDA tensors mixed, misaligned or wrongly typed codes and
scales: ValueError (invalid) or RuntimeError (unsupported on CUDA) naming the argument.

Seeds: hypothesis with derandomize=True (fuzz_util.VALID: 200 draws, INVALID: 100 draws per test)."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import encore
from fuzz_cuda_util import DT, pair
from fuzz_util import INVALID, SEEDS, VALID, refused, torch  # noqa: F401
from helpers import needs_torch_cuda

pytestmark = needs_torch_cuda


def _same(got, ref):
    """got (CUDA) equals ref (CPU) value for value, NaN where ref has NaN (payloads may differ)."""
    g = got.cpu()
    nan = torch.isnan(ref)
    assert g.dtype == ref.dtype and g.shape == ref.shape
    assert torch.equal(torch.isnan(g), nan), "NaN in other places than the CPU backend's"
    assert torch.equal(g[~nan], ref[~nan]), "differs from the CPU backend"


def _bytes(rng, shape):
    return torch.from_numpy(rng.integers(0, 256, shape, dtype=np.uint8))


def _mx_scale_shape(rows, scale_cols, swizzled):
    return (-(-rows // 128) * 128, -(-scale_cols // 4) * 4) if swizzled else (rows, scale_cols)


@VALID
@given(seed=SEEDS, dt=st.sampled_from(["bf16", "f16", "f32"]), rows=st.sampled_from([1, 3, 17, 128, 130]),
       groups=st.sampled_from([1, 2, 7]), col=st.booleans(), pow2=st.booleans())
def test_fp8_group_dequant_of_cuda_codes(seed, dt, rows, groups, col, pow2):
    """fp8_group_dequant runs on the CPU backend only (include/encore/quant.hpp): the CUDA codes are refused
    (unsupported: RuntimeError naming q); their host copies dequantize bit-identically to the CPU
    quantization's, within e4m3's rounding (half a unit of 3 mantissa bits, or of the subnormal step 2^-9)."""
    dt = DT[dt]
    rng = np.random.default_rng(seed)
    xg, xc = pair(rng, (rows, 128 * groups), dt, 3.0)
    qg, sg = encore.fp8_group_quant(xg, column_major_scales=col, power_of_two_scales=pow2)
    qc, sc = encore.fp8_group_quant(xc, column_major_scales=col, power_of_two_scales=pow2)
    refused(lambda: encore.fp8_group_dequant(qg, sg), ["q"], kinds=(RuntimeError,))
    got = encore.fp8_group_dequant(qg.cpu(), sg.cpu())
    ref = encore.fp8_group_dequant(qc, sc)
    _same(got, ref)
    s = sc.double().repeat_interleave(128, 1)
    x = xc.double()
    assert ((ref.double() - x).abs() <= 2.0**-4 * x.abs() * (1 + 1e-5) + s * 2.0**-10).all()


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
@VALID
@given(seed=SEEDS, dt=st.sampled_from(["bf16", "f16", "f32"]), rows=st.sampled_from([1, 5, 128, 130]),
       blocks=st.sampled_from([1, 3, 8, 33]), swizzled=st.booleans(), source=st.sampled_from(["quant", "bytes"]))
def test_mx_dequant_cuda_equals_cpu(fmt, seed, dt, rows, blocks, swizzled, source):
    """mxfp8_dequant / nvfp4_dequant on CUDA against the CPU backend, bit for bit: on the quantization's codes
    (of x in dt) or on random bytes (every code, NaN scales, products past fp32's range)."""
    dt = DT[dt]
    rng = np.random.default_rng(seed)
    k = 32 * blocks
    if source == "quant":
        _, xc = pair(rng, (rows, k), dt, 3.0)
        if fmt == "mxfp8":
            q, s = encore.mxfp8_quant(xc, swizzled=swizzled)
        else:
            q, s, gs = encore.nvfp4_quant(xc, swizzled=swizzled)
    elif fmt == "mxfp8":
        q = _bytes(rng, (rows, k)).view(torch.float8_e4m3fn)
        s = _bytes(rng, _mx_scale_shape(rows, k // 32, swizzled))
    else:
        q = _bytes(rng, (rows, k // 2))
        s = _bytes(rng, _mx_scale_shape(rows, k // 16, swizzled)).view(torch.float8_e4m3fn)
        gs = torch.tensor([float(rng.choice([1.0, 2.0**-20, 3.7e-3, 1e30]))], dtype=torch.float32)
    if fmt == "mxfp8":
        got = encore.mxfp8_dequant(q.cuda(), s.cuda(), swizzled=swizzled)
        ref = encore.mxfp8_dequant(q, s, swizzled=swizzled)
    else:
        got = encore.nvfp4_dequant(q.cuda(), s.cuda(), gs.cuda(), swizzled=swizzled)
        ref = encore.nvfp4_dequant(q, s, gs, swizzled=swizzled)
    assert got.is_cuda and got.dtype == torch.float32
    _same(got, ref)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4", "fp8_group"])
@INVALID
@given(seed=SEEDS, case=st.sampled_from(["scales_cpu", "q_cpu", "q_misaligned", "q_f16", "scales_f32", "global_cpu", "k_odd", "cuda_codes"]))
def test_dequant_cuda_refusals(fmt, seed, case):
    rng = np.random.default_rng(seed)
    m, k = int(rng.integers(2, 6)), 32 * int(rng.integers(1, 5))
    if fmt == "fp8_group":
        k = 128 * int(rng.integers(1, 3))
        q, s = encore.fp8_group_quant(torch.from_numpy(rng.standard_normal((m, k))).to(torch.bfloat16).cuda())
        kind, names = ValueError, ["scales"]
        if case in ("cuda_codes", "q_misaligned", "global_cpu", "k_odd"):  # the CPU backend's only: CUDA codes
            kind, names = RuntimeError, ["q"]
        elif case == "q_f16":
            q, s, names = q.cpu().to(torch.float16), s.cpu(), ["q"]
        elif case == "scales_f32":
            q, s = q.cpu(), s.cpu().double()
        else:  # host codes with CUDA scales (scales_cpu, q_cpu)
            q = q.cpu()
        refused(lambda: encore.fp8_group_dequant(q, s), names, kinds=(kind,))
        return
    half = fmt == "nvfp4"
    qc = _bytes(rng, (m, k // 2 if half else k))
    q = qc.cuda() if half else qc.cuda().view(torch.float8_e4m3fn)
    s = _bytes(rng, (m, k // (16 if half else 32))).cuda()
    if half:
        s = s.view(torch.float8_e4m3fn)
    gs = torch.ones(1, device="cuda")
    kind, names = ValueError, [case.split("_")[0]]
    if case == "scales_cpu":
        s = s.cpu()
    elif case == "q_cpu":  # the output x is allocated on q's device: the CUDA scales are refused against it
        q, names = q.cpu(), ["scales"]
    elif case == "q_misaligned":  # codes at an odd byte address: the CUDA alignment rule of q, 8 (4) bytes, is
        # invalid (ValueError "<fmt> on CUDA: q's data pointer ...", src/quant/mx_quant.cpp validate_cuda)
        buf = torch.zeros(qc.numel() + 16, dtype=torch.uint8, device="cuda")
        q = buf[1:1 + qc.numel()].view(qc.shape)
        q = q if half else q.view(torch.float8_e4m3fn)
    elif case == "q_f16":
        q = q.view(torch.uint8).to(torch.float16)
    elif case == "scales_f32":
        s = s.view(torch.uint8).float()
    elif case == "global_cpu" and half:
        gs, names = gs.cpu(), ["global_scale"]
    elif case == "k_odd":  # K not a multiple of the block
        q, names = q[:, :(k // 2 if half else k) - 4], ["q"]
    else:  # global_cpu for mxfp8, cuda_codes: a swizzled layout of the wrong shape instead
        refused(lambda: encore.mxfp8_dequant(q, s, swizzled=True) if not half else encore.nvfp4_dequant(q, s, gs, swizzled=True),
                ["scales"])
        return
    refused(lambda: encore.nvfp4_dequant(q, s, gs) if half else encore.mxfp8_dequant(q, s), names, kinds=(kind,))
