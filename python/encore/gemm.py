"""GEMM-epilogue programs (include/encore/gemm.hpp): ``D = epilogue(a @ w.T)`` with a [M, K] and weights w [N, K]
(the backward rows with weight_kn, e.g. swiglu_bwd and rmsnorm_bwd: ``epilogue(a @ w)`` with w [K, N]).

CPU backend for numpy / CPU torch arrays (fp64 reference), CUDA (CUTLASS Sm90) for CUDA torch
tensors: bf16/fp16, K a multiple of 8, N too except for lse and ce_bwd (their D rows are padded here). Outputs are allocated here in a's dtype (statistics
fp32). Inference only (no autograd).
"""
from __future__ import annotations

from . import _encore
from ._util import _dl, _empty, _no_autograd, _ops, _stream_for, _via_torch_op, _with_absent

# The catalogue's epilogues (encore/gemm_epilogues.def) and the CUDA tiles, by name.
Epilogue = _encore.Epilogue
GemmTile = _encore.GemmTile
_RESIDUAL, _ROW_SCALE, _SWIGLU, _ROPE = Epilogue.residual_sqsum_aux, Epilogue.row_scale, Epilogue.swiglu, Epilogue.rope
_HEAD_SQSUM, _LSE, _SCALAR = Epilogue.qkv_head_sqsum, Epilogue.lse, Epilogue.scalar_scale
_TILES = {t.name: t for t in GemmTile}


def _tile_name(tile):
    """A tile as its name (the torch ops take str): a GemmTile or one of its names."""
    name = getattr(tile, "name", tile)
    if name not in _TILES:
        raise ValueError(f"tile: one of {sorted(_TILES)}, got {tile!r}")
    return name


def _run(epilogue, a, w, *, d=None, aux=None, c=None, c2=None, zdz=None, gamma=None, row_scale=None, pos=None, freq=None, alpha=None,
         partials=None, target=None, target_logit=None, partial_tile_n=0, head_dim=128, ignore_index=-100, tile="auto",
         stream=None, lse=None):
    _no_autograd(a, w, c, c2, gamma)
    tile = _tile_name(tile)
    _encore.gemm_epilogue_out(epilogue, *_dl(a, w, d, aux, c, c2, zdz, gamma, row_scale, pos, freq, alpha, partials, target, target_logit,
                                             lse),
                              int(partial_tile_n), int(head_dim), int(ignore_index), _TILES[tile], _stream_for(a, stream))


def _mn(a, w, weight_kn=False, a_transposed=False):
    """(M, N): N is w's rows, or its columns for a weight_kn row (w [K, N], acc = a @ w); M is a's
    rows, or its columns for an a_transposed row (a stored [K, M], acc = a.T @ w: wgrad)."""
    if getattr(a, "ndim", 0) != 2 or getattr(w, "ndim", 0) != 2:
        raise ValueError(f"a, w: expected a {'[K, M]' if a_transposed else '[M, K]'} and w {'[K, N]' if weight_kn else '[N, K]'}")
    return a.shape[1 if a_transposed else 0], w.shape[1 if weight_kn else 0]


def _tiles(epilogue, a, w, partial_tile_n):
    m, n = _mn(a, w)
    t = partial_tile_n or _encore.gemm_partial_tile_n(epilogue, m, n, a.shape[1])
    return (n + t - 1) // t, t


# The rows whose D may have any N on CUDA where its rows are 16-byte aligned: their D is allocated with
# rows padded to a multiple of 8 elements and returned as the [M, N] view (contiguous when N % 8 == 0).
_PADDED_D = ("lse", "ce_bwd")


def _padded_rows(like, m, n, new=None):
    """An uninitialized [m, n] view of rows padded to a multiple of 8 elements, in like's dtype; `new`
    allocates (the torch fakes pass their own), else _empty on like's framework."""
    n8 = (n + 7) // 8 * 8
    buf = _empty(like, (m, n8), "like") if new is None else new(like, (m, n8))
    return buf[:, :n]


# Rows of column partials per M (kColumnPartialsTileM, include/encore/gemm.hpp: the CUDA tile M).
_COLUMN_PARTIALS_TILE_M = 128

# The catalogue read once (plain Python, so torch.compile traces the wrappers without calling the
# binding): row name -> (Epilogue, {operand flag name: bool}).
_ROWS = {e.name: (e, {f: bool(_encore.gemm_epilogue_operands(e) & bit) for f, bit in _encore.gemm_operand_flags.items()})
         for e in Epilogue}


def _as_epilogue(epilogue):
    """The catalogue row's name for `epilogue` (a name or an Epilogue)."""
    name = epilogue if isinstance(epilogue, str) else getattr(epilogue, "name", None)
    if name not in _ROWS:
        raise ValueError(f"epilogue: one of {list(_ROWS)}, got {epilogue!r}")
    return name


def _epilogue_keys(name, store_d, has_target):
    """The outputs the row writes, in the order d, aux, partials, target_logit."""
    uses = _ROWS[name][1]
    return ([k for k, on in (("d", uses["d"] or (uses["d_optional"] and store_d)),
                             ("aux", uses["aux"] or uses["aux_half"] or uses["aux_double"]),
                             ("partials", uses["tile_partials"] or uses["head_partials"] or uses["column_partials"]),
                             ("target_logit", uses["target"] and has_target)) if on])


def _epilogue_outputs(name, a, w, store_d, partial_tile_n, head_dim, has_target):
    """What row `name` writes: [(key, shape, kind)] in _epilogue_keys' order, and the partials' tile
    width (0 without per-tile or column partials). M and N may be symbolic (torch fakes): the width
    query reads K only, so they are passed as 1 there. Shapes: aux [M, N / 2] (aux_half), [M, 2N]
    (aux_double: packed pairs) or [M, N]; tile partials [M, ceil(N / tile)]; column partials
    [ceil(M / 128), round_up(N, tile)] (one row per 128-row M-tile)."""
    epilogue, uses = _ROWS[name]
    m, n = _mn(a, w, uses["weight_kn"], uses["a_transposed"])
    tile_n = 0
    if uses["tile_partials"] or uses["column_partials"]:
        tile_n = partial_tile_n or _encore.gemm_partial_tile_n(epilogue, m if isinstance(m, int) else 1,
                                                               n if isinstance(n, int) else 1, int(a.shape[1]))
    if uses["column_partials"]:
        rows = (m + _COLUMN_PARTIALS_TILE_M - 1) // _COLUMN_PARTIALS_TILE_M
        partials = (rows, (n + tile_n - 1) // tile_n * tile_n)
    elif tile_n:
        partials = (m, (n + tile_n - 1) // tile_n)
    else:
        partials = (m, n // head_dim if head_dim > 0 else 0)
    aux_n = n // 2 if uses["aux_half"] else 2 * n if uses["aux_double"] else n
    shapes = {"d": ((m, n), "padded" if name in _PADDED_D else "like"), "aux": ((m, aux_n), "like"), "partials": (partials, "f32"),
              "target_logit": ((m,), "f32")}
    return [(k, *shapes[k]) for k in _epilogue_keys(name, store_d, has_target)], tile_n


def gemm_epilogue(epilogue, a, w, *, c=None, gamma=None, row_scale=None, pos=None, freq=None, alpha=None, target=None,
                  store_d=True, partial_tile_n=0, head_dim=128, ignore_index=-100, tile="auto", stream=None, c2=None, zdz=None,
                  lse=None):
    """Any epilogue of the catalogue, by name or encore.Epilogue: ``D = epilogue(a @ w.T)`` (``a @ w``
    with w [K, N] for the weight_kn rows: swiglu_bwd, rmsnorm_bwd, dgrad; ``a.T @ w`` with a stored
    [K, M] for wgrad: the weight gradient dW = dz.T @ x, alpha optional).

    Pass the inputs the epilogue reads (see encore/gemm_epilogues.def: c, c2, zdz, gamma, row_scale,
    pos, freq, alpha, target); the outputs it writes are allocated here and returned in a dict with
    keys among "d", "aux", "partials", "target_logit" (store_d=False skips an optional D).
    E.g. ``gemm_epilogue("residual_add", a, w, c=c)["d"]`` = a @ w.T + c;
    ``gemm_epilogue("swiglu_bwd", dx, w_down, c=z)`` gives d = y, aux = dZ [M, 2F] and the zdz
    partials (finish with partials_sum(p, scale=1 / hidden));
    ``gemm_epilogue("ce_bwd", x, w_lm, lse=lse, target=t, alpha=a)["d"]`` = alpha * (softmax(x @ w_lm.T) - onehot(t))
    per row from the forward's lse (0 on ignore_index rows): the cross-entropy backward recomputing the logits.
    The D of lse and ce_bwd has its rows padded to a multiple of 8 elements (an [M, N] view), so any N runs on CUDA.
    """
    name = _as_epilogue(epilogue)
    if _via_torch_op(stream, a, w, c, gamma, row_scale, pos, freq, alpha, target, c2, zdz, lse):
        got = _ops().gemm_epilogue(name, a, w, c, gamma, row_scale, pos, freq, alpha, target, store_d, partial_tile_n, head_dim,
                                   ignore_index, _tile_name(tile), c2, zdz, lse)
        return dict(zip(_epilogue_keys(name, store_d, target is not None), got))
    outs, tile_n = _epilogue_outputs(name, a, w, store_d, partial_tile_n, head_dim, target is not None)
    out = {key: _padded_rows(a, *shape) if kind == "padded" else _empty(a, shape, kind) for key, shape, kind in outs}
    _run(_ROWS[name][0], a, w, d=out.get("d"), aux=out.get("aux"), c=c, c2=c2, zdz=zdz, gamma=gamma, row_scale=row_scale, pos=pos, freq=freq,
         alpha=alpha, partials=out.get("partials"), target=target, target_logit=out.get("target_logit"), partial_tile_n=tile_n,
         head_dim=head_dim, ignore_index=ignore_index, tile=tile, stream=stream, lse=lse)
    return out


def gemm_row_scale(a, w, r, tile="auto", stream=None):
    """D = r[:, None] * (a @ w.T); r [M] float32 (RMSNorm applied after the GEMM)."""
    if _via_torch_op(stream, a, w, r):
        return _ops().gemm_row_scale(a, w, r, _tile_name(tile))
    m, n = _mn(a, w)
    d = _empty(a, (m, n), "like")
    _run(_ROW_SCALE, a, w, d=d, row_scale=r, tile=tile, stream=stream)
    return d


def gemm_scalar_scale(a, w, alpha, tile="auto", stream=None):
    """D = alpha[0] * (a @ w.T); alpha [1] float32, read from (device) memory."""
    if _via_torch_op(stream, a, w, alpha):
        return _ops().gemm_scalar_scale(a, w, alpha, _tile_name(tile))
    m, n = _mn(a, w)
    d = _empty(a, (m, n), "like")
    _run(_SCALAR, a, w, d=d, alpha=alpha, tile=tile, stream=stream)
    return d


def gemm_residual_rms_partial(a, w, residual, gamma, partial_tile_n=0, stream=None):
    """y = a @ w.T + residual. Returns (y, aux = y * gamma, partials [M, tiles] float32 of sum(y**2)
    per partial_tile_n columns (0: gemm_partial_tile_n)); finish with rms_final_reduce."""
    if _via_torch_op(stream, a, w, residual, gamma):
        return _ops().gemm_residual_rms_partial(a, w, residual, gamma, int(partial_tile_n))
    m, n = _mn(a, w)
    tiles, t = _tiles(_RESIDUAL, a, w, partial_tile_n)
    d, aux, p = _empty(a, (m, n), "like"), _empty(a, (m, n), "like"), _empty(a, (m, tiles), "f32")
    _run(_RESIDUAL, a, w, d=d, aux=aux, c=residual, gamma=gamma, partials=p, partial_tile_n=t, stream=stream)
    return d, aux, p


def rms_final_reduce(partials, hidden: int, eps: float = 1e-6, stream=None):
    """r = rsqrt(partials.sum(1) / hidden + eps) as float32 [M] (tiles summed in order)."""
    if _via_torch_op(stream, partials):
        return _ops().rms_final_reduce(partials, int(hidden), float(eps))
    r = _empty(partials, (partials.shape[0],), "f32")
    _encore.rms_final_reduce_out(partials, r, int(hidden), float(eps), _stream_for(partials, stream))
    return r


def gemm_swiglu(a, w, r=None, tile="auto", stream=None):
    """z = r[:, None] * (a @ w.T) over interleaved gate/up columns (see interleave_gate_up).
    Returns (z [M, N], silu(z[:, 0::2]) * z[:, 1::2] [M, N // 2])."""
    if _via_torch_op(stream, a, w, r):
        return _ops().gemm_swiglu(a, w, r, _tile_name(tile))
    m, n = _mn(a, w)
    z, y = _empty(a, (m, n), "like"), _empty(a, (m, n // 2), "like")
    _run(_SWIGLU, a, w, d=z, aux=y, row_scale=r, tile=tile, stream=stream)
    return z, y


def gemm_rope(a, w, pos, freq, r=None, tile="auto", stream=None):
    """RoPE(r[:, None] * (a @ w.T)): column pairs (2j, 2j+1) rotated by 2*pi*pos[m]*f_j, f_j =
    freq[2j] + freq[2j+1] (see rope_freq_turns); pos [M] int32."""
    if _via_torch_op(stream, a, w, pos, freq, r):
        return _ops().gemm_rope(a, w, pos, freq, r, _tile_name(tile))
    m, n = _mn(a, w)
    d = _empty(a, (m, n), "like")
    _run(_ROPE, a, w, d=d, row_scale=r, pos=pos, freq=freq, tile=tile, stream=stream)
    return d


def gemm_qkv_head_sqsum(a, w, head_dim: int = 128, stream=None):
    """D = a @ w.T and partials [M, N // head_dim] float32 of sum(D**2) per head."""
    if _via_torch_op(stream, a, w):
        return _ops().gemm_qkv_head_sqsum(a, w, int(head_dim))
    m, n = _mn(a, w)
    d, p = _empty(a, (m, n), "like"), _empty(a, (m, n // head_dim), "f32")
    _run(_HEAD_SQSUM, a, w, d=d, partials=p, head_dim=head_dim, stream=stream)
    return d, p


def qk_norm_rope_(qkv, partials, q_weight, k_weight, pos, freq, num_q_heads: int, num_kv_heads: int, head_dim: int = 128,
                  eps: float = 1e-6, stream=None):
    """In place after gemm_qkv_head_sqsum: per-head RMSNorm of the Q and K heads from their sums of
    squares (partials), times q_weight / k_weight, then RoPE of their column pairs; returns qkv.
    CPU and CUDA backends."""
    if _via_torch_op(stream, qkv, partials, q_weight, k_weight, pos, freq):
        _ops().qk_norm_rope_(qkv, partials, q_weight, k_weight, pos, freq, int(num_q_heads), int(num_kv_heads), int(head_dim),
                             float(eps))
        return qkv
    _encore.qk_norm_rope_(qkv, partials, q_weight, k_weight, pos, freq, int(num_q_heads), int(num_kv_heads), int(head_dim),
                          float(eps), _stream_for(qkv, stream))
    return qkv


def qk_norm_rope_backward(dy, x, partials, q_weight, k_weight, pos, freq, num_q_heads: int, num_kv_heads: int,
                          head_dim: int = 128, eps: float = 1e-6, stream=None):
    """Backward of qk_norm_rope_ (training with QK-norm): x is the forward's input (the qkv_head_sqsum GEMM's
    output, kept before the in-place finish), partials its sums of squares, dy the gradient of the finished qkv.
    Returns (dx [M, N] in dy's dtype, dq_weight [head_dim] float32, dk_weight [head_dim] float32): per Q / K head
    the inverse rotation, then the per-head RMSNorm backward; V heads dx = dy. CPU and CUDA backends."""
    args = (int(num_q_heads), int(num_kv_heads), int(head_dim), float(eps))
    if _via_torch_op(stream, dy, x, partials, q_weight, k_weight, pos, freq):
        return tuple(_ops().qk_norm_rope_backward(dy, x, partials, q_weight, k_weight, pos, freq, *args))
    dx = _empty(dy, tuple(dy.shape), "like")
    dq, dk = _empty(dy, (int(head_dim),), "f32"), _empty(dy, (int(head_dim),), "f32")
    nbytes = _encore.qk_norm_rope_bwd_workspace_bytes(dy, *args[:3])
    ws = _empty(dy, (nbytes,), "u8") if nbytes else None
    _encore.qk_norm_rope_bwd_out(*_dl(dy, x, partials, q_weight, k_weight, pos, freq, dx, dq, dk), *args, _dl(ws)[0],
                                 _stream_for(dy, stream))
    return dx, dq, dk


def gemm_lse(a, w, r=None, target=None, store_logits=False, ignore_index=-100, partial_tile_n=0, stream=None):
    """z = r[:, None] * (a @ w.T). Returns (partials [M, tiles] float32 of log-sum-exp per tile,
    logits z or None, target_logit [M] float32 = z[m, target[m]] or None); finish with lse_finish."""
    if _via_torch_op(stream, a, w, r, target):
        outs = _ops().gemm_lse(a, w, r, target, bool(store_logits), int(ignore_index), int(partial_tile_n))
        return _with_absent(outs, (True, store_logits, target is not None))
    m, n = _mn(a, w)
    tiles, t = _tiles(_LSE, a, w, partial_tile_n)
    p = _empty(a, (m, tiles), "f32")
    d = _padded_rows(a, m, n) if store_logits else None  # rows padded to 8 elements: any vocabulary width on CUDA
    tl = _empty(a, (m,), "f32") if target is not None else None
    _run(_LSE, a, w, d=d, row_scale=r, partials=p, target=target, target_logit=tl, partial_tile_n=t, ignore_index=ignore_index,
         stream=stream)
    return p, d, tl


def lse_finish(partials, target=None, target_logit=None, ignore_index=-100, stream=None):
    """lse [M] = logsumexp over the tiles; with target: loss [M] = lse - target_logit (0 for
    ignore_index). Returns lse, or (lse, loss)."""
    if _via_torch_op(stream, partials, target, target_logit):
        lse, loss = _with_absent(_ops().lse_finish(partials, target, target_logit, int(ignore_index)), (True, target is not None))
        return lse if loss is None else (lse, loss)
    m = partials.shape[0]
    lse = _empty(partials, (m,), "f32")
    loss = _empty(partials, (m,), "f32") if target is not None else None
    _encore.lse_finish_out(partials, lse, target, target_logit, loss, int(ignore_index), _stream_for(partials, stream))
    return lse if loss is None else (lse, loss)


def cross_entropy_bwd(logits, lse, target, alpha=None, ignore_index=-100, out=None, stream=None):
    """The cross-entropy backward on stored logits [M, N] (e.g. gemm_lse's, store_logits=True):
    ``alpha[0] * (softmax(logits) - onehot(target))`` per row from the forward's lse [M] float32,
    0 on rows whose target == ignore_index; target [M] int32, alpha [1] float32 (device memory; None:
    1). Written into `out` (logits' shape and dtype; may be logits itself: cross_entropy_bwd_), else
    into a new array. A target outside [0, N) other than ignore_index: ValueError on the CPU, a NaN row
    on CUDA."""
    if out is None and _via_torch_op(stream, logits, lse, target, alpha):
        return _ops().cross_entropy_bwd(logits, lse, target, alpha, int(ignore_index))
    if out is None:
        out = _empty(logits, logits.shape, "like")
    _encore.cross_entropy_bwd_out(*_dl(logits, lse, target, alpha, out), int(ignore_index), _stream_for(logits, stream))
    return out


def cross_entropy_bwd_(logits, lse, target, alpha=None, ignore_index=-100, stream=None):
    """cross_entropy_bwd in place: the logits are overwritten by their gradient; returns logits."""
    if _via_torch_op(stream, logits, lse, target, alpha):
        _ops().cross_entropy_bwd_(logits, lse, target, alpha, int(ignore_index))
        return logits
    _encore.cross_entropy_bwd_out(*_dl(logits, lse, target, alpha, logits), int(ignore_index), _stream_for(logits, stream))
    return logits


def partials_sum(partials, per_column=False, scale: float = 1.0, n=None, stream=None):
    """Deterministic sums of a backward epilogue's float32 partials, tiles in order:
    per row ``scale * partials.sum(1)`` [rows] (zdz from swiglu_bwd's tile partials, scale = 1 / hidden),
    per column ``scale * partials[:, :n].sum(0)`` [n] (dγ from rmsnorm_bwd's column partials; n
    defaults to all columns, the partials' N is rounded up to the tile)."""
    cols = partials.shape[1]
    n = cols if n is None else int(n)
    if _via_torch_op(stream, partials):
        return _ops().partials_sum(partials, bool(per_column), float(scale), n)
    out = _empty(partials, (n if per_column else partials.shape[0],), "f32")
    _encore.partials_sum_out(partials, out, bool(per_column), float(scale), _stream_for(partials, stream))
    return out


def rope_freq_turns(num_heads: int, rotary_heads: int, head_dim: int, base: float = 10000.0):
    """RoPE frequencies for gemm_rope as a float32 numpy array [num_heads * head_dim] of (hi, lo)
    pairs; heads past rotary_heads (V) get 0 (no rotation)."""
    import numpy as np

    f = np.empty(num_heads * head_dim, dtype=np.float32)
    _encore.rope_freq_turns_out(int(num_heads), int(rotary_heads), int(head_dim), float(base), f)
    return f


def interleave_gate_up(gate, up):
    """[2F, K] weights with rows 2j = gate[j], 2j+1 = up[j] (CPU arrays), for gemm_swiglu."""
    out = _empty(gate, (2 * gate.shape[0], gate.shape[1]), "like")
    _encore.interleave_gate_up_out(gate, up, out)
    return out
