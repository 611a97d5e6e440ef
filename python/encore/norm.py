"""The norm family: RMSNorm, fused residual-add + RMSNorm, and QK-norm (per-head RMSNorm in place)."""
from __future__ import annotations

from . import _encore
from ._util import _dl, _empty_like, _ops, _rows, _rows_view, _stream_for, _via_torch_op

__all__ = ["rms_norm", "add_rms_norm", "qk_norm_"]

# Each wrapper sends torch tensors to torch.ops.encore when traced (_util._via_torch_op); the direct
# implementation below it is the op's kernel (encore.torch_ops) and the path for everything else.


def rms_norm(x, weight, eps: float = 1e-6, weight_offset: float = 0.0, stream=None):
    """y = x * rsqrt(mean(x**2, -1) + eps) * (weight + weight_offset), over the last dimension.

    x: [..., hidden] (bf16, fp16 or fp32; last dimension contiguous); weight: [hidden], same dtype.
    Returns y with x's shape and dtype.
    """
    if _via_torch_op(stream, x, weight):
        return _ops().rms_norm(x, weight, float(eps), float(weight_offset))
    return _rms_norm(x, weight, eps, weight_offset, stream=stream)


def _rms_norm(x, weight, eps, weight_offset, stream):
    x2 = _rows(x, "x")
    y = _empty_like(x2)
    _encore.rms_norm_out(*_dl(x2, weight, y), float(eps), float(weight_offset), _stream_for(x, stream))
    return y if x2 is x else y.reshape(x.shape)


def add_rms_norm(x, residual, weight, eps: float = 1e-6, weight_offset: float = 0.0, h_out=None, stream=None):
    """h = x + residual; y = rms_norm(h). Returns (y, h).

    h is rounded to the dtype before the normalization. Pass ``h_out=residual`` (or ``x``) to update
    the residual stream in place (h_out must be viewable as [rows, hidden]).
    """
    if _via_torch_op(stream, x, residual, weight, h_out):
        args = (float(eps), float(weight_offset))
        if h_out is None:
            return _ops().add_rms_norm(x, residual, weight, *args)
        if h_out is residual or h_out is x:  # in place: the op mutates its second operand (x + r = r + x)
            return _ops().add_rms_norm_(residual if h_out is x else x, h_out, weight, *args), h_out
        return _ops().add_rms_norm_out(x, residual, weight, *args, h_out), h_out
    return _add_rms_norm(x, residual, weight, eps, weight_offset, h_out, stream=stream)


def _add_rms_norm(x, residual, weight, eps, weight_offset, h_out=None, *, stream):
    x2, r2 = _rows(x, "x"), _rows(residual, "residual")
    y = _empty_like(x2)
    h = _empty_like(x2) if h_out is None else _rows_view(h_out, "h_out")
    _encore.add_rms_norm_out(*_dl(x2, r2, weight, y, h), float(eps), float(weight_offset), _stream_for(x, stream))
    if x2 is not x:
        y, h = y.reshape(x.shape), (h.reshape(x.shape) if h_out is None else h)
    return y, (h if h_out is None else h_out)


def qk_norm_(qkv, q_weight, k_weight, num_q_heads: int, num_kv_heads: int, head_dim: int = 128,
             eps: float = 1e-6, weight_offset: float = 0.0, stream=None):
    """In place: per-head RMSNorm of the Q and K heads of a fused QKV buffer; returns qkv.

    qkv: [tokens, (num_q_heads + 2 * num_kv_heads) * head_dim] (bf16 or fp16; any token stride that
    is a multiple of 8 elements); q_weight, k_weight: [head_dim]; head_dim 64, 128 or 256. V heads
    are left untouched.
    """
    args = (int(num_q_heads), int(num_kv_heads), int(head_dim), float(eps), float(weight_offset))
    if _via_torch_op(stream, qkv, q_weight, k_weight):
        _ops().qk_norm_(qkv, q_weight, k_weight, *args)
    else:
        _qk_norm(qkv, q_weight, k_weight, *args, stream=stream)
    return qkv


def _qk_norm(qkv, q_weight, k_weight, num_q_heads, num_kv_heads, head_dim, eps, weight_offset, *, stream):
    if getattr(qkv, "ndim", 0) != 2:
        raise ValueError("qkv: expected 2 dimensions [tokens, (num_q_heads + 2*num_kv_heads) * head_dim]")
    _encore.qk_norm_(*_dl(qkv, q_weight, k_weight), num_q_heads, num_kv_heads, head_dim, eps, weight_offset,
                     _stream_for(qkv, stream))
