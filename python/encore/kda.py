"""Kimi Delta Attention (include/encore/kda.hpp), the chunk_kda contract: q, k [B, T, H, K], g
[B, T, HV, K], v [B, T, HV, V], beta [B, T, HV] (HV a multiple of H: grouped value heads, fla's GVA).
Forward: CPU backend (fp64 reference) for numpy / CPU torch arrays, CUDA forward for CUDA torch
tensors (bf16/fp16/fp32; K, V <= 128 on tensor cores, up to 256 on a token-recurrent path), optionally returning the residuals the
backward reads. Backward: kda_backward (the gradients; the CPU backend with or without the forward's
residuals, CUDA with them). chunk_kda: fla's
drop-in for torch, differentiable through torch.autograd.

Each public function calls its launcher (the binding's <op>_workspace on CUDA, then <op>_run, over
the C++ KdaForwardArgs / KdaBackwardArgs / KdaOptions structs) directly for numpy arrays and eager
torch tensors, and torch.ops.encore.<op> (declared here on the same launcher) when traced. kda_forward's
ops have C++ kernels in encore._encore_torch (python/torch/kda_ops.cpp) where it is built: an eager call
on plain torch tensors goes through them instead of the launcher (_core.native)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from . import _core
from . import _encore as _b
from ._kda_args import (_OUT_WORD_END, _fla_layouts, _forward_args, _gate_params, _given, _op_flags, _op_options, _opt_float, _opts,
                        _state_layout, _state_shape)
from ._kda_serving import fused_recurrent_kda, fused_recurrent_kda_fwd, kda_forward_pool
from ._core import (as_float, dl, empty, empty_like, eager, given_outputs, is_torch, matrix_shape, native, ops, present, stream_for,
                    torch_module, torch_op, with_absent)

if TYPE_CHECKING:  # the ops' string annotations (torch.library.infer_schema reads them)
    from torch import Tensor

__all__ = ["kda_forward", "kda_forward_workspace_bytes", "kda_backward", "chunk_kda", "fused_recurrent_kda", "fused_recurrent_kda_fwd",
           "kda_forward_pool"]

_RESIDUAL_KINDS = {None: "f32", "float32": "f32", "bfloat16": "bf16"}
_RESIDUAL_NAMES = ("G", "Aqk", "Akk", "h")
_CHUNK = 64  # tokens per chunk (kda::kChunk)


def _residual_names(return_residuals):
    if return_residuals is True:
        return _RESIDUAL_NAMES
    names = (return_residuals,) if isinstance(return_residuals, str) else tuple(return_residuals)
    bad = [x for x in names if x not in _RESIDUAL_NAMES]
    if bad or not names:
        raise ValueError(f"return_residuals: expected True or a non-empty subset of {_RESIDUAL_NAMES}, got {return_residuals!r}")
    return names


def _residual_tuple(residuals):
    """(G, Aqk, Akk, h) from kda_forward's residual dict (None where absent or for no dict)."""
    if residuals is None:
        return (None,) * 4
    if not isinstance(residuals, dict) or set(residuals) - set(_RESIDUAL_NAMES):
        raise ValueError(f"residuals: expected the dict kda_forward returns (keys among {_RESIDUAL_NAMES}), got {residuals!r:.80}")
    return tuple(residuals.get(x) for x in _RESIDUAL_NAMES)


def _host_cu(cu_seqlens):
    if cu_seqlens is not None and is_torch(cu_seqlens) and cu_seqlens.is_cuda:
        return cu_seqlens.cpu()
    return cu_seqlens


def _torch_cu(cu_seqlens):
    """cu_seqlens as a torch tensor for the torch.ops path (a host numpy array is wrapped, not copied)."""
    if cu_seqlens is None or is_torch(cu_seqlens):
        return cu_seqlens
    import numpy as np

    return torch_module().from_numpy(np.ascontiguousarray(cu_seqlens))


def _state_kind(q):
    """final_state's dtype: float32, or float64 for float64 inputs (the CPU backend's exact mode)."""
    return "like" if str(q.dtype).endswith("float64") else "f32"


def _on_cuda(a):
    return is_torch(a) and a.is_cuda


# --- launchers: one workspace query (CUDA) and one run each; stream None is torch's current stream -----

def _kda_forward_launch(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm, use_gate_in_kernel, A_log,
                        dt_bias, lower_bound, cu_seqlens, names, residual_dtype, out, workspace, stream, state_v_first=False):
    """(o, final_state or None, {name: residual for name in names} or None); state_v_first: initial_state and
    final_state [N, HV, V, K] (the residuals' h stays [NT, HV, K, V])."""
    b, t, _, kd = matrix_shape(q, "q", 4, "[B, T, H, K]")
    h, vd = matrix_shape(v, "v", 4, "[B, T, HV, V]")[2:]  # h: the value heads HV (a multiple of q's heads; fla's GVA)
    cu = _host_cu(cu_seqlens)
    if out is None:
        n = b if cu is None else len(cu) - 1
        o = empty(v, (b, t, h, vd))
        fin = empty(q, _state_shape(n, h, kd, vd, state_v_first), _state_kind(q)) if output_final_state else None
    else:
        o, fin = given_outputs(out, ("o", "final_state"))
        if (fin is not None) != bool(output_final_state):
            raise ValueError("out: final_state must be an array exactly when output_final_state is set")
    res = None
    if names:
        if residual_dtype not in _RESIDUAL_KINDS:
            raise ValueError(f"residual_dtype: expected 'float32' or 'bfloat16', got {residual_dtype!r}")
        kind = _RESIDUAL_KINDS[residual_dtype]
        shapes = {"G": ((b, t, h, kd), "f32"), "Aqk": ((b, t, h, _CHUNK), kind), "Akk": ((b, t, h, _CHUNK), kind)}
        if "h" in names:
            nt = _b.kda_chunk_count(_forward_args(q, k, v, g, beta, cu_seqlens=cu), _opts(None, False, False, None))
            shapes["h"] = ((nt, h, kd, vd), kind)
        res = {x: empty(q, *shapes[x]) for x in names}
    args = _forward_args(q, k, v, g, beta, initial_state, A_log, dt_bias, cu, o, fin,
                         None if res is None else tuple(res.get(x) for x in _RESIDUAL_NAMES))
    opts = _opts(scale, use_qk_l2norm, use_gate_in_kernel, lower_bound, bool(output_final_state), bool(state_v_first))
    nbytes = _b.kda_forward_workspace(args, opts) if _on_cuda(q) else 0  # the CPU backend needs none
    ws = _core.workspace(workspace, q, nbytes, 16, "kda_forward_workspace_bytes")
    _b.kda_forward_run(args, opts, ws if nbytes else None, stream_for(q, stream))
    return o, fin, res


def _kda_backward_launch(q, k, v, g, beta, d_o, d_final_state, scale, initial_state, use_qk_l2norm, use_gate_in_kernel, A_log,
                         dt_bias, lower_bound, cu_seqlens, residuals, stream, state_v_first=False):
    """{dq, dk, dv, dg, dbeta, then dh0, dA_log, ddt_bias where initial_state, A_log, dt_bias are given};
    residuals: (G, Aqk, Akk, h), None where absent; state_v_first: initial_state, d_final_state and dh0 [N, HV, V, K]."""
    grads = {"dq": empty_like(q), "dk": empty_like(k), "dv": empty_like(v), "dg": empty_like(g), "dbeta": empty_like(beta)}
    for name, src in (("dh0", initial_state), ("dA_log", A_log), ("ddt_bias", dt_bias)):
        if src is not None:
            grads[name] = empty_like(src)
    fwd = _forward_args(q, k, v, g, beta, initial_state, A_log, dt_bias, _host_cu(cu_seqlens), residuals=residuals)
    args = _b.KdaBackwardArgs(fwd=fwd, d_o=dl(d_o), d_final_state=dl(d_final_state), **{x: dl(a) for x, a in grads.items()})
    opts = _opts(scale, use_qk_l2norm, use_gate_in_kernel, lower_bound, False, bool(state_v_first))
    nbytes = _b.kda_backward_workspace(args, opts) if _on_cuda(q) else 0
    _b.kda_backward_run(args, opts, _core.workspace(None, q, nbytes, 16, "kda_backward") if nbytes else None,
                        stream_for(q, stream))
    return grads


# --- torch.ops.encore: the launchers on torch's current stream ----------------------------------------

def _kda_forward_fake(q, k, v, g, beta, flags=0, initial_state=None, A_log=None, dt_bias=None, cu_seqlens=None, scale=None,
                      lower_bound=None):
    output_final_state, _, _, state_v_first, residual_dtype, residuals = _op_options(flags)
    torch = torch_module()
    b, t, _, kd = q.shape
    h, vd = v.shape[2], v.shape[3]
    n = b if cu_seqlens is None else cu_seqlens.shape[0] - 1
    state = torch.float64 if q.dtype == torch.float64 else torch.float32
    outs = [v.new_empty((b, t, h, vd))] + ([q.new_empty(_state_shape(n, h, kd, vd, state_v_first), dtype=state)]
                                           if output_final_state else [])
    if not residuals:
        return outs
    dt = torch.bfloat16 if residual_dtype == "bfloat16" else torch.float32
    # h: the chunks of 64 tokens of all sequences, with cu_seqlens data-dependent
    nt = b * ((t + _CHUNK - 1) // _CHUNK) if cu_seqlens is None else torch.library.get_ctx().new_dynamic_size()
    shapes = {"G": ((b, t, h, kd), torch.float32), "Aqk": ((b, t, h, _CHUNK), dt), "Akk": ((b, t, h, _CHUNK), dt),
              "h": ((nt, h, kd, vd), dt)}
    return outs + [q.new_empty(shapes[x][0], dtype=shapes[x][1]) for x in residuals]


@torch_op("kda_forward", fake=_kda_forward_fake)
def _kda_forward(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, flags: int = 0, initial_state: Tensor | None = None,
                 A_log: Tensor | None = None, dt_bias: Tensor | None = None, cu_seqlens: Tensor | None = None,
                 scale: float | None = None, lower_bound: float | None = None) -> list[Tensor]:
    """[o, final_state if output_final_state, *residuals in the order G, Aqk, Akk, h]; flags: the options word
    (_op_flags), the residuals included. The optional arguments come last with their defaults: a call passes
    the ones it gives (each argument converted costs the dispatcher host time). (A mutable op may not return a
    Tensor[]: kda_forward_out takes no residuals.)"""
    final, l2, gate, vfirst, rdt, names = _op_options(flags)
    o, fin, res = _kda_forward_launch(q, k, v, g, beta, scale, initial_state, final, l2, gate, A_log, dt_bias, lower_bound, cu_seqlens,
                                      names, rdt, None, None, None, vfirst)
    return present([o, fin, *(res or {}).values()])


@torch_op("kda_forward_out", fake=lambda *_: None, mutates=("o", "final_state", "workspace"))
def _kda_forward_out(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, flags: int, initial_state: Tensor | None,
                     A_log: Tensor | None, dt_bias: Tensor | None, cu_seqlens: Tensor | None, scale: float | None,
                     lower_bound: float | None, o: Tensor, final_state: Tensor | None, workspace: Tensor | None) -> None:
    final, l2, gate, vfirst, _, _ = _op_options(flags, _OUT_WORD_END)
    _kda_forward_launch(q, k, v, g, beta, scale, initial_state, final, l2, gate, A_log, dt_bias, lower_bound, cu_seqlens, (), None,
                        (o, final_state), workspace, None, vfirst)


def _kda_backward_fake(q, k, v, g, beta, d_o, d_final_state, scale, initial_state, use_qk_l2norm, use_gate_in_kernel, A_log,
                       dt_bias, *_):
    return [x.new_empty(x.shape) for x in (q, k, v, g, beta, initial_state, A_log, dt_bias) if x is not None]


@torch_op("kda_backward", fake=_kda_backward_fake)
def _kda_backward(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, d_o: Tensor, d_final_state: Tensor | None,
                  scale: float | None, initial_state: Tensor | None, use_qk_l2norm: bool, use_gate_in_kernel: bool,
                  A_log: Tensor | None, dt_bias: Tensor | None, lower_bound: float | None, cu_seqlens: Tensor | None,
                  res_G: Tensor | None, res_Aqk: Tensor | None, res_Akk: Tensor | None, res_h: Tensor | None,
                  state_v_first: bool = False) -> list[Tensor]:
    """[dq, dk, dv, dg, dbeta, then dh0 / dA_log / ddt_bias where initial_state / A_log / dt_bias are given]."""
    return list(_kda_backward_launch(q, k, v, g, beta, d_o, d_final_state, scale, initial_state, use_qk_l2norm, use_gate_in_kernel,
                                     A_log, dt_bias, lower_bound, cu_seqlens, (res_G, res_Aqk, res_Akk, res_h), None,
                                     state_v_first).values())


# --- public API ---------------------------------------------------------------------------------------

def kda_forward(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm=False,
                use_gate_in_kernel=False, A_log=None, dt_bias=None, lower_bound=None, cu_seqlens=None,
                return_residuals=False, residual_dtype=None, out=None, workspace=None, stream=None, state_v_first=False):
    """Returns (o [B, T, H, V] in v's dtype, final_state [N, H, K, V] float32 (float64 for float64 inputs) or None), and with
    return_residuals a third element: dict(G [B, T, H, K] float32 (chunk-local log2 gate cumsum),
    Aqk, Akk [B, T, H, 64], h [NT, H, K, V] (chunk-start states)) in residual_dtype ("float32", the
    default, or "bfloat16" for torch tensors). return_residuals=True returns all four; a name or a
    subset of names (e.g. ("Aqk", "Akk"), 256 bytes per token and head in bfloat16) only those.

    g: log-decay, or the raw gate with use_gate_in_kernel (softplus gate with A_log [H] and optional
    dt_bias [H * K]; lower_bound in [-5, 0) selects the lower-bound gate). cu_seqlens [N + 1]
    (int32/int64, a host array even for CUDA tensors) makes the B = 1 batch varlen.

    out: optional (o, final_state) to write into (final_state None unless output_final_state),
    returned as given. workspace: optional 1-D uint8 array on q's device of at least
    kda_forward_workspace_bytes(q, k, v, g, beta, out, cu_seqlens) bytes (the CUDA forward's records, 96.5 KB
    + 8 bytes per chunk of 64 tokens and head); without it each CUDA call allocates one. With both and no
    residuals a call allocates nothing (fixed addresses, e.g. for CUDA graph capture). Torch
    tensors go through torch.ops.encore.kda_forward (kda_forward_out with out or workspace), except
    out or workspace together with return_residuals (the direct call: eager only, not traceable).

    state_v_first (fla's): initial_state and final_state are [N, H, V, K], each state transposed (the
    residuals' h stays [NT, H, K, V]); a state in the other layout is refused naming the argument.
    """
    given = out is not None or workspace is not None
    vf = bool(state_v_first)
    names = _residual_names(return_residuals) if return_residuals else ()
    if stream is None and not (given and names):
        flags = (bool(output_final_state), bool(use_qk_l2norm), bool(use_gate_in_kernel))
        if not eager(q, k, v, g, beta, initial_state, A_log, dt_bias, workspace):
            o = ops()
            return _forward_op(o.kda_forward, o.kda_forward_out, q, k, v, g, beta, _opt_float(scale), initial_state, *flags, A_log,
                               dt_bias, _opt_float(lower_bound), _torch_cu(cu_seqlens), names, residual_dtype, out, workspace, vf)
        if _native_forward(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, residual_dtype, out, workspace):
            return _forward_op(_core.NATIVE["kda_forward"], _core.NATIVE["kda_forward_out"], q, k, v, g, beta,
                               None if scale is None else as_float(scale, "scale"), initial_state, *flags, A_log, dt_bias,
                               None if lower_bound is None else as_float(lower_bound, "lower_bound"), cu_seqlens, names, residual_dtype,
                               out, workspace, vf)
    o, fin, res = _kda_forward_launch(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm, use_gate_in_kernel,
                                      A_log, dt_bias, lower_bound, cu_seqlens, names, residual_dtype, out, workspace, stream, vf)
    return (o, fin, res) if return_residuals else (o, fin)


def _native_forward(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, residual_dtype, out, workspace):
    """True where kda_forward's C++ kernels (kda_forward, kda_forward_out) serve this eager call: every given
    array a plain torch tensor (out a pair of them, final_state may be None), residual_dtype None or a str;
    otherwise the launcher names the wrong argument."""
    if residual_dtype is not None and type(residual_dtype) is not str:
        return False
    others = [x for x in (k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, workspace) if x is not None]
    if out is not None:
        if type(out) not in (tuple, list) or len(out) != 2 or out[0] is None:
            return False
        others += [x for x in out if x is not None]
    return native(q, "kda_forward", *others) is not None and "kda_forward_out" in _core.NATIVE


def _forward_op(fwd, fwd_out, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm, use_gate_in_kernel, A_log,
                dt_bias, lower_bound, cu_seqlens, names, residual_dtype, out, workspace, state_v_first):
    """kda_forward through the ops `fwd` (kda_forward) or, with out or workspace, `fwd_out` (kda_forward_out):
    torch.ops.encore's overloads when traced, the C++ kernels' dispatcher entries when eager; kda_forward's return value."""
    canonical = tuple(x for x in _RESIDUAL_NAMES if x in names)
    flags = _op_flags(output_final_state, use_qk_l2norm, use_gate_in_kernel, state_v_first, residual_dtype if names else None, canonical)
    ins = (q, k, v, g, beta, flags, initial_state, A_log, dt_bias, cu_seqlens, scale, lower_bound)
    if out is not None or workspace is not None:
        if out is None:  # (the launcher's checks first: its messages)
            b, t, _, kd = matrix_shape(q, "q", 4, "[B, T, H, K]")
            h, vd = matrix_shape(v, "v", 4, "[B, T, HV, V]")[2:]
            n = b if cu_seqlens is None else len(cu_seqlens) - 1
            out = (empty(v, (b, t, h, vd)),
                   empty(q, _state_shape(n, h, kd, vd, state_v_first), _state_kind(q)) if output_final_state else None)
        out = given_outputs(out, ("o", "final_state"))
        fwd_out(*ins, *out, workspace)
        return out
    outs = fwd(*_given(*ins))
    if not names:
        return outs[0], outs[1] if output_final_state else None
    o, fin, *res = with_absent(outs, (True, output_final_state) + (True,) * len(names))
    res = dict(zip(canonical, res))
    return o, fin, {x: res[x] for x in names}


def kda_forward_workspace_bytes(q, k, v, g, beta, out, cu_seqlens=None, state_v_first=False) -> int:
    """The size in bytes to allocate for kda_forward's `workspace` with these inputs and outputs
    `out` = (o, final_state or None; final_state [N, H, V, K] with state_v_first): 96.5 KB + 8 bytes per chunk of
    64 tokens and head on CUDA plus 16 for alignment, 0 on the CPU backend."""
    o, fin = given_outputs(out, ("o", "final_state"))
    # The size depends on the chunk and head counts only: the default options stand in for any.
    nbytes = _b.kda_forward_workspace(_forward_args(q, k, v, g, beta, cu_seqlens=_host_cu(cu_seqlens), o=o, final_state=fin),
                                      _opts(None, False, False, None, fin is not None, bool(state_v_first)))
    return int(nbytes) + 16 if nbytes else 0


def kda_backward(q, k, v, g, beta, d_o, d_final_state=None, scale=None, initial_state=None, use_qk_l2norm=False,
                 use_gate_in_kernel=False, A_log=None, dt_bias=None, lower_bound=None, cu_seqlens=None, residuals=None,
                 stream=None, state_v_first=False):
    """Gradients of sum(o * d_o) + sum(final_state * d_final_state) for the forward with the same
    arguments. Returns a dict with dq, dk, dv, dg, dbeta (in the inputs' dtypes; dg with respect to
    the g passed in, dq and dk before the L2 norm) and dh0, dA_log, ddt_bias (float32) when
    initial_state, A_log, dt_bias are given (in their dtypes). residuals: the dict kda_forward returned with
    return_residuals (Aqk, Akk, and h for the saved-h mode; without h the backward
    rematerializes the chunk states; G optional: recomputed from g when absent); the CPU backend runs its chunked backward on them, or its
    token-level backward without; the CUDA backward needs them (its workspace is allocated per
    call, kda_backward_workspace_bytes in C++). stream: as for the forward (an explicit one takes the direct
    path; the CPU backend ignores it). state_v_first: initial_state, d_final_state and dh0 are [N, H, V, K]."""
    res = _residual_tuple(residuals)
    if stream is None and not eager(q, k, v, g, beta, d_o, d_final_state, initial_state, A_log, dt_bias, *res):
        grads = ops().kda_backward(q, k, v, g, beta, d_o, d_final_state, _opt_float(scale), initial_state, bool(use_qk_l2norm),
                                   bool(use_gate_in_kernel), A_log, dt_bias, _opt_float(lower_bound), _torch_cu(cu_seqlens), *res,
                                   bool(state_v_first))
        optional = (("dh0", initial_state), ("dA_log", A_log), ("ddt_bias", dt_bias))
        return dict(zip(("dq", "dk", "dv", "dg", "dbeta", *(x for x, src in optional if src is not None)), grads))
    return _kda_backward_launch(q, k, v, g, beta, d_o, d_final_state, scale, initial_state, use_qk_l2norm, use_gate_in_kernel, A_log,
                                dt_bias, lower_bound, cu_seqlens, res, stream, bool(state_v_first))


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
              use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, safe_gate=False,
              lower_bound=None, disable_recompute=False, return_intermediate_states=False, state_v_first=False,
              cu_seqlens=None, cu_seqlens_cpu=None, cp_context=None, use_graph=False, max_num_seqs=None, **kwargs):
    """fla's chunk_kda (fla.ops.kda.chunk_kda) for torch tensors, differentiable: the same
    arguments in the same positional order, defaults and return value (o [B, T, H, V] in v's dtype, final_state [N, H, K, V]
    float32 or None), with gradients for q, k, v, g, beta, A_log, dt_bias and initial_state through
    torch.autograd (a torch.autograd.Function over the torch.library ops kda_forward and
    kda_backward, so it also runs under torch.compile). A model that imports fla's chunk_kda trains
    by changing the import.

    Like fla's default, the backward rebuilds the chunk states (the rematerialize mode: far less memory).
    On CUDA with bfloat16 inputs the forward keeps nothing but its inputs (as cuDNN's): the forward
    re-runs inside the backward, writing the states, Aqk, Akk and G into its workspace; otherwise the
    forward saves Aqk and Akk (256 bytes per token and head in bfloat16; G, the cumulative gate, is
    recomputed from g) and, with fp16 inputs, the recurrence re-runs in fp32. disable_recompute=True
    (fla's switch) or rematerialize=False saves the chunk-start states h and Aqk, Akk instead (the
    saved-h mode; h in the residual dtype). Residuals are bfloat16
    for bfloat16 inputs and float32 otherwise (fp16 inputs included: bfloat16 residuals would cost
    them their precision); the CPU backend with float64 inputs saves none (its
    token-level backward, exact for gradcheck).

    fla options: cu_seqlens (or cu_seqlens_cpu, preferred since the sequence table is read on the
    host), A_log / dt_bias (keywords, as fla takes them, in any shape of HV and HV * K elements),
    lower_bound with use_gate_in_kernel (the lower-bound gate; safe_gate accepted, with fla's check that
    lower_bound is in [-5, 0)); with a precomputed gate safe_gate / lower_bound are accepted and ignored
    (they declare the gate bounded; encore's kernels take any gate),
    disable_recompute (the saved-h mode), max_num_seqs (ignored),
    chunk_size 64 or 32 (computed in chunks of 64: the same math; other values refused with fla's
    message), use_beta_sigmoid_in_kernel (beta = sigmoid(beta), fp32, before the kernels) with
    allow_neg_eigval (2 sigmoid(beta)), return_intermediate_states (inference: also h [B, NT, HV, K, V] bf16, NT the
    chunks of chunk_size: with 32 the odd states come from the token recurrence over each 64-token chunk's first half).
    Tensors of any strides, as fla's (the kernels read batch, token and head strides in place; a strided
    last dimension or a non-contiguous initial_state is copied; a state pool never is).
    Refused with a ValueError when set: cp_context, use_graph and any other keyword. encore's own
    keywords: rematerialize (below), cp_group and ssm_state_indices.

    state_v_first=True (fla's; its deprecated name transpose_state_layout is accepted with fla's warning):
    every state the caller passes or receives is stored transposed, [.., HV, V, K]: initial_state and
    final_state [N, HV, V, K] (their gradients too), the pool with ssm_state_indices [P, HV, V, K], and
    return_intermediate_states' h [B, NT, HV, V, K] (a transposed copy); the math is unchanged. A state in
    the other layout is refused naming the argument. With cp_group it has no effect (no caller states).

    Serving (encore's, docs/kda_serving.md): ssm_state_indices=[N] with initial_state = the state
    pool [P, HV, K, V] (float32 / bfloat16): the prefill reads sequence n's initial state from slot
    ssm_state_indices[n] and writes its final state back there in place (< 0: padding, o rows zero);
    returns (o, the pool). Inference only (no gradient); no gather / scatter copies.

    encore's context parallelism: cp_group=<torch.distributed process group>, each rank passing its
    contiguous slice along T of a varlen batch (B = 1) and the global cu_seqlens; returns (this rank's o,
    None). The ranks exchange one packed summary per direction (encore/_kda_cp.py); CPU tensors (fp64
    reference summaries) and CUDA tensors (summaries composed from the CUDA forward and backward, NCCL)."""
    state_v_first = _state_layout(state_v_first, kwargs)
    cp_group = kwargs.pop("cp_group", None)
    ssm_state_indices = kwargs.pop("ssm_state_indices", None)
    A_log, dt_bias = kwargs.pop("A_log", None), kwargs.pop("dt_bias", None)
    remat_given = "rematerialize" in kwargs
    rematerialize = bool(kwargs.pop("rematerialize", not disable_recompute))
    cu_cpu = cu_seqlens_cpu
    del max_num_seqs  # ignored: the sequence table is read on the host
    chunk_size = kwargs.pop("chunk_size", 64)
    if chunk_size not in (32, 64):  # fla's values and wording; 32 computes as 64 (the same math)
        raise ValueError(f"`chunk_size` must be either 32 or 64 for KDA, got {chunk_size}.")
    if safe_gate and use_gate_in_kernel:
        if lower_bound is None:
            raise ValueError("`lower_bound` must be specified when `safe_gate=True` and `use_gate_in_kernel=True`.")
        if not -5 <= lower_bound < 0:
            raise ValueError(f"`lower_bound` must be in the safe range [-5, 0), got {lower_bound}.")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    if cp_context is not None or use_graph or kwargs:
        bad = [name for name, on in (("cp_context", cp_context is not None), ("use_graph", use_graph)) if on]
        raise ValueError(f"chunk_kda: not supported by encore: {', '.join(bad + sorted(kwargs))}")
    if not is_torch(q):
        raise ValueError("q: chunk_kda expects torch tensors (kda_forward / kda_backward take numpy arrays)")
    matrix_shape(q, "q", 4, "[B, T, H, K]")
    matrix_shape(v, "v", 4, "[B, T, HV, V]")
    if use_gate_in_kernel and A_log is None and lower_bound is None:
        raise ValueError("A_log: must be given with use_gate_in_kernel unless lower_bound is set")
    if use_beta_sigmoid_in_kernel:  # beta = sigmoid(raw), in (0, 2) with allow_neg_eigval; fp32 at least, differentiable
        torch = torch_module()
        wide = beta if beta.dtype in (torch.float32, torch.float64) else beta.float()
        beta = torch.sigmoid(wide) * (2.0 if allow_neg_eigval else 1.0)
    if not use_gate_in_kernel:
        # fla ignores A_log and dt_bias for a precomputed gate; safe_gate / lower_bound there only declare
        # the gate bounded (encore's kernels take any gate)
        A_log = dt_bias = lower_bound = None
    else:
        A_log, dt_bias = _gate_params(A_log, dt_bias, v.shape[2], q.shape[3])
    if ssm_state_indices is not None:  # the prefill on a state pool, in place (inference): the pool never copied
        return _chunk_kda_pool(q, k, v, g, beta, scale, initial_state, ssm_state_indices, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                               A_log, dt_bias, lower_bound, cu_cpu if cu_cpu is not None else cu_seqlens, cp_group,
                               return_intermediate_states, state_v_first)
    (q, k, v, g, beta), initial_state = _fla_layouts((q, k, v, g, beta), initial_state)  # fla's: any strides
    if cp_group is not None:
        if initial_state is not None or output_final_state:
            raise ValueError("cp_group: context parallelism takes no initial_state and no output_final_state")
        if remat_given and rematerialize:
            raise ValueError("cp_group: rematerialize is not supported with context parallelism yet")
        from ._kda_cp import chunk_kda_cp

        return chunk_kda_cp(q, k, v, g, beta, cu_cpu if cu_cpu is not None else cu_seqlens, cp_group, scale, use_qk_l2norm_in_kernel,
                            use_gate_in_kernel, lower_bound, A_log, dt_bias), None
    if return_intermediate_states:  # fla's inference form: (o, final_state, h [B, NT, HV, K, V] bf16)
        torch = torch_module()
        if not torch.is_inference_mode_enabled():
            raise ValueError("return_intermediate_states: only allowed in inference mode (torch.inference_mode()), as fla's")
        if disable_recompute:
            raise ValueError("return_intermediate_states: must be used with disable_recompute=False, as fla's")
        cu = cu_cpu if cu_cpu is not None else cu_seqlens
        o, fin, res = kda_forward(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                                  use_gate_in_kernel, A_log, dt_bias, lower_bound, cu, return_residuals="h",
                                  residual_dtype="float32" if chunk_size == 32 else "bfloat16", state_v_first=state_v_first)
        h = res["h"]  # [NT, HV, K, V]; fla's state_v_first gives the chunk states as [.., V, K] too
        if chunk_size == 32:
            h = _states_every_32(q, k, v, g, beta, h, cu, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias,
                                 lower_bound).to(torch.bfloat16)
        if state_v_first:
            h = h.transpose(-1, -2).contiguous()
        return o, fin, h.reshape(q.shape[0], h.shape[0] // q.shape[0], *h.shape[1:])
    return _chunk_kda_apply()(q, k, v, g, beta, A_log, dt_bias, initial_state, scale, output_final_state,
                           use_qk_l2norm_in_kernel, use_gate_in_kernel, lower_bound,
                           cu_cpu if cu_cpu is not None else cu_seqlens, rematerialize, state_v_first)


def _states_every_32(q, k, v, g, beta, h, cu_seqlens, scale, l2, gate, A_log, dt_bias, lower_bound):
    """fla's chunk_size=32 chunk-start states from encore's 64-token ones, h [NT, HV, K, V] fp32 (sequence-major): the
    even ones are h, the odd ones h advanced over the first 32 tokens of their chunk by the token recurrence
    (fused_recurrent_kda over those 32-token segments as varlen sequences). Inference only."""
    from ._kda_serving import fused_recurrent_kda

    torch = torch_module()
    b, t = q.shape[0], q.shape[1]
    if cu_seqlens is None:
        bounds = [i * t for i in range(b + 1)]
    else:
        bounds = [int(x) for x in (cu_seqlens.tolist() if is_torch(cu_seqlens) else cu_seqlens)]
    rows, firsts, inits, chunk = [], [], [], 0  # rows: per output state, its source (True: h, False: a segment)
    for start, end in zip(bounds[:-1], bounds[1:]):
        length = end - start
        for j in range(-(-length // 64)):
            rows.append((True, chunk + j))
            if 64 * j + 32 < length:  # the chunk's second half starts inside the sequence: its state from a segment
                rows.append((False, len(inits)))
                inits.append(chunk + j)
                firsts.append(start + 64 * j)
        chunk += -(-length // 64)
    if not inits:
        return h
    idx = (torch.tensor(firsts)[:, None] + torch.arange(32)).reshape(-1).to(q.device)  # each segment's 32 tokens
    sel = [x.reshape(1, b * t, *x.shape[2:]).index_select(1, idx) for x in (q, k, v, g, beta)]
    seg = torch.arange(0, 32 * len(inits) + 1, 32, dtype=torch.int64, device=q.device)
    _, mid = fused_recurrent_kda(*sel, A_log=A_log, dt_bias=dt_bias, scale=scale, initial_state=h[torch.tensor(inits, device=h.device)],
                                 output_final_state=True, use_qk_l2norm_in_kernel=l2, use_gate_in_kernel=gate, lower_bound=lower_bound,
                                 cu_seqlens=seg)
    src = torch.cat((h, mid.to(h.dtype)))
    pick = torch.tensor([i if from_h else h.shape[0] + i for from_h, i in rows], device=h.device)
    return src.index_select(0, pick)


_APPLY = None


def _chunk_kda_apply():
    """_kda_autograd.chunk_kda_apply, imported on the first call (encore.kda itself needs no torch) and
    kept: an import statement per call cost more than the rest of the Python layer's checks."""
    global _APPLY
    if _APPLY is None:
        from ._kda_autograd import chunk_kda_apply

        _APPLY = chunk_kda_apply
    return _APPLY


def _chunk_kda_pool(q, k, v, g, beta, scale, pool, ssm_state_indices, use_qk_l2norm, use_gate_in_kernel, A_log, dt_bias, lower_bound,
                    cu_seqlens, cp_group, return_intermediate_states, state_v_first):
    """chunk_kda with ssm_state_indices: (o, pool) by kda_forward_pool."""
    if pool is None:
        layout = "[P, HV, V, K]" if state_v_first else "[P, HV, K, V]"
        raise ValueError(f"ssm_state_indices: needs initial_state, the state pool {layout} (read and written in place)")
    if cp_group is not None or return_intermediate_states:
        raise ValueError("ssm_state_indices: not supported with cp_group or return_intermediate_states")
    torch = torch_module()
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, g, beta, A_log, dt_bias, pool)):
        raise RuntimeError("ssm_state_indices: the prefill on a state pool is inference only (no gradient); call chunk_kda under "
                           "torch.no_grad() or torch.inference_mode()")
    o = kda_forward_pool(q, k, v, g, beta, pool, ssm_state_indices, scale, use_qk_l2norm, use_gate_in_kernel, A_log, dt_bias, lower_bound,
                         cu_seqlens, state_v_first=state_v_first)
    return o, pool
