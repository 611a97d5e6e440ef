"""chunk_kda with context parallelism (docs/math/kda.md §10; encore/kda_cp.hpp): every rank of a torch.distributed
process group holds one contiguous slice along T of a varlen batch (B = 1) and the global cu_seqlens.

Forward, per rank: the summary (S_ext, M) of its last local piece (zeros when that sequence ends on this rank),
one all-gather of the packed [S_ext | M], the merge of the earlier ranks' summaries into the initial state of
its first local piece (when that sequence started on an earlier rank), then the ordinary forward of its
slice with that initial state. Backward: the summary (dS_ext, dM) of its first local piece from its d_o, one
all-gather, the merge of the later ranks' summaries into the d_final_state of its last local piece, then the
ordinary backward of its slice. The gradients of q, k, v, g, beta are the rank's slice of the global ones;
those of A_log and dt_bias are the rank's contributions (sum them over the group, as for any replicated
parameter). Restrictions (as fla's): no initial_state, no output_final_state.

CPU tensors: the fp64 reference summaries and merge, any torch.distributed backend (gloo). CUDA tensors: the
summaries composed from the CUDA forward and backward (encore/kda_cp.hpp; fp32 [S_ext | M]), the merge in
torch (fp32), the exchange over the group's backend (NCCL: on the current CUDA device; others: through the
host). `group` may also be an exchange object with rank, world_size and all_gather(tensor) -> list (the
single-process rank emulation of tests/python/test_kda_cp.py)."""
from __future__ import annotations

import torch

from . import _core
from . import _encore as _b
from ._core import dl, ops, stream_for
from ._kda_autograd import _residual_list, _residual_request
from ._kda_args import _forward_args, _given, _op_flags, _opt_float, _opts


class _DistExchange:
    """The collectives of one CP rank over a torch.distributed process group."""

    def __init__(self, group):
        import torch.distributed as dist

        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.nccl = "nccl" in str(dist.get_backend(group))

    def all_gather(self, t):
        import torch.distributed as dist

        dev = torch.device("cuda", torch.cuda.current_device()) if self.nccl else torch.device("cpu")
        x = t.to(dev).contiguous()
        out = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(out, x, group=self.group)
        return [y.to(t.device) for y in out]


def _exchange(group):
    return group if hasattr(group, "all_gather") and hasattr(group, "world_size") else _DistExchange(group)


def _slice_bounds(t_local, ex):
    sizes = ex.all_gather(torch.tensor([t_local], dtype=torch.long))
    bounds = [0]
    for s in sizes:
        bounds.append(bounds[-1] + int(s))
    return bounds


def _summary(q, k, v, g, beta, A_log, dt_bias, cu, opts, piece, d_o=None):
    """The packed [S | M] of local piece `piece` (d_o given: the backward's [dS_ext | dM]): float64 on the CPU,
    float32 on CUDA (composed from the CUDA forward / backward, on torch's current stream)."""
    hv, K, V = v.shape[2], q.shape[3], v.shape[3]
    dt = torch.float32 if q.is_cuda else torch.float64
    S = torch.empty(hv, K, V, dtype=dt, device=q.device)
    M = torch.empty(hv, K, K, dtype=dt, device=q.device)
    args = _b.KdaCpSummaryArgs(fwd=_forward_args(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu), d_o=dl(d_o),
                               piece=int(piece), S=dl(S), M=dl(M))
    size, run = ((_b.kda_cp_forward_summary_workspace, _b.kda_cp_forward_summary_run) if d_o is None else
                 (_b.kda_cp_backward_summary_workspace, _b.kda_cp_backward_summary_run))
    nbytes = size(args, opts) if q.is_cuda else 0  # the CPU backend needs none
    run(args, opts, _core.workspace(None, q, nbytes, 16, size.__name__) if nbytes else None, stream_for(q))
    return torch.cat((S.flatten(), M.flatten()))


def _forward_packed(q, k, v, g, beta, A_log, dt_bias, cu_local, opts, post):
    """This rank's contribution to the forward all-gather: the summary of its last piece, zeros when no later
    rank continues that sequence."""
    if post > 0:
        return _summary(q, k, v, g, beta, A_log, dt_bias, cu_local, opts, cu_local.numel() - 2)
    return _zeros_packed(q, v)


def _backward_packed(q, k, v, g, beta, A_log, dt_bias, cu_local, opts, pre, d_o):
    """The backward all-gather's: the backward summary of its first piece, zeros when it starts its sequence."""
    if pre > 0:
        return _summary(q, k, v, g, beta, A_log, dt_bias, cu_local, opts, 0, d_o=d_o)
    return _zeros_packed(q, v)


def _zeros_packed(q, v):
    hv, K, V = v.shape[2], q.shape[3], v.shape[3]
    return torch.zeros(hv * K * (V + K), dtype=torch.float32 if q.is_cuda else torch.float64, device=q.device)


def _merge(parts, ranks, hv, K, V):
    """X = 0; X = M_j·X + S_j over the gathered summaries of `ranks`, in order; [hv, K, V] (float64 on the CPU
    through the reference, float32 in torch on CUDA)."""
    n = hv * K * V
    if parts[0].is_cuda:
        return _merge_torch(parts, ranks, hv, K, V)
    S = torch.stack([parts[j][:n].view(hv, K, V) for j in ranks])
    M = torch.stack([parts[j][n:].view(hv, K, K) for j in ranks])
    out = torch.empty(hv, K, V, dtype=torch.float64)
    _b.kda_cp_merge_run(S=dl(S), M=dl(M), out=dl(out))
    return out


def _merge_torch(parts, ranks, hv, K, V):
    """The merge in torch, in the parts' dtype and device (CUDA: fp32)."""
    n = hv * K * V
    X = torch.zeros(hv, K, V, dtype=parts[0].dtype, device=parts[0].device)
    for j in ranks:
        X = torch.baddbmm(parts[j][:n].view(hv, K, V), parts[j][n:].view(hv, K, K), X)
    return X


class ChunkKdaCpFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, scale, l2, gate, lower_bound, cu_local, pre, post, ex):
        r = ex.rank
        hv, K, V = v.shape[2], q.shape[3], v.shape[3]
        opts = _opts(scale, l2, gate, lower_bound)
        n_local = cu_local.numel() - 1
        parts = ex.all_gather(_forward_packed(q, k, v, g, beta, A_log, dt_bias, cu_local, opts, post))
        h0 = torch.zeros(n_local, hv, K, V, dtype=torch.float32 if q.dtype != torch.float64 else torch.float64, device=q.device)
        if pre > 0:
            h0[0] = _merge(parts, range(r - pre, r), hv, K, V).to(h0.dtype)
        names, rdt = _residual_request(q, False)
        outs = ops().kda_forward(*_given(q, k, v, g, beta, _op_flags(False, l2, gate, False, rdt, names), h0, A_log, dt_bias, cu_local,
                                         _opt_float(scale), _opt_float(lower_bound)))
        res = _residual_list(names, outs[1:])
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, h0, cu_local, *res)
        ctx.meta = (scale, bool(l2), bool(gate), lower_bound, opts, pre, post, ex, r)
        return outs[0]

    @staticmethod
    def backward(ctx, d_o):
        q, k, v, g, beta, A_log, dt_bias, h0, cu, *res = ctx.saved_tensors
        scale, l2, gate, lower, opts, pre, post, ex, r = ctx.meta
        hv, K, V = v.shape[2], q.shape[3], v.shape[3]
        d_o = d_o.contiguous()
        parts = ex.all_gather(_backward_packed(q, k, v, g, beta, A_log, dt_bias, cu, opts, pre, d_o))
        d_fin = torch.zeros_like(h0)
        if post > 0:
            d_fin[-1] = _merge(parts, range(r + post, r, -1), hv, K, V).to(h0.dtype)
        grads = ops().kda_backward(q, k, v, g, beta, d_o, d_fin, _opt_float(scale), h0, l2, gate, A_log, dt_bias,
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
    ex = _exchange(group)
    bounds = _slice_bounds(q.shape[1], ex)
    cu = [int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
    local, pre, post = _b.kda_cp_split(cu, bounds)[ex.rank]
    cu_local = torch.tensor(local, dtype=torch.long)
    return ChunkKdaCpFunction.apply(q, k, v, g, beta, A_log, dt_bias, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, lower_bound,
                                    cu_local, pre, post, ex)
