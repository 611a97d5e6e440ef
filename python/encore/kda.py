"""Kimi Delta Attention forward (include/encore/kda.hpp), the chunk_kda contract: q, k, g
[B, T, H, K], v [B, T, H, V], beta [B, T, H]; CPU backend (fp64 reference) for numpy / CPU torch
arrays, CUDA forward for CUDA torch tensors (bf16/fp32, K, V <= 128). Inference only."""
from __future__ import annotations

from . import _encore
from ._util import _empty, _is_torch, _no_autograd, _stream_for


def kda_forward(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm=False,
                use_gate_in_kernel=False, A_log=None, dt_bias=None, lower_bound=None, cu_seqlens=None, stream=None):
    """Returns (o [B, T, H, V] in v's dtype, final_state [N, H, K, V] float32 or None).

    g: log-decay, or the raw gate with use_gate_in_kernel (softplus gate with A_log [H] and optional
    dt_bias [H * K]; lower_bound in [-5, 0) selects the lower-bound gate). cu_seqlens [N + 1]
    (int32/int64, a host array even for CUDA tensors) makes the B = 1 batch varlen.
    """
    _no_autograd(q, k, v, g, beta)
    b, t, h, kd = q.shape
    vd = v.shape[3]
    n = (len(cu_seqlens) - 1) if cu_seqlens is not None else b
    if cu_seqlens is not None and _is_torch(cu_seqlens) and cu_seqlens.is_cuda:
        cu_seqlens = cu_seqlens.cpu()
    o = _empty(v, (b, t, h, vd), "like")
    fin = _empty(q, (n, h, kd, vd), "f32") if output_final_state else None
    lower = lower_bound is not None
    args = (q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, o, fin, float(scale or 0.0), bool(use_qk_l2norm),
            bool(use_gate_in_kernel), lower, float(lower_bound if lower else -5.0))
    nbytes = _encore.kda_forward_workspace_bytes(*args)
    ws = _empty(q, (nbytes,), "u8") if nbytes else None
    _encore.kda_forward_out(*args, ws, _stream_for(q, stream))
    return o, fin
