"""KDA for serving engines (include/encore/kda_serving.hpp, docs/kda_serving.md): fla-core 0.6.0's
fused_recurrent_kda and fused_recurrent_kda_fwd (the recurrent step: decode over a state pool with
continuous batching, ssm_state_indices, and speculative tokens, num_accepted_tokens) and
kda_forward_pool, the chunked prefill that reads and writes the pool in place (chunk_kda's
ssm_state_indices). Forward only (inference): tensors that require grad under grad mode are refused.
CPU backend (fp64 reference) for numpy arrays and CPU torch tensors; on CUDA tensors the recurrent step runs
the decode kernel and kda_forward_pool the CUDA chunked forward with the pool read and written by its state
kernel (K, V <= 128; above, the decode kernel over each sequence's tokens). On CUDA the indices are on the
device (host indices refused); eager calls check their values from a host copy first (check_indices), CUDA-graph
captures do not (the kernels' contract: an index >= P gives NaN rows of out and writes nothing, duplicates are
the caller's).

Family-module shape (docs/python.md): launchers over the binding's KdaRecurrentArgs /
KdaPoolForwardArgs, the torch.library ops kda_recurrent and kda_forward_pool (mutating: the pool, o,
final_state; no outputs of their own), the public functions (direct launcher call when eager, the op
when traced)."""
from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING

from . import _encore as _b
from ._core import as_float, dl, eager, empty, is_torch, matrix_shape, ops, stream_for, torch_module, torch_op, workspace
from ._kda_args import _fla_layouts, _forward_args, _gate_params, _opt_float, _opts, _state_layout, _state_shape

if TYPE_CHECKING:  # the ops' string annotations (torch.library.infer_schema reads them)
    from torch import Tensor

__all__ = ["fused_recurrent_kda", "fused_recurrent_kda_fwd", "kda_forward_pool"]

_REC_OPTIONS = {}  # the KdaRecurrentOptions per distinct value


def _rec_opts(scale, use_qk_l2norm, use_gate_in_kernel, lower_bound, use_beta_sigmoid, allow_neg_eigval, state_v_first=False):
    key = (scale, use_qk_l2norm, use_gate_in_kernel, lower_bound, use_beta_sigmoid, allow_neg_eigval, state_v_first)
    o = _REC_OPTIONS.get(key)
    if o is None:
        s = 0.0 if scale is None else as_float(scale, "scale")
        if scale is not None and not (s > 0 and math.isfinite(s)):
            raise ValueError(f"scale: must be positive and finite (None: K ** -0.5), got {scale!r}")
        lower = lower_bound is not None
        o = _REC_OPTIONS[key] = _b.KdaRecurrentOptions(
            scale=s, use_qk_l2norm=bool(use_qk_l2norm), use_gate_in_kernel=bool(use_gate_in_kernel), use_lower_bound=lower,
            lower_bound=as_float(lower_bound, "lower_bound") if lower else -5.0, use_beta_sigmoid=bool(use_beta_sigmoid),
            allow_neg_eigval=bool(allow_neg_eigval), state_v_first=bool(state_v_first))
    return o


def _torch_arg(x):
    """A numpy index array as a torch tensor for the torch.ops path (wrapped, not copied)."""
    if x is None or is_torch(x):
        return x
    import numpy as np

    return torch_module().from_numpy(np.ascontiguousarray(x))


def _host_indices(stream, *xs):
    """The eager index check's host copies: None when no x is a CUDA tensor or its device is capturing a CUDA
    graph (no check), else xs with each CUDA tensor copied to the host in the order of `stream` (the call's
    explicit one) or the current stream: what the kernel will read. The caller holds them while views point in."""
    on = [x for x in xs if x is not None and is_torch(x) and x.is_cuda]
    if not on:
        return None
    cuda = torch_module().cuda
    with cuda.device(on[0].device):
        if cuda.is_current_stream_capturing():
            return None
        order = cuda.stream(cuda.ExternalStream(stream_for(on[0], stream))) if stream is not None else contextlib.nullcontext()
        with order:
            return tuple(x.cpu() if x is not None and is_torch(x) and x.is_cuda else x for x in xs)


# --- launchers ------------------------------------------------------------------------------------------

def _kda_recurrent_launch(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, inplace_final_state, state_indices,
                          num_accepted_tokens, cu_seqlens, use_qk_l2norm, use_gate_in_kernel, lower_bound, use_beta_sigmoid,
                          allow_neg_eigval, o, final_state, stream=None, check_indices=True, state_v_first=False):
    """Writes o and final_state (or, with inplace_final_state / state_indices, initial_state in place); state_v_first:
    the states (the pool) [.., HV, V, K].
    check_indices: device indices are copied to the host and checked first (out of range, duplicates,
    num_accepted_tokens out of [1, S]: ValueError, nothing written); skipped under CUDA-graph capture."""
    if inplace_final_state and state_indices is None:
        final_state = initial_state

    def make(idx, nat):
        return _b.KdaRecurrentArgs(q=dl(q), k=dl(k), v=dl(v), g=dl(g), beta=dl(beta), A_log=dl(A_log), dt_bias=dl(dt_bias),
                                   cu_seqlens=dl(cu_seqlens), initial_state=dl(initial_state), state_indices=dl(idx),
                                   num_accepted_tokens=dl(nat), o=dl(o), final_state=dl(final_state))

    opts = _rec_opts(scale, use_qk_l2norm, use_gate_in_kernel, lower_bound, use_beta_sigmoid, allow_neg_eigval, bool(state_v_first))
    host = _host_indices(stream, state_indices, num_accepted_tokens) if check_indices else None
    if host is not None:
        _b.kda_recurrent_workspace(make(*host), opts)  # validates the values
    _b.kda_recurrent_run(make(state_indices, num_accepted_tokens), opts, None, stream_for(q, stream))


def _kda_forward_pool_launch(q, k, v, g, beta, scale, pool, state_indices, use_qk_l2norm, use_gate_in_kernel, A_log, dt_bias,
                             lower_bound, cu_seqlens, o, stream=None, check_indices=True, state_v_first=False):
    opts = _opts(scale, use_qk_l2norm, use_gate_in_kernel, lower_bound, False, bool(state_v_first))
    fwd = _forward_args(q, k, v, g, beta, None, A_log, dt_bias, cu_seqlens, o)
    host = _host_indices(stream, state_indices) if check_indices else None  # as _kda_recurrent_launch's check
    if host is not None:
        _b.kda_forward_pool_workspace(_b.KdaPoolForwardArgs(fwd=fwd, pool=dl(pool), state_indices=dl(host[0])), opts)
    args = _b.KdaPoolForwardArgs(fwd=fwd, pool=dl(pool), state_indices=dl(state_indices))
    nbytes = _b.kda_forward_pool_workspace(args, opts) if is_torch(q) and q.is_cuda else 0  # the CUDA forward's records
    _b.kda_forward_pool_run(args, opts, workspace(None, q, nbytes, 16, "kda_forward_pool") if nbytes else None, stream_for(q, stream))


# --- torch.ops.encore: mutating ops, no outputs of their own ----------------------------------------------

@torch_op("kda_recurrent", fake=lambda *_: None, mutates=("initial_state", "o", "final_state"))
def _kda_recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Tensor | None, dt_bias: Tensor | None,
                   scale: float | None, initial_state: Tensor | None, inplace_final_state: bool, state_indices: Tensor | None,
                   num_accepted_tokens: Tensor | None, cu_seqlens: Tensor | None, use_qk_l2norm: bool, use_gate_in_kernel: bool,
                   lower_bound: float | None, use_beta_sigmoid: bool, allow_neg_eigval: bool, o: Tensor,
                   final_state: Tensor | None, check_indices: bool = True, state_v_first: bool = False) -> None:
    """The recurrent step into o and final_state; initial_state written in place with state_indices (the pool) or
    inplace_final_state (final_state None then)."""
    _kda_recurrent_launch(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, inplace_final_state, state_indices,
                          num_accepted_tokens, _cpu(cu_seqlens), use_qk_l2norm, use_gate_in_kernel, lower_bound, use_beta_sigmoid,
                          allow_neg_eigval, o, final_state, check_indices=check_indices, state_v_first=state_v_first)


@torch_op("kda_forward_pool", fake=lambda *_: None, mutates=("pool", "o"))
def _kda_forward_pool(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None, pool: Tensor,
                      state_indices: Tensor, use_qk_l2norm: bool, use_gate_in_kernel: bool, A_log: Tensor | None,
                      dt_bias: Tensor | None, lower_bound: float | None, cu_seqlens: Tensor | None, o: Tensor,
                      check_indices: bool = True, state_v_first: bool = False) -> None:
    """The chunked prefill on the pool into o; the pool's slots state_indices written in place."""
    _kda_forward_pool_launch(q, k, v, g, beta, scale, pool, state_indices, use_qk_l2norm, use_gate_in_kernel, A_log, dt_bias,
                             lower_bound, _cpu(cu_seqlens), o, check_indices=check_indices, state_v_first=state_v_first)


def _cpu(cu_seqlens):
    """cu_seqlens in host memory (the sequence table is read on the host; fla passes it on the device)."""
    if cu_seqlens is not None and is_torch(cu_seqlens) and cu_seqlens.is_cuda:
        return cu_seqlens.cpu()
    return cu_seqlens


# --- public API ------------------------------------------------------------------------------------------

def _state_v_first(state_v_first, kwargs, name, alias=True):
    """state_v_first (or, alias, fla's deprecated transpose_state_layout); any other keyword refused naming it.
    fla's fused_recurrent_kda_fwd ignores transpose_state_layout (it reads state_v_first only): refused there
    (alias False) rather than read another way than fla."""
    if alias:
        state_v_first = _state_layout(state_v_first, kwargs, stacklevel=4)
    if kwargs:
        hint = " (fla's fused_recurrent_kda_fwd ignores transpose_state_layout: pass state_v_first)" if "transpose_state_layout" in kwargs else ""
        raise ValueError(f"{name}: not supported by encore: {', '.join(sorted(kwargs))}{hint}")
    return state_v_first


def fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None, output_final_state=False,
                        use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                        allow_neg_eigval=False, lower_bound=None, state_v_first=False, cu_seqlens=None, **kwargs):
    """fla's fused_recurrent_kda (fla.ops.kda.fused_recurrent_kda, fla-core 0.6.0): the token recurrence
    over q, k [B, T, H, K], v [B, T, HV, V], g [B, T, HV, K], beta [B, T, HV] (HV a multiple of H),
    the same arguments, defaults and return value (o [B, T, HV, V] in v's dtype, final_state
    [N, HV, K, V] float32 or None). Forward only. initial_state [N, HV, K, V] float32 / bfloat16;
    cu_seqlens [N + 1] (B = 1). The in-kernel options as fla's: the gate (use_gate_in_kernel with
    A_log [HV] and dt_bias [HV * K] in any shape, lower_bound), q/k L2 norm, beta = sigmoid(beta)
    (use_beta_sigmoid_in_kernel) or 2 sigmoid(beta) (with allow_neg_eigval). state_v_first=True (or fla's
    deprecated transpose_state_layout): initial_state and final_state are [N, HV, V, K], each state transposed."""
    state_v_first = _state_v_first(state_v_first, kwargs, "fused_recurrent_kda")
    b = matrix_shape(q, "q", 4, "[B, T, H, K]")[0]
    if cu_seqlens is not None:
        if b != 1:
            raise ValueError(f"The batch size is expected to be 1 rather than {b} when using `cu_seqlens`."
                             f"Please flatten variable-length inputs before processing.")
        if initial_state is not None and initial_state.shape[0] != len(cu_seqlens) - 1:
            raise ValueError(f"The number of initial states is expected to be equal to the number of input sequences, "
                             f"i.e., {len(cu_seqlens) - 1} rather than {initial_state.shape[0]}.")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    if is_torch(q):  # fla's: any strides (initial_state is only read here: inplace_final_state=False)
        (q, k, v, g, beta), initial_state = _fla_layouts((q, k, v, g, beta), initial_state)
    return fused_recurrent_kda_fwd(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=initial_state, scale=scale,
                                   output_final_state=output_final_state, inplace_final_state=False, cu_seqlens=cu_seqlens,
                                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                                   use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                                   lower_bound=lower_bound, state_v_first=state_v_first)


def fused_recurrent_kda_fwd(q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None, scale=None, output_final_state=False,
                            inplace_final_state=True, state_v_first=False, cu_seqlens=None, ssm_state_indices=None,
                            num_accepted_tokens=None, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                            use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None, out=None, stream=None,
                            check_indices=True, **kwargs):
    """fla's fused_recurrent_kda_fwd (fla-core 0.6.0), the serving form: returns (out, final_state).

    - inplace_final_state=True (fla's default) needs initial_state and returns it as final_state, updated in
      place. Without ssm_state_indices: initial_state [N, HV, K, V], row n gets sequence n's final state.
    - ssm_state_indices [N] (continuous batching): initial_state is the pool [P, HV, K, V] (float32 or
      bfloat16; each slot's [HV, K, V] contiguous); sequence n starts from slot ssm_state_indices[n] and
      its final state is written back there. An index < 0 is a padding sequence: its rows of out are zero
      and the pool is not touched. The non-negative indices of a call are distinct and < P.
    - ssm_state_indices [N, S] (speculative decoding, T_n <= S tokens per sequence): sequence n starts
      from slot ssm_state_indices[n, num_accepted_tokens[n] - 1] (column 0 without num_accepted_tokens,
      each in [1, S]) and the state after its token t is written to slot ssm_state_indices[n, t] (not
      where < 0); a sequence whose start entry is < 0 is padding.
    - inplace_final_state=False: without ssm_state_indices, final_state is a new float32 [N, HV, K, V]
      with output_final_state (else None); with ssm_state_indices it is refused (the pool is updated in
      place; fla writes per-token states into final_state rows by token position there).

    out: optional [B, T, HV, V] array to write (returned). Bad indices (out of range, duplicates,
    num_accepted_tokens out of [1, S]) raise ValueError naming the argument before anything is written.
    Indices on the GPU are checked from a host copy (a synchronization) unless check_indices=False or a
    CUDA graph is being captured; unchecked, an index >= P gives NaN rows of out and writes nothing to the
    pool, and duplicates are the caller's contract. stream: an explicit stream (direct call).

    state_v_first=True (fla's; transpose_state_layout is refused here: fla's fused_recurrent_kda_fwd ignores
    it): every state, initial_state, the pool and final_state, is stored transposed: [N or P, HV, V, K] (each slot's [HV, V, K] contiguous);
    states in the [K, V] layout are refused naming the argument. On CUDA with K = V = 128 the decode then
    takes the general kernel (scalar state accesses) instead of the compile-time ones."""
    state_v_first = _state_v_first(state_v_first, kwargs, "fused_recurrent_kda_fwd", alias=False)
    matrix_shape(q, "q", 4, "[B, T, H, K]")
    b, t, hv, vd = matrix_shape(v, "v", 4, "[B, T, HV, V]")
    kd = q.shape[3]
    if not use_gate_in_kernel:  # fla reads A_log, dt_bias and lower_bound only for the in-kernel gate
        A_log = dt_bias = lower_bound = None
    else:
        A_log, dt_bias = _gate_params(A_log, dt_bias, hv, kd)
    allow_neg_eigval = bool(allow_neg_eigval and use_beta_sigmoid_in_kernel)  # fla: effective with the sigmoid only
    if out is None:
        out = empty(v, (b, t, hv, vd))
    elif tuple(getattr(out, "shape", ())) != (b, t, hv, vd):
        raise ValueError(f"out: expected v's shape {[b, t, hv, vd]}, got {list(getattr(out, 'shape', []))}")
    if inplace_final_state:
        if initial_state is None:
            raise ValueError("inplace_final_state: needs initial_state (the states updated in place); "
                             "pass inplace_final_state=False for new final states")
        final_state, returned = None, initial_state
    elif ssm_state_indices is not None:
        raise ValueError("inplace_final_state=False with ssm_state_indices: not supported by encore (the pool, initial_state, "
                         "is updated in place)")
    elif output_final_state:
        n = b if cu_seqlens is None else len(cu_seqlens) - 1
        kind = "like" if str(q.dtype).endswith("float64") else "f32"
        final_state = returned = empty(q, _state_shape(n, hv, kd, vd, state_v_first), kind)
    else:
        final_state = returned = None
    flags = (bool(use_qk_l2norm_in_kernel), bool(use_gate_in_kernel))
    if stream is None and not eager(q, k, v, g, beta, A_log, dt_bias, initial_state, out, final_state):
        ops().kda_recurrent(q, k, v, g, beta, A_log, dt_bias, _opt_float(scale), initial_state,
                            bool(inplace_final_state), _torch_arg(ssm_state_indices), _torch_arg(num_accepted_tokens),
                            _torch_arg(cu_seqlens), *flags, _opt_float(lower_bound),
                            bool(use_beta_sigmoid_in_kernel), allow_neg_eigval, out, final_state, bool(check_indices),
                            state_v_first)
    else:
        _kda_recurrent_launch(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, bool(inplace_final_state), ssm_state_indices,
                              num_accepted_tokens, _cpu(cu_seqlens), *flags, lower_bound, bool(use_beta_sigmoid_in_kernel),
                              allow_neg_eigval, out, final_state, stream, bool(check_indices), state_v_first)
    return out, returned


def kda_forward_pool(q, k, v, g, beta, pool, state_indices, scale=None, use_qk_l2norm=False, use_gate_in_kernel=False, A_log=None,
                     dt_bias=None, lower_bound=None, cu_seqlens=None, out=None, stream=None, check_indices=True, state_v_first=False):
    """The chunked prefill on a state pool (kda_forward's arguments, inference): sequence n starts from
    pool[state_indices[n]] ([P, HV, K, V] float32 / bfloat16, updated in place) and its final state is
    written back there; state_indices [N] (< 0: padding, its rows of o zero, the pool untouched; the
    non-negative ones distinct and < P). Returns o [B, T, HV, V] (out when given). chunk_kda(...,
    initial_state=pool, ssm_state_indices=state_indices) calls it. On CUDA: state_indices on q's device
    (int32 / int64; checked from a host copy as fused_recurrent_kda_fwd's unless check_indices=False or
    under CUDA-graph capture; unchecked, an index >= P gives NaN rows of o and writes nothing), a pool of
    float32 / bfloat16, the workspace allocated per call (the CUDA forward's records). state_v_first: the pool is
    [P, HV, V, K] (fla's layout of that name; each slot's [HV, V, K] contiguous)."""
    b, t, hv, vd = matrix_shape(v, "v", 4, "[B, T, HV, V]")
    if out is None:
        out = empty(v, (b, t, hv, vd))
    if stream is None and not eager(q, k, v, g, beta, A_log, dt_bias, pool, out):
        ops().kda_forward_pool(q, k, v, g, beta, _opt_float(scale), pool, _torch_arg(state_indices),
                               bool(use_qk_l2norm), bool(use_gate_in_kernel), A_log, dt_bias,
                               _opt_float(lower_bound), _torch_arg(cu_seqlens), out,
                               bool(check_indices), bool(state_v_first))
    else:
        _kda_forward_pool_launch(q, k, v, g, beta, scale, pool, state_indices, use_qk_l2norm, use_gate_in_kernel, A_log, dt_bias,
                                 lower_bound, _cpu(cu_seqlens), out, stream, bool(check_indices), bool(state_v_first))
    return out
