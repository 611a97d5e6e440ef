"""GEMM-epilogue programs (include/encore/gemm.hpp): ``D = epilogue(a @ w.T)`` with a [M, K] and weights w [N, K]
(the backward rows with weight_kn, e.g. swiglu_bwd and rmsnorm_bwd: ``epilogue(a @ w)`` with w [K, N]).

CPU backend for numpy / CPU torch arrays (fp64 reference), CUDA (CUTLASS Sm90) for CUDA torch
tensors: bf16/fp16, K a multiple of 8, N too except for lse and ce_bwd (their D rows are padded here). Outputs are allocated here in a's dtype (statistics
fp32). Inference only (no autograd).

Each public function calls its launcher (one gemm_epilogue_run over the bound GemmEpilogueArgs and a
cached GemmEpilogueOptions; the finishers' own run) directly for numpy arrays and eager torch
tensors, and torch.ops.encore.<op> (declared here on the same launcher) when traced (_core.eager).
Where encore._encore_torch holds the op's C++ kernel (python/torch/gemm_ops.cpp, the same outputs and
checks), an eager call on plain torch tensors goes through it instead (_core.native: cheaper than the
launcher's Python).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from . import _encore as _b
from ._core import as_float, as_int, dl, eager, empty, empty_like, matrix_shape, native, ops, present, stream_for, torch_op, with_absent

if TYPE_CHECKING:  # the ops' string annotations (torch.library.infer_schema reads them)
    from torch import Tensor

# The catalogue's epilogues (encore/gemm_epilogues.def) and the CUDA tiles, by name.
Epilogue = _b.Epilogue
GemmTile = _b.GemmTile
_RESIDUAL, _ROW_SCALE, _SWIGLU, _ROPE = Epilogue.residual_sqsum_aux, Epilogue.row_scale, Epilogue.swiglu, Epilogue.rope
_HEAD_SQSUM, _LSE, _SCALAR = Epilogue.qkv_head_sqsum, Epilogue.lse, Epilogue.scalar_scale
_TILES = {t.name: t for t in GemmTile}
_TILE_OF = {**_TILES, **{t: t for t in GemmTile}}  # a name or a GemmTile -> GemmTile
_PER_ROW, _PER_COLUMN = _b.PartialsSum.per_row, _b.PartialsSum.per_column


def _tile_name(tile):
    """A tile as its name (the torch ops take str): a GemmTile or one of its names."""
    name = getattr(tile, "name", tile)
    if name not in _TILES:
        raise ValueError(f"tile: one of {sorted(_TILES)}, got {tile!r}")
    return name


def _tile_arg(tile):
    """The tile argument of a C++ kernel: a str as it is (the kernel checks it), a GemmTile as its name."""
    return tile if type(tile) is str else _tile_name(tile)


def _native(name, a, *others):
    """The C++ kernel of op `name` for an eager call (see _core.native) on the arrays `others` that are
    given (None: an optional one left out)."""
    return native(a, name, *[o for o in others if o is not None])


# --- cached options: built once per distinct value, then a dict lookup per call -----------------------

_OPTIONS = {}  # (row name, partial_tile_n, head_dim, ignore_index, tile as given) -> GemmEpilogueOptions
_QK_OPTIONS = {}  # (num_q_heads, num_kv_heads, head_dim, eps) -> QkNormRopeOptions
_TILE_N = {}  # (row name, K) -> gemm_partial_tile_n (the query reads K only)


def _options(name, partial_tile_n=0, head_dim=128, ignore_index=-100, tile="auto"):
    """The options of row `name` (a str key: hashing an Epilogue runs Python code)."""
    key = (name, partial_tile_n, head_dim, ignore_index, tile)
    o = _OPTIONS.get(key)
    if o is None:
        t = _TILE_OF.get(tile) if isinstance(tile, (str, GemmTile)) else None
        if t is None:
            _tile_name(tile)  # raises
        o = _OPTIONS[key] = _b.GemmEpilogueOptions(_ROWS[name][0], int(partial_tile_n), int(head_dim), int(ignore_index), t)
    return o


def _qk_options(num_q_heads, num_kv_heads, head_dim, eps):
    key = (num_q_heads, num_kv_heads, head_dim, eps)
    o = _QK_OPTIONS.get(key)
    if o is None:
        o = _QK_OPTIONS[key] = _b.QkNormRopeOptions(int(num_q_heads), int(num_kv_heads), int(head_dim), float(eps))
    return o


def _tile_n(name, k):
    """gemm_partial_tile_n of row `name` for K = k (M and N are not read: passed as 1, so symbolic sizes
    stay symbolic)."""
    key = (name, k)
    t = _TILE_N.get(key)
    if t is None:
        t = _TILE_N[key] = _b.gemm_partial_tile_n(_ROWS[name][0], 1, 1, int(k))
    return t


def _fields(a, w, d, aux, c, c2, zdz, gamma, row_scale, pos, freq, alpha, partials, target, target_logit, lse):
    """GemmEpilogueArgs from every field, in the C++ field order (absent ones None: not converted)."""
    return _b.GemmEpilogueArgs(*[None if t is None else dl(t) for t in (a, w, d, aux, c, c2, zdz, gamma, row_scale, pos, freq, alpha,
                                                                        partials, target, target_logit, lse)])


def _run(epilogue, a, w, *, d=None, aux=None, c=None, c2=None, zdz=None, gamma=None, row_scale=None, pos=None, freq=None, alpha=None,
         partials=None, target=None, target_logit=None, partial_tile_n=0, head_dim=128, ignore_index=-100, tile="auto",
         stream=None, lse=None):
    """One launch of `epilogue` (an Epilogue) over the given arrays (outputs preallocated)."""
    _b.gemm_epilogue_run(_fields(a, w, d, aux, c, c2, zdz, gamma, row_scale, pos, freq, alpha, partials, target, target_logit, lse),
                         _options(getattr(epilogue, "name", epilogue), partial_tile_n, head_dim, ignore_index, tile), None,
                         stream_for(a, stream))


def _mn(a, w, weight_kn=False, a_transposed=False):
    """(M, N): N is w's rows, or its columns for a weight_kn row (w [K, N], acc = a @ w); M is a's
    rows, or its columns for an a_transposed row (a stored [K, M], acc = a.T @ w: wgrad)."""
    if getattr(a, "ndim", 0) != 2 or getattr(w, "ndim", 0) != 2:
        raise ValueError(f"a, w: expected a {'[K, M]' if a_transposed else '[M, K]'} and w {'[K, N]' if weight_kn else '[N, K]'}")
    return a.shape[1 if a_transposed else 0], w.shape[1 if weight_kn else 0]


def _check_tile_n(partial_tile_n):
    if partial_tile_n < 0:
        raise ValueError(f"partial_tile_n: must be positive or 0 (auto), got {partial_tile_n}")
    return partial_tile_n


def _tile_partials(name, a, m, n, partial_tile_n):
    """Per-tile partials [M, ceil(N / tile)] float32 of row `name` and the tile width."""
    t = _check_tile_n(partial_tile_n) or _tile_n(name, int(a.shape[1]))
    return empty(a, (m, (n + t - 1) // t), "f32"), t


# The rows whose D may have any N on CUDA where its rows are 16-byte aligned: their D is allocated with
# rows padded to a multiple of 8 elements and returned as the [M, N] view (contiguous when N % 8 == 0).
_PADDED_D = ("lse", "ce_bwd")


def _padded_rows(like, m, n):
    """An uninitialized [m, n] view of rows padded to a multiple of 8 elements, in like's dtype (on
    like's framework: the torch fakes allocate through it too)."""
    return empty(like, (m, (n + 7) // 8 * 8))[:, :n]


# Rows of column partials per M (kColumnPartialsTileM, include/encore/gemm.hpp: the CUDA tile M).
_COLUMN_PARTIALS_TILE_M = 128

# The catalogue read once (plain Python, so torch.compile traces the wrappers without calling the
# binding): row name -> (Epilogue, {operand flag name: bool}).
_ROWS = {e.name: (e, {f: bool(_b.gemm_epilogue_operands(e) & bit) for f, bit in _b.gemm_operand_flags.items()})
         for e in Epilogue}


def _as_epilogue(epilogue):
    """The catalogue row's name for `epilogue` (a name or an Epilogue)."""
    name = epilogue if isinstance(epilogue, str) else getattr(epilogue, "name", None)
    if name not in _ROWS:
        raise ValueError(f"epilogue: one of {list(_ROWS)}, got {epilogue!r}")
    return name


_LAYOUTS = {}  # (name, store_d, has_target) -> _layout's tuple


def _layout(name, store_d, has_target):
    """What row `name` writes, from the catalogue once per (name, store_d, has_target): (Epilogue,
    keys in the order d, aux, partials, target_logit, weight_kn, a_transposed, partials kind "tile" /
    "column" / "head" / None, aux width kind "half" / "double" / None)."""
    key = (name, store_d, has_target)
    got = _LAYOUTS.get(key)
    if got is None:
        epilogue, uses = _ROWS[name]
        keys = tuple(k for k, on in (("d", uses["d"] or (uses["d_optional"] and store_d)),
                                     ("aux", uses["aux"] or uses["aux_half"] or uses["aux_double"]),
                                     ("partials", uses["tile_partials"] or uses["head_partials"] or uses["column_partials"]),
                                     ("target_logit", uses["target"] and has_target)) if on)
        parts = "column" if uses["column_partials"] else "tile" if uses["tile_partials"] else "head" if uses["head_partials"] else None
        aux = "half" if uses["aux_half"] else "double" if uses["aux_double"] else None
        got = _LAYOUTS[key] = (epilogue, keys, uses["weight_kn"], uses["a_transposed"], parts, aux)
    return got


def _epilogue_keys(name, store_d, has_target):
    """The outputs the row writes, in the order d, aux, partials, target_logit."""
    return list(_layout(name, store_d, has_target)[1])


def _epilogue_outputs(name, a, w, store_d, partial_tile_n, head_dim, has_target):
    """What row `name` writes: [(key, shape, kind)] in _epilogue_keys' order, and the partials' tile
    width (0 without per-tile or column partials). M and N may be symbolic (torch fakes): the width
    query reads K only. Shapes: aux [M, N / 2] (aux_half), [M, 2N] (aux_double: packed pairs) or
    [M, N]; tile partials [M, ceil(N / tile)]; column partials [ceil(M / 128), round_up(N, tile)]
    (one row per 128-row M-tile)."""
    _, keys, weight_kn, a_transposed, parts, aux = _layout(name, store_d, has_target)
    m, n = _mn(a, w, weight_kn, a_transposed)
    tile_n = (_check_tile_n(partial_tile_n) or _tile_n(name, int(a.shape[1]))) if parts in ("tile", "column") else 0
    out = []
    for k in keys:
        if k == "d":
            out.append(("d", (m, n), "padded" if name in _PADDED_D else "like"))
        elif k == "aux":
            out.append(("aux", (m, n // 2 if aux == "half" else 2 * n if aux == "double" else n), "like"))
        elif k == "partials":
            if parts == "column":
                shape = ((m + _COLUMN_PARTIALS_TILE_M - 1) // _COLUMN_PARTIALS_TILE_M, (n + tile_n - 1) // tile_n * tile_n)
            elif parts == "tile":
                shape = (m, (n + tile_n - 1) // tile_n)
            else:
                shape = (m, n // head_dim if head_dim > 0 else 0)
            out.append(("partials", shape, "f32"))
        else:
            out.append(("target_logit", (m,), "f32"))
    return out, tile_n


def _allocate(name, a, w, store_d, partial_tile_n, head_dim, has_target):
    """The row's outputs {key: array} on a's framework (the launcher's and the fake's) and the tile width."""
    outs, tile_n = _epilogue_outputs(name, a, w, store_d, partial_tile_n, head_dim, has_target)
    return {k: _padded_rows(a, *shape) if kind == "padded" else empty(a, shape, kind) for k, shape, kind in outs}, tile_n


# --- launchers: one binding call each (the finishers' own run); stream None is torch's current stream --

def _gemm_epilogue_launch(name, a, w, c, gamma, row_scale, pos, freq, alpha, target, store_d, partial_tile_n, head_dim, ignore_index,
                          tile, c2, zdz, lse, stream):
    out, tile_n = _allocate(name, a, w, store_d, partial_tile_n, head_dim, target is not None)
    get = out.get
    args = _fields(a, w, get("d"), get("aux"), c, c2, zdz, gamma, row_scale, pos, freq, alpha, get("partials"), target, get("target_logit"),
                   lse)
    _b.gemm_epilogue_run(args, _options(name, tile_n, head_dim, ignore_index, tile), None, stream_for(a, stream))
    return out


def _d(a, w):
    m, n = _mn(a, w)
    return empty(a, (m, n))


def _gemm_row_scale_launch(a, w, r, tile, stream):
    d = _d(a, w)
    _b.gemm_epilogue_run(_b.GemmEpilogueArgs(a=dl(a), w=dl(w), d=dl(d), row_scale=dl(r)), _options("row_scale", tile=tile), None,
                         stream_for(a, stream))
    return d


def _gemm_scalar_scale_launch(a, w, alpha, tile, stream):
    d = _d(a, w)
    _b.gemm_epilogue_run(_b.GemmEpilogueArgs(a=dl(a), w=dl(w), d=dl(d), alpha=dl(alpha)), _options("scalar_scale", tile=tile), None,
                         stream_for(a, stream))
    return d


def _residual_outputs(a, w, partial_tile_n):
    d, aux = _d(a, w), _d(a, w)
    p, t = _tile_partials("residual_sqsum_aux", a, d.shape[0], d.shape[1], partial_tile_n)
    return d, aux, p, t


def _gemm_residual_rms_partial_launch(a, w, residual, gamma, partial_tile_n, stream):
    d, aux, p, t = _residual_outputs(a, w, partial_tile_n)
    _b.gemm_epilogue_run(_b.GemmEpilogueArgs(a=dl(a), w=dl(w), d=dl(d), aux=dl(aux), c=dl(residual), gamma=dl(gamma), partials=dl(p)),
                         _options("residual_sqsum_aux", t), None, stream_for(a, stream))
    return d, aux, p


def _rms_final_reduce_launch(partials, hidden, eps, stream):
    r = empty(partials, (matrix_shape(partials, "partials", 2, "[M, tiles]")[0],), "f32")
    _b.rms_final_reduce_run(_b.RmsFinalReduceArgs(dl(partials), dl(r)), int(hidden), float(eps), stream_for(partials, stream))
    return r


def _swiglu_outputs(a, w):
    m, n = _mn(a, w)
    return empty(a, (m, n)), empty(a, (m, n // 2))


def _gemm_swiglu_launch(a, w, r, tile, stream):
    z, y = _swiglu_outputs(a, w)
    _b.gemm_epilogue_run(_b.GemmEpilogueArgs(a=dl(a), w=dl(w), d=dl(z), aux=dl(y), row_scale=dl(r)), _options("swiglu", tile=tile),
                         None, stream_for(a, stream))
    return z, y


def _gemm_rope_launch(a, w, pos, freq, r, tile, stream):
    d = _d(a, w)
    _b.gemm_epilogue_run(_b.GemmEpilogueArgs(a=dl(a), w=dl(w), d=dl(d), row_scale=dl(r), pos=dl(pos), freq=dl(freq)),
                         _options("rope", tile=tile), None, stream_for(a, stream))
    return d


def _head_sqsum_outputs(a, w, head_dim):
    m, n = _mn(a, w)
    if head_dim <= 0:
        raise ValueError(f"head_dim: {head_dim} must be positive and divide N = {n}")
    return empty(a, (m, n)), empty(a, (m, n // head_dim), "f32")


def _gemm_qkv_head_sqsum_launch(a, w, head_dim, stream):
    d, p = _head_sqsum_outputs(a, w, head_dim)
    _b.gemm_epilogue_run(_b.GemmEpilogueArgs(a=dl(a), w=dl(w), d=dl(d), partials=dl(p)), _options("qkv_head_sqsum", head_dim=head_dim),
                         None, stream_for(a, stream))
    return d, p


def _qk_norm_rope_launch(qkv, partials, q_weight, k_weight, pos, freq, num_q_heads, num_kv_heads, head_dim, eps, stream):
    _b.qk_norm_rope_run(_b.QkNormRopeArgs(dl(qkv), dl(partials), dl(q_weight), dl(k_weight), dl(pos), dl(freq)),
                        _qk_options(num_q_heads, num_kv_heads, head_dim, eps), stream_for(qkv, stream))


def _qk_bwd_outputs(dy, head_dim):
    """dx [M, N] in dy's dtype, dq_weight, dk_weight [head_dim] float32 (a head_dim < 1 is refused by the op)."""
    shape, hd = matrix_shape(dy, "dy", 2, "[M, N]"), max(head_dim, 0)
    return empty(dy, shape), empty(dy, (hd,), "f32"), empty(dy, (hd,), "f32")


def _qk_norm_rope_backward_launch(dy, x, partials, q_weight, k_weight, pos, freq, num_q_heads, num_kv_heads, head_dim, eps, stream):
    dx, dq, dk = _qk_bwd_outputs(dy, int(head_dim))
    args = _b.QkNormRopeBwdArgs(dl(dy), dl(x), dl(partials), dl(q_weight), dl(k_weight), dl(pos), dl(freq), dl(dx), dl(dq), dl(dk))
    opts = _qk_options(num_q_heads, num_kv_heads, head_dim, eps)
    nbytes = _b.qk_norm_rope_backward_workspace(args, opts)
    _b.qk_norm_rope_backward_run(args, opts, dl(empty(dy, (nbytes,), "u8")) if nbytes else None, stream_for(dy, stream))
    return dx, dq, dk


def _lse_outputs(a, w, store_logits, has_target, partial_tile_n):
    m, n = _mn(a, w)
    p, t = _tile_partials("lse", a, m, n, partial_tile_n)
    d = _padded_rows(a, m, n) if store_logits else None  # rows padded to 8 elements: any vocabulary width on CUDA
    return p, d, empty(a, (m,), "f32") if has_target else None, t


def _gemm_lse_launch(a, w, r, target, store_logits, ignore_index, partial_tile_n, stream):
    p, d, tl, t = _lse_outputs(a, w, store_logits, target is not None, partial_tile_n)
    _b.gemm_epilogue_run(_b.GemmEpilogueArgs(a=dl(a), w=dl(w), d=dl(d), row_scale=dl(r), partials=dl(p), target=dl(target),
                                             target_logit=dl(tl)), _options("lse", t, ignore_index=ignore_index), None,
                         stream_for(a, stream))
    return p, d, tl


def _lse_finish_outputs(partials, has_target):
    m = matrix_shape(partials, "partials", 2, "[M, tiles]")[0]
    return empty(partials, (m,), "f32"), empty(partials, (m,), "f32") if has_target else None


def _lse_finish_launch(partials, target, target_logit, ignore_index, stream):
    lse, loss = _lse_finish_outputs(partials, target is not None)
    _b.lse_finish_run(_b.LseFinishArgs(dl(partials), dl(lse), dl(target), dl(target_logit), dl(loss)), int(ignore_index),
                      stream_for(partials, stream))
    return lse, loss


def _cross_entropy_bwd_launch(logits, lse, target, alpha, ignore_index, out, stream):
    try:
        _b.cross_entropy_bwd_run(_b.CrossEntropyBwdArgs(dl(logits), dl(lse), dl(target), dl(alpha), dl(out)), int(ignore_index),
                                 stream_for(logits, stream))
    except (ValueError, TypeError) as e:  # the C++ API's dlogits is the caller's out: name it so
        msg = str(e)
        if out is logits or not msg.startswith("dlogits:"):
            raise
        raise type(e)("out (dlogits)" + msg[len("dlogits"):]) from None
    return out


def _partials_sum_launch(partials, per_column, scale, n, stream):
    rows, cols = matrix_shape(partials, "partials", 2, "[rows, cols]")
    if per_column and not 1 <= n <= cols:
        raise ValueError(f"n: must be in [1, {cols}] (the partials' columns), got {n}")
    out = empty(partials, (n if per_column else rows,), "f32")
    _b.partials_sum_run(_b.PartialsSumArgs(dl(partials), dl(out)), _PER_COLUMN if per_column else _PER_ROW, float(scale),
                        stream_for(partials, stream))
    return out



# --- torch.ops.encore: the launchers on torch's current stream; fakes allocate as the launchers do ------

@torch_op("gemm_row_scale", fake=lambda a, w, *_: _d(a, w))
def _gemm_row_scale(a: Tensor, w: Tensor, r: Tensor, tile: str = "auto") -> Tensor:
    return _gemm_row_scale_launch(a, w, r, tile, None)


@torch_op("gemm_scalar_scale", fake=lambda a, w, *_: _d(a, w))
def _gemm_scalar_scale(a: Tensor, w: Tensor, alpha: Tensor, tile: str = "auto") -> Tensor:
    return _gemm_scalar_scale_launch(a, w, alpha, tile, None)


@torch_op("gemm_residual_rms_partial", fake=lambda a, w, residual, gamma, t: _residual_outputs(a, w, t)[:3])
def _gemm_residual_rms_partial(a: Tensor, w: Tensor, residual: Tensor, gamma: Tensor, partial_tile_n: int) -> tuple[Tensor, Tensor, Tensor]:
    return _gemm_residual_rms_partial_launch(a, w, residual, gamma, partial_tile_n, None)


@torch_op("rms_final_reduce", fake=lambda p, *_: empty(p, (p.shape[0],), "f32"))
def _rms_final_reduce(partials: Tensor, hidden: int, eps: float) -> Tensor:
    return _rms_final_reduce_launch(partials, hidden, eps, None)


@torch_op("gemm_swiglu", fake=lambda a, w, *_: _swiglu_outputs(a, w))
def _gemm_swiglu(a: Tensor, w: Tensor, r: Tensor | None, tile: str = "auto") -> tuple[Tensor, Tensor]:
    return _gemm_swiglu_launch(a, w, r, tile, None)


@torch_op("gemm_rope", fake=lambda a, w, *_: _d(a, w))
def _gemm_rope(a: Tensor, w: Tensor, pos: Tensor, freq: Tensor, r: Tensor | None, tile: str = "auto") -> Tensor:
    return _gemm_rope_launch(a, w, pos, freq, r, tile, None)


@torch_op("gemm_qkv_head_sqsum", fake=_head_sqsum_outputs)
def _gemm_qkv_head_sqsum(a: Tensor, w: Tensor, head_dim: int) -> tuple[Tensor, Tensor]:
    return _gemm_qkv_head_sqsum_launch(a, w, head_dim, None)


@torch_op("qk_norm_rope_", fake=lambda *_: None, mutates=("qkv",))
def _qk_norm_rope(qkv: Tensor, partials: Tensor, q_weight: Tensor, k_weight: Tensor, pos: Tensor, freq: Tensor, num_q_heads: int,
                  num_kv_heads: int, head_dim: int, eps: float) -> None:
    _qk_norm_rope_launch(qkv, partials, q_weight, k_weight, pos, freq, num_q_heads, num_kv_heads, head_dim, eps, None)


@torch_op("qk_norm_rope_backward", fake=lambda dy, *a: _qk_bwd_outputs(dy, a[-2]))
def _qk_norm_rope_backward(dy: Tensor, x: Tensor, partials: Tensor, q_weight: Tensor, k_weight: Tensor, pos: Tensor, freq: Tensor,
                           num_q_heads: int, num_kv_heads: int, head_dim: int, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    return _qk_norm_rope_backward_launch(dy, x, partials, q_weight, k_weight, pos, freq, num_q_heads, num_kv_heads, head_dim, eps, None)


@torch_op("gemm_lse", fake=lambda a, w, r, target, store, ii, t: present(_lse_outputs(a, w, store, target is not None, t)[:3]))
def _gemm_lse(a: Tensor, w: Tensor, r: Tensor | None, target: Tensor | None, store_logits: bool, ignore_index: int,
              partial_tile_n: int) -> list[Tensor]:
    """[partials, logits if store_logits, target_logit if target]."""
    return present(_gemm_lse_launch(a, w, r, target, store_logits, ignore_index, partial_tile_n, None))


def _gemm_epilogue_fake(e, a, w, c, gamma, row_scale, pos, freq, alpha, target, store_d, partial_tile_n, head_dim, *_):
    return list(_allocate(_as_epilogue(e), a, w, store_d, partial_tile_n, head_dim, target is not None)[0].values())


@torch_op("gemm_epilogue", fake=_gemm_epilogue_fake)
def _gemm_epilogue(epilogue: str, a: Tensor, w: Tensor, c: Tensor | None, gamma: Tensor | None, row_scale: Tensor | None,
                   pos: Tensor | None, freq: Tensor | None, alpha: Tensor | None, target: Tensor | None, store_d: bool, partial_tile_n: int,
                   head_dim: int, ignore_index: int, tile: str, c2: Tensor | None = None, zdz: Tensor | None = None,
                   lse: Tensor | None = None) -> list[Tensor]:
    """Any catalogue row by name: [d, aux, partials, target_logit], the ones the row writes."""
    return list(_gemm_epilogue_launch(_as_epilogue(epilogue), a, w, c, gamma, row_scale, pos, freq, alpha, target, store_d,
                                      partial_tile_n, head_dim, ignore_index, tile, c2, zdz, lse, None).values())


@torch_op("partials_sum", fake=lambda p, per_column, scale, n: empty(p, (n if per_column else p.shape[0],), "f32"))
def _partials_sum(partials: Tensor, per_column: bool, scale: float, n: int) -> Tensor:
    """zdz [rows] (per row) or dγ [n] (per column) of the backward epilogues' partials."""
    return _partials_sum_launch(partials, per_column, scale, n, None)


@torch_op("cross_entropy_bwd", fake=lambda logits, *_: empty_like(logits))
def _cross_entropy_bwd(logits: Tensor, lse: Tensor, target: Tensor, alpha: Tensor | None, ignore_index: int) -> Tensor:
    return _cross_entropy_bwd_launch(logits, lse, target, alpha, ignore_index, empty_like(logits), None)


@torch_op("cross_entropy_bwd_", fake=lambda *_: None, mutates=("logits",))
def _cross_entropy_bwd_inplace(logits: Tensor, lse: Tensor, target: Tensor, alpha: Tensor | None, ignore_index: int) -> None:
    """The logits overwritten by their gradient (the stored-logits path of encore.nn.FusedLinearCrossEntropyLoss)."""
    _cross_entropy_bwd_launch(logits, lse, target, alpha, ignore_index, logits, None)


@torch_op("lse_finish", fake=lambda p, target, *_: present(_lse_finish_outputs(p, target is not None)))
def _lse_finish(partials: Tensor, target: Tensor | None, target_logit: Tensor | None, ignore_index: int) -> list[Tensor]:
    """[lse, loss if target]."""
    return present(_lse_finish_launch(partials, target, target_logit, ignore_index, None))


# --- public API ---------------------------------------------------------------------------------------

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
    partial_tile_n, head_dim = as_int(partial_tile_n, "partial_tile_n"), as_int(head_dim, "head_dim")
    ignore_index = as_int(ignore_index, "ignore_index")
    if stream is None:
        traced = not eager(a, w, c, gamma, row_scale, pos, freq, alpha, target, c2, zdz, lse)
        op = ops().gemm_epilogue if traced else _native("gemm_epilogue", a, w, c, gamma, row_scale, pos, freq, alpha, target, c2, zdz, lse)
        if op is not None:
            got = op(name, a, w, c, gamma, row_scale, pos, freq, alpha, target, bool(store_d), partial_tile_n, head_dim, ignore_index,
                     _tile_name(tile) if traced else _tile_arg(tile), c2, zdz, lse)
            return dict(zip(_epilogue_keys(name, store_d, target is not None), got))
    return _gemm_epilogue_launch(name, a, w, c, gamma, row_scale, pos, freq, alpha, target, store_d, partial_tile_n, head_dim,
                                 ignore_index, tile, c2, zdz, lse, stream)


def gemm_row_scale(a, w, r, tile="auto", stream=None):
    """D = r[:, None] * (a @ w.T); r [M] float32 (RMSNorm applied after the GEMM)."""
    if stream is None:
        if not eager(a, w, r):
            return ops().gemm_row_scale(a, w, r, _tile_name(tile))
        op = native(a, "gemm_row_scale", w, r)
        if op is not None:
            return op(a, w, r, _tile_arg(tile))
    return _gemm_row_scale_launch(a, w, r, tile, stream)


def gemm_scalar_scale(a, w, alpha, tile="auto", stream=None):
    """D = alpha[0] * (a @ w.T); alpha [1] float32, read from (device) memory."""
    if stream is None:
        if not eager(a, w, alpha):
            return ops().gemm_scalar_scale(a, w, alpha, _tile_name(tile))
        op = native(a, "gemm_scalar_scale", w, alpha)
        if op is not None:
            return op(a, w, alpha, _tile_arg(tile))
    return _gemm_scalar_scale_launch(a, w, alpha, tile, stream)


def gemm_residual_rms_partial(a, w, residual, gamma, partial_tile_n=0, stream=None):
    """y = a @ w.T + residual. Returns (y, aux = y * gamma, partials [M, tiles] float32 of sum(y**2)
    per partial_tile_n columns (0: gemm_partial_tile_n)); finish with rms_final_reduce."""
    partial_tile_n = as_int(partial_tile_n, "partial_tile_n")
    if stream is None:
        op = (ops().gemm_residual_rms_partial if not eager(a, w, residual, gamma)
              else native(a, "gemm_residual_rms_partial", w, residual, gamma))
        if op is not None:
            return op(a, w, residual, gamma, partial_tile_n)
    return _gemm_residual_rms_partial_launch(a, w, residual, gamma, partial_tile_n, stream)


def rms_final_reduce(partials, hidden: int, eps: float = 1e-6, stream=None):
    """r = rsqrt(partials.sum(1) / hidden + eps) as float32 [M] (tiles summed in order)."""
    hidden, eps = as_int(hidden, "hidden"), as_float(eps, "eps")
    if stream is None:
        op = ops().rms_final_reduce if not eager(partials) else native(partials, "rms_final_reduce")
        if op is not None:
            return op(partials, hidden, eps)
    return _rms_final_reduce_launch(partials, hidden, eps, stream)


def gemm_swiglu(a, w, r=None, tile="auto", stream=None):
    """z = r[:, None] * (a @ w.T) over interleaved gate/up columns (see interleave_gate_up).
    Returns (z [M, N], silu(z[:, 0::2]) * z[:, 1::2] [M, N // 2])."""
    if stream is None:
        if not eager(a, w, r):
            return ops().gemm_swiglu(a, w, r, _tile_name(tile))
        op = _native("gemm_swiglu", a, w, r)
        if op is not None:
            return op(a, w, r, _tile_arg(tile))
    return _gemm_swiglu_launch(a, w, r, tile, stream)


def gemm_rope(a, w, pos, freq, r=None, tile="auto", stream=None):
    """RoPE(r[:, None] * (a @ w.T)): column pairs (2j, 2j+1) rotated by 2*pi*pos[m]*f_j, f_j =
    freq[2j] + freq[2j+1] (see rope_freq_turns); pos [M] int32."""
    if stream is None:
        if not eager(a, w, pos, freq, r):
            return ops().gemm_rope(a, w, pos, freq, r, _tile_name(tile))
        op = _native("gemm_rope", a, w, pos, freq, r)
        if op is not None:
            return op(a, w, pos, freq, r, _tile_arg(tile))
    return _gemm_rope_launch(a, w, pos, freq, r, tile, stream)


def gemm_qkv_head_sqsum(a, w, head_dim: int = 128, stream=None):
    """D = a @ w.T and partials [M, N // head_dim] float32 of sum(D**2) per head."""
    head_dim = as_int(head_dim, "head_dim")
    if stream is None:
        op = ops().gemm_qkv_head_sqsum if not eager(a, w) else native(a, "gemm_qkv_head_sqsum", w)
        if op is not None:
            return op(a, w, head_dim)
    return _gemm_qkv_head_sqsum_launch(a, w, head_dim, stream)


def qk_norm_rope_(qkv, partials, q_weight, k_weight, pos, freq, num_q_heads: int, num_kv_heads: int, head_dim: int = 128,
                  eps: float = 1e-6, stream=None):
    """In place after gemm_qkv_head_sqsum: per-head RMSNorm of the Q and K heads from their sums of
    squares (partials), times q_weight / k_weight, then RoPE of their column pairs; returns qkv.
    CPU and CUDA backends."""
    args = (as_int(num_q_heads, "num_q_heads"), as_int(num_kv_heads, "num_kv_heads"), as_int(head_dim, "head_dim"), as_float(eps, "eps"))
    if stream is None:
        op = (ops().qk_norm_rope_ if not eager(qkv, partials, q_weight, k_weight, pos, freq)
              else native(qkv, "qk_norm_rope_", partials, q_weight, k_weight, pos, freq))
        if op is not None:
            op(qkv, partials, q_weight, k_weight, pos, freq, *args)
            return qkv
    _qk_norm_rope_launch(qkv, partials, q_weight, k_weight, pos, freq, *args, stream)
    return qkv


def qk_norm_rope_backward(dy, x, partials, q_weight, k_weight, pos, freq, num_q_heads: int, num_kv_heads: int,
                          head_dim: int = 128, eps: float = 1e-6, stream=None):
    """Backward of qk_norm_rope_ (training with QK-norm): x is the forward's input (the qkv_head_sqsum GEMM's
    output, kept before the in-place finish), partials its sums of squares, dy the gradient of the finished qkv.
    Returns (dx [M, N] in dy's dtype, dq_weight [head_dim] float32, dk_weight [head_dim] float32): per Q / K head
    the inverse rotation, then the per-head RMSNorm backward; V heads dx = dy. CPU and CUDA backends."""
    args = (as_int(num_q_heads, "num_q_heads"), as_int(num_kv_heads, "num_kv_heads"), as_int(head_dim, "head_dim"), as_float(eps, "eps"))
    if stream is None:
        op = (ops().qk_norm_rope_backward if not eager(dy, x, partials, q_weight, k_weight, pos, freq)
              else native(dy, "qk_norm_rope_backward", x, partials, q_weight, k_weight, pos, freq))
        if op is not None:
            return tuple(op(dy, x, partials, q_weight, k_weight, pos, freq, *args))
    return _qk_norm_rope_backward_launch(dy, x, partials, q_weight, k_weight, pos, freq, *args, stream)


def gemm_lse(a, w, r=None, target=None, store_logits=False, ignore_index=-100, partial_tile_n=0, stream=None):
    """z = r[:, None] * (a @ w.T). Returns (partials [M, tiles] float32 of log-sum-exp per tile,
    logits z or None, target_logit [M] float32 = z[m, target[m]] or None); finish with lse_finish."""
    ignore_index, partial_tile_n = as_int(ignore_index, "ignore_index"), as_int(partial_tile_n, "partial_tile_n")
    if stream is None:
        op = ops().gemm_lse if not eager(a, w, r, target) else _native("gemm_lse", a, w, r, target)
        if op is not None:
            outs = op(a, w, r, target, bool(store_logits), ignore_index, partial_tile_n)
            return with_absent(outs, (True, store_logits, target is not None))
    return _gemm_lse_launch(a, w, r, target, store_logits, ignore_index, partial_tile_n, stream)


def lse_finish(partials, target=None, target_logit=None, ignore_index=-100, stream=None):
    """lse [M] = logsumexp over the tiles; with target: loss [M] = lse - target_logit (0 for
    ignore_index). Returns lse, or (lse, loss)."""
    ignore_index = as_int(ignore_index, "ignore_index")
    op = None
    if stream is None:
        op = ops().lse_finish if not eager(partials, target, target_logit) else _native("lse_finish", partials, target, target_logit)
    if op is not None:
        lse, loss = with_absent(op(partials, target, target_logit, ignore_index), (True, target is not None))
    else:
        lse, loss = _lse_finish_launch(partials, target, target_logit, ignore_index, stream)
    return lse if loss is None else (lse, loss)


def cross_entropy_bwd(logits, lse, target, alpha=None, ignore_index=-100, out=None, stream=None):
    """The cross-entropy backward on stored logits [M, N] (e.g. gemm_lse's, store_logits=True):
    ``alpha[0] * (softmax(logits) - onehot(target))`` per row from the forward's lse [M] float32,
    0 on rows whose target == ignore_index; target [M] int32, alpha [1] float32 (device memory; None:
    1). Written into `out` (logits' shape and dtype; may be logits itself: cross_entropy_bwd_), else
    into a new array. A target outside [0, N) other than ignore_index: ValueError on the CPU, a NaN row
    on CUDA."""
    ignore_index = as_int(ignore_index, "ignore_index")
    if out is None and stream is None:
        if not eager(logits, lse, target, alpha):
            return ops().cross_entropy_bwd(logits, lse, target, alpha, ignore_index)
        op = _native("cross_entropy_bwd", logits, lse, target, alpha)
        if op is not None:
            matrix_shape(logits, "logits", 2, "[M, N]")  # (the launcher's check before allocating out)
            return op(logits, lse, target, alpha, ignore_index)
    if out is None:
        matrix_shape(logits, "logits", 2, "[M, N]")
        out = empty_like(logits)
    return _cross_entropy_bwd_launch(logits, lse, target, alpha, ignore_index, out, stream)


def cross_entropy_bwd_(logits, lse, target, alpha=None, ignore_index=-100, stream=None):
    """cross_entropy_bwd in place: the logits are overwritten by their gradient; returns logits."""
    ignore_index = as_int(ignore_index, "ignore_index")
    if stream is None:
        op = (ops().cross_entropy_bwd_ if not eager(logits, lse, target, alpha)
              else _native("cross_entropy_bwd_", logits, lse, target, alpha))
        if op is not None:
            op(logits, lse, target, alpha, ignore_index)
            return logits
    return _cross_entropy_bwd_launch(logits, lse, target, alpha, ignore_index, logits, stream)


def partials_sum(partials, per_column=False, scale: float = 1.0, n=None, stream=None):
    """Deterministic sums of a backward epilogue's float32 partials, tiles in order:
    per row ``scale * partials.sum(1)`` [rows] (zdz from swiglu_bwd's tile partials, scale = 1 / hidden),
    per column ``scale * partials[:, :n].sum(0)`` [n] (dγ from rmsnorm_bwd's column partials; n
    defaults to all columns, the partials' N is rounded up to the tile)."""
    n = matrix_shape(partials, "partials", 2, "[rows, cols]")[1] if n is None else as_int(n, "n")
    scale = as_float(scale, "scale")
    if stream is None:
        op = ops().partials_sum if not eager(partials) else native(partials, "partials_sum")
        if op is not None:
            return op(partials, bool(per_column), scale, n)
    return _partials_sum_launch(partials, per_column, scale, n, stream)


def rope_freq_turns(num_heads: int, rotary_heads: int, head_dim: int, base: float = 10000.0):
    """RoPE frequencies for gemm_rope as a float32 numpy array [num_heads * head_dim] of (hi, lo)
    pairs; heads past rotary_heads (V) get 0 (no rotation)."""
    import numpy as np

    num_heads, rotary_heads, head_dim = as_int(num_heads, "num_heads"), as_int(rotary_heads, "rotary_heads"), as_int(head_dim, "head_dim")
    f = np.empty(max(num_heads * head_dim, 0), dtype=np.float32)  # a negative size is refused by the call, naming the argument
    _b.rope_freq_turns(num_heads, rotary_heads, head_dim, as_float(base, "base"), f)
    return f


def interleave_gate_up(gate, up):
    """[2F, K] weights with rows 2j = gate[j], 2j+1 = up[j] (CPU arrays), for gemm_swiglu."""
    f, k = matrix_shape(gate, "gate", 2, "[F, K]")
    out = empty(gate, (2 * f, k))
    _b.interleave_gate_up(dl(gate), dl(up), dl(out))
    return out
