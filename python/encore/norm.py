"""The norm family: RMSNorm, fused residual-add + RMSNorm, and QK-norm (per-head RMSNorm in place)."""
from __future__ import annotations

from . import _encore
from ._util import _empty_like, _no_autograd, _rows, _stream_for

__all__ = ["rms_norm", "add_rms_norm", "qk_norm_"]


def rms_norm(x, weight, eps: float = 1e-6, weight_offset: float = 0.0, stream=None):
    """y = x * rsqrt(mean(x**2, -1) + eps) * (weight + weight_offset), over the last dimension.

    x: [..., hidden] (bf16, fp16 or fp32; last dimension contiguous); weight: [hidden], same dtype.
    Returns y with x's shape and dtype.
    """
    _no_autograd(x, weight)
    x2 = _rows(x, "x")
    y = _empty_like(x2)
    _encore.rms_norm_out(x2, weight, y, float(eps), float(weight_offset), _stream_for(x, stream))
    return y.reshape(x.shape)


def add_rms_norm(x, residual, weight, eps: float = 1e-6, weight_offset: float = 0.0, h_out=None, stream=None):
    """h = x + residual; y = rms_norm(h). Returns (y, h).

    h is rounded to the dtype before the normalization. Pass ``h_out=residual`` (or ``x``) to update
    the residual stream in place.
    """
    _no_autograd(x, residual, weight)
    x2, r2 = _rows(x, "x"), _rows(residual, "residual")
    y = _empty_like(x2)
    h = _empty_like(x2) if h_out is None else _rows(h_out, "h_out")
    _encore.add_rms_norm_out(x2, r2, weight, y, h, float(eps), float(weight_offset), _stream_for(x, stream))
    return y.reshape(x.shape), (h.reshape(x.shape) if h_out is None else h_out)


def qk_norm_(qkv, q_weight, k_weight, num_q_heads: int, num_kv_heads: int, head_dim: int = 128,
             eps: float = 1e-6, weight_offset: float = 0.0, stream=None):
    """In place: per-head RMSNorm of the Q and K heads of a fused QKV buffer; returns qkv.

    qkv: [tokens, (num_q_heads + 2 * num_kv_heads) * head_dim] (bf16 or fp16; any token stride that
    is a multiple of 8 elements); q_weight, k_weight: [head_dim]; head_dim 64, 128 or 256. V heads
    are left untouched.
    """
    _no_autograd(qkv, q_weight, k_weight)
    if getattr(qkv, "ndim", 0) != 2:
        raise ValueError("qkv: expected 2 dimensions [tokens, (num_q_heads + 2*num_kv_heads) * head_dim]")
    _encore.qk_norm_(qkv, q_weight, k_weight, int(num_q_heads), int(num_kv_heads), int(head_dim), float(eps),
                     float(weight_offset), _stream_for(qkv, stream))
    return qkv
