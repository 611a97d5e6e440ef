"""encore's public ops as torch.library operators (namespace ``encore``) with fake implementations.

Imported on the first call with torch tensors (or at ``import encore`` when torch is already loaded;
``import encore.torch_ops`` registers them explicitly), never for numpy-only use. The public
wrappers send torch tensors (when no explicit stream is given) to torch.ops.encore.<op>; each op's
kernel is the wrapper's direct path with torch's current stream: the norm family's direct
implementations (norm._rms_norm, ...), else the public wrapper called with that stream (an explicit
stream takes the direct path). So the wrappers hold the only calling code, and this module adds
each op's schema, where its outputs are optional (a Tensor[] of the present ones) the adapter, and
its fake (meta) implementation: exact shapes, dtypes and strides, so torch.compile(fullgraph=True)
traces through encore calls. Mutated arguments are marked ``Tensor(a!)`` in the schemas (the
``mutates_args`` of torch.library.custom_op); no output aliases an input.

Allocating forms are one op; the in-place forms of a public function are ops of their own:
add_rms_norm_ (h written over ``residual``), add_rms_norm_out (into ``h_out``),
llama_block_forward_out and kda_forward_out (into the caller's outputs). Workspaces are optional
mutated arguments.

Autograd: the training entry points are torch.autograd.Function classes over these ops, the forward
calling torch.ops.encore.<op> and saving what its backward op reads (kda.chunk_kda:
kda_forward with residuals, then kda_backward). The other public wrappers refuse tensors that
require grad (under grad mode) until their backward lands.
"""
from __future__ import annotations

import types

import torch

from . import _core, _encore, blocks, gemm, kda, moe, quant
from ._util import _torch_stream  # noqa

__all__ = ["OPS"]

OPS = _core._OPS  # op name -> torch.ops.encore.<name>.default (transitional: shared with _core)
_core.register_torch_ops()  # the ops the family modules declare (transitional)
_LIB = torch.library.Library("encore", "FRAGMENT")
_F32 = torch.float32


def _define(schema, fake, fn=None, out=None, kernel=None):
    """Defines encore::<schema> with its fake; the kernel is `kernel`, or else `fn` (a direct path)
    called with the op's arguments (positionally) and torch's current stream, its result adapted by
    `out` where given."""
    name = schema[:schema.index("(")]
    if kernel is None:
        def kernel(*args):
            r = fn(*args, stream=_torch_stream(args[0]))
            return r if out is None else out(r)
    _LIB.define(schema)
    _LIB.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"encore::{name}", fake, lib=_LIB)
    setattr(OPS, name, getattr(torch.ops.encore, name).default)


def _new(like, shape, dtype=None):
    return like.new_empty(shape, dtype=like.dtype if dtype is None else dtype)


def _present(outs):
    """An op's Tensor[]: the outputs that are not None, in order."""
    return [t for t in outs if t is not None]


def _nothing(_):
    return None  # in-place ops return nothing (an op's output may not alias its input)


def _first(outs):
    return outs[0]


# --- quant ------------------------------------------------------------------------------------------------


def _fp8_group_quant_fake(x, column_major_scales, power_of_two_scales, eps):
    m, k = x.shape
    scales = _new(x, (k // 128, m), _F32).T if column_major_scales else _new(x, (m, k // 128), _F32)
    return _new(x, (m, k), torch.float8_e4m3fn), scales


_define("fp8_group_quant(Tensor x, bool column_major_scales, bool power_of_two_scales, float eps) -> (Tensor, Tensor)",
        _fp8_group_quant_fake, quant.fp8_group_quant)
_define("fp8_group_dequant(Tensor q, Tensor scales) -> Tensor", lambda q, s: _new(q, q.shape, _F32), quant.fp8_group_dequant)

# --- gemm -------------------------------------------------------------------------------------------------


def _mn(a, w):
    return a.shape[0], w.shape[0]


def _partials(epilogue, a, w, partial_tile_n):
    """The fake [M, ceil(N / tile width)] float32 partials. The width, when not given, is the host
    query gemm_partial_tile_n, which reads K only: a symbolic M or N is passed as 1 rather than
    specialized (test_partial_tile_n_reads_k_only holds the query to that)."""
    m, (n, k) = a.shape[0], w.shape
    t = partial_tile_n or _encore.gemm_partial_tile_n(epilogue, m if isinstance(m, int) else 1, n if isinstance(n, int) else 1,
                                                      int(k))
    return _new(a, (m, (n + t - 1) // t), _F32)


def _gemm_lse_fake(a, w, r, target, store_logits, ignore_index, partial_tile_n):
    m, n = _mn(a, w)
    return _present([_partials(gemm._LSE, a, w, partial_tile_n), gemm._padded_rows(a, m, n, _new) if store_logits else None,
                     _new(a, (m,), _F32) if target is not None else None])


_define("gemm_row_scale(Tensor a, Tensor w, Tensor r, str tile) -> Tensor", lambda a, w, *_: _new(a, _mn(a, w)),
        gemm.gemm_row_scale)
_define("gemm_scalar_scale(Tensor a, Tensor w, Tensor alpha, str tile) -> Tensor", lambda a, w, *_: _new(a, _mn(a, w)),
        gemm.gemm_scalar_scale)
_define("gemm_residual_rms_partial(Tensor a, Tensor w, Tensor residual, Tensor gamma, int partial_tile_n) "
        "-> (Tensor, Tensor, Tensor)",
        lambda a, w, c, gamma, t: (_new(a, _mn(a, w)), _new(a, _mn(a, w)), _partials(gemm._RESIDUAL, a, w, t)),
        gemm.gemm_residual_rms_partial)
_define("rms_final_reduce(Tensor partials, int hidden, float eps) -> Tensor", lambda p, *_: _new(p, (p.shape[0],), _F32),
        gemm.rms_final_reduce)
_define("gemm_swiglu(Tensor a, Tensor w, Tensor? r, str tile) -> (Tensor, Tensor)",
        lambda a, w, *_: (_new(a, _mn(a, w)), _new(a, (a.shape[0], w.shape[0] // 2))), gemm.gemm_swiglu)
_define("gemm_rope(Tensor a, Tensor w, Tensor pos, Tensor freq, Tensor? r, str tile) -> Tensor",
        lambda a, w, *_: _new(a, _mn(a, w)), gemm.gemm_rope)
_define("gemm_qkv_head_sqsum(Tensor a, Tensor w, int head_dim) -> (Tensor, Tensor)",
        lambda a, w, hd: (_new(a, _mn(a, w)), _new(a, (a.shape[0], w.shape[0] // hd), _F32)), gemm.gemm_qkv_head_sqsum)
_define("qk_norm_rope_(Tensor(a!) qkv, Tensor partials, Tensor q_weight, Tensor k_weight, Tensor pos, Tensor freq, "
        "int num_q_heads, int num_kv_heads, int head_dim, float eps) -> ()",
        lambda *_: None, gemm.qk_norm_rope_, _nothing)
_define("qk_norm_rope_backward(Tensor dy, Tensor x, Tensor partials, Tensor q_weight, Tensor k_weight, Tensor pos, Tensor freq, "
        "int num_q_heads, int num_kv_heads, int head_dim, float eps) -> (Tensor, Tensor, Tensor)",
        lambda dy, *a: (_new(dy, dy.shape), _new(dy, (a[-2],), _F32), _new(dy, (a[-2],), _F32)), gemm.qk_norm_rope_backward)
_define("gemm_lse(Tensor a, Tensor w, Tensor? r, Tensor? target, bool store_logits, int ignore_index, int partial_tile_n) "
        "-> Tensor[]",  # [partials, logits if store_logits, target_logit if target]
        _gemm_lse_fake, gemm.gemm_lse, _present)
# gemm_epilogue: any catalogue row by name; [d, aux, partials, target_logit], the ones the row writes
_define("gemm_epilogue(str epilogue, Tensor a, Tensor w, Tensor? c, Tensor? gamma, Tensor? row_scale, Tensor? pos, Tensor? freq, "
        "Tensor? alpha, Tensor? target, bool store_d, int partial_tile_n, int head_dim, int ignore_index, str tile, "
        "Tensor? c2=None, Tensor? zdz=None, Tensor? lse=None) -> Tensor[]",
        lambda e, a, w, c, g, r, p, f, al, target, store_d, ptn, hd, *_: [
            gemm._padded_rows(a, *shape, _new) if kind == "padded" else _new(a, shape, _F32 if kind == "f32" else None)
            for _, shape, kind in gemm._epilogue_outputs(gemm._as_epilogue(e), a, w, store_d, ptn, hd, target is not None)[0]],
        kernel=lambda e, a, w, c, g, r, p, f, al, target, store_d, ptn, hd, ii, tile, c2=None, zdz=None, lse=None: list(gemm.gemm_epilogue(
            e, a, w, c=c, gamma=g, row_scale=r, pos=p, freq=f, alpha=al, target=target, store_d=store_d, partial_tile_n=ptn,
            head_dim=hd, ignore_index=ii, tile=tile, stream=_torch_stream(a), c2=c2, zdz=zdz, lse=lse).values()))
# partials_sum: zdz [rows] (per row) or dγ [n] (per column) of the backward epilogues' partials
_define("partials_sum(Tensor partials, bool per_column, float scale, int n) -> Tensor",
        lambda p, per_column, scale, n: _new(p, (n if per_column else p.shape[0],), _F32),
        kernel=lambda p, per_column, scale, n: gemm.partials_sum(p, per_column, scale, n, stream=_torch_stream(p)))
# cross_entropy_bwd: dlogits = alpha * (softmax(logits) - onehot(target)) from stored logits; the in-place form
# overwrites the logits (the stored-logits path of encore.nn.FusedLinearCrossEntropyLoss)
_define("cross_entropy_bwd(Tensor logits, Tensor lse, Tensor target, Tensor? alpha, int ignore_index) -> Tensor",
        lambda logits, *_: _new(logits, logits.shape),
        kernel=lambda logits, lse, target, alpha, ii: gemm.cross_entropy_bwd(logits, lse, target, alpha, ii,
                                                                             out=torch.empty_like(logits, memory_format=torch.contiguous_format),
                                                                             stream=_torch_stream(logits)))
_define("cross_entropy_bwd_(Tensor(a!) logits, Tensor lse, Tensor target, Tensor? alpha, int ignore_index) -> ()", lambda *_: None,
        kernel=lambda logits, lse, target, alpha, ii: _nothing(gemm.cross_entropy_bwd_(logits, lse, target, alpha, ii,
                                                                                        stream=_torch_stream(logits))))
# lse_finish: [lse, loss if target]
_define("lse_finish(Tensor partials, Tensor? target, Tensor? target_logit, int ignore_index) -> Tensor[]",
        lambda p, target, *_: [_new(p, (p.shape[0],), _F32) for _ in range(1 if target is None else 2)],
        gemm.lse_finish, lambda r: list(r) if isinstance(r, tuple) else [r])

# --- blocks -----------------------------------------------------------------------------------------------

_BLOCK_IN = ("Tensor y0, Tensor x0, Tensor w0, Tensor w1, Tensor w2, Tensor w3, Tensor gamma0, Tensor gamma1, Tensor pos, "
             "Tensor freq, float eps")


def _llama_block_fake(y0, x0, w0, w1, w2, w3, *_):
    m, d = y0.shape
    return (_new(y0, (m, d)), _new(y0, (m, d)), _new(y0, (m, w1.shape[0])), _new(y0, (m, w3.shape[0])),
            _new(y0, (m,), _F32), _new(y0, (m,), _F32))


_define(f"llama_block_forward({_BLOCK_IN}, Tensor(a!)? workspace) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
        _llama_block_fake,
        kernel=lambda *args: blocks.llama_block_forward(*args[:11], workspace=args[11], stream=_torch_stream(args[0])))
_define(f"llama_block_forward_out({_BLOCK_IN}, Tensor(a!) x1, Tensor(b!) x2, Tensor(c!) z1, Tensor(d!) qkv, Tensor(e!) r1, "
        "Tensor(f!) r2, Tensor(g!)? workspace) -> ()",
        lambda *_: None, kernel=lambda *args: _nothing(
            blocks.llama_block_forward(*args[:11], out=args[11:17], workspace=args[17], stream=_torch_stream(args[0]))))

_BLOCK_BWD_IN = ("Tensor y0, Tensor w0, Tensor w1, Tensor w2, Tensor w3, Tensor gamma0, Tensor gamma1, Tensor pos, Tensor freq, "
                 "Tensor x1, Tensor x2, Tensor z1, Tensor qkv, Tensor r1, Tensor r2, Tensor d_qkv, Tensor d_x2")


def _llama_block_backward_fake(y0, w0, w1, w2, w3, *_):
    m, d = y0.shape
    return (_new(y0, (m, d)), _new(y0, (m, d)), _new(y0, w0.shape), _new(y0, w1.shape), _new(y0, w2.shape), _new(y0, w3.shape),
            _new(y0, (d,), _F32), _new(y0, (d,), _F32))


_define(f"llama_block_backward({_BLOCK_BWD_IN}, Tensor(a!)? workspace) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
        _llama_block_backward_fake,
        kernel=lambda *args: blocks.llama_block_backward(*args[:17], workspace=args[17], stream=_torch_stream(args[0])))
_define(f"llama_block_backward_out({_BLOCK_BWD_IN}, Tensor(a!) d_y0, Tensor(b!) d_x0, Tensor(c!) dw0, Tensor(d!) dw1, "
        "Tensor(e!) dw2, Tensor(f!) dw3, Tensor(g!) dgamma0, Tensor(h!) dgamma1, Tensor(i!)? workspace) -> ()",
        lambda *_: None, kernel=lambda *args: _nothing(
            blocks.llama_block_backward(*args[:17], out=args[17:25], workspace=args[25], stream=_torch_stream(args[0]))))

_LAST_IN = ("Tensor y0, Tensor x0, Tensor w0, Tensor w1, Tensor w2, Tensor gamma0, Tensor gamma_final, Tensor w_lm, Tensor target, "
            "float eps, int ignore_index")


def _llama_last_fake(y0, x0, w0, w1, *_):
    m, d = y0.shape
    return (_new(y0, (m, d)), _new(y0, (m, d)), _new(y0, (m, w1.shape[0])), _new(y0, (m, d)), _new(y0, (m,), _F32),
            _new(y0, (m,), _F32), _new(y0, (m,), _F32), _new(y0, (1,), _F32))


_define(f"llama_last_block_forward({_LAST_IN}, Tensor(a!)? workspace) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
        _llama_last_fake,
        kernel=lambda *args: blocks.llama_last_block_forward(*args[:11], workspace=args[11], stream=_torch_stream(args[0])))

_LAST_BWD_IN = ("Tensor y0, Tensor w0, Tensor w1, Tensor w2, Tensor gamma0, Tensor gamma_final, Tensor w_lm, Tensor target, "
                "Tensor x1, Tensor x2, Tensor z1, Tensor h2, Tensor r1, Tensor r2, Tensor lse, Tensor d_loss, int ignore_index")


def _llama_last_backward_fake(y0, w0, w1, w2, gamma0, gamma_final, w_lm, *_):
    m, d = y0.shape
    return (_new(y0, (m, d)), _new(y0, (m, d)), _new(y0, w0.shape), _new(y0, w1.shape), _new(y0, w2.shape), _new(y0, w_lm.shape),
            _new(y0, (d,), _F32), _new(y0, (d,), _F32))


_define(f"llama_last_block_backward({_LAST_BWD_IN}, Tensor(a!)? workspace) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "
        "Tensor)",
        _llama_last_backward_fake,
        kernel=lambda *args: blocks.llama_last_block_backward(*args[:17], workspace=args[17], stream=_torch_stream(args[0])))

_QKV_BWD_IN = "Tensor x, Tensor gamma, Tensor w3, Tensor pos, Tensor freq, Tensor r, Tensor qkv, Tensor d_qkv, Tensor? d_x_prev"
_define(f"qkv_norm_backward({_QKV_BWD_IN}, Tensor(a!)? workspace) -> (Tensor, Tensor, Tensor)",
        lambda x, gamma, w3, *_: (_new(x, x.shape), _new(x, w3.shape), _new(x, (x.shape[1],), _F32)),
        kernel=lambda *args: blocks.qkv_norm_backward(*args[:9], workspace=args[9], stream=_torch_stream(args[0])))
_define(f"qkv_norm_backward_out({_QKV_BWD_IN}, Tensor(a!) dx, Tensor(b!) dw3, Tensor(c!) dgamma, Tensor(d!)? workspace) -> ()",
        lambda *_: None, kernel=lambda *args: _nothing(
            blocks.qkv_norm_backward(*args[:9], out=args[9:12], workspace=args[12], stream=_torch_stream(args[0]))))

# --- kda --------------------------------------------------------------------------------------------------

_KDA_IN = ("Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float? scale, Tensor? initial_state, bool output_final_state, "
           "bool use_qk_l2norm, bool use_gate_in_kernel, Tensor? A_log, Tensor? dt_bias, float? lower_bound, Tensor? cu_seqlens")


def _state_dtype(q):
    return torch.float64 if q.dtype == torch.float64 else _F32


def _kda_forward_fake(q, k, v, g, beta, scale, h0, final, l2, gate, A_log, dt_bias, lower, cu, residuals, residual_dtype):
    b, t, _, kd = q.shape
    h, vd = v.shape[2], v.shape[3]  # h: the value heads HV (a multiple of q's heads; fla's GVA)
    n = b if cu is None else cu.shape[0] - 1
    outs = [_new(v, (b, t, h, vd))] + ([_new(q, (n, h, kd, vd), _state_dtype(q))] if final else [])
    if not residuals:
        return outs
    dt = torch.bfloat16 if residual_dtype == "bfloat16" else _F32
    # h: the chunks of 64 tokens of all sequences, with cu_seqlens data-dependent
    nt = b * ((t + 63) // 64) if cu is None else torch.library.get_ctx().new_dynamic_size()
    shapes = {"G": ((b, t, h, kd), _F32), "Aqk": ((b, t, h, 64), dt), "Akk": ((b, t, h, 64), dt), "h": ((nt, h, kd, vd), dt)}
    return outs + [_new(q, *shapes[x]) for x in residuals.split(",")]


def _kda_forward_kernel(*args):
    *ins, residuals, residual_dtype = args
    r = kda.kda_forward(*ins, tuple(residuals.split(",")) if residuals else False, residual_dtype, stream=_torch_stream(args[0]))
    return [*_present(r[:2]), *(r[2].values() if residuals else ())]


def _kda_backward_fake(q, k, v, g, beta, d_o, d_fin, scale, h0, l2, gate, A_log, dt_bias, *_):
    grads = [_new(x, x.shape) for x in (q, k, v, g, beta)]
    return grads + [_new(x, x.shape) for x in (h0, A_log, dt_bias) if x is not None]


def _kda_backward_kernel(*args):
    names = ("G", "Aqk", "Akk", "h")
    res = {x: t for x, t in zip(names, args[15:19]) if t is not None}
    grads = kda.kda_backward(*args[:15], residuals=res or None, stream=_torch_stream(args[0]))
    return list(grads.values())


# residuals: comma-separated names among G, Aqk, Akk, h in that order ("" for none); Tensor[] =
# [o, final_state if output_final_state, *residuals]. (A mutable op may not return a Tensor[]: the
# out / workspace form takes no residuals.)
_define(f"kda_forward({_KDA_IN}, str residuals, str? residual_dtype) -> Tensor[]", _kda_forward_fake, kernel=_kda_forward_kernel)
_define(f"kda_forward_out({_KDA_IN}, Tensor(a!) o, Tensor(b!)? final_state, Tensor(c!)? workspace) -> ()", lambda *_: None,
        kernel=lambda *args: _nothing(
            kda.kda_forward(*args[:14], out=args[14:16], workspace=args[16], stream=_torch_stream(args[0]))))
_define("kda_backward(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor d_o, Tensor? d_final_state, float? scale, "
        "Tensor? initial_state, bool use_qk_l2norm, bool use_gate_in_kernel, Tensor? A_log, Tensor? dt_bias, float? lower_bound, "
        "Tensor? cu_seqlens, Tensor? res_G, Tensor? res_Aqk, Tensor? res_Akk, Tensor? res_h) -> Tensor[]",
        # [dq, dk, dv, dg, dbeta, dh0 / dA_log / ddt_bias where given]
        _kda_backward_fake, kernel=_kda_backward_kernel)


# --- moe --------------------------------------------------------------------------------------------------


def _moe_rows(t, k, e, align):
    """moe_permuted_rows(T, k, E, align) for a possibly symbolic T: T*k + min(E, T*k) * (align - 1)."""
    tk = t * k
    return tk + torch.sym_min(e, tk) * (align - 1)


_define("moe_routing(Tensor logits, Tensor? correction_bias, int top_k, str scoring, bool renormalize, int n_group, "
        "int topk_group, float routed_scaling_factor) -> (Tensor, Tensor)",
        lambda logits, bias, k, *_: (_new(logits, (logits.shape[0], k), torch.int32), _new(logits, (logits.shape[0], k), _F32)),
        kernel=lambda logits, bias, k, scoring, renorm, ng, tg, rsf: moe.moe_routing(
            logits, k, scoring, renorm, ng, tg, bias, rsf, stream=_torch_stream(logits)))
# moe_dispatch: [expert_counts, expert_offsets, slot_rows, row_slots, x_permuted if x, x_scales if x and fp8]
def _moe_dispatch_fake(ids, e, x, align, fp8=False, pow2=False):
    rows = _moe_rows(ids.shape[0], ids.shape[1], e, align)
    maps = [_new(ids, (e,)), _new(ids, (e + 1,)), _new(ids, ids.shape), _new(ids, (rows,))]
    if x is None:
        return maps
    if not fp8:
        return maps + [_new(x, (rows, x.shape[1]))]
    return maps + [_new(x, (rows, x.shape[1]), torch.float8_e4m3fn), _new(x, (rows, x.shape[1] // 128), _F32)]


_define("moe_dispatch(Tensor topk_ids, int num_experts, Tensor? x, int align_m, bool fp8=False, bool power_of_two_scales=False) "
        "-> Tensor[]", _moe_dispatch_fake, moe.moe_dispatch, lambda r: list(r.values()))
_define("moe_combine(Tensor expert_out, Tensor slot_rows, Tensor topk_weights) -> Tensor",
        lambda y, rows, w: _new(y, (rows.shape[0], y.shape[1])), moe.moe_combine)
_define("moe_forward(Tensor x, Tensor router_logits, Tensor w13, Tensor w2, int top_k, str scoring, bool renormalize, "
        "int n_group, int topk_group, Tensor? correction_bias, float routed_scaling_factor, int align_m) -> Tensor",
        lambda x, *_: _new(x, x.shape), moe.moe_forward)
