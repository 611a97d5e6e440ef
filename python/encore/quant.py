"""The quant family (include/encore/quant.hpp): FP8 e4m3 per-token-group (128) quantization and its CPU
inverse; MXFP8 and NVFP4 and their inverses.

Each public function calls its launcher (one binding call over the C++ Args / Options structs)
directly for numpy arrays and eager torch tensors; fp8_group_quant / fp8_group_dequant go through
torch.ops.encore.<op> (declared here on the same launchers) when traced (_core.eager). fp8 e4m3
tensors cross the binding as their uint8 bytes."""
from __future__ import annotations

from typing import TYPE_CHECKING

from . import _encore as _b
from ._core import as_float, dl, eager, empty, is_torch, matrix_shape, ops, stream_for, torch_module, torch_op

if TYPE_CHECKING:  # the ops' string annotations (torch.library.infer_schema reads them)
    from torch import Tensor

__all__ = ["fp8_group_quant", "fp8_group_dequant", "mxfp8_quant", "mxfp8_dequant", "nvfp4_quant", "nvfp4_dequant"]

_OPTIONS = {}  # (power_of_two_scales, eps) -> Fp8GroupQuantOptions
_MX_OPTIONS = {}  # (swizzled, rceil, global_scale) -> MxQuantOptions


def _options(power_of_two_scales, eps):
    key = (bool(power_of_two_scales), float(eps))
    o = _OPTIONS.get(key)
    if o is None:
        o = _OPTIONS[key] = _b.Fp8GroupQuantOptions(power_of_two_scales=key[0], eps=key[1])
    return o


def _mx_options(swizzled, rceil=False, global_scale=0.0):
    key = (bool(swizzled), bool(rceil), float(global_scale))
    o = _MX_OPTIONS.get(key)
    if o is None:
        o = _MX_OPTIONS[key] = _b.MxQuantOptions(_b.MxScaleLayout.swizzled if key[0] else _b.MxScaleLayout.row_major,
                                                 _b.MxScaleRounding.rceil if key[1] else _b.MxScaleRounding.floor, key[2])
    return o


def _matrix(x):
    if getattr(x, "ndim", 0) != 2:
        raise ValueError("x: expected 2 dimensions [M, K]")
    return x.shape


def _codes(q, layout):
    """The (m, k) of the codes q: 2-D, else ValueError (TypeError for a non-array) naming q."""
    return matrix_shape(q, "q", 2, layout)


def _as_fp8(a):
    """Bytes written by the binding as a torch float8_e4m3fn view (numpy: the uint8 bytes)."""
    return a.view(torch_module().float8_e4m3fn) if is_torch(a) else a


def _bytes(a):
    """A torch float8_e4m3fn tensor as its uint8 view (the bindings take the raw bytes); any other
    array as it is (a tensor of another dtype is refused by the binding, not reinterpreted as bytes)."""
    if is_torch(a) and a.dtype == torch_module().float8_e4m3fn:
        return a.view(torch_module().uint8)
    return a


# --- launchers: one binding call each; stream None is torch's current stream -------------------------

def _fp8_group_quant_launch(x, column_major_scales, power_of_two_scales, eps, stream):
    m, k = _matrix(x)
    q = empty(x, (m, k), "u8")
    scales = empty(x, (k // 128, m), "f32").T if column_major_scales else empty(x, (m, k // 128), "f32")
    _b.fp8_group_quant_run(_b.Fp8GroupQuantArgs(dl(x), dl(q), dl(scales)), _options(power_of_two_scales, eps), None,
                           stream_for(x, stream))
    return _as_fp8(q), scales


def _fp8_group_dequant_launch(q, scales):
    """q: the e4m3 bytes (uint8)."""
    m, k = _codes(q, "[M, K]")
    out = empty(q, (m, k), "f32")
    _b.fp8_group_dequant_run(_b.Fp8GroupDequantArgs(dl(q), dl(scales), dl(out)), _options(False, 1e-10))
    return out


def _mx_scales(x, m, k, block, swizzled):
    """The scale buffer: [M, K / block] bytes, or the swizzled [ceil(M/128)*128, ceil(K/block/4)*4]."""
    rows, cols = m, k // block
    if swizzled:
        rows, cols = -(-rows // 128) * 128, -(-cols // 4) * 4
    return empty(x, (rows, cols), "u8")


def _mxfp8_quant_launch(x, swizzled, rceil, stream):
    m, k = _matrix(x)
    q = empty(x, (m, k), "u8")
    scales = _mx_scales(x, m, k, 32, swizzled)
    _b.mxfp8_quant_run(_b.Mxfp8QuantArgs(dl(x), dl(q), dl(scales)), _mx_options(swizzled, rceil), None, stream_for(x, stream))
    return _as_fp8(q), scales


def _mxfp8_dequant_launch(q, scales, swizzled, stream):
    q = _bytes(q)
    m, k = _codes(q, "[M, K]")
    if k % 32:
        raise ValueError(f"q: K = {k} must be a multiple of 32 (the mxfp8 block)")
    out = empty(q, (m, k), "f32")
    _b.mxfp8_dequant_run(_b.Mxfp8DequantArgs(dl(q), dl(scales), dl(out)), _mx_options(swizzled), stream_for(q, stream))
    return out


def _nvfp4_quant_launch(x, swizzled, global_scale, stream):
    m, k = _matrix(x)
    q = empty(x, (m, k // 2), "u8")
    scales = _mx_scales(x, m, k, 16, swizzled)
    g = empty(x, (1,), "f32")
    _b.nvfp4_quant_run(_b.Nvfp4QuantArgs(dl(x), dl(q), dl(scales), dl(g)), _mx_options(swizzled, False, global_scale or 0.0), None,
                       stream_for(x, stream))
    return q, _as_fp8(scales), g


def _nvfp4_dequant_launch(q, scales, global_scale, swizzled, stream):
    scales = _bytes(scales)
    m, half = _codes(q, "[M, K / 2]")
    if half % 8:
        raise ValueError(f"q: K / 2 = {half} must be a multiple of 8 (K a multiple of the nvfp4 block, 16)")
    out = empty(q, (m, 2 * half), "f32")
    _b.nvfp4_dequant_run(_b.Nvfp4DequantArgs(dl(q), dl(scales), dl(global_scale), dl(out)), _mx_options(swizzled), stream_for(q, stream))
    return out


# --- torch.ops.encore: the launchers on torch's current stream ----------------------------------------

def _fp8_group_quant_fake(x, column_major_scales, power_of_two_scales, eps):
    torch = torch_module()
    m, k = x.shape
    f32 = torch.float32
    scales = x.new_empty((k // 128, m), dtype=f32).T if column_major_scales else x.new_empty((m, k // 128), dtype=f32)
    return x.new_empty((m, k), dtype=torch.float8_e4m3fn), scales


@torch_op("fp8_group_quant", fake=_fp8_group_quant_fake)
def _fp8_group_quant(x: Tensor, column_major_scales: bool, power_of_two_scales: bool, eps: float) -> tuple[Tensor, Tensor]:
    return _fp8_group_quant_launch(x, column_major_scales, power_of_two_scales, eps, None)


@torch_op("fp8_group_dequant", fake=lambda q, s: q.new_empty(q.shape, dtype=torch_module().float32))
def _fp8_group_dequant(q: Tensor, scales: Tensor) -> Tensor:
    return _fp8_group_dequant_launch(q, scales)


# --- public API ---------------------------------------------------------------------------------------

def fp8_group_quant(x, column_major_scales: bool = False, power_of_two_scales: bool = False, eps: float = 1e-10,
                    stream=None):
    """FP8 e4m3 per-token-group quantization, groups of 128 along the last dimension.

    x: [M, K] (bf16, fp16 or fp32; K a multiple of 128). Returns (q, scales): q [M, K] as
    torch.float8_e4m3fn for torch inputs, or the raw e4m3 bytes as a uint8 numpy array; scales
    [M, K // 128] float32 with s = max|x_group| / 448 (or the next power of two), q = e4m3(x / s).
    column_major_scales: the scales' storage is [K // 128, M] (returned as its transposed view).
    """
    eps = as_float(eps, "eps")
    if stream is None and not eager(x):
        return tuple(ops().fp8_group_quant(x, bool(column_major_scales), bool(power_of_two_scales), eps))
    return _fp8_group_quant_launch(x, column_major_scales, power_of_two_scales, eps, stream)


def fp8_group_dequant(q, scales, stream=None):
    """The inverse on the CPU backend: float32 [M, K] = float(q) * scale of the element's group.
    stream: as for the other ops (an explicit one takes the direct path; the CPU backend ignores it)."""
    q = _bytes(q)  # the op takes the e4m3 bytes
    if stream is None and not eager(q, scales):
        return ops().fp8_group_dequant(q, scales)
    return _fp8_group_dequant_launch(q, scales)


def mxfp8_quant(x, swizzled: bool = False, rounding: str = "floor"):
    """MXFP8 (OCP MX v1.0) on the CPU backend: e4m3 elements, one e8m0 scale per 32 columns.

    x: [M, K] (bf16, fp16 or fp32; K a multiple of 32). Returns (q, scales): q [M, K] e4m3 bytes
    (torch.float8_e4m3fn for torch inputs, uint8 for numpy), scales uint8 e8m0 (2^(s - 127); 0xff
    NaN), [M, K // 32] or, swizzled, the 128x4-tiled buffer Blackwell's block-scaled GEMMs read.
    rounding: "floor" (the spec: floor(log2(amax)) - 8) or "rceil" (2^ceil(log2(amax / 448)))."""
    if rounding not in ("floor", "rceil"):
        raise ValueError('rounding: "floor" or "rceil"')
    return _mxfp8_quant_launch(x, swizzled, rounding == "rceil", None)


def mxfp8_dequant(q, scales, swizzled: bool = False):
    """The inverse (CPU): float32 [M, K] = float(q) * 2^(scale - 127)."""
    return _mxfp8_dequant_launch(q, scales, swizzled, None)


def nvfp4_quant(x, swizzled: bool = False, global_scale: float | None = None):
    """NVFP4 on the CPU backend: e2m1 elements two a byte (even column in the low nibble), one e4m3
    scale per 16 columns, one fp32 global scale (amax / (6 * 448) unless given).

    Returns (q [M, K // 2] uint8, scales (torch.float8_e4m3fn for torch inputs, uint8 bytes for
    numpy) [M, K // 16] or the swizzled buffer, global_scale float32 [1])."""
    return _nvfp4_quant_launch(x, swizzled, None if global_scale is None else as_float(global_scale, "global_scale"), None)


def nvfp4_dequant(q, scales, global_scale, swizzled: bool = False):
    """The inverse (CPU): float32 [M, 2 * q.shape[1]] = e2m1(q) * float(scale) * global_scale."""
    return _nvfp4_dequant_launch(q, scales, global_scale, swizzled, None)
