"""The moe family (include/encore/moe.hpp; single GPU, TP = 1): routing, dispatch, combine and the layer.
Routing, dispatch and combine run on numpy / CPU torch (CPU backend) and CUDA torch tensors; moe_forward
too (on CUDA bf16 only: its grouped GEMMs; D and F multiples of 8). The math, shapes and conventions are
in include/encore/moe.hpp and docs/moe.md. encore.nn.MoE is the layer as a torch module.

Each public function calls its launcher (one binding call over the C++ Args / Options structs)
directly for numpy arrays and eager torch tensors, and torch.ops.encore.moe_* (declared here on the
same launchers) when traced (_core.eager); moe_forward with caller-given buffers, max_tokens or out
takes the direct path."""
from __future__ import annotations

from typing import TYPE_CHECKING

from . import _encore as _b
from ._core import as_float, as_int, dl, eager, empty, is_torch, matrix_shape, ops, stream_for, torch_module, torch_op, workspace

if TYPE_CHECKING:  # the ops' string annotations (torch.library.infer_schema reads them)
    from torch import Tensor

__all__ = ["moe_routing", "moe_dispatch", "moe_combine", "moe_forward", "moe_permuted_rows", "moe_buffers_bytes"]


def moe_permuted_rows(tokens: int, top_k: int, num_experts: int, align_m: int) -> int:
    """Rows of the permuted buffer at most: T*k + min(E, T*k) * (align_m - 1) (include/encore/moe.hpp)."""
    tokens, top_k, num_experts, align_m = (as_int(tokens, "tokens"), as_int(top_k, "top_k"), as_int(num_experts, "num_experts"),
                                           as_int(align_m, "align_m"))
    if tokens < 0:
        raise ValueError(f"tokens: must be >= 0, got {tokens}")
    if not 1 <= num_experts < 2**20:
        raise ValueError(f"num_experts: must be in [1, 2^20), got {num_experts}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k: must be in [1, num_experts = {num_experts}], got {top_k}")
    if not (1 <= align_m <= 1024 and align_m & (align_m - 1) == 0):
        raise ValueError(f"align_m: must be a power of two in [1, 1024], got {align_m}")
    return _b.moe_permuted_rows(tokens, top_k, num_experts, align_m)


_ROUTING = {}  # (top_k, scoring, renormalize, n_group, topk_group, routed_scaling_factor) -> MoeRoutingOptions
_DISPATCH = {}  # (num_experts, align_m, power_of_two_scales) -> MoeDispatchOptions
_LAYER = {}  # routing key + (align_m,) -> MoeOptions
_COMBINE = None  # MoeCombineOptions (no fields)
_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}  # framework name -> encore's


def _scoring(scoring):
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring: must be 'softmax' or 'sigmoid', got {scoring!r}")
    return _b.MoeScoring.sigmoid if scoring == "sigmoid" else _b.MoeScoring.softmax


def _routing_options(top_k, scoring, renormalize, n_group, topk_group, routed_scaling_factor):
    key = (as_int(top_k, "top_k"), scoring, bool(renormalize), as_int(n_group, "n_group"), as_int(topk_group, "topk_group"),
           as_float(routed_scaling_factor, "routed_scaling_factor"))
    o = _ROUTING.get(key)
    if o is None:
        o = _ROUTING[key] = _b.MoeRoutingOptions(key[0], _scoring(scoring), *key[2:])
    return o


def _layer_options(align_m, *routing):
    key = (as_int(align_m, "align_m"), *routing)
    o = _LAYER.get(key)
    if o is None:
        o = _LAYER[key] = _b.MoeOptions(_routing_options(*routing), key[0])
    return o


def _dispatch_options(num_experts, align_m, power_of_two_scales):
    key = (as_int(num_experts, "num_experts"), as_int(align_m, "align_m"), bool(power_of_two_scales))
    o = _DISPATCH.get(key)
    if o is None:
        o = _DISPATCH[key] = _b.MoeDispatchOptions(*key)
    return o


def _shape(max_tokens, hidden, intermediate, num_experts, like, like_name="like", check_dtype=False):
    """The MoeLayerShape; like (argument like_name) gives the dtype, refused naming it with check_dtype
    (moe_buffers_bytes keeps its contract: 0 for an invalid shape)."""
    if not hasattr(like, "dtype"):
        raise TypeError(f"{like_name}: expected an array (a numpy array or a torch tensor), got {type(like).__name__}")
    name = str(like.dtype).rsplit(".", 1)[-1]
    if check_dtype and name not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"{like_name}: dtype must be one of {{bf16, fp16, fp32}}, got {_DTYPES.get(name, name)}")
    return _b.MoeLayerShape(as_int(max_tokens, "max_tokens"), as_int(hidden, "hidden"), as_int(intermediate, "intermediate"),
                            as_int(num_experts, "num_experts"), _DTYPES.get(name, name))


def _zero(a):
    if is_torch(a):
        a.zero_()
    else:
        a.fill(0)


# --- launchers: one binding call each (plus the dispatch's workspace query); stream None is torch's current stream

def _moe_routing_launch(logits, top_k, scoring, renormalize, n_group, topk_group, correction_bias, routed_scaling_factor, stream):
    if getattr(logits, "ndim", 0) != 2:
        raise ValueError("logits: expected 2 dimensions [T, E]")
    t, e = logits.shape
    top_k = as_int(top_k, "top_k")
    if top_k < 1:  # (a larger one is refused by the op, which knows the groups)
        raise ValueError(f"top_k: must be in [1, E = {e}] (E from logits' last dimension), got {top_k}")
    ids, w = empty(logits, (t, top_k), "i32"), empty(logits, (t, top_k), "f32")
    _b.moe_routing_run(_b.MoeRoutingArgs(dl(logits), dl(correction_bias), dl(ids), dl(w)),
                       _routing_options(top_k, scoring, renormalize, n_group, topk_group, routed_scaling_factor), None,
                       stream_for(logits, stream))
    return ids, w


def _moe_dispatch_launch(topk_ids, num_experts, x, align_m, fp8, power_of_two_scales, stream):
    """The dispatch's dict of outputs (see moe_dispatch)."""
    num_experts, align_m = as_int(num_experts, "num_experts"), as_int(align_m, "align_m")
    if fp8 and x is None:
        raise ValueError("x: fp8=True quantizes the gathered rows of x; pass x")
    if getattr(topk_ids, "ndim", 0) != 2:
        raise ValueError("topk_ids: expected 2 dimensions [T, k]")
    t, k = topk_ids.shape
    rows = _b.moe_permuted_rows(t, k, int(num_experts), int(align_m)) if num_experts > 0 and align_m > 0 else 1
    e = max(num_experts, 1)
    r = {"expert_counts": empty(topk_ids, (e,), "i32"), "expert_offsets": empty(topk_ids, (e + 1,), "i32"),
         "slot_rows": empty(topk_ids, (t, k), "i32"), "row_slots": empty(topk_ids, (rows,), "i32")}
    xp = xs = None
    if x is not None:
        if getattr(x, "ndim", 0) != 2:
            raise ValueError("x: expected 2 dimensions [T, D]")
        xp = empty(x, (rows, x.shape[1]), "u8" if fp8 else "like")
        _zero(xp)  # the rows past expert_offsets[E] are not written: zeros rather than garbage
        if fp8:
            xs = empty(x, (rows, x.shape[1] // 128), "f32")
            _zero(xs)
    args = _b.MoeDispatchArgs(dl(topk_ids), dl(x), dl(r["expert_counts"]), dl(r["expert_offsets"]), dl(r["slot_rows"]),
                              dl(r["row_slots"]), dl(xp), dl(xs))
    opts = _dispatch_options(num_experts, align_m, power_of_two_scales)
    ws = workspace(None, topk_ids, _b.moe_dispatch_workspace(args, opts), 16, "moe_dispatch")
    _b.moe_dispatch_run(args, opts, dl(ws), stream_for(topk_ids, stream))
    if xp is not None:
        r["x_permuted"] = xp.view(torch_module().float8_e4m3fn) if fp8 and is_torch(xp) else xp
        if fp8:
            r["x_scales"] = xs
    return r


def _moe_combine_launch(expert_out, slot_rows, topk_weights, out, stream):
    if getattr(expert_out, "ndim", 0) != 2 or getattr(slot_rows, "ndim", 0) != 2:
        raise ValueError("expert_out: expected [R, D] and slot_rows [T, k]")
    if out is None:
        out = empty(expert_out, (slot_rows.shape[0], expert_out.shape[1]))
    _b.moe_combine_run(_b.MoeCombineArgs(dl(expert_out), dl(slot_rows), dl(topk_weights), dl(out)), _combine_options(), None,
                       stream_for(expert_out, stream))
    return out


def _combine_options():
    global _COMBINE
    if _COMBINE is None:
        _COMBINE = _b.MoeCombineOptions()
    return _COMBINE


def _moe_forward_launch(x, router_logits, w13, w2, top_k, scoring, renormalize, n_group, topk_group, correction_bias,
                        routed_scaling_factor, align_m, buffers, max_tokens, out, stream):
    t, d = matrix_shape(x, "x", 2, "[T, D]")
    f2 = matrix_shape(w13, "w13", 3, "[E, 2F, D]")[1]
    e = matrix_shape(router_logits, "router_logits", 2, "[T, E]")[1]
    for name, size, what in (("x", min(t, d), "T and D"), ("w13", f2 // 2, "2F (F >= 1)"), ("router_logits", e, "E")):
        if size < 1:
            raise ValueError(f"{name}: {what} must be >= 1")
    shape = _shape(t if max_tokens is None else max_tokens, d, f2 // 2, e, x, "x", check_dtype=True)
    opts = _layer_options(align_m, top_k, scoring, renormalize, n_group, topk_group, routed_scaling_factor)
    nbytes = _b.moe_buffers_bytes(shape, opts) or 256  # 0: invalid options, which the carve reports
    buf = workspace(buffers, x, nbytes, 256, "moe_buffers_bytes", "buffers")
    if out is None:
        out = empty(x, (t, d))
    args = _b.MoeForwardArgs(dl(x), dl(router_logits), dl(correction_bias), dl(w13), dl(w2), _b.moe_buffers_carve(shape, opts, dl(buf)),
                             dl(out))
    _b.moe_forward_run(args, opts, None, stream_for(x, stream))
    return out


# --- torch.ops.encore: the launchers on torch's current stream ----------------------------------------

def _moe_rows(t, k, e, align):
    """moe_permuted_rows(T, k, E, align) for a possibly symbolic T: T*k + min(E, T*k) * (align - 1)."""
    tk = t * k
    return tk + torch_module().sym_min(e, tk) * (align - 1)


def _moe_routing_fake(logits, bias, top_k, *_):
    torch = torch_module()
    t = logits.shape[0]
    return logits.new_empty((t, top_k), dtype=torch.int32), logits.new_empty((t, top_k), dtype=torch.float32)


def _moe_dispatch_fake(topk_ids, num_experts, x, align_m, fp8=False, power_of_two_scales=False):
    torch = torch_module()
    e, rows = num_experts, _moe_rows(topk_ids.shape[0], topk_ids.shape[1], num_experts, align_m)
    maps = [topk_ids.new_empty((e,)), topk_ids.new_empty((e + 1,)), topk_ids.new_empty(topk_ids.shape), topk_ids.new_empty((rows,))]
    if x is None:
        return maps
    if not fp8:
        return maps + [x.new_empty((rows, x.shape[1]))]
    return maps + [x.new_empty((rows, x.shape[1]), dtype=torch.float8_e4m3fn), x.new_empty((rows, x.shape[1] // 128), dtype=torch.float32)]


@torch_op("moe_routing", fake=_moe_routing_fake)
def _moe_routing(logits: Tensor, correction_bias: Tensor | None, top_k: int, scoring: str, renormalize: bool, n_group: int,
                 topk_group: int, routed_scaling_factor: float) -> tuple[Tensor, Tensor]:
    return _moe_routing_launch(logits, top_k, scoring, renormalize, n_group, topk_group, correction_bias, routed_scaling_factor, None)


@torch_op("moe_dispatch", fake=_moe_dispatch_fake)
def _moe_dispatch(topk_ids: Tensor, num_experts: int, x: Tensor | None, align_m: int, fp8: bool = False,
                  power_of_two_scales: bool = False) -> list[Tensor]:
    """[expert_counts, expert_offsets, slot_rows, row_slots, x_permuted if x, x_scales if x and fp8]."""
    return list(_moe_dispatch_launch(topk_ids, num_experts, x, align_m, fp8, power_of_two_scales, None).values())


@torch_op("moe_combine", fake=lambda y, rows, w: y.new_empty((rows.shape[0], y.shape[1])))
def _moe_combine(expert_out: Tensor, slot_rows: Tensor, topk_weights: Tensor) -> Tensor:
    return _moe_combine_launch(expert_out, slot_rows, topk_weights, None, None)


@torch_op("moe_forward", fake=lambda x, *_: x.new_empty(x.shape))
def _moe_forward(x: Tensor, router_logits: Tensor, w13: Tensor, w2: Tensor, top_k: int, scoring: str, renormalize: bool, n_group: int,
                 topk_group: int, correction_bias: Tensor | None, routed_scaling_factor: float, align_m: int) -> Tensor:
    return _moe_forward_launch(x, router_logits, w13, w2, top_k, scoring, renormalize, n_group, topk_group, correction_bias,
                               routed_scaling_factor, align_m, None, None, None, None)


# --- public API ---------------------------------------------------------------------------------------

def moe_routing(logits, top_k: int, scoring: str = "softmax", renormalize: bool = True, n_group: int = 1, topk_group: int = 1,
                correction_bias=None, routed_scaling_factor: float = 1.0, stream=None):
    """Top-k routing of logits [T, E] (bf16, fp16 or fp32). Returns (topk_ids int32 [T, k], topk_weights
    float32 [T, k]), experts in descending order of score (+ correction_bias), ties to the lower index.
    scoring "softmax" or "sigmoid"; n_group / topk_group: grouped top-k (DeepSeek-V3 with a bias)."""
    if not eager(logits, correction_bias) and stream is None:
        return tuple(ops().moe_routing(logits, correction_bias, int(top_k), scoring, bool(renormalize), int(n_group),
                                       int(topk_group), float(routed_scaling_factor)))
    return _moe_routing_launch(logits, top_k, scoring, renormalize, n_group, topk_group, correction_bias, routed_scaling_factor, stream)


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
    if not eager(topk_ids, x) and stream is None:
        got = ops().moe_dispatch(topk_ids, int(num_experts), x, int(align_m), bool(fp8), bool(power_of_two_scales))
        keys = _DISPATCH_KEYS + (("x_permuted",) if x is not None else ()) + (("x_scales",) if x is not None and fp8 else ())
        return dict(zip(keys, got))
    return _moe_dispatch_launch(topk_ids, num_experts, x, align_m, fp8, power_of_two_scales, stream)


def moe_combine(expert_out, slot_rows, topk_weights, out=None, stream=None):
    """out [T, D] = sum over j = 0..k-1 of topk_weights[t, j] * expert_out[slot_rows[t, j]], in fp32 in
    slot order (bit-reproducible), rounded to out's dtype (default expert_out's)."""
    if not eager(expert_out, slot_rows, topk_weights) and out is None and stream is None:
        return ops().moe_combine(expert_out, slot_rows, topk_weights)
    return _moe_combine_launch(expert_out, slot_rows, topk_weights, out, stream)


def moe_buffers_bytes(max_tokens: int, hidden: int, intermediate: int, num_experts: int, top_k: int, like, align_m: int = 1):
    """Bytes of the layer's persistent buffers for up to max_tokens tokens of like's dtype (0 if invalid)."""
    return _b.moe_buffers_bytes(_shape(max_tokens, hidden, intermediate, num_experts, like),
                                _layer_options(align_m, top_k, "softmax", True, 1, 1, 1.0))


def moe_forward(x, router_logits, w13, w2, top_k: int, scoring: str = "softmax", renormalize: bool = True, n_group: int = 1,
                topk_group: int = 1, correction_bias=None, routed_scaling_factor: float = 1.0, align_m: int = 1, buffers=None,
                max_tokens=None, out=None, stream=None):
    """The MoE layer: routing -> dispatch -> per-expert SwiGLU MLP -> combine (weights applied at combine).
    x [T, D]; router_logits [T, E] (the router GEMM is the caller's); w13 [E, 2F, D] (gate rows, then up
    rows); w2 [E, D, F]; all of x's dtype. buffers: optional persistent 1-D uint8 array of
    moe_buffers_bytes(max_tokens, ...) bytes (+ 256 for alignment), reused across calls with T <= max_tokens."""
    if not eager(x, router_logits, w13, w2, correction_bias) and buffers is None and out is None and max_tokens is None and \
            stream is None:
        return ops().moe_forward(x, router_logits, w13, w2, int(top_k), scoring, bool(renormalize), int(n_group), int(topk_group),
                                 correction_bias, float(routed_scaling_factor), int(align_m))
    return _moe_forward_launch(x, router_logits, w13, w2, top_k, scoring, renormalize, n_group, topk_group, correction_bias,
                               routed_scaling_factor, align_m, buffers, max_tokens, out, stream)
