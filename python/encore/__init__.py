"""encore: fused transformer kernels for NVIDIA Hopper with a CPU reference backend.

Arrays are exchanged through DLPack: numpy arrays (CPU backend) and torch tensors (CPU backend, or
the CUDA backend for CUDA tensors). Outputs are allocated with the caller's framework; CUDA work
runs on torch's current stream unless ``stream`` is given. Invalid arguments raise ``ValueError``
with encore's message, other failures ``RuntimeError``.
"""
from __future__ import annotations

from . import _encore
from ._util import _empty, _empty_like, _is_torch, _no_autograd, _rows, _stream_for
from .gemm import (gemm_lse, gemm_qkv_head_sqsum, gemm_residual_rms_partial, gemm_rope, gemm_row_scale, gemm_scalar_scale,
                   gemm_swiglu, interleave_gate_up, llama_block_forward, llama_block_workspace_bytes, lse_finish, qk_norm_rope_,
                   rms_final_reduce, rope_freq_turns)
from .kda import kda_backward, kda_forward, kda_forward_workspace_bytes

__all__ = ["rms_norm", "add_rms_norm", "qk_norm_", "fp8_group_quant", "fp8_group_dequant", "built_with_cuda",
           "cuda_device_count", "gemm_row_scale", "gemm_scalar_scale", "gemm_residual_rms_partial",
           "rms_final_reduce", "gemm_swiglu", "gemm_rope", "gemm_qkv_head_sqsum", "gemm_lse", "lse_finish",
           "rope_freq_turns", "interleave_gate_up", "llama_block_forward", "llama_block_workspace_bytes",
           "kda_forward", "kda_forward_workspace_bytes", "kda_backward", "qk_norm_rope_"]

built_with_cuda = _encore.built_with_cuda
cuda_device_count = _encore.cuda_device_count


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


def fp8_group_quant(x, column_major_scales: bool = False, power_of_two_scales: bool = False, eps: float = 1e-10,
                    stream=None):
    """FP8 e4m3 per-token-group quantization, groups of 128 along the last dimension.

    x: [M, K] (bf16, fp16 or fp32; K a multiple of 128). Returns (q, scales): q [M, K] as
    torch.float8_e4m3fn for torch inputs, or the raw e4m3 bytes as a uint8 numpy array; scales
    [M, K // 128] float32 with s = max|x_group| / 448 (or the next power of two), q = e4m3(x / s).
    column_major_scales: the scales' storage is [K // 128, M] (returned as its transposed view).
    """
    _no_autograd(x)
    if getattr(x, "ndim", 0) != 2:
        raise ValueError("x: expected 2 dimensions [M, K]")
    m, k = x.shape
    q = _empty(x, (m, k), "u8")
    if column_major_scales:
        s = _empty(x, (k // 128, m), "f32")
        scales = s.T
    else:
        scales = _empty(x, (m, k // 128), "f32")
    _encore.fp8_group_quant_out(x, q, scales, bool(power_of_two_scales), float(eps), _stream_for(x, stream))
    if _is_torch(x):
        import torch

        q = q.view(torch.float8_e4m3fn)
    return q, scales


def fp8_group_dequant(q, scales):
    """The inverse on the CPU backend: float32 [M, K] = float(q) * scale of the element's group."""
    if _is_torch(q):
        import torch

        q = q.view(torch.uint8) if q.dtype != torch.uint8 else q
    m, k = q.shape
    out = _empty(q, (m, k), "f32")
    _encore.fp8_group_dequant_out(q, scales, out)
    return out
