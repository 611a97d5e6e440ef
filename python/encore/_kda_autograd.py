"""chunk_kda's torch.autograd.Function (imported by encore.kda.chunk_kda on its first call, so that
encore.kda itself needs no torch): the forward runs torch.ops.encore.kda_forward asking for the
residuals the backward needs saved (_residual_request), the backward runs torch.ops.encore.kda_backward
on them. Both are torch.library ops with fake implementations, so the Function traces under torch.compile."""
from __future__ import annotations

import torch

from ._core import ops
from ._kda_args import _given, _op_flags, _opt_float


_NAMES = ("G", "Aqk", "Akk", "h")  # the op's residual order (kda_backward's arguments)


def _residual_request(q, rematerialize):
    """(names, dtype) of the residuals to save: none for float64 on the CPU (the token-level
    backward, exact) and none for bf16 CUDA inputs when rematerializing (the second backward re-runs
    the forward, which writes Aqk, Akk, h and G into its workspace: nothing kept but the inputs, as
    cuDNN's backward), else Aqk, Akk (+ h unless rematerializing) in bf16 for bf16 inputs and fp32
    otherwise: bf16 Aqk / Akk under fp16 inputs cost fp16's precision (dA_log 1.6e-3 from fp64 against
    4.7e-4 with fp32 residuals on fla's B2 T1500 D128 case, dv / dbeta / dh0 4x). G (the chunk-local
    cumulative gate, fp32: 4 K bytes a token and head) is not saved: the backward recomputes it from g."""
    if q.dtype == torch.float64 or (rematerialize and q.is_cuda and q.dtype == torch.bfloat16):
        return (), None
    names = ("Aqk", "Akk") if rematerialize else ("Aqk", "Akk", "h")
    return names, "bfloat16" if q.dtype == torch.bfloat16 else "float32"


def _residual_list(names, outs):
    """kda_forward's residual outputs (in the order G, Aqk, Akk, h) as (G, Aqk, Akk, h), None where not
    saved: kda_backward's residual arguments."""
    saved = dict(zip(names, outs))
    return [saved.get(x) for x in _NAMES]


class ChunkKdaFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, scale, output_final_state, l2, gate, lower_bound, cu,
                rematerialize, state_v_first):
        names, rdt = _residual_request(q, rematerialize)
        scale, lower = _opt_float(scale), _opt_float(lower_bound)
        outs = ops().kda_forward(*_given(q, k, v, g, beta, _op_flags(output_final_state, l2, gate, state_v_first, rdt, names),
                                         initial_state, A_log, dt_bias, cu, scale, lower))
        o = outs[0]
        fin = outs[1] if output_final_state else None
        res = _residual_list(names, outs[2 if output_final_state else 1:])
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu, *res)
        ctx.opts = (scale, bool(l2), bool(gate), lower, bool(state_v_first))
        return o, fin

    @staticmethod
    def backward(ctx, d_o, d_fin):
        q, k, v, g, beta, A_log, dt_bias, h0, cu, *res = ctx.saved_tensors
        scale, l2, gate, lower, state_v_first = ctx.opts
        if d_o is None:
            d_o = torch.zeros_like(v)
        # state_v_first: d_fin (like final_state) and dh0 (like initial_state) are [N, HV, V, K]
        grads = ops().kda_backward(q, k, v, g, beta, d_o.contiguous(), None if d_fin is None else d_fin.contiguous(), scale, h0,
                                    l2, gate, A_log, dt_bias, lower, cu, *res, state_v_first)
        dq, dk, dv, dg, dbeta, *extra = grads
        extra = iter(extra)
        dh0 = next(extra) if h0 is not None else None
        dA_log = next(extra) if A_log is not None else None
        ddt_bias = next(extra) if dt_bias is not None else None
        return dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0, None, None, None, None, None, None, None, None


def chunk_kda_apply(q, k, v, g, beta, A_log, dt_bias, initial_state, scale, output_final_state, l2, gate, lower_bound, cu,
                    rematerialize, state_v_first=False):
    if cu is not None:  # the sequence table is read on the host: copied once here, not in each op
        cu = cu.cpu() if isinstance(cu, torch.Tensor) else torch.as_tensor(cu)
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or g.requires_grad or beta.requires_grad or
                                        any(t is not None and t.requires_grad for t in (A_log, dt_bias, initial_state)))
    if not grad:
        # inference: the forward alone, no residuals saved, no autograd node
        outs = ops().kda_forward(*_given(q, k, v, g, beta, _op_flags(output_final_state, l2, gate, state_v_first), initial_state, A_log,
                                         dt_bias, cu, _opt_float(scale), _opt_float(lower_bound)))
        return outs[0], (outs[1] if output_final_state else None)
    return ChunkKdaFunction.apply(q, k, v, g, beta, A_log, dt_bias, initial_state, scale, output_final_state, l2, gate,
                                  lower_bound, cu, bool(rematerialize), bool(state_v_first))
