"""Training modules over the GEMM-epilogue rows (docs/math/gemm_epilogues.md §4): the SwiGLU MLP with its input RMSNorm
fused into the gate/up GEMM, and the RMSNorm fused into any following linear layer. Each is a
torch.autograd.Function over torch.ops.encore (gemm_epilogue, partials_sum), so it traces under
torch.compile; the weight gradients and the plain dgrad are torch.matmul (cuBLAS on CUDA).

SwiGLU MLP, x [M, d] (the residual stream), w13 [2F, d] (gate row 2j, up row 2j+1), w2 [d, F]:
  forward   r = rsqrt(mean(x²) + eps) (fp32), h = x ⊙ γ;  swiglu row: z = r·(h·w13ᵀ) [M, 2F] (saved),
            y = silu(z_gate)·z_up [M, F];  out = y·w2ᵀ
  backward  swiglu_bwd row (A = dout, W = w2 [d, F] un-transposed, C = z): y again, dz [M, 2F] packed,
            zdz = (1/d)·Σ_n z·dz (partials_sum);  dw2 = doutᵀ·y;
            rmsnorm_bwd row (A = dz, W = w13, C = x, γ, r, zdz): dx, aux = x̂⊙γ, dγ partials;  dw13 = dzᵀ·aux
Without the norm (norm=False) x enters the gate/up GEMM as it is and dx = dz·w13.
RMSNorm + linear, x [M, d], w [N, d]: out = r·((x ⊙ γ)·wᵀ) (row_scale row);  backward zdz = (1/d)·Σ_n out·dout,
then the rmsnorm_bwd row on dout as above, dw = doutᵀ·aux.
"""
from __future__ import annotations

import torch

from ._core import ops as _ops


def interleave(wg, wu):
    """w13 [2F, d]: row 2j gate j, row 2j+1 up j (the swiglu row's layout), from gate_proj / up_proj [F, d]."""
    return torch.stack((wg, wu), 1).reshape(2 * wg.shape[0], wg.shape[1])


def _rstd(x, eps):
    return torch.rsqrt(x.float().pow(2).mean(-1) + eps)


def _epi(name, a, w, c=None, gamma=None, row_scale=None, c2=None, zdz=None):
    # gemm_epilogue(name, a, w, c, gamma, row_scale, pos, freq, alpha, target, store_d, partial_tile_n, head_dim, ignore_index,
    #               tile, c2, zdz) -> the row's outputs in the order d, aux, partials
    return _ops().gemm_epilogue(name, a, w, c, gamma, row_scale, None, None, None, None, True, 0, 128, -100, "auto", c2, zdz)


def _rmsnorm_dgrad(dz, w, x, gamma, r, zdz):
    """rmsnorm_bwd on dz [M, N] through w [N, d], zdz = (1/d)·Σ_n z·dz: (dx, aux = x̂⊙γ, dγ)."""
    dx, aux, colp = _epi("rmsnorm_bwd", dz, w, c=x, gamma=gamma, row_scale=r, zdz=zdz)
    dgamma = _ops().partials_sum(colp, True, 1.0, x.shape[1])
    return dx, aux, dgamma


class SwigluMlpFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gamma, w13, w2, eps):
        r = _rstd(x, eps) if gamma is not None else None
        h = x * gamma if gamma is not None else x
        z, y = _epi("swiglu", h, w13, row_scale=r)
        ctx.save_for_backward(x, gamma, w13, w2, z, r)
        return torch.matmul(y, w2.t())

    @staticmethod
    def backward(ctx, dout):
        x, gamma, w13, w2, z, r = ctx.saved_tensors
        dout = dout.contiguous()
        y, dz, zp = _epi("swiglu_bwd", dout, w2, c=z)
        dw2 = torch.matmul(dout.t(), y)
        if gamma is None:
            return torch.matmul(dz, w13), None, torch.matmul(dz.t(), x), dw2, None
        zdz = _ops().partials_sum(zp, False, 1.0 / x.shape[1], zp.shape[1])
        dx, aux, dgamma = _rmsnorm_dgrad(dz, w13, x, gamma, r, zdz)
        return dx, dgamma.to(gamma.dtype), torch.matmul(dz.t(), aux), dw2, None


class RmsNormLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gamma, w, eps):
        r = _rstd(x, eps)
        (out,) = _epi("row_scale", x * gamma, w, row_scale=r)
        ctx.save_for_backward(x, gamma, w, r, out)
        return out

    @staticmethod
    def backward(ctx, dout):
        x, gamma, w, r, out = ctx.saved_tensors
        dout = dout.contiguous()
        zdz = (out.float() * dout.float()).sum(-1) / x.shape[1]
        dx, aux, dgamma = _rmsnorm_dgrad(dout, w, x, gamma, r, zdz)
        return dx, dgamma.to(gamma.dtype), torch.matmul(dout.t(), aux), None


def _rows(x, d, name):
    if x.shape[-1] != d:
        raise ValueError(f"{name}: expected [..., {d}], got {tuple(x.shape)}")
    return x.reshape(-1, d).contiguous()


class SwiGLUMLP(torch.nn.Module):
    """down(silu(gate(n(x))) * up(n(x))) with n the RMSNorm (weight γ, eps) fused into the gate/up GEMM
    (norm=True) or the identity (norm=False: LLaMA's MLP on an already normalized input, as Liger's
    LigerSwiGLUMLP). Weights: w13 [2F, d] with gate row 2j and up row 2j+1 (from_linear builds it
    from Hugging Face's gate_proj / up_proj / down_proj), w2 [d, F]. Input [..., d] in the weights'
    dtype (bf16 / fp16 on CUDA; fp32 on the CPU backend), d and F multiples of 8 on CUDA."""

    def __init__(self, hidden_size: int, intermediate_size: int, norm: bool = True, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.hidden_size, self.intermediate_size, self.eps = hidden_size, intermediate_size, float(eps)
        self.w13 = torch.nn.Parameter(torch.empty(2 * intermediate_size, hidden_size, **kw))
        self.w2 = torch.nn.Parameter(torch.empty(hidden_size, intermediate_size, **kw))
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, **kw)) if norm else None
        self.reset_parameters()

    def reset_parameters(self):
        with torch.no_grad():
            self.w13.normal_(0.0, self.hidden_size ** -0.5)
            self.w2.normal_(0.0, self.intermediate_size ** -0.5)
            if self.weight is not None:
                self.weight.fill_(1.0)

    @classmethod
    def from_linear(cls, gate_proj, up_proj, down_proj, norm_weight=None, eps: float = 1e-6):
        """The MLP of Hugging Face LLaMA weights (nn.Linear or tensors: gate/up [F, d], down [d, F]); copies."""
        g, u, dn = (getattr(t, "weight", t).detach() for t in (gate_proj, up_proj, down_proj))
        f, d = g.shape
        m = cls(d, f, norm=norm_weight is not None, eps=eps, device=g.device, dtype=g.dtype)
        with torch.no_grad():
            m.w13.copy_(interleave(g, u))
            m.w2.copy_(dn)
            if norm_weight is not None:
                m.weight.copy_(getattr(norm_weight, "weight", norm_weight))
        return m

    def forward(self, x):
        rows = _rows(x, self.hidden_size, "x")
        out = SwigluMlpFunction.apply(rows, self.weight, self.w13, self.w2, self.eps)
        return out.reshape(x.shape)

    def extra_repr(self):
        return f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, norm={self.weight is not None}"


class RMSNormLinear(torch.nn.Module):
    """linear(rmsnorm(x) ⊙ γ) without bias: out = r·((x ⊙ γ)·wᵀ), the norm's row scale applied in the GEMM's epilogue
    and its backward in the dgrad GEMM's (e.g. a decoder layer's attention norm + fused QKV projection, or the
    final norm + LM head). w [out_features, in_features]."""

    def __init__(self, in_features: int, out_features: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.in_features, self.out_features, self.eps = in_features, out_features, float(eps)
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, **kw))
        self.norm_weight = torch.nn.Parameter(torch.ones(in_features, **kw))
        with torch.no_grad():
            self.weight.normal_(0.0, in_features ** -0.5)

    def forward(self, x):
        rows = _rows(x, self.in_features, "x")
        out = RmsNormLinearFunction.apply(rows, self.norm_weight, self.weight, self.eps)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, eps={self.eps}"
