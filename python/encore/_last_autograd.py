"""encore.nn.LlamaLastLayer: the last decoder layer's MLP half + final norm + LM head + mean cross-entropy
(include/encore/blocks/llama_last.hpp, docs/blocks.md "Last layer + loss") as a trainable torch module.
Its torch.autograd.Function runs torch.ops.encore.llama_last_block_forward (no logits stored), saves what
llama_last_block_backward reads (the inputs but x0, the weights and the forward's x1, x2, z1, h2, r1, r2,
lse), and runs torch.ops.encore.llama_last_block_backward from the loss's gradient (a device scalar: no
host sync). CPU tensors (fp32, the CPU backend) and CUDA tensors (bf16/fp16)."""
from __future__ import annotations

import math

import torch

from ._core import ops as _ops

__all__ = ["LlamaLastLayer", "LlamaLastLayerFunction"]


class LlamaLastLayerFunction(torch.autograd.Function):
    """loss = layer(y0, x0; w0, w1, w2, gamma0, gamma_final, w_lm) against target (int32 [M], not
    differentiated); a 0-dim float32 tensor."""

    @staticmethod
    def forward(ctx, y0, x0, w0, w1, w2, gamma0, gamma_final, w_lm, target, eps, ignore_index):
        x1, x2, z1, h2, r1, r2, lse, loss = _ops().llama_last_block_forward(y0, x0, w0, w1, w2, gamma0, gamma_final, w_lm, target,
                                                                            float(eps), int(ignore_index), None)
        ctx.save_for_backward(y0, w0, w1, w2, gamma0, gamma_final, w_lm, target, x1, x2, z1, h2, r1, r2, lse)
        ctx.ignore_index = int(ignore_index)
        return loss.reshape(())

    @staticmethod
    def backward(ctx, d_loss):
        saved = ctx.saved_tensors
        dl = d_loss.float().reshape(1).contiguous()
        d_y0, d_x0, dw0, dw1, dw2, dw_lm, dg0, dgf = _ops().llama_last_block_backward(*saved, dl, ctx.ignore_index, None)
        gamma0, gamma_final = saved[4], saved[5]
        return d_y0, d_x0, dw0, dw1, dw2, dg0.to(gamma0.dtype), dgf.to(gamma_final.dtype), dw_lm, None, None, None


class LlamaLastLayer(torch.nn.Module):
    """The last decoder layer from its attention output projection to the loss:

        x1 = y0 @ w0.T + x0;   x2 = swiglu(rmsnorm(x1) * gamma0 @ w1.T) @ w2.T + x1
        loss = cross_entropy(rmsnorm(x2) * gamma_final @ w_lm.T, target)   (mean over rows not ignored)

    forward(y0, x0, target) -> loss (0-dim float32; 0 when every target is ignore_index): y0 [M, d] the
    attention output, x0 [M, d] the residual stream into the layer, target [M] class indices. Parameters:
    w0 [d, d], w1 [2F, d] (gate/up rows interleaved, encore.interleave_gate_up), w2 [d, F], w_lm [V, d],
    gamma0 (ffn norm), gamma_final (the final norm). The logits are recomputed in the backward's GEMM
    epilogue, never stored. Gradients flow to y0, x0 and every parameter."""

    def __init__(self, hidden_size: int, intermediate_size: int, vocab_size: int, eps: float = 1e-5, ignore_index: int = -100,
                 device=None, dtype=None):
        super().__init__()
        d, f, v = hidden_size, intermediate_size, vocab_size
        self.hidden_size, self.intermediate_size, self.vocab_size = d, f, v
        self.eps, self.ignore_index = float(eps), int(ignore_index)
        kw = {"device": device, "dtype": dtype}
        self.w0 = torch.nn.Parameter(torch.empty(d, d, **kw))
        self.w1 = torch.nn.Parameter(torch.empty(2 * f, d, **kw))
        self.w2 = torch.nn.Parameter(torch.empty(d, f, **kw))
        self.w_lm = torch.nn.Parameter(torch.empty(v, d, **kw))
        self.gamma0 = torch.nn.Parameter(torch.ones(d, **kw))
        self.gamma_final = torch.nn.Parameter(torch.ones(d, **kw))
        self.reset_parameters()

    def reset_parameters(self):
        with torch.no_grad():
            for w, fan_in in ((self.w0, self.hidden_size), (self.w1, self.hidden_size), (self.w2, self.intermediate_size),
                              (self.w_lm, self.hidden_size)):
                w.normal_(0.0, 1.0 / math.sqrt(fan_in))
            self.gamma0.fill_(1.0)
            self.gamma_final.fill_(1.0)

    def forward(self, y0, x0, target):
        t = target.reshape(-1).to(device=y0.device, dtype=torch.int32).contiguous()
        return LlamaLastLayerFunction.apply(y0, x0, self.w0, self.w1, self.w2, self.gamma0, self.gamma_final, self.w_lm, t, self.eps,
                                            self.ignore_index)

    def extra_repr(self):
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, vocab_size={self.vocab_size}, "
                f"eps={self.eps}, ignore_index={self.ignore_index}")
