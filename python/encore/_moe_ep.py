"""The MoE layer across the ranks of a torch.distributed process group, on the collective path (issue 33;
docs/moe.md "Across GPUs"): NCCL's all-to-all / all-reduce on CUDA tensors, gloo's on CPU tensors. It is
the path every deployment can take, the fallback of the peer-memory exchange and its baseline.

Rank r of W owns the experts [r * E / W, (r + 1) * E / W) (E_local = E / W, w13 [E_local, 2F, D],
w2 [E_local, D, F]); the router logits span all E experts on every rank.

- mode "ep" (expert parallel, data-parallel tokens): x [T_r, D] are this rank's own tokens. Routing on
  the rank; the (t, j) pairs, stably sorted by destination rank, go out by one all-to-all of their rows
  (and one of their local expert ids, after one of the counts); each rank runs its local experts on the
  rows it received (in (source rank, token, j) order) through moe_forward with a one-hot top-1 routing
  (weight exactly 1, so each output row is the expert's own rounded output); the rows go back by the
  reverse all-to-all and moe_combine sums them in j order in fp32 with the routing weights: the result
  equals moe_forward on all ranks' tokens in one process bit for bit (each expert row is computed
  independently of the rows beside it, and the combine order is the same).
- mode "tp" (replicated tokens): x [T, D] is the same on every rank. Each rank computes the pairs routed
  to its experts, combines them in fp32 with the other pairs' weights zeroed, and an all-reduce sums the
  fp32 partial outputs, rounded to x's dtype once: equal to the single-GPU layer up to the order of that
  fp32 sum (bit-exact when each token's k experts sit on one rank).

Every call agrees on the inputs (EP: an error flag beside the counts in their exchange; TP: one all-reduce of
the flag first; on an error, one all-gather of the messages): a rank with bad inputs makes every rank raise a
ValueError naming it, instead of leaving its peers waiting. Every other wait is bounded by the process group's
timeout."""
import os
import secrets

import torch
import torch.distributed as dist

from . import _encore
from . import moe as _moe
from . import norm as _norm
from . import quant as _quant
from ._core import dl, stream_for, torch_module

torch_module()  # _core's torch: dl passes tensors as DLPack capsules


def _world(group):
    return dist.get_world_size(group), dist.get_rank(group)


def _raise_refused(group, error):
    """Every rank calls this once some rank's inputs were refused: gathers the messages and raises."""
    world, rank = _world(group)
    msgs = [None] * world
    dist.all_gather_object(msgs, error, group=group)
    bad = "; ".join(f"rank {r}: {m}" for r, m in enumerate(msgs) if m is not None)
    raise ValueError(f"moe_forward_ep (rank {rank} of {world}): refused on {bad}")


def _agree(group, error, device):
    """Raises on every rank if any rank's `error` (a message, or None) is set: one all-reduce of a flag (the
    TP path; the EP path carries the flag in its counts exchange)."""
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if int(flag.item()) != 0:
        _raise_refused(group, error)


def _check(x, router_logits, w13, w2, top_k, world, mode):
    if getattr(x, "ndim", 0) != 2:
        return f"x: expected [T, D], got shape {tuple(getattr(x, 'shape', ()))}"
    if getattr(router_logits, "ndim", 0) != 2 or router_logits.shape[0] != x.shape[0]:
        return f"router_logits: expected [T, E] with T = {x.shape[0]}, got {tuple(router_logits.shape)}"
    E = router_logits.shape[1]
    if E % world != 0:
        return f"router_logits: E = {E} experts must divide over the {world} ranks"
    el = E // world
    if getattr(w13, "ndim", 0) != 3 or w13.shape[0] != el or w13.shape[2] != x.shape[1] or w13.shape[1] % 2 != 0:
        return f"w13: expected this rank's [E / W = {el}, 2F, D = {x.shape[1]}], got {tuple(w13.shape)}"
    if getattr(w2, "ndim", 0) != 3 or tuple(w2.shape) != (el, x.shape[1], w13.shape[1] // 2):
        return f"w2: expected [{el}, {x.shape[1]}, {w13.shape[1] // 2}], got {tuple(w2.shape)}"
    if not 1 <= top_k <= E:
        return f"top_k: must be in [1, E = {E}], got {top_k}"
    if mode not in ("ep", "tp"):
        return f"mode: must be 'ep' or 'tp', got {mode!r}"
    if x.dtype != w13.dtype or w2.dtype != w13.dtype:
        return f"w13, w2: must have x's dtype {x.dtype}, got {w13.dtype}, {w2.dtype}"
    return None


def _experts(rows, local_ids, w13, w2, align_m):
    """Each row through its local expert: moe_forward with a one-hot top-1 routing (weight exactly 1)."""
    if rows.shape[0] == 0:
        return rows.new_empty(0, rows.shape[1])
    logits = torch.full((rows.shape[0], w13.shape[0]), -30000.0, dtype=torch.float32, device=rows.device)
    logits.scatter_(1, local_ids.long()[:, None], 0.0)
    return _moe.moe_forward(rows, logits, w13, w2, 1, scoring="softmax", renormalize=True, align_m=align_m)


def _route(x, router_logits, top_k, routing):
    if x.shape[0] == 0:
        return (torch.empty(0, top_k, dtype=torch.int32, device=x.device), torch.empty(0, top_k, dtype=torch.float32, device=x.device))
    return _moe.moe_routing(router_logits, top_k, **routing)


def _fp8_rows(x):
    """x [T, D] as e4m3 rows and their 1x128 fp32 scales (encore.fp8_group_quant)."""
    if x.shape[0] == 0:
        return (torch.empty(0, x.shape[1], dtype=torch.uint8, device=x.device),
                torch.empty(0, x.shape[1] // 128, dtype=torch.float32, device=x.device))
    q, scales = _quant.fp8_group_quant(x)
    return q.view(torch.uint8), scales.contiguous()


def fp8_roundtrip_rows(q, scales, dtype):
    """What a receiver makes of e4m3 rows q [R, D] (bytes) and their scales [R, D / 128]: float(q) * scale in
    fp32, rounded once to dtype. moe_forward on fp8_roundtrip_rows(*fp8 rows of x) is the layer an fp8 dispatch
    equals bit for bit."""
    if q.shape[0] == 0:
        return torch.empty(0, q.shape[1], dtype=dtype, device=q.device)
    return (q.view(torch.float8_e4m3fn).to(torch.float32) * scales.repeat_interleave(128, dim=1)).to(dtype)


def _combine(y_pairs, weights, out_dtype):
    t, k = weights.shape
    if t == 0:
        return y_pairs.new_empty(0, y_pairs.shape[1], dtype=out_dtype)
    slots = torch.arange(t * k, dtype=torch.int32, device=y_pairs.device).view(t, k)
    out = torch.empty(t, y_pairs.shape[1], dtype=out_dtype, device=y_pairs.device)
    return _moe.moe_combine(y_pairs, slots, weights, out=out)


_FP8_DISAGREE = "moe_forward_ep: dispatch_fp8 differs between the ranks (every rank must pass the same value)"
_PEERS = {}  # (group, E, k, D, dtype, device, fp8, max_tokens) -> _encore.EpPeerRank, built collectively once
PEER_TIMEOUT_MS = 20000  # every spin loop of the peer transport gives up after this (then every rank raises)


def _peer_rank(group, world, rank, E, k, D, like, m_bound, fp8=False):
    """(key, this rank's end of the peer-memory group for these shapes): created on first use, by every rank at
    once (they all see the same m_bound), max_tokens the next power of two >= m_bound. fp8: e4m3 rows with
    their scales (D / 32 bytes), expert outputs in like's dtype."""
    cap = 1 << max(0, (max(1, m_bound) - 1).bit_length())
    key = (id(group), E, k, D, like.dtype, like.device.index, fp8, cap)
    if key not in _PEERS:
        for old in [k_ for k_ in _PEERS if k_[:-1] == key[:-1] and k_[-1] < cap]:  # a smaller bound: superseded
            del _PEERS[old]
        name = [f"{os.getpid()}-{secrets.token_hex(6)}" if rank == 0 else None]
        dist.broadcast_object_list(name, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        dev = like.device.index if like.device.index is not None else torch.cuda.current_device()
        _PEERS[key] = _encore.EpPeerRank(world, rank, E, k, D, cap, dl(like), D // 32 if fp8 else 0, PEER_TIMEOUT_MS, dev, name[0], fp8)
    return key, _PEERS[key]


def _ep_peer(x, router_logits, w13, w2, k, group, routing, align_m, error, fp8=False):
    """mode "ep" over peer memory (EpDeviceAllToAll, src/moe/ep_device.hpp): the rows go straight into the
    owners' memory, the outputs straight back, the combine in fp32 in j order (the same chain as moe_combine),
    so the result equals the collective path and moe_forward bit for bit. One all-reduce agrees on the
    inputs and the token bound; the host reads the received counts once (a synchronization)."""
    world, rank = _world(group)
    if error is None and not x.is_cuda:
        error = "transport 'peer': needs CUDA tensors (the collective path takes CPU ones)"
    # NCCL takes CUDA tensors only: the agreement on a CUDA device there whatever x is, so a rank passing CPU
    # tensors raises with the others instead of inside the collective
    nccl = dist.get_backend(group) == "nccl"
    where = torch.device("cuda", torch.cuda.current_device()) if nccl else x.device
    # [refused, token bound, dispatch_fp8, not dispatch_fp8]: every rank learns the same maxima
    agree = torch.tensor([0 if error is None else 1, x.shape[0] if error is None else 0, int(fp8), int(not fp8)], dtype=torch.int64,
                         device=where)
    dist.all_reduce(agree, op=dist.ReduceOp.MAX, group=group)
    flag, m_bound, some_fp8, some_not = agree.tolist()
    if flag:
        _raise_refused(group, error)
    if some_fp8 and some_not:
        raise ValueError(_FP8_DISAGREE)
    E, D = router_logits.shape[1], x.shape[1]
    el = E // world
    key, ep = _peer_rank(group, world, rank, E, k, D, x, m_bound, fp8)
    ids, weights = _route(x, router_logits, k, routing)
    stream = stream_for(x)
    if fp8:
        q, scales = _fp8_rows(x)
        ep.dispatch(dl(q), dl(ids.contiguous()), dl(scales.view(torch.uint8)), stream)
    else:
        ep.dispatch(dl(x.contiguous()), dl(ids.contiguous()), None, stream)
    counts, _, rows, rscales = ep.received()
    counts_h = counts.cpu()  # the host synchronization
    n = int(counts_h.sum())
    local = torch.repeat_interleave(torch.arange(el, dtype=torch.int32, device=x.device), counts_h.to(x.device))
    if fp8:
        rows = fp8_roundtrip_rows(rows[:n], rscales[:n].view(torch.float32), x.dtype)
    y = torch.empty(ep.max_rows, D, dtype=x.dtype, device=x.device)
    y[:n] = _experts(rows[:n], local, w13, w2, align_m)
    out = torch.empty(x.shape[0], D, dtype=x.dtype, device=x.device)
    ep.combine(dl(y), dl(weights.contiguous()), dl(out), stream)
    torch.cuda.current_stream(x.device).synchronize()
    try:
        ep.check()  # a timeout or bad ids anywhere in the group: raises on every rank with the failing rank's message
    except RuntimeError:
        _PEERS.pop(key, None)  # an aborted group is not reused
        raise
    return out


def _check_norm(x, residual, norm_weight):
    if residual is None or norm_weight is None:
        return "residual, norm_weight: pass both (the residual add + RMSNorm after the layer) or neither"
    if tuple(residual.shape) != tuple(x.shape) or residual.dtype != x.dtype or residual.device != x.device:
        return f"residual: expected x's shape {tuple(x.shape)}, dtype {x.dtype} and device, got {tuple(residual.shape)} {residual.dtype} {residual.device}"
    if tuple(norm_weight.shape) != (x.shape[1],) or norm_weight.dtype != x.dtype or norm_weight.device != x.device:
        return f"norm_weight: expected [{x.shape[1]}] of {x.dtype} on x's device, got {tuple(norm_weight.shape)} {norm_weight.dtype} {norm_weight.device}"
    return None


def _finish(out, residual, norm_weight, eps):
    """The layer's output, or (rms_norm(residual + out), residual + out) when a norm follows."""
    if norm_weight is None:
        return out
    if out.shape[0] == 0:
        return out, out + residual
    return _norm.add_rms_norm(out, residual, norm_weight, eps)


def moe_forward_ep(x, router_logits, w13, w2, top_k: int, group=None, mode: str = "ep", scoring: str = "softmax",
                   renormalize: bool = True, n_group: int = 1, topk_group: int = 1, correction_bias=None,
                   routed_scaling_factor: float = 1.0, align_m: int = 1, transport: str = "collective", dispatch_fp8: bool = False,
                   residual=None, norm_weight=None, norm_eps: float = 1e-6):
    """The MoE layer over `group` (default: the world). x [T, D] (this rank's tokens for "ep", every rank's
    same tokens for "tp"); router_logits [T, E] over all experts; w13 [E / W, 2F, D] and w2 [E / W, D, F] the
    experts of this rank (rank r: experts r * E / W ...). Routing options as moe_forward's. Returns [T, D].
    transport: "collective" (the group's all-to-all; any backend) or, for mode "ep" on CUDA, "peer" (the
    rows written into the other ranks' GPU memory: every rank a process on one node, the GPUs able to map
    each other's memory). dispatch_fp8 (mode "ep"): the rows travel as e4m3 with their 1x128 fp32 scales
    (encore.fp8_group_quant, D a multiple of 128; every rank passes the same value) and the receivers
    dequantize them (float(q) * scale in fp32, rounded once to x's dtype) before the experts; the expert
    outputs come back in x's dtype. The result equals moe_forward on the dequantized tokens bit for bit.
    residual [T, D] and norm_weight [D] (x's dtype): the next residual add + RMSNorm on the layer's output,
    returning (y, h) with h = residual + out and y = rms_norm(h) * norm_weight (encore.add_rms_norm, one
    kernel after the combine or the all-reduce; the all-reduce itself stays NCCL's)."""
    world, rank = _world(group)
    error = _check(x, router_logits, w13, w2, int(top_k), world, mode)
    if error is None and (residual is not None or norm_weight is not None):
        error = _check_norm(x, residual, norm_weight)
    if error is None and transport not in ("collective", "peer"):
        error = f"transport: must be 'collective' or 'peer', got {transport!r}"
    if error is None and transport == "peer" and mode != "ep":
        error = "transport 'peer': only for mode 'ep'"
    if error is None and dispatch_fp8 and (mode != "ep" or x.shape[1] % 128 != 0):
        error = (f"dispatch_fp8: needs mode 'ep' and a hidden size that is a multiple of 128, got mode {mode!r}, "
                 f"hidden {x.shape[1]}")
    routing = dict(scoring=scoring, renormalize=renormalize, n_group=n_group, topk_group=topk_group, correction_bias=correction_bias,
                   routed_scaling_factor=routed_scaling_factor)
    if transport == "peer" and mode == "ep":
        return _finish(_ep_peer(x, router_logits, w13, w2, int(top_k), group, routing, align_m, error, bool(dispatch_fp8)), residual,
                       norm_weight, norm_eps)
    if mode != "ep":  # "tp" (or a bad mode): one all-reduce of the error flag first
        _agree(group, error, x.device)
    k, el = (int(top_k), router_logits.shape[1] // world) if error is None else (1, 1)
    if error is not None:  # "ep": no tokens, but still the counts exchange below, which carries the flag
        x, router_logits = x.new_zeros(0, 1), None
    ids, weights = _route(x, router_logits, k, routing)
    flat = ids.reshape(-1).long()
    dest = torch.div(flat, el, rounding_mode="floor")
    if mode == "tp":
        sel = torch.nonzero(dest == rank).flatten()
        y_local = _experts(x.index_select(0, torch.div(sel, k, rounding_mode="floor")), flat[sel] - rank * el, w13, w2, align_m)
        y_pairs = x.new_zeros(flat.numel(), x.shape[1])
        y_pairs[sel] = y_local
        mine = torch.zeros_like(weights).reshape(-1)
        mine[sel] = weights.reshape(-1)[sel]
        partial = _combine(y_pairs, mine.view_as(weights), torch.float32)
        dist.all_reduce(partial, group=group)
        return _finish(partial.to(x.dtype), residual, norm_weight, norm_eps)
    order = torch.argsort(dest, stable=True)  # (destination, token, j): a stable order every receiver sees
    send = torch.bincount(dest, minlength=world).to(torch.int64)
    # one exchange of [count to r, my error flag, my dispatch_fp8] per destination r: the counts and the agreement
    # on the inputs
    msg = torch.stack((send, torch.full_like(send, 0 if error is None else 1), torch.full_like(send, int(dispatch_fp8))), 1).flatten()
    got = torch.empty_like(msg)
    dist.all_to_all_single(got, msg, group=group)
    both = torch.cat((send, got)).tolist()  # one host synchronization
    send_l, recv_l, flags, fp8s = both[:world], both[world::3], both[world + 1::3], both[world + 2::3]
    if any(flags):
        _raise_refused(group, error)
    if len(set(fp8s)) > 1:  # every rank sees every rank's flag: all raise
        raise ValueError(_FP8_DISAGREE)
    src = torch.div(order, k, rounding_mode="floor")
    ids_out = (flat[order] - dest[order] * el).to(torch.int32)
    ids_in = torch.empty(sum(recv_l), dtype=torch.int32, device=x.device)
    if dispatch_fp8:  # e4m3 bytes and fp32 scales over the wire, dequantized here
        q, scales = _fp8_rows(x)
        q_in = torch.empty(sum(recv_l), x.shape[1], dtype=torch.uint8, device=x.device)
        s_in = torch.empty(sum(recv_l), x.shape[1] // 128, dtype=torch.float32, device=x.device)
        dist.all_to_all_single(q_in, q.index_select(0, src), output_split_sizes=recv_l, input_split_sizes=send_l, group=group)
        dist.all_to_all_single(s_in, scales.index_select(0, src), output_split_sizes=recv_l, input_split_sizes=send_l, group=group)
        rows_in = fp8_roundtrip_rows(q_in, s_in, x.dtype)
    else:
        rows_in = x.new_empty(sum(recv_l), x.shape[1])
        dist.all_to_all_single(rows_in, x.index_select(0, src), output_split_sizes=recv_l, input_split_sizes=send_l, group=group)
    dist.all_to_all_single(ids_in, ids_out, output_split_sizes=recv_l, input_split_sizes=send_l, group=group)
    y_in = _experts(rows_in, ids_in, w13, w2, align_m)
    y_back = x.new_empty(flat.numel(), x.shape[1])
    dist.all_to_all_single(y_back, y_in, output_split_sizes=send_l, input_split_sizes=recv_l, group=group)
    y_pairs = torch.empty_like(y_back)
    y_pairs[order] = y_back
    return _finish(_combine(y_pairs, weights, x.dtype), residual, norm_weight, norm_eps)


class ExpertParallelMoE(torch.nn.Module):
    """encore.nn.MoE over a process group: the router (all E experts) on every rank, this rank's E / W experts'
    weights (w13 [E / W, 2F, D], w2 [E / W, D, F]); forward(x [..., D]) as moe_forward_ep with `mode` ("ep":
    x holds this rank's tokens; "tp": the same tokens on every rank); moe_forward_ep's other keywords
    (routing options, align_m, transport="peer" for the peer-memory path) pass through **options."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, group=None, mode: str = "ep",
                 device=None, dtype=None, **options):
        super().__init__()
        world, rank = _world(group)
        if num_experts % world != 0:
            raise ValueError(f"num_experts: {num_experts} must divide over the {world} ranks")
        kw = {"device": device, "dtype": dtype}
        self.group, self.mode, self.top_k, self.options = group, mode, top_k, options
        self.hidden_size, self.num_experts, self.first_expert = hidden_size, num_experts, rank * (num_experts // world)
        self.gate = torch.nn.Linear(hidden_size, num_experts, bias=False, **kw)
        self.w13 = torch.nn.Parameter(torch.empty(num_experts // world, 2 * intermediate_size, hidden_size, **kw), requires_grad=False)
        self.w2 = torch.nn.Parameter(torch.empty(num_experts // world, hidden_size, intermediate_size, **kw), requires_grad=False)
        self.gate.requires_grad_(False)
        self.register_buffer("correction_bias", None)

    @classmethod
    def from_layer(cls, layer, group=None, mode: str = "ep"):
        """This rank's share of an encore.nn.MoE holding all experts (weights sliced, not copied)."""
        world, rank = _world(group)
        el = layer.num_experts // world
        m = cls(layer.hidden_size, layer.intermediate_size, layer.num_experts, layer.top_k, group, mode, device="meta",
                dtype=layer.w13.dtype, **layer.options)
        m.gate.weight = torch.nn.Parameter(layer.gate.weight, requires_grad=False)
        m.w13 = torch.nn.Parameter(layer.w13[rank * el:(rank + 1) * el], requires_grad=False)
        m.w2 = torch.nn.Parameter(layer.w2[rank * el:(rank + 1) * el], requires_grad=False)
        m.correction_bias = layer.e_score_correction_bias
        return m

    def forward(self, x):
        rows = x.reshape(-1, self.hidden_size)
        out = moe_forward_ep(rows, self.gate(rows), self.w13, self.w2, self.top_k, self.group, self.mode,
                             correction_bias=self.correction_bias, **self.options)
        return out.reshape(x.shape)
