"""encore.nn.LlamaBlock: the shifted LLaMA block (include/encore/blocks/llama.hpp, docs/blocks.md) as a
trainable torch module. Its torch.autograd.Function runs torch.ops.encore.llama_block_forward, saves
what llama_block_backward reads (the inputs but x0, the weights and the forward's x1, x2, z1, qkv, r1,
r2), and runs torch.ops.encore.llama_block_backward in the backward. Both are torch.library ops with
fake implementations, so the Function traces under torch.compile. CPU tensors (fp32, the CPU backend)
and CUDA tensors (bf16/fp16)."""
from __future__ import annotations

import math

import torch

from ._core import ops as _ops

__all__ = ["LlamaBlock", "LlamaBlockFunction"]


class LlamaBlockFunction(torch.autograd.Function):
    """(x2, qkv) = block(y0, x0; w0, w1, w2, w3, gamma0, gamma1) with positions pos and RoPE table freq
    (not differentiated)."""

    @staticmethod
    def forward(ctx, y0, x0, w0, w1, w2, w3, gamma0, gamma1, pos, freq, eps):
        x1, x2, z1, qkv, r1, r2 = _ops().llama_block_forward(y0, x0, w0, w1, w2, w3, gamma0, gamma1, pos, freq, float(eps), None)
        ctx.save_for_backward(y0, w0, w1, w2, w3, gamma0, gamma1, pos, freq, x1, x2, z1, qkv, r1, r2)
        return x2, qkv

    @staticmethod
    def backward(ctx, d_x2, d_qkv):
        saved = ctx.saved_tensors
        x2, qkv = saved[10], saved[12]
        d_x2 = torch.zeros_like(x2) if d_x2 is None else d_x2.to(x2.dtype).contiguous()
        d_qkv = torch.zeros_like(qkv) if d_qkv is None else d_qkv.to(qkv.dtype).contiguous()
        d_y0, d_x0, dw0, dw1, dw2, dw3, dg0, dg1 = _ops().llama_block_backward(*saved, d_qkv, d_x2, None)
        gamma0, gamma1 = saved[5], saved[6]
        return d_y0, d_x0, dw0, dw1, dw2, dw3, dg0.to(gamma0.dtype), dg1.to(gamma1.dtype), None, None, None


class LlamaBlock(torch.nn.Module):
    """The shifted LLaMA block, from layer l's attention output projection to layer l+1's QKV projection:

        x1 = y0 @ w0.T + x0;   z1 = rmsnorm(x1) * gamma0 @ w1.T;   x2 = swiglu(z1) @ w2.T + x1
        qkv = RoPE(rmsnorm(x2) * gamma1 @ w3.T)

    forward(y0, x0, pos) -> (x2, qkv): y0 [M, d] the attention output of layer l, x0 [M, d] the residual
    stream into the block, pos [M] int32 positions; x2 [M, d] the residual stream out, qkv [M, Nqkv] the
    next layer's rotated Q, K and V. Parameters: w0 [d, d] (o-proj), w1 [2F, d] (gate/up rows
    interleaved: row 2j gate j, row 2j+1 up j; see encore.interleave_gate_up), w2 [d, F] (down), w3
    [Nqkv, d] (fused QKV, Nqkv = (num_heads + 2 num_kv_heads) head_dim, Q and K rows in the pair-adjacent
    RoPE order: rotate-half partners (i, i + head_dim/2) at rows (2i, 2i+1) of each head), gamma0 (ffn
    norm), gamma1 (the next layer's attention norm). RoPE: (a, b) -> (a cos - b sin, b cos + a sin) with
    theta = pos * base^(-2i/head_dim). Gradients flow to y0, x0 and every parameter."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rope_base: float = 500000.0, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        d, f = hidden_size, intermediate_size
        self.hidden_size, self.intermediate_size, self.eps = d, f, float(eps)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        nqkv = (num_heads + 2 * num_kv_heads) * head_dim
        kw = {"device": device, "dtype": dtype}
        self.w0 = torch.nn.Parameter(torch.empty(d, d, **kw))
        self.w1 = torch.nn.Parameter(torch.empty(2 * f, d, **kw))
        self.w2 = torch.nn.Parameter(torch.empty(d, f, **kw))
        self.w3 = torch.nn.Parameter(torch.empty(nqkv, d, **kw))
        self.gamma0 = torch.nn.Parameter(torch.ones(d, **kw))
        self.gamma1 = torch.nn.Parameter(torch.ones(d, **kw))
        from .gemm import rope_freq_turns

        freq = torch.from_numpy(rope_freq_turns(num_heads + 2 * num_kv_heads, num_heads + num_kv_heads, head_dim, rope_base))
        self.register_buffer("freq", freq.to(device=device) if device is not None else freq, persistent=False)
        self.reset_parameters()

    def reset_parameters(self):
        with torch.no_grad():
            for w, fan_in in ((self.w0, self.hidden_size), (self.w1, self.hidden_size), (self.w2, self.intermediate_size),
                              (self.w3, self.hidden_size)):
                w.normal_(0.0, 1.0 / math.sqrt(fan_in))
            self.gamma0.fill_(1.0)
            self.gamma1.fill_(1.0)

    def forward(self, y0, x0, pos):
        freq = self.freq if self.freq.device == y0.device else self.freq.to(y0.device)
        return LlamaBlockFunction.apply(y0, x0, self.w0, self.w1, self.w2, self.w3, self.gamma0, self.gamma1, pos, freq, self.eps)

    def extra_repr(self):
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, eps={self.eps}")
