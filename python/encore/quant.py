"""The quant family: FP8 e4m3 per-token-group (128) quantization and its CPU inverse."""
from __future__ import annotations

from . import _encore
from ._util import _dl, _empty, _is_torch, _ops, _stream_for, _via_torch_op

__all__ = ["fp8_group_quant", "fp8_group_dequant"]


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
