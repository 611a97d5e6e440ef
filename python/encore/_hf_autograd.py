"""The autograd Functions behind encore.transformers (the Hugging Face module patch): RMSNorm on any
rows, the fused QKV projection with RoPE (LLaMA) or with QK-norm + RoPE (Qwen3), and the layouts they
derive from the model's own weights (nothing saved changes).

Layouts. encore's RoPE rotates adjacent column pairs (2i, 2i+1) (docs/math/gemm_epilogues.md §3.2);
transformers' rotate_half pairs (i, i + D/2). The Q and K rows of each head are therefore permuted
(row 2i = old row i, row 2i+1 = old row i + D/2) when the fused QKV weight [Wq; Wk; Wv] is built:
q·k is unchanged when q and k are permuted alike, so attention, V and the o-projection see nothing
(the KV cache holds K in the permuted order). Qwen3's q_norm / k_norm weights get the same
permutation. The derivation is a differentiable copy (torch.cat of permuted views): one copy of the
QKV weights per forward, and its gradient scattered back by autograd in the backward.

    qkv = RoPE(x·Wqkvᵀ)                      _RopeQkvFunction: the `rope` GEMM row; backward Rᵀ·dqkv
                                             (a torch composite: encore's elementwise rope_bwd_zdz
                                             has no Python binding yet), then dx = dz·W, dW = dzᵀ·x
    qkv = RoPE(qk_norm(x·Wqkvᵀ))             _QkNormRopeQkvFunction: qkv_head_sqsum GEMM + the
                                             qk_norm_rope_ finisher; backward qk_norm_rope_backward,
                                             then dx = dz·W, dW = dzᵀ·x
    y = rmsnorm(x)·w                         _RmsNormFunction: encore.rms_norm forward; the backward
                                             is a torch composite (encore has no standalone RMSNorm
                                             backward kernel: its norm backward lives in the GEMMs)
"""
from __future__ import annotations

import math

import torch

from . import gemm as _gemm
from . import norm as _norm


def autocast_cast(*tensors):
    """The tensors in torch.autocast's dtype where autocast is on for their device (as nn.Linear's GEMM
    would run them), else as they are."""
    dev = tensors[0].device.type
    if not torch.is_autocast_enabled(dev):
        return tensors
    dt = torch.get_autocast_dtype(dev)
    return tuple(t if t.dtype == dt else t.to(dt) for t in tensors)


# --- RMSNorm ------------------------------------------------------------------------------------------

class _RmsNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y = _norm.rms_norm(x, weight, eps)
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        xf = x.float()
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + ctx.eps)
        xhat = xf * r
        dyf = dy.float()
        g = dyf * w.float()
        dx = r * (g - xhat * (g * xhat).mean(-1, keepdim=True))
        dw = (dyf * xhat).reshape(-1, x.shape[-1]).sum(0)
        return dx.to(x.dtype), dw.to(w.dtype), None


def rms_norm(x, weight, eps):
    """y = x·rsqrt(mean(x²) + eps)·weight over the last dimension, differentiable. x and weight in the
    dtype they promote to (transformers' RMSNorm returns weight·x̂ in that dtype)."""
    dt = torch.promote_types(x.dtype, weight.dtype)
    x, weight = x.to(dt), weight.to(dt)
    if not x.is_contiguous():
        x = x.contiguous()
    return _RmsNormFunction.apply(x, weight, float(eps))


# --- RoPE layouts -------------------------------------------------------------------------------------

def pair_rows(w, heads, head_dim):
    """w [heads·D, d] with each head's rows (i, i + D/2) made adjacent (2i, 2i+1): a permuted view."""
    return w.view(heads, 2, head_dim // 2, w.shape[-1]).transpose(1, 2).reshape(heads * head_dim, w.shape[-1])


def pair_vector(v, head_dim):
    """A per-head weight [D] in the same order (q_norm / k_norm)."""
    return v.view(2, head_dim // 2).t().reshape(head_dim)


def freq_table(inv_freq, num_q_heads, num_kv_heads, head_dim):
    """encore's frequency table [(Hq + 2·Hkv)·D] fp32 for the fused QKV layout: per Q and K head the
    (hi, lo) split of inv_freq / 2π in turns (rope_freq_turns' layout, from the model's own inv_freq so
    that rope scalings folded into it carry over), 0 for the V heads (no rotation)."""
    turns = inv_freq.double() / (2 * math.pi)
    hi = turns.float()
    lo = (turns - hi.double()).float()
    head = torch.stack((hi, lo), -1).reshape(head_dim)
    v = torch.zeros(num_kv_heads * head_dim, dtype=torch.float32, device=inv_freq.device)
    return torch.cat((head.repeat(num_q_heads + num_kv_heads), v))


def _rope_inverse(dy, pos, freq, rotated):
    """Rᵀ·dy for the first `rotated` columns of dy [M, N] (pairs (2j, 2j+1), θ = 2π·pos·f_j); the rest
    pass through. The angle is formed in fp64 and reduced to [-½, ½] turns, as encore's kernels do."""
    f = freq[0:rotated:2].double() + freq[1:rotated:2].double()
    t = pos.double()[:, None] * f[None, :]
    th = (t - torch.round(t)) * (2 * math.pi)
    c, s = torch.cos(th).float(), torch.sin(th).float()
    a, b = dy[:, 0:rotated:2].float(), dy[:, 1:rotated:2].float()
    dz = torch.stack((a * c + b * s, b * c - a * s), -1).reshape(dy.shape[0], rotated).to(dy.dtype)
    return dz if rotated == dy.shape[1] else torch.cat((dz, dy[:, rotated:]), 1)


class _RopeQkvFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, pos, freq, rotated):
        qkv = _gemm.gemm_epilogue("rope", x, w, pos=pos, freq=freq)["d"]
        ctx.save_for_backward(x, w, pos, freq)
        ctx.rotated = rotated
        return qkv

    @staticmethod
    def backward(ctx, dqkv):
        x, w, pos, freq = ctx.saved_tensors
        dz = _rope_inverse(dqkv, pos, freq, ctx.rotated)
        dx = torch.matmul(dz, w) if ctx.needs_input_grad[0] else None
        dw = torch.matmul(dz.t(), x) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None, None


def _head_sqsum(x, w, head_dim):
    """(x·wᵀ, per-head sums of its squares [M, heads] fp32): encore's qkv_head_sqsum GEMM where it runs
    (the CPU backend; CUDA at head_dim 128), else the GEMM and the sums in torch."""
    if not x.is_cuda or head_dim == 128:
        return _gemm.gemm_qkv_head_sqsum(x, w, head_dim)
    raw = torch.matmul(x, w.t())
    return raw, raw.view(raw.shape[0], -1, head_dim).float().pow(2).sum(-1)


class _QkNormRopeQkvFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, q_weight, k_weight, pos, freq, num_q_heads, num_kv_heads, head_dim, eps):
        raw, partials = _head_sqsum(x, w, head_dim)
        qkv = raw.clone()
        _gemm.qk_norm_rope_(qkv, partials, q_weight, k_weight, pos, freq, num_q_heads, num_kv_heads, head_dim, eps)
        ctx.save_for_backward(x, w, q_weight, k_weight, pos, freq, raw, partials)
        ctx.shape = (num_q_heads, num_kv_heads, head_dim, eps)
        return qkv

    @staticmethod
    def backward(ctx, dqkv):
        x, w, qw, kw, pos, freq, raw, partials = ctx.saved_tensors
        dz, dqw, dkw = _gemm.qk_norm_rope_backward(dqkv.contiguous(), raw, partials, qw, kw, pos, freq, *ctx.shape)
        dx = torch.matmul(dz, w) if ctx.needs_input_grad[0] else None
        dw = torch.matmul(dz.t(), x) if ctx.needs_input_grad[1] else None
        return dx, dw, dqw.to(qw.dtype), dkw.to(kw.dtype), None, None, None, None, None, None


def qkv_rope(x, wq, wk, wv, pos, inv_freq, num_q_heads, num_kv_heads, head_dim, q_norm=None, k_norm=None, eps=1e-6):
    """The attention's Q, K, V in one GEMM with RoPE (and, given q_norm / k_norm weights, the per-head
    QK-norm before it) from the model's own projection weights: x [M, d], pos [M] int32; returns
    qkv [M, (Hq + 2·Hkv)·D] with Q and K in the paired order (see the module docstring)."""
    x, wq, wk, wv = autocast_cast(x, wq, wk, wv)
    w = torch.cat((pair_rows(wq, num_q_heads, head_dim), pair_rows(wk, num_kv_heads, head_dim), wv))
    freq = freq_table(inv_freq, num_q_heads, num_kv_heads, head_dim)
    if not x.is_contiguous():
        x = x.contiguous()
    if q_norm is None:
        return _RopeQkvFunction.apply(x, w, pos, freq, (num_q_heads + num_kv_heads) * head_dim)
    qw, kw = pair_vector(q_norm, head_dim).to(x.dtype), pair_vector(k_norm, head_dim).to(x.dtype)
    return _QkNormRopeQkvFunction.apply(x, w, qw, kw, pos, freq, num_q_heads, num_kv_heads, head_dim, float(eps))
