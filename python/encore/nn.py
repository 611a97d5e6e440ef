"""torch.nn modules over encore's ops (needs torch; `import encore.nn`, or `encore.nn` after `import encore`).

MoE: the single-GPU mixture-of-experts layer (encore.moe_forward: routing, dispatch, the experts'
SwiGLU MLPs, combine), for inference: its parameters do not require grad (the layer has no backward
yet). The weights are in the common layouts: router [E, D] (an nn.Linear named `gate`, as in
Hugging Face's Qwen3-MoE and DeepSeek-V3), w13 [E, 2F, D] (each expert's gate rows, then its up
rows) and w2 [E, D, F]. ExpertParallelMoE: the same layer over a torch.distributed process group, each rank holding
E / W experts (expert or tensor parallel on the collective path, encore/_moe_ep.py)."""
from __future__ import annotations

import torch

from . import moe as _moe
from ._block_autograd import LlamaBlock
from ._ce_autograd import FusedLinearCrossEntropyLoss
from ._last_autograd import LlamaLastLayer
from ._mlp_autograd import RMSNormLinear, SwiGLUMLP
from ._moe_ep import ExpertParallelMoE

__all__ = ["MoE", "ExpertParallelMoE", "LlamaBlock", "LlamaLastLayer", "FusedLinearCrossEntropyLoss", "SwiGLUMLP", "RMSNormLinear"]


class MoE(torch.nn.Module):
    """y = sum_j w[t, j] * expert_{ids[t, j]}(x[t]) with expert(x) = (silu(x W_gate^T) * (x W_up^T)) W_down^T and the
    routing of encore.moe_routing (softmax or sigmoid top-k, DeepSeek-V3's grouped top-k with a correction bias).
    Input [..., D]; output of the same shape and dtype."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, scoring: str = "softmax",
                 renormalize: bool = True, n_group: int = 1, topk_group: int = 1, routed_scaling_factor: float = 1.0,
                 correction_bias: bool = False, align_m: int = 1, device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.hidden_size, self.intermediate_size, self.num_experts, self.top_k = hidden_size, intermediate_size, num_experts, top_k
        self.options = dict(scoring=scoring, renormalize=renormalize, n_group=n_group, topk_group=topk_group,
                            routed_scaling_factor=routed_scaling_factor, align_m=align_m)
        self.gate = torch.nn.Linear(hidden_size, num_experts, bias=False, **kw)
        self.w13 = torch.nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, **kw))
        self.w2 = torch.nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, **kw))
        bias = torch.zeros(num_experts, device=device, dtype=torch.float32) if correction_bias else None
        self.register_buffer("e_score_correction_bias", bias)
        self.reset_parameters()
        self.requires_grad_(False)

    def reset_parameters(self):
        with torch.no_grad():
            self.gate.reset_parameters()
            self.w13.normal_(0.0, self.hidden_size ** -0.5)
            self.w2.normal_(0.0, self.intermediate_size ** -0.5)

    @classmethod
    def from_weights(cls, router_weight, w13, w2, top_k: int, correction_bias=None, **options):
        """A layer holding the given weights (router [E, D], w13 [E, 2F, D], w2 [E, D, F]; shared, not copied)."""
        e, two_f, d = w13.shape
        if two_f % 2 or tuple(w2.shape) != (e, d, two_f // 2) or tuple(router_weight.shape) != (e, d):
            raise ValueError(f"weights: expected router [E, D], w13 [E, 2F, D], w2 [E, D, F]; got {tuple(router_weight.shape)}, "
                             f"{tuple(w13.shape)}, {tuple(w2.shape)}")
        layer = cls(d, two_f // 2, e, top_k, correction_bias=correction_bias is not None, device="meta", dtype=w13.dtype,
                    **options)
        layer.gate.weight = torch.nn.Parameter(router_weight, requires_grad=False)
        layer.w13 = torch.nn.Parameter(w13, requires_grad=False)
        layer.w2 = torch.nn.Parameter(w2, requires_grad=False)
        if correction_bias is not None:
            layer.e_score_correction_bias = correction_bias
        return layer

    def forward(self, x):
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"x: expected [..., {self.hidden_size}], got {tuple(x.shape)}")
        rows = x.reshape(-1, self.hidden_size)
        out = _moe.moe_forward(rows, self.gate(rows), self.w13, self.w2, self.top_k,
                               correction_bias=self.e_score_correction_bias, **self.options)
        return out.reshape(x.shape)

    def extra_repr(self):
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, num_experts={self.num_experts}, "
                f"top_k={self.top_k}, " + ", ".join(f"{k}={v}" for k, v in self.options.items()))
