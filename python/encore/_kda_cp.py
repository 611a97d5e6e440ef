"""chunk_kda with context parallelism (math-kda.md §10; encore/kda_cp.hpp): every rank of a torch.distributed
process group holds one contiguous slice along T of a varlen batch (B = 1) and the global cu_seqlens.

Forward, per rank: the summary (S_ext, M) of its last local piece (zeros when that sequence ends on this rank),
one all-gather of the packed [S_ext | M], the merge of the earlier ranks' summaries into the initial state of
its first local piece (when that sequence started on an earlier rank), then the ordinary forward of its
slice with that initial state. Backward: the summary (dS_ext, dM) of its first local piece from its d_o, one
all-gather, the merge of the later ranks' summaries into the d_final_state of its last local piece, then the
ordinary backward of its slice. The gradients of q, k, v, g, beta are the rank's slice of the global ones;
those of A_log and dt_bias are the rank's contributions (sum them over the group, as for any replicated
parameter). Restrictions (as fla's): no initial_state, no output_final_state.

The summaries and the merge run on the CPU backend today (the CUDA summary kernels are not written): CPU
tensors only; the exchange works over any torch.distributed backend (gloo for CPU tensors)."""
from __future__ import annotations

import torch

from . import _encore
from ._kda_autograd import _residual_request
from .kda import _opts
from ._util import _dl, _ops


def _slice_bounds(t_local, group):
    import torch.distributed as dist

    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor([t_local], dtype=torch.long), group=group)
    bounds = [0]
    for s in sizes:
        bounds.append(bounds[-1] + int(s))
    return bounds


def _gather(packed, group):
    import torch.distributed as dist

    out = [torch.empty_like(packed) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, packed.contiguous(), group=group)
    return out


def _summary(q, k, v, g, beta, A_log, dt_bias, cu, opts, piece, d_o=None):
    hv, K, V = v.shape[2], q.shape[3], v.shape[3]
    S = torch.zeros(hv, K, V, dtype=torch.float64)
    M = torch.zeros(hv, K, K, dtype=torch.float64)
    _encore.kda_cp_summary_out(*_dl(q, k, v, g, beta, A_log, dt_bias, cu, d_o), int(piece), *opts, *_dl(S, M))
    return torch.cat((S.flatten(), M.flatten()))


def _merge(parts, ranks, hv, K, V):
    """X = 0; X = M_j·X + S_j over the gathered summaries of `ranks`, in order; [hv, K, V] float64."""
    n = hv * K * V
    S = torch.stack([parts[j][:n].view(hv, K, V) for j in ranks])
    M = torch.stack([parts[j][n:].view(hv, K, K) for j in ranks])
    out = torch.empty(hv, K, V, dtype=torch.float64)
    _encore.kda_cp_merge_out(*_dl(S, M, out))
    return out


class ChunkKdaCpFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, scale, l2, gate, lower_bound, cu_local, pre, post, group):
        import torch.distributed as dist

        r = dist.get_rank(group)
        hv, K, V = v.shape[2], q.shape[3], v.shape[3]
        opts = _opts(scale, l2, gate, lower_bound)
        n_local = cu_local.numel() - 1
        packed = (_summary(q, k, v, g, beta, A_log, dt_bias, cu_local, opts, n_local - 1) if post > 0
                  else torch.zeros(hv * K * (V + K), dtype=torch.float64))
        parts = _gather(packed, group)
        h0 = torch.zeros(n_local, hv, K, V, dtype=torch.float32 if q.dtype != torch.float64 else torch.float64)
        if pre > 0:
            h0[0] = _merge(parts, range(r - pre, r), hv, K, V).to(h0.dtype)
        names, rdt = _residual_request(q, False)
        outs = _ops().kda_forward(q, k, v, g, beta, None if scale is None else float(scale), h0, False, bool(l2), bool(gate), A_log,
                                  dt_bias, None if lower_bound is None else float(lower_bound), cu_local, names, rdt)
        res = list(outs[1:]) + [None] * (4 - len(outs[1:]))
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, h0, cu_local, *res)
        ctx.meta = (scale, bool(l2), bool(gate), lower_bound, opts, pre, post, group, r)
        return outs[0]

    @staticmethod
    def backward(ctx, d_o):
        q, k, v, g, beta, A_log, dt_bias, h0, cu, *res = ctx.saved_tensors
        scale, l2, gate, lower, opts, pre, post, group, r = ctx.meta
        hv, K, V = v.shape[2], q.shape[3], v.shape[3]
        d_o = d_o.contiguous()
        packed = (_summary(q, k, v, g, beta, A_log, dt_bias, cu, opts, 0, d_o=d_o) if pre > 0
                  else torch.zeros(hv * K * (V + K), dtype=torch.float64))
        parts = _gather(packed, group)
        d_fin = torch.zeros_like(h0)
        if post > 0:
            d_fin[-1] = _merge(parts, range(r + post, r, -1), hv, K, V).to(h0.dtype)
        grads = _ops().kda_backward(q, k, v, g, beta, d_o, d_fin, None if scale is None else float(scale), h0, l2, gate, A_log, dt_bias,
                                    None if lower is None else float(lower), cu, *res)
        dq, dk, dv, dg, dbeta, *extra = grads
        extra = iter(extra[1:])  # extra[0]: dh0 of the merged initial state (carried upstream by the merge instead)
        dA_log = next(extra) if A_log is not None else None
        ddt_bias = next(extra) if dt_bias is not None else None
        return dq, dk, dv, dg, dbeta, dA_log, ddt_bias, None, None, None, None, None, None, None, None


def chunk_kda_cp(q, k, v, g, beta, cu_seqlens, group, scale=None, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                 lower_bound=None, A_log=None, dt_bias=None):
    """This rank's o [1, T_local, HV, V] of the global varlen batch (cu_seqlens: the global sequence table, the
    same on every rank; q, k, v, g, beta: this rank's contiguous slice, ranks in group order)."""
    if q.shape[0] != 1:
        raise ValueError(f"q: context parallelism takes the varlen layout B = 1, got {tuple(q.shape)}")
    if q.is_cuda:
        raise NotImplementedError("chunk_kda with cp_group: the CUDA summary kernels are not written yet; CPU tensors only")
    import torch.distributed as dist

    bounds = _slice_bounds(q.shape[1], group)
    cu = [int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
    split = _encore.kda_cp_split(cu, bounds)
    local, pre, post = split[dist.get_rank(group)]
    cu_local = torch.tensor(local, dtype=torch.long)
    return ChunkKdaCpFunction.apply(q, k, v, g, beta, A_log, dt_bias, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, lower_bound,
                                    cu_local, pre, post, group)
