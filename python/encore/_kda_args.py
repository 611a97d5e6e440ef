"""The KDA binding's structs built from Python arguments (KdaOptions cached per distinct value,
KdaForwardArgs with its residuals), shared by kda.py's launchers, _kda_cp.py's summaries and
_kda_serving.py; _gate_params: A_log and dt_bias in any shape fla takes."""
from __future__ import annotations

import math

from . import _encore as _b
from ._core import as_float, dl

_OPTIONS = {}  # (scale, l2, gate, lower_bound, output_final_state, state_v_first) -> KdaOptions: built once per distinct value


def _opts(scale, use_qk_l2norm, use_gate_in_kernel, lower_bound, output_final_state=False, state_v_first=False):
    """The KdaOptions of these arguments (lower_bound None: the softplus gate; state_v_first: fla's [.., V, K] states)."""
    key = (scale, use_qk_l2norm, use_gate_in_kernel, lower_bound, output_final_state, state_v_first)
    o = _OPTIONS.get(key)
    if o is None:
        lower = lower_bound is not None
        s = 0.0 if scale is None else as_float(scale, "scale")
        if scale is not None and not (s > 0 and math.isfinite(s)):  # the C++ options read <= 0 as K^-1/2: refuse, not substitute
            raise ValueError(f"scale: must be positive and finite (None: K ** -0.5), got {scale!r}")
        o = _OPTIONS[key] = _b.KdaOptions(scale=s, output_final_state=bool(output_final_state),
                                          use_qk_l2norm=bool(use_qk_l2norm), use_gate_in_kernel=bool(use_gate_in_kernel),
                                          use_lower_bound=lower, lower_bound=as_float(lower_bound, "lower_bound") if lower else -5.0,
                                          state_v_first=bool(state_v_first))
    return o


def _forward_args(q, k, v, g, beta, initial_state=None, A_log=None, dt_bias=None, cu_seqlens=None, o=None, final_state=None,
                  residuals=None):
    """KdaForwardArgs; residuals: (G, Aqk, Akk, h) or None."""
    res = None
    if residuals is not None:
        G, Aqk, Akk, h = residuals
        res = _b.KdaResiduals(G=dl(G), Aqk=dl(Aqk), Akk=dl(Akk), h=dl(h))
    return _b.KdaForwardArgs(q=dl(q), k=dl(k), v=dl(v), g=dl(g), beta=dl(beta), initial_state=dl(initial_state), A_log=dl(A_log),
                             dt_bias=dl(dt_bias), cu_seqlens=dl(cu_seqlens), o=dl(o), final_state=dl(final_state), residuals=res)


def _numel(a):
    """Elements of a torch tensor or a numpy array (the product of its shape; traceable by torch.compile,
    which cannot trace callable() on a bound method); -1 for anything without a shape."""
    shape = getattr(a, "shape", None)
    try:
        n = 1
        for s in shape:
            n *= s
        return n
    except TypeError:
        return -1


def _gate_params(A_log, dt_bias, hv, kd):
    """A_log and dt_bias in any shape fla accepts (HV and HV * K elements: [HV], [1, 1, HV, 1], [HV, K],
    ...) as the [HV] and [HV * K] views the kernels take; gradients flow back in the caller's shape."""
    if A_log is not None:
        if _numel(A_log) != hv:
            raise ValueError(f"A_log: expected {hv} elements (one per value head, any shape), got shape {list(getattr(A_log, 'shape', []))}")
        A_log = A_log.reshape(hv)
    if dt_bias is not None:
        if _numel(dt_bias) != hv * kd:
            raise ValueError(f"dt_bias: expected {hv * kd} elements (HV * K, any shape), got shape {list(getattr(dt_bias, 'shape', []))}")
        dt_bias = dt_bias.reshape(hv * kd)
    return A_log, dt_bias


def _state_layout(state_v_first, kwargs, stacklevel=3):
    """state_v_first, or fla's deprecated name for it, transpose_state_layout (popped from kwargs, with fla's
    DeprecationWarning; both given: fla's ValueError)."""
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise ValueError("Cannot pass both `state_v_first` and the deprecated `transpose_state_layout`.")
        import warnings

        from . import _core

        compiling = _core._COMPILING  # bound once torch is imported (None for numpy callers)
        if compiling is None or not compiling():  # dynamo cannot trace warnings.warn (fullgraph compiles keep working)
            warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`.", DeprecationWarning,
                          stacklevel=stacklevel)
        state_v_first = kwargs.pop("transpose_state_layout")
    return bool(state_v_first)


def _state_shape(n, hv, kd, vd, state_v_first):
    """A state tensor's shape: [N, HV, K, V], or [N, HV, V, K] with state_v_first."""
    return (n, hv, vd, kd) if state_v_first else (n, hv, kd, vd)


def _fla_layouts(tensors, state):
    """fla's entry points take tensors of any strides (its input_guard copies them contiguous); encore's kernels
    take q, k, v, g, beta with unit-stride rows (any batch, token and head strides) and a contiguous state.
    Copies only what they cannot take: a tensor whose last dimension is strided, and a state that is not
    contiguous (read only here: the callers never pass a state updated in place, a pool or an in-place final state)."""
    out = [x if x is None or x.is_contiguous() or x.dim() == 0 or x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()
           for x in tensors]
    return out, state if state is None or state.is_contiguous() else state.contiguous()


# The options word of torch.ops.encore.kda_forward / kda_forward_out (one int: each argument costs the
# dispatcher ~0.1-0.2 us a call, docs/python.md "Host cost"): the bool options, the residual dtype and, for
# kda_forward, the residuals to return (bits 32-256, returned in the order G, Aqk, Akk, h).
KDA_FINAL_STATE, KDA_QK_L2NORM, KDA_GATE_IN_KERNEL, KDA_STATE_V_FIRST, KDA_RESIDUALS_BF16 = 1, 2, 4, 8, 16
KDA_RESIDUAL_BITS = {"G": 32, "Aqk": 64, "Akk": 128, "h": 256}
_WORD_END, _OUT_WORD_END = 512, 32  # kda_forward's words are < 512; kda_forward_out's (no residuals) < 32


def _op_flags(output_final_state, use_qk_l2norm, use_gate_in_kernel, state_v_first, residual_dtype=None, residuals=()):
    """The ops' options word; residual_dtype (None, 'float32' or 'bfloat16') and residuals (names among G, Aqk,
    Akk, h) where residuals are asked for."""
    if not (residual_dtype is None or (type(residual_dtype) is str and residual_dtype in ("float32", "bfloat16"))):
        raise ValueError(f"residual_dtype: expected 'float32' or 'bfloat16', got {residual_dtype!r}")
    word = ((KDA_FINAL_STATE if output_final_state else 0) | (KDA_QK_L2NORM if use_qk_l2norm else 0) |
            (KDA_GATE_IN_KERNEL if use_gate_in_kernel else 0) | (KDA_STATE_V_FIRST if state_v_first else 0) |
            (KDA_RESIDUALS_BF16 if residual_dtype == "bfloat16" else 0))
    for name in residuals:  # (names checked by the callers: kda._residual_names, _kda_autograd._residual_request)
        word |= KDA_RESIDUAL_BITS[name]
    return word


def _op_options(flags, end=_WORD_END):
    """(output_final_state, use_qk_l2norm, use_gate_in_kernel, state_v_first, residual_dtype, residual names in the
    order G, Aqk, Akk, h) of an options word; end: 32 for kda_forward_out's (no residuals)."""
    if type(flags) is not int or not 0 <= flags < end:
        raise ValueError(f"flags: expected an options word in [0, {end}) (kda._op_flags), got {flags!r}")
    return (bool(flags & KDA_FINAL_STATE), bool(flags & KDA_QK_L2NORM), bool(flags & KDA_GATE_IN_KERNEL), bool(flags & KDA_STATE_V_FIRST),
            "bfloat16" if flags & KDA_RESIDUALS_BF16 else "float32", tuple(n for n, bit in KDA_RESIDUAL_BITS.items() if flags & bit))


def _opt_float(x):
    """An optional float argument of the ops (scale, lower_bound) as the schema's float? takes it."""
    return None if x is None else float(x)


def _given(*args):
    """kda_forward's arguments without the trailing ones left at None (their default): each argument the
    dispatcher converts costs host time."""
    n = len(args)
    while args[n - 1] is None:
        n -= 1
    return args[:n]
