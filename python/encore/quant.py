"""The quant family: FP8 e4m3 per-token-group (128) quantization and its CPU inverse; MXFP8 and NVFP4
(CPU backend only for now) and their inverses."""
from __future__ import annotations

from . import _encore
from ._util import _dl, _empty, _is_torch, _ops, _stream_for, _torch, _via_torch_op

__all__ = ["fp8_group_quant", "fp8_group_dequant", "mxfp8_quant", "mxfp8_dequant", "nvfp4_quant", "nvfp4_dequant"]


def fp8_group_quant(x, column_major_scales: bool = False, power_of_two_scales: bool = False, eps: float = 1e-10,
                    stream=None):
    """FP8 e4m3 per-token-group quantization, groups of 128 along the last dimension.

    x: [M, K] (bf16, fp16 or fp32; K a multiple of 128). Returns (q, scales): q [M, K] as
    torch.float8_e4m3fn for torch inputs, or the raw e4m3 bytes as a uint8 numpy array; scales
    [M, K // 128] float32 with s = max|x_group| / 448 (or the next power of two), q = e4m3(x / s).
    column_major_scales: the scales' storage is [K // 128, M] (returned as its transposed view).
    """
    if _via_torch_op(stream, x):
        return _ops().fp8_group_quant(x, bool(column_major_scales), bool(power_of_two_scales), float(eps))
    if getattr(x, "ndim", 0) != 2:
        raise ValueError("x: expected 2 dimensions [M, K]")
    m, k = x.shape
    q = _empty(x, (m, k), "u8")
    if column_major_scales:
        s = _empty(x, (k // 128, m), "f32")
        scales = s.T
    else:
        scales = _empty(x, (m, k // 128), "f32")
    _encore.fp8_group_quant_out(*_dl(x, q, scales), bool(power_of_two_scales), float(eps), _stream_for(x, stream))
    if _is_torch(x):
        import torch

        q = q.view(torch.float8_e4m3fn)
    return q, scales


def fp8_group_dequant(q, scales, stream=None):
    """The inverse on the CPU backend: float32 [M, K] = float(q) * scale of the element's group.
    stream: as for the other ops (an explicit one takes the direct path; the CPU backend ignores it)."""
    if _is_torch(q):
        import torch

        q = q.view(torch.uint8) if q.dtype != torch.uint8 else q  # the op takes the e4m3 bytes
    if _via_torch_op(stream, q, scales):
        return _ops().fp8_group_dequant(q, scales)
    m, k = q.shape
    out = _empty(q, (m, k), "f32")
    _encore.fp8_group_dequant_out(*_dl(q, scales, out))
    return out


def _mx_scales(x, m, k, block, swizzled):
    """The scale buffer: [M, K / block] bytes, or the swizzled [ceil(M/128)*128, ceil(K/block/4)*4]."""
    rows, cols = m, k // block
    if swizzled:
        rows, cols = -(-rows // 128) * 128, -(-cols // 4) * 4
    return _empty(x, (rows, cols), "u8")


def _matrix(x):
    if getattr(x, "ndim", 0) != 2:
        raise ValueError("x: expected 2 dimensions [M, K]")
    return x.shape


def _bytes(a):
    """A torch float8 tensor as its uint8 view (the bindings take the raw bytes)."""
    if _is_torch(a) and a.dtype != _torch().uint8:
        return a.view(_torch().uint8)
    return a


def mxfp8_quant(x, swizzled: bool = False, rounding: str = "floor"):
    """MXFP8 (OCP MX v1.0) on the CPU backend: e4m3 elements, one e8m0 scale per 32 columns.

    x: [M, K] (bf16, fp16 or fp32; K a multiple of 32). Returns (q, scales): q [M, K] e4m3 bytes
    (torch.float8_e4m3fn for torch inputs, uint8 for numpy), scales uint8 e8m0 (2^(s - 127); 0xff
    NaN), [M, K // 32] or, swizzled, the 128x4-tiled buffer Blackwell's block-scaled GEMMs read.
    rounding: "floor" (the spec: floor(log2(amax)) - 8) or "rceil" (2^ceil(log2(amax / 448)))."""
    if rounding not in ("floor", "rceil"):
        raise ValueError('rounding: "floor" or "rceil"')
    m, k = _matrix(x)
    q = _empty(x, (m, k), "u8")
    scales = _mx_scales(x, m, k, 32, swizzled)
    _encore.mxfp8_quant_out(*_dl(x, q, scales), bool(swizzled), rounding == "rceil")
    if _is_torch(x):
        q = q.view(_torch().float8_e4m3fn)
    return q, scales


def mxfp8_dequant(q, scales, swizzled: bool = False):
    """The inverse (CPU): float32 [M, K] = float(q) * 2^(scale - 127)."""
    q = _bytes(q)
    out = _empty(q, tuple(q.shape), "f32")
    _encore.mxfp8_dequant_out(*_dl(q, scales, out), bool(swizzled))
    return out


def nvfp4_quant(x, swizzled: bool = False, global_scale: float | None = None):
    """NVFP4 on the CPU backend: e2m1 elements two a byte (even column in the low nibble), one e4m3
    scale per 16 columns, one fp32 global scale (amax / (6 * 448) unless given).

    Returns (q [M, K // 2] uint8, scales (torch.float8_e4m3fn for torch inputs, uint8 bytes for
    numpy) [M, K // 16] or the swizzled buffer, global_scale float32 [1])."""
    m, k = _matrix(x)
    q = _empty(x, (m, k // 2), "u8")
    scales = _mx_scales(x, m, k, 16, swizzled)
    g = _empty(x, (1,), "f32")
    _encore.nvfp4_quant_out(*_dl(x, q, scales, g), bool(swizzled), float(global_scale or 0.0))
    if _is_torch(x):
        scales = scales.view(_torch().float8_e4m3fn)
    return q, scales, g


def nvfp4_dequant(q, scales, global_scale, swizzled: bool = False):
    """The inverse (CPU): float32 [M, 2 * q.shape[1]] = e2m1(q) * float(scale) * global_scale."""
    scales = _bytes(scales)
    out = _empty(q, (q.shape[0], 2 * q.shape[1]), "f32")
    _encore.nvfp4_dequant_out(*_dl(q, scales, global_scale, out), bool(swizzled))
    return out
