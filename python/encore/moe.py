"""The moe family (single GPU, TP = 1): routing, dispatch, combine and the layer. Routing, dispatch
and combine run on numpy / CPU torch (CPU backend) and CUDA torch tensors; moe_forward too (on CUDA
bf16 only: its grouped GEMMs; D and F multiples of 8). The math, shapes
and conventions are in include/encore/moe.hpp and docs/moe.md. torch.library registration (torch.ops.encore)
registers routing, dispatch, combine and the layer as torch.ops.encore.moe_* (traced by torch.compile;
moe_forward with caller-given buffers or out takes the direct path). encore.nn.MoE is the layer as a
torch module."""
from __future__ import annotations

from . import _encore
from ._util import _dl, _empty, _is_torch, _no_autograd, _ops, _stream_for, _via_torch_op, _workspace

__all__ = ["moe_routing", "moe_dispatch", "moe_combine", "moe_forward", "moe_permuted_rows", "moe_buffers_bytes"]

moe_permuted_rows = _encore.moe_permuted_rows


def _scoring(scoring):
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring: must be 'softmax' or 'sigmoid', got {scoring!r}")
    return scoring == "sigmoid"


def moe_routing(logits, top_k: int, scoring: str = "softmax", renormalize: bool = True, n_group: int = 1, topk_group: int = 1,
                correction_bias=None, routed_scaling_factor: float = 1.0, stream=None):
    """Top-k routing of logits [T, E] (bf16, fp16 or fp32). Returns (topk_ids int32 [T, k], topk_weights
    float32 [T, k]), experts in descending order of score (+ correction_bias), ties to the lower index.
    scoring "softmax" or "sigmoid"; n_group / topk_group: grouped top-k (DeepSeek-V3 with a bias)."""
    if _via_torch_op(stream, logits, correction_bias):
        return tuple(_ops().moe_routing(logits, correction_bias, int(top_k), scoring, bool(renormalize), int(n_group),
                                        int(topk_group), float(routed_scaling_factor)))
    _no_autograd(logits)
    if getattr(logits, "ndim", 0) != 2:
        raise ValueError("logits: expected 2 dimensions [T, E]")
    t = logits.shape[0]
    ids, w = _empty(logits, (t, top_k), "i32"), _empty(logits, (t, top_k), "f32")
    _encore.moe_routing_out(*_dl(logits, correction_bias, ids, w), int(top_k), _scoring(scoring), bool(renormalize), int(n_group),
                            int(topk_group), float(routed_scaling_factor), _stream_for(logits, stream))
    return ids, w


_DISPATCH_KEYS = ("expert_counts", "expert_offsets", "slot_rows", "row_slots")


def moe_dispatch(topk_ids, num_experts: int, x=None, align_m: int = 1, fp8: bool = False, power_of_two_scales: bool = False,
                 stream=None):
    """Expert-contiguous permutation of the (token, k) slots of topk_ids [T, k] int32. Returns a dict:
    expert_counts [E], expert_offsets [E + 1] (each expert's block padded to align_m rows), slot_rows
    [T, k] ((t, j) -> row), row_slots [R] (row -> t * k + j, -1 for rows without a token), and, with
    x [T, D], x_permuted [R, D] (gathered rows, padding rows zeroed; rows from expert_offsets[E] on
    unspecified). R = moe_permuted_rows(T, k, E, align_m).
    fp8=True (D a multiple of 128): the FP8 1x128 quantization fused into the gather: x_permuted as
    fp8_group_quant returns it (torch.float8_e4m3fn, or raw e4m3 bytes as uint8 for numpy) and
    x_scales [R, D // 128] float32, bit for bit fp8_group_quant of the unquantized rows (padding rows:
    q 0 and the scale of a zero group)."""
    if _via_torch_op(stream, topk_ids, x):
        got = _ops().moe_dispatch(topk_ids, int(num_experts), x, int(align_m), bool(fp8), bool(power_of_two_scales))
        keys = _DISPATCH_KEYS + (("x_permuted",) if x is not None else ()) + (("x_scales",) if x is not None and fp8 else ())
        return dict(zip(keys, got))
    if fp8 and x is None:
        raise ValueError("x: fp8=True quantizes the gathered rows of x; pass x")
    if getattr(topk_ids, "ndim", 0) != 2:
        raise ValueError("topk_ids: expected 2 dimensions [T, k]")
    t, k = topk_ids.shape
    rows = _encore.moe_permuted_rows(t, k, int(num_experts), int(align_m)) if num_experts > 0 and align_m > 0 else 1
    r = {"expert_counts": _empty(topk_ids, (max(num_experts, 1),), "i32"), "expert_offsets": _empty(topk_ids, (max(num_experts, 1) + 1,), "i32"),
         "slot_rows": _empty(topk_ids, (t, k), "i32"), "row_slots": _empty(topk_ids, (rows,), "i32")}
    xp = None
    if x is not None:
        _no_autograd(x)
        if getattr(x, "ndim", 0) != 2:
            raise ValueError("x: expected 2 dimensions [T, D]")
        xp = _empty(x, (rows, x.shape[1]), "u8" if fp8 else "like")
        if _is_torch(xp):
            xp.zero_()  # the rows past expert_offsets[E] are not written: zeros rather than garbage
        else:
            xp.fill(0)
        if fp8:
            xs = _empty(x, (rows, x.shape[1] // 128), "f32")
            xs[...] = 0
    nbytes = _encore.moe_dispatch_workspace_bytes(*_dl(topk_ids), int(num_experts), int(align_m))
    ws = _workspace(None, topk_ids, nbytes, 16, "moe_dispatch")
    _encore.moe_dispatch_out(*_dl(topk_ids, x, r["expert_counts"], r["expert_offsets"], r["slot_rows"], r["row_slots"], xp,
                                  xs if fp8 else None, ws),
                             int(num_experts), int(align_m), bool(power_of_two_scales), _stream_for(topk_ids, stream))
    if xp is not None:
        if fp8 and _is_torch(xp):
            import torch

            xp = xp.view(torch.float8_e4m3fn)
        r["x_permuted"] = xp
        if fp8:
            r["x_scales"] = xs
    return r


def moe_combine(expert_out, slot_rows, topk_weights, out=None, stream=None):
    """out [T, D] = sum over j = 0..k-1 of topk_weights[t, j] * expert_out[slot_rows[t, j]], in fp32 in
    slot order (bit-reproducible), rounded to out's dtype (default expert_out's)."""
    if out is None and _via_torch_op(stream, expert_out, slot_rows, topk_weights):
        return _ops().moe_combine(expert_out, slot_rows, topk_weights)
    _no_autograd(expert_out)
    if getattr(expert_out, "ndim", 0) != 2 or getattr(slot_rows, "ndim", 0) != 2:
        raise ValueError("expert_out: expected [R, D] and slot_rows [T, k]")
    if out is None:
        out = _empty(expert_out, (slot_rows.shape[0], expert_out.shape[1]), "like")
    _encore.moe_combine_out(*_dl(expert_out, slot_rows, topk_weights, out), _stream_for(expert_out, stream))
    return out


def moe_buffers_bytes(max_tokens: int, hidden: int, intermediate: int, num_experts: int, top_k: int, like, align_m: int = 1):
    """Bytes of the layer's persistent buffers for up to max_tokens tokens of like's dtype (0 if invalid)."""
    return _encore.moe_buffers_bytes(int(max_tokens), int(hidden), int(intermediate), int(num_experts), *_dl(like), int(top_k), int(align_m))


def moe_forward(x, router_logits, w13, w2, top_k: int, scoring: str = "softmax", renormalize: bool = True, n_group: int = 1,
                topk_group: int = 1, correction_bias=None, routed_scaling_factor: float = 1.0, align_m: int = 1, buffers=None,
                max_tokens=None, out=None, stream=None):
    """The MoE layer: routing -> dispatch -> per-expert SwiGLU MLP -> combine (weights applied at combine).
    x [T, D]; router_logits [T, E] (the router GEMM is the caller's); w13 [E, 2F, D] (gate rows, then up
    rows); w2 [E, D, F]; all of x's dtype. buffers: optional persistent 1-D uint8 array of
    moe_buffers_bytes(max_tokens, ...) bytes (+ 256 for alignment), reused across calls with T <= max_tokens."""
    if buffers is None and out is None and max_tokens is None and \
            _via_torch_op(stream, x, router_logits, w13, w2, correction_bias):
        return _ops().moe_forward(x, router_logits, w13, w2, int(top_k), scoring, bool(renormalize), int(n_group), int(topk_group),
                                  correction_bias, float(routed_scaling_factor), int(align_m))
    _no_autograd(x, router_logits, w13, w2)
    if getattr(x, "ndim", 0) != 2 or getattr(w13, "ndim", 0) != 3 or getattr(router_logits, "ndim", 0) != 2:
        raise ValueError("x: expected x [T, D], router_logits [T, E], w13 [E, 2F, D]")
    t, d = x.shape
    max_tokens = t if max_tokens is None else int(max_tokens)
    nbytes = moe_buffers_bytes(max_tokens, d, w13.shape[1] // 2, router_logits.shape[1], top_k, x, align_m)
    if nbytes == 0:
        nbytes = 256  # invalid options: the call below reports which
    buf = _workspace(buffers, x, nbytes, 256, "moe_buffers_bytes")
    if out is None:
        out = _empty(x, (t, d), "like")
    _encore.moe_forward_out(*_dl(x, router_logits, correction_bias, w13, w2, buf), max_tokens, *_dl(out), int(top_k), _scoring(scoring),
                            bool(renormalize), int(n_group), int(topk_group), float(routed_scaling_factor), int(align_m),
                            _stream_for(x, stream))
    return out
