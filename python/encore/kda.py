"""Kimi Delta Attention (include/encore/kda.hpp), the chunk_kda contract: q, k [B, T, H, K], g
[B, T, HV, K], v [B, T, HV, V], beta [B, T, HV] (HV a multiple of H: grouped value heads, fla's GVA).
Forward: CPU backend (fp64 reference) for numpy / CPU torch arrays, CUDA forward for CUDA torch
tensors (bf16/fp16/fp32; K, V <= 128 on tensor cores, up to 256 on a token-recurrent path), optionally returning the residuals the
backward reads. Backward: kda_backward (the gradients; the CPU backend with or without the forward's
residuals, CUDA with them). chunk_kda: fla's
drop-in for torch, differentiable through torch.autograd."""
from __future__ import annotations

from . import _encore
from ._util import _dl, _empty, _given_outputs, _is_torch, _ops, _stream_for, _via_torch_op, _with_absent, _workspace

_RESIDUAL_KINDS = {None: "f32", "float32": "f32", "bfloat16": "bf16"}
_RESIDUAL_NAMES = ("G", "Aqk", "Akk", "h")


def _residual_names(return_residuals):
    if return_residuals is True:
        return _RESIDUAL_NAMES
    names = (return_residuals,) if isinstance(return_residuals, str) else tuple(return_residuals)
    bad = [x for x in names if x not in _RESIDUAL_NAMES]
    if bad or not names:
        raise ValueError(f"return_residuals: expected True or a non-empty subset of {_RESIDUAL_NAMES}, got {return_residuals!r}")
    return names


def _host_cu(cu_seqlens):
    if cu_seqlens is not None and _is_torch(cu_seqlens) and cu_seqlens.is_cuda:
        return cu_seqlens.cpu()
    return cu_seqlens


def _state_kind(q):
    """final_state's dtype: float32, or float64 for float64 inputs (the CPU backend's exact mode)."""
    return "like" if str(q.dtype).endswith("float64") else "f32"


def _opt_float(x):
    return None if x is None else float(x)


def _torch_cu(cu_seqlens):
    """cu_seqlens as a torch tensor for the torch.ops path (a host numpy array is wrapped, not copied)."""
    if cu_seqlens is None or _is_torch(cu_seqlens):
        return cu_seqlens
    import numpy as np
    import torch

    return torch.from_numpy(np.ascontiguousarray(cu_seqlens))


def _opts(scale, use_qk_l2norm, use_gate_in_kernel, lower_bound):
    lower = lower_bound is not None
    return (float(scale or 0.0), bool(use_qk_l2norm), bool(use_gate_in_kernel), lower, float(lower_bound if lower else -5.0))


def kda_forward(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm=False,
                use_gate_in_kernel=False, A_log=None, dt_bias=None, lower_bound=None, cu_seqlens=None,
                return_residuals=False, residual_dtype=None, out=None, workspace=None, stream=None):
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
    per chunk of 64 tokens and head); without it each CUDA call allocates one. With both and no
    residuals a call allocates nothing (fixed addresses, e.g. for CUDA graph capture). Torch
    tensors go through torch.ops.encore.kda_forward (kda_forward_out with out or workspace), except
    out or workspace together with return_residuals (the direct call: eager only, not traceable).
    """
    b, t, _, kd = q.shape
    h, vd = v.shape[2], v.shape[3]  # h: the value heads HV (a multiple of q's heads; fla's GVA)
    # Torch tensors: torch.ops.encore.kda_forward, or kda_forward_out (no residuals) with out or workspace.
    given = out is not None or workspace is not None
    if _via_torch_op(stream, q, k, v, g, beta, initial_state, A_log, dt_bias, workspace) and not (given and return_residuals):
        names = _residual_names(return_residuals) if return_residuals else ()
        ins = (q, k, v, g, beta, _opt_float(scale), initial_state, bool(output_final_state), bool(use_qk_l2norm),
               bool(use_gate_in_kernel), A_log, dt_bias, _opt_float(lower_bound), _torch_cu(cu_seqlens))
        if given:
            if out is None:
                n = b if cu_seqlens is None else len(cu_seqlens) - 1
                out = (_empty(v, (b, t, h, vd), "like"), _empty(q, (n, h, kd, vd), _state_kind(q)) if output_final_state else None)
            out = _given_outputs(out, ("o", "final_state"))
            _ops().kda_forward_out(*ins, *out, workspace)
            return out
        canonical = tuple(x for x in _RESIDUAL_NAMES if x in names)
        o, fin, *res = _with_absent(_ops().kda_forward(*ins, ",".join(canonical), residual_dtype),
                                    (True, output_final_state) + (True,) * len(names))
        if not return_residuals:
            return o, fin
        res = dict(zip(canonical, res))
        return o, fin, {x: res[x] for x in names}
    n = (len(cu_seqlens) - 1) if cu_seqlens is not None else b
    cu_seqlens = _host_cu(cu_seqlens)
    if out is None:
        o = _empty(v, (b, t, h, vd), "like")
        fin = _empty(q, (n, h, kd, vd), _state_kind(q)) if output_final_state else None
    else:
        o, fin = _given_outputs(out, ("o", "final_state"))
        if (fin is not None) != bool(output_final_state):
            raise ValueError("out: final_state must be an array exactly when output_final_state is set")
    res = None
    if return_residuals:
        if residual_dtype not in _RESIDUAL_KINDS:
            raise ValueError(f"residual_dtype: expected 'float32' or 'bfloat16', got {residual_dtype!r}")
        kind = _RESIDUAL_KINDS[residual_dtype]
        nt = _encore.kda_chunk_count(*_dl(q, k, v, g, beta, cu_seqlens))
        shapes = {"G": ((b, t, h, kd), "f32"), "Aqk": ((b, t, h, 64), kind), "Akk": ((b, t, h, 64), kind),
                  "h": ((nt, h, kd, vd), kind)}
        res = {name: _empty(q, *shapes[name]) for name in _residual_names(return_residuals)}
    args = (q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, o, fin,
            *_opts(scale, use_qk_l2norm, use_gate_in_kernel, lower_bound),
            *((res or {}).get(name) for name in _RESIDUAL_NAMES))
    nbytes = _encore.kda_forward_workspace_bytes(*_dl(*args))  # a capsule is used once: _dl per call
    ws = _workspace(workspace, q, nbytes, 16, "kda_forward_workspace_bytes")
    _encore.kda_forward_out(*_dl(*args, ws if nbytes else None), _stream_for(q, stream))
    return (o, fin, res) if return_residuals else (o, fin)


def kda_forward_workspace_bytes(q, k, v, g, beta, out, cu_seqlens=None) -> int:
    """The size in bytes to allocate for kda_forward's `workspace` with these inputs and outputs
    `out` = (o, final_state or None): 96.5 KB per chunk of 64 tokens and head on CUDA plus 16 for
    alignment, 0 on the CPU backend."""
    o, fin = _given_outputs(out, ("o", "final_state"))
    # The size depends on the chunk and head counts only: the default options stand in for any.
    nbytes = _encore.kda_forward_workspace_bytes(*_dl(q, k, v, g, beta, None, None, None, _host_cu(cu_seqlens), o, fin),
                                                 *_opts(None, False, False, None), None, None, None, None)
    return int(nbytes) + 16 if nbytes else 0


def kda_backward(q, k, v, g, beta, d_o, d_final_state=None, scale=None, initial_state=None, use_qk_l2norm=False,
                 use_gate_in_kernel=False, A_log=None, dt_bias=None, lower_bound=None, cu_seqlens=None, residuals=None,
                 stream=None):
    """Gradients of sum(o * d_o) + sum(final_state * d_final_state) for the forward with the same
    arguments. Returns a dict with dq, dk, dv, dg, dbeta (in the inputs' dtypes; dg with respect to
    the g passed in, dq and dk before the L2 norm) and dh0, dA_log, ddt_bias (float32) when
    initial_state, A_log, dt_bias are given (in their dtypes). residuals: the dict kda_forward returned with
    return_residuals (G, Aqk, Akk, and h for the saved-h mode; without h the backward
    rematerializes the chunk states); the CPU backend runs its chunked backward on them, or its
    token-level backward without; the CUDA backward needs them (its workspace is allocated per
    call, kda_backward_workspace_bytes in C++). stream: as for the forward (an explicit one takes the direct
    path; the CPU backend ignores it)."""
    res = _residual_tuple(residuals)
    if _via_torch_op(stream, q, k, v, g, beta, d_o, d_final_state, initial_state, A_log, dt_bias, *res):
        opt = (("dh0", initial_state), ("dA_log", A_log), ("ddt_bias", dt_bias))
        grads = _ops().kda_backward(q, k, v, g, beta, d_o, d_final_state, _opt_float(scale), initial_state, bool(use_qk_l2norm),
                                    bool(use_gate_in_kernel), A_log, dt_bias, _opt_float(lower_bound), _torch_cu(cu_seqlens), *res)
        return dict(zip(("dq", "dk", "dv", "dg", "dbeta", *(x for x, src in opt if src is not None)), grads))
    cu_seqlens = _host_cu(cu_seqlens)
    grads = {"dq": _empty(q, q.shape, "like"), "dk": _empty(k, k.shape, "like"), "dv": _empty(v, v.shape, "like"),
             "dg": _empty(g, g.shape, "like"), "dbeta": _empty(beta, beta.shape, "like")}
    opt = {"dh0": initial_state, "dA_log": A_log, "ddt_bias": dt_bias}
    for name, src in opt.items():
        if src is not None:
            grads[name] = _empty(src, src.shape, "like")
    args = (q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, d_o, d_final_state)
    outs = tuple(grads.get(x) for x in ("dq", "dk", "dv", "dg", "dbeta", "dh0", "dA_log", "ddt_bias"))
    opts = _opts(scale, use_qk_l2norm, use_gate_in_kernel, lower_bound)
    nbytes = _encore.kda_backward_workspace_bytes(*_dl(*args), *opts, *_dl(*outs, *res))  # a capsule is used once: _dl per call
    ws = _workspace(None, q, nbytes, 16, "kda_backward") if nbytes else None
    _encore.kda_backward_out(*_dl(*args), *opts, *_dl(*outs, *res, ws), _stream_for(q, stream))
    return grads


def _residual_tuple(residuals):
    """(G, Aqk, Akk, h) from kda_forward's residual dict (None where absent or for no dict)."""
    if residuals is None:
        return (None,) * 4
    if not isinstance(residuals, dict) or set(residuals) - set(_RESIDUAL_NAMES):
        raise ValueError(f"residuals: expected the dict kda_forward returns (keys among {_RESIDUAL_NAMES}), got {residuals!r:.80}")
    return tuple(residuals.get(x) for x in _RESIDUAL_NAMES)




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

    The backward reads the forward's saved residuals G, Aqk and Akk and, like fla's default, re-runs
    the state recurrence (the rematerialize mode: far less memory, Aqk + Akk are 256 bytes per token
    and head in bfloat16, and more accurate, the chunk states staying fp32; on an H200 within 2% of
    the saved-h mode's time). disable_recompute=True (fla's switch) or rematerialize=False saves the
    chunk-start states h instead (the saved-h mode; h in the residual dtype). Residuals are bfloat16
    for bfloat16 inputs and float32 otherwise (fp16 inputs included: bfloat16 residuals would cost
    them their precision); the CPU backend with float64 inputs saves none (its
    token-level backward, exact for gradcheck).

    fla options: cu_seqlens (or cu_seqlens_cpu, preferred since the sequence table is read on the
    host), A_log / dt_bias (keywords, as fla takes them), lower_bound with use_gate_in_kernel (the
    lower-bound gate; safe_gate accepted, with fla's check that lower_bound is in [-5, 0)),
    disable_recompute (the saved-h mode), max_num_seqs (ignored),
    chunk_size 64. Refused with a ValueError when set: use_beta_sigmoid_in_kernel, allow_neg_eigval,
    return_intermediate_states, state_v_first, cp_context, use_graph, chunk_size 32 and any other
    keyword. encore's own keywords: rematerialize (below) and cp_group.

    encore's context parallelism: cp_group=<torch.distributed process group>, each rank passing its
    contiguous slice along T of a varlen batch (B = 1) and the global cu_seqlens; returns (this rank's o,
    None). The ranks exchange one packed summary per direction (encore/_kda_cp.py); CPU tensors (fp64
    reference summaries) and CUDA tensors (summaries composed from the CUDA forward and backward, NCCL)."""
    cp_group = kwargs.pop("cp_group", None)
    A_log, dt_bias = kwargs.pop("A_log", None), kwargs.pop("dt_bias", None)
    remat_given = "rematerialize" in kwargs
    rematerialize = bool(kwargs.pop("rematerialize", not disable_recompute))
    cu_cpu = cu_seqlens_cpu
    del max_num_seqs  # ignored: the sequence table is read on the host
    if kwargs.pop("chunk_size", 64) != 64:
        raise ValueError("chunk_size: encore's chunked KDA uses chunks of 64 tokens")
    if safe_gate and use_gate_in_kernel and (lower_bound is None or not -5 <= lower_bound < 0):
        raise ValueError(f"lower_bound: safe_gate with use_gate_in_kernel needs lower_bound in [-5, 0), got {lower_bound}")
    refused = {"use_beta_sigmoid_in_kernel": use_beta_sigmoid_in_kernel, "allow_neg_eigval": allow_neg_eigval,
               "return_intermediate_states": return_intermediate_states, "state_v_first": state_v_first,
               "cp_context": cp_context is not None, "use_graph": use_graph}
    bad = [name for name, on in refused.items() if on]
    if bad or kwargs:
        raise ValueError(f"chunk_kda: not supported by encore: {', '.join(bad + sorted(kwargs))}")
    if not _is_torch(q):
        raise ValueError("chunk_kda: expects torch tensors (kda_forward / kda_backward take numpy arrays)")
    if use_gate_in_kernel and A_log is None and lower_bound is None:
        raise ValueError("A_log: must be given with use_gate_in_kernel unless lower_bound is set")
    if not use_gate_in_kernel:
        A_log = dt_bias = None  # fla ignores them for a precomputed gate
    if cp_group is not None:
        if initial_state is not None or output_final_state:
            raise ValueError("cp_group: context parallelism takes no initial_state and no output_final_state")
        if remat_given and rematerialize:
            raise ValueError("cp_group: rematerialize is not supported with context parallelism yet")
        from ._kda_cp import chunk_kda_cp

        return chunk_kda_cp(q, k, v, g, beta, cu_cpu if cu_cpu is not None else cu_seqlens, cp_group, scale, use_qk_l2norm_in_kernel,
                            use_gate_in_kernel, lower_bound, A_log, dt_bias), None
    from ._kda_autograd import chunk_kda_apply

    return chunk_kda_apply(q, k, v, g, beta, A_log, dt_bias, initial_state, scale, output_final_state,
                           use_qk_l2norm_in_kernel, use_gate_in_kernel, lower_bound,
                           cu_cpu if cu_cpu is not None else cu_seqlens, rematerialize)
