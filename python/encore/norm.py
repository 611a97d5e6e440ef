"""The norm family (include/encore/norm.hpp): RMSNorm, fused residual-add + RMSNorm, and QK-norm (per-head
RMSNorm in place).

Each public function calls its launcher (one binding call over the C++ Args / Options structs)
directly for numpy arrays and eager torch tensors, and torch.ops.encore.<op> (declared here on the
same launcher) when traced (_core.eager)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from . import _encore as _b
from ._core import as_float, as_int, dl, eager, empty_like, native, ops, plain_op, rows, rows_view, stream_for, torch_op

if TYPE_CHECKING:  # the ops' string annotations (torch.library.infer_schema reads them)
    from torch import Tensor

__all__ = ["rms_norm", "add_rms_norm", "qk_norm_"]

_OPTIONS = {}  # (eps, weight_offset) -> RmsNormOptions: built once per distinct value


def _options(eps, weight_offset):
    key = (eps, weight_offset)
    o = _OPTIONS.get(key)
    if o is None:
        o = _OPTIONS[key] = _b.RmsNormOptions(float(eps), float(weight_offset))
    return o


# --- launchers: one binding call each; stream None is torch's current stream -------------------------

def _rms_norm_launch(x, weight, eps, weight_offset, stream):
    x2 = x if getattr(x, "ndim", 0) == 2 else rows(x, "x")
    y = empty_like(x2)
    _b.rms_norm_run(_b.RmsNormArgs(dl(x2), dl(weight), dl(y)), _options(eps, weight_offset), None, stream_for(x, stream))
    return y if x2 is x else y.reshape(x.shape)


def _add_rms_norm_launch(x, residual, weight, eps, weight_offset, h, stream):
    """y = rms_norm(x + residual) with h = x + residual written to `h` (None: a new array); (y, h)."""
    x2, r2 = rows(x, "x"), rows(residual, "residual")
    y = empty_like(x2)
    h2 = empty_like(x2) if h is None else rows_view(h, "h_out")
    _b.add_rms_norm_run(_b.AddRmsNormArgs(dl(x2), dl(r2), dl(weight), dl(y), dl(h2)), _options(eps, weight_offset), None,
                        stream_for(x, stream))
    if x2 is not x:
        y = y.reshape(x.shape)
        h2 = h2.reshape(x.shape) if h is None else h
    return y, (h2 if h is None else h)


def _qk_norm_launch(qkv, q_weight, k_weight, num_q_heads, num_kv_heads, head_dim, eps, weight_offset, stream):
    if getattr(qkv, "ndim", 0) != 2:
        raise ValueError("qkv: expected 2 dimensions [tokens, (num_q_heads + 2*num_kv_heads) * head_dim]")
    _b.qk_norm_run(_b.QkNormArgs(dl(qkv), dl(q_weight), dl(k_weight)),
                   _b.QkNormOptions(num_q_heads, num_kv_heads, head_dim, eps, weight_offset), None, stream_for(qkv, stream))


# --- torch.ops.encore: the launchers on torch's current stream ----------------------------------------

def _fake_like(x, *_):
    return x.new_empty(x.shape)


@torch_op("rms_norm", fake=_fake_like)
def _rms_norm(x: Tensor, weight: Tensor, eps: float, weight_offset: float) -> Tensor:
    return _rms_norm_launch(x, weight, eps, weight_offset, None)


@torch_op("add_rms_norm", fake=lambda x, *_: (x.new_empty(x.shape), x.new_empty(x.shape)))
def _add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float, weight_offset: float) -> tuple[Tensor, Tensor]:
    return _add_rms_norm_launch(x, residual, weight, eps, weight_offset, None, None)


@torch_op("add_rms_norm_", fake=_fake_like, mutates=("residual",))
def _add_rms_norm_inplace(x: Tensor, residual: Tensor, weight: Tensor, eps: float, weight_offset: float) -> Tensor:
    """y; residual becomes x + residual (an op's output may not alias its input: h is not returned)."""
    return _add_rms_norm_launch(x, residual, weight, eps, weight_offset, residual, None)[0]


@torch_op("add_rms_norm_out", fake=_fake_like, mutates=("h_out",))
def _add_rms_norm_out(x: Tensor, residual: Tensor, weight: Tensor, eps: float, weight_offset: float, h_out: Tensor) -> Tensor:
    return _add_rms_norm_launch(x, residual, weight, eps, weight_offset, h_out, None)[0]


@torch_op("qk_norm_", fake=lambda *_: None, mutates=("qkv",))
def _qk_norm(qkv: Tensor, q_weight: Tensor, k_weight: Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int, eps: float,
             weight_offset: float) -> None:
    _qk_norm_launch(qkv, q_weight, k_weight, num_q_heads, num_kv_heads, head_dim, eps, weight_offset, None)


# --- public API ---------------------------------------------------------------------------------------

def rms_norm(x, weight, eps: float = 1e-6, weight_offset: float = 0.0, stream=None):
    """y = x * rsqrt(mean(x**2, -1) + eps) * (weight + weight_offset), over the last dimension.

    x: [..., hidden] (bf16, fp16 or fp32; last dimension contiguous); weight: [hidden], same dtype.
    Returns y with x's shape and dtype. stream: a CUDA stream handle (int) to launch on instead of
    torch's current stream (the call then never goes through torch.ops)."""
    if stream is None and type(eps) is float and type(weight_offset) is float:
        op = plain_op("rms_norm", x, weight)
        if op is not None:
            return op(x, weight, eps, weight_offset)
    eps, weight_offset = as_float(eps, "eps"), as_float(weight_offset, "weight_offset")
    if stream is None:
        if not eager(x, weight):
            return ops().rms_norm(x, weight, eps, weight_offset)
        op = native(x, "rms_norm", weight)
        if op is not None:
            return op(x, weight, eps, weight_offset)
    return _rms_norm_launch(x, weight, eps, weight_offset, stream)


def add_rms_norm(x, residual, weight, eps: float = 1e-6, weight_offset: float = 0.0, h_out=None, stream=None):
    """h = x + residual; y = rms_norm(h). Returns (y, h).

    h is rounded to the dtype before the normalization. Pass ``h_out=residual`` (or ``x``) to update
    the residual stream in place (h_out must be viewable as [rows, hidden])."""
    eps, weight_offset = as_float(eps, "eps"), as_float(weight_offset, "weight_offset")
    given = (residual, weight) if h_out is None else (residual, weight, h_out)
    if stream is None and (not eager(x, *given) or native(x, "add_rms_norm", *given) is not None):
        o, args = ops(), (eps, weight_offset)
        if h_out is None:
            return o.add_rms_norm(x, residual, weight, *args)
        if h_out is residual or h_out is x:  # in place: the op mutates its second operand (x + r = r + x)
            return o.add_rms_norm_(residual if h_out is x else x, h_out, weight, *args), h_out
        return o.add_rms_norm_out(x, residual, weight, *args, h_out), h_out
    return _add_rms_norm_launch(x, residual, weight, eps, weight_offset, h_out, stream)


def qk_norm_(qkv, q_weight, k_weight, num_q_heads: int, num_kv_heads: int, head_dim: int = 128,
             eps: float = 1e-6, weight_offset: float = 0.0, stream=None):
    """In place: per-head RMSNorm of the Q and K heads of a fused QKV buffer; returns qkv.

    qkv: [tokens, (num_q_heads + 2 * num_kv_heads) * head_dim] (bf16 or fp16; any token stride that
    is a multiple of 8 elements); q_weight, k_weight: [head_dim]; head_dim 64, 128 or 256. V heads
    are left untouched."""
    args = (as_int(num_q_heads, "num_q_heads"), as_int(num_kv_heads, "num_kv_heads"), as_int(head_dim, "head_dim"),
            as_float(eps, "eps"), as_float(weight_offset, "weight_offset"))
    if stream is None:
        op = ops().qk_norm_ if not eager(qkv, q_weight, k_weight) else native(qkv, "qk_norm_", q_weight, k_weight)
        if op is not None:
            op(qkv, q_weight, k_weight, *args)
            return qkv
    _qk_norm_launch(qkv, q_weight, k_weight, *args, stream)
    return qkv
