"""The autograd Functions behind encore.transformers (the Hugging Face module patch): RMSNorm on any
rows, the fused QKV projection with RoPE (LLaMA) or with QK-norm + RoPE (Qwen3), the SwiGLU MLP, and the
layouts they derive from the model's own weights (nothing saved changes).

Layouts. encore's RoPE rotates adjacent column pairs (2i, 2i+1) (docs/math/gemm_epilogues.md §3.2);
transformers' rotate_half pairs (i, i + D/2). The Q and K rows of each head are therefore permuted
(row 2i = old row i, row 2i+1 = old row i + D/2) when the fused QKV weight [Wq; Wk; Wv] is built:
q·k is unchanged when q and k are permuted alike, so attention, V and the o-projection see nothing
(the KV cache holds K in the permuted order). Qwen3's q_norm / k_norm weights get the same
permutation. The swiglu row reads gate and up interleaved (w13, row 2j gate j, 2j+1 up j). Each Function
takes the model's weights themselves and derives its layout inside the forward and again inside the
backward (one copy of the weights each; the derived copy is never kept between them, so training holds
no more weight memory than the unpatched model), and splits its weight gradient back into the model's
parameters.

    qkv = RoPE(x·Wqkvᵀ)                      _RopeQkvFunction: the `rope` GEMM row; backward Rᵀ·dqkv
                                             (one complex product per pair in torch), then
                                             dx = dz·W, dW = dzᵀ·x
    qkv = RoPE(qk_norm(x·Wqkvᵀ))             _QkNormRopeQkvFunction: qkv_head_sqsum GEMM + the
                                             qk_norm_rope_ finisher; backward qk_norm_rope_backward,
                                             then dx = dz·W, dW = dzᵀ·x
    out = (silu(x·Wgᵀ) ⊙ x·Wuᵀ)·Wdᵀ           _SwigluMlpFunction: the swiglu row, then Wd in torch;
                                             backward the swiglu_bwd row, then three GEMMs in torch
    y = rmsnorm(x)·w                         _RmsNormFunction: encore.rms_norm forward; the backward
                                             is torch's fused RMSNorm backward on CUDA (encore has no
                                             standalone RMSNorm backward kernel: its norm backward
                                             lives in the GEMMs, used by block_schedule), a torch
                                             composite on the CPU
"""
from __future__ import annotations

import math

import torch

from . import gemm as _gemm
from . import norm as _norm
from ._mlp_autograd import _epi, interleave


def autocast_cast(*tensors):
    """The tensors in torch.autocast's dtype where autocast is on for their device (as nn.Linear's GEMM
    would run them), else as they are."""
    dev = tensors[0].device.type
    if not torch.is_autocast_enabled(dev):
        return tensors
    dt = torch.get_autocast_dtype(dev)
    return tuple(t if t.dtype == dt else t.to(dt) for t in tensors)


# --- RMSNorm ------------------------------------------------------------------------------------------

# torch's fused RMSNorm backward (CUDA; torch >= 2.8): the backward of the patched norms on CUDA, a composite elsewhere
_FUSED_RMS_NORM_BWD = getattr(torch.ops.aten, "_fused_rms_norm_backward", None)


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
        if x.is_cuda and _FUSED_RMS_NORM_BWD is not None:
            # rstd from one fp32 reduction over x, then torch's fused RMSNorm backward (one pass for dx, one for dw)
            d = x.shape[-1]
            r = torch.linalg.vector_norm(x, 2, -1, keepdim=True, dtype=torch.float32).square_().div_(d).add_(ctx.eps).rsqrt_()
            dx, dw = _FUSED_RMS_NORM_BWD(dy.contiguous(), x, [d], r, w, [ctx.needs_input_grad[0], ctx.needs_input_grad[1]])
            return dx, dw, None
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


def unpair_rows(w, heads, head_dim):
    """The inverse of pair_rows: rows (2i, 2i+1) of each head back to (i, i + D/2), contiguous."""
    return w.view(heads, head_dim // 2, 2, w.shape[-1]).transpose(1, 2).reshape(heads * head_dim, w.shape[-1])


def qkv_weight(wq, wk, wv, heads):
    """The fused QKV weight [Wq; Wk; Wv] with Q and K rows paired: derived from the model's weights in the forward and
    again in the backward, never kept between them."""
    hq, hkv, hd = heads
    return torch.cat((pair_rows(wq, hq, hd), pair_rows(wk, hkv, hd), wv))


def _qkv_grads(dw, heads, needs):
    """dW of the fused paired weight -> (dWq, dWk, dWv) in the model's row order (None where not needed)."""
    hq, hkv, hd = heads
    nq, nk = hq * hd, hkv * hd
    return (unpair_rows(dw[:nq], hq, hd) if needs[0] else None, unpair_rows(dw[nq:nq + nk], hkv, hd) if needs[1] else None,
            dw[nq + nk:] if needs[2] else None)


def _rope_inverse(dy, pos, freq, heads):
    """Rᵀ·dy for the Q and K columns of dy [M, (Hq + 2·Hkv)·D] (pairs (2j, 2j+1) of every head, θ = 2π·pos·f_j); the V
    columns pass through. The angle is formed in fp64 and reduced to [-½, ½] turns, as encore's kernels do, once
    per position and frequency [M, D/2] (every Q and K head shares them: freq_table repeats one head's table, read
    here from head 0); the rotation is one complex product in fp32."""
    hq, hkv, hd = heads
    dy = dy.contiguous()  # view_as_complex needs unit stride in the pairs (a transposed or expanded gradient has not)
    m, rotated = dy.shape[0], (hq + hkv) * hd
    f = freq[0:hd:2].double() + freq[1:hd:2].double()
    t = pos.double()[:, None] * f[None, :]
    th = ((t - torch.round(t)) * (2 * math.pi)).float()
    rot = torch.polar(torch.ones_like(th), -th)[:, None, :]  # e^{-iθ} [M, 1, D/2]
    pairs = torch.view_as_complex(dy[:, :rotated].float().view(m, hq + hkv, hd // 2, 2))
    dz = torch.empty_like(dy)
    dz[:, :rotated].copy_(torch.view_as_real(pairs * rot).view(m, rotated))
    dz[:, rotated:].copy_(dy[:, rotated:])
    return dz


class _RopeQkvFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, wq, wk, wv, pos, freq, heads):
        qkv = _gemm.gemm_epilogue("rope", x, qkv_weight(wq, wk, wv, heads), pos=pos, freq=freq)["d"]
        ctx.save_for_backward(x, wq, wk, wv, pos, freq)
        ctx.heads = heads
        return qkv

    @staticmethod
    def backward(ctx, dqkv):
        x, wq, wk, wv, pos, freq = ctx.saved_tensors
        dz = _rope_inverse(dqkv, pos, freq, ctx.heads)
        dx = torch.matmul(dz, qkv_weight(wq, wk, wv, ctx.heads)) if ctx.needs_input_grad[0] else None
        dw = (None, None, None)
        if any(ctx.needs_input_grad[1:4]):
            dw = _qkv_grads(torch.matmul(dz.t(), x), ctx.heads, ctx.needs_input_grad[1:4])
        return dx, *dw, None, None, None


def _head_sqsum(x, w, head_dim):
    """(x·wᵀ, per-head sums of its squares [M, heads] fp32): encore's qkv_head_sqsum GEMM where it runs
    (the CPU backend; CUDA at head_dim 128), else the GEMM and the sums in torch."""
    if not x.is_cuda or head_dim == 128:
        return _gemm.gemm_qkv_head_sqsum(x, w, head_dim)
    raw = torch.matmul(x, w.t())
    return raw, raw.view(raw.shape[0], -1, head_dim).float().pow(2).sum(-1)


class _QkNormRopeQkvFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, wq, wk, wv, q_weight, k_weight, pos, freq, heads, eps):
        raw, partials = _head_sqsum(x, qkv_weight(wq, wk, wv, heads), heads[2])
        qkv = raw.clone()
        _gemm.qk_norm_rope_(qkv, partials, q_weight, k_weight, pos, freq, *heads, eps)
        ctx.save_for_backward(x, wq, wk, wv, q_weight, k_weight, pos, freq, raw, partials)
        ctx.shape = (*heads, eps)
        return qkv

    @staticmethod
    def backward(ctx, dqkv):
        x, wq, wk, wv, qw, kw, pos, freq, raw, partials = ctx.saved_tensors
        heads = ctx.shape[:3]
        dz, dqw, dkw = _gemm.qk_norm_rope_backward(dqkv.contiguous(), raw, partials, qw, kw, pos, freq, *ctx.shape)
        dx = torch.matmul(dz, qkv_weight(wq, wk, wv, heads)) if ctx.needs_input_grad[0] else None
        dw = (None, None, None)
        if any(ctx.needs_input_grad[1:4]):
            dw = _qkv_grads(torch.matmul(dz.t(), x), heads, ctx.needs_input_grad[1:4])
        return dx, *dw, dqw.to(qw.dtype), dkw.to(kw.dtype), None, None, None, None


def qkv_rope(x, wq, wk, wv, pos, inv_freq, num_q_heads, num_kv_heads, head_dim, q_norm=None, k_norm=None, eps=1e-6):
    """The attention's Q, K, V in one GEMM with RoPE (and, given q_norm / k_norm weights, the per-head
    QK-norm before it) from the model's own projection weights: x [M, d], pos [M] int32; returns
    qkv [M, (Hq + 2·Hkv)·D] with Q and K in the paired order (see the module docstring)."""
    x, wq, wk, wv = autocast_cast(x, wq, wk, wv)
    heads = (num_q_heads, num_kv_heads, head_dim)
    freq = freq_table(inv_freq, num_q_heads, num_kv_heads, head_dim)
    if not x.is_contiguous():
        x = x.contiguous()
    if q_norm is None:
        return _RopeQkvFunction.apply(x, wq, wk, wv, pos, freq, heads)
    qw, kw = pair_vector(q_norm, head_dim).to(x.dtype), pair_vector(k_norm, head_dim).to(x.dtype)
    return _QkNormRopeQkvFunction.apply(x, wq, wk, wv, qw, kw, pos, freq, heads, float(eps))


# --- SwiGLU MLP -----------------------------------------------------------------------------------------

class _SwigluMlpFunction(torch.autograd.Function):
    """down(silu(x·Wgᵀ) ⊙ (x·Wuᵀ)) on the model's own gate / up / down weights: the swiglu row on w13 derived in the
    forward and again in the backward (one copy of 2·F·d weights each, never kept between them); the backward's
    swiglu_bwd row gives y and dz, then dWd = doutᵀ·y, dx = dz·w13, dW13 = dzᵀ·x split back into dWg, dWu."""
    @staticmethod
    def forward(ctx, x, wg, wu, wd):
        z, y = _epi("swiglu", x, interleave(wg, wu))
        ctx.save_for_backward(x, wg, wu, wd, z)
        return torch.matmul(y, wd.t())

    @staticmethod
    def backward(ctx, dout):
        x, wg, wu, wd, z = ctx.saved_tensors
        dout = dout.contiguous()
        y, dz = _epi("swiglu_bwd", dout, wd, c=z)[:2]
        need = ctx.needs_input_grad
        dx = torch.matmul(dz, interleave(wg, wu)) if need[0] else None
        dwg = dwu = None
        if need[1] or need[2]:
            dwg, dwu = torch.matmul(dz.t(), x).view(wg.shape[0], 2, wg.shape[1]).unbind(1)
        dwd = torch.matmul(dout.t(), y) if need[3] else None
        return dx, dwg, dwu, dwd


def swiglu_mlp(x, wg, wu, wd):
    """The Hugging Face MLP down(silu(gate(x)) ⊙ up(x)) through encore's swiglu rows: x [M, d] contiguous."""
    return _SwigluMlpFunction.apply(x, wg, wu, wd)
