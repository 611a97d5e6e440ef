"""encore.nn.FusedLinearCrossEntropyLoss: the LM head and the cross-entropy loss in one autograd Function
over torch.library ops (so torch.compile traces it), float logits never materialized.

Forward: torch.ops.encore.gemm_lse (the GEMM x @ W.T with per-tile log-sum-exp partials and the target
logit in its epilogue), then lse_finish (lse and the per-row loss, 0 on ignore_index rows).
Backward, three modes:
  recompute=True (default): the logits are not kept; the backward recomputes them in the epilogue of the
    ce_bwd GEMM, which writes dlogits = alpha * (softmax - onehot) in the input dtype, over chunks of rows,
    each followed by dx = dlogits @ W and dW += dlogits.T @ x (plain GEMMs). Extra peak memory: one chunk
    of dlogits, chunk_rows x V x 2 bytes (default: at most 1/8 of the M x V x 2 bytes of the logits).
  recompute=False: the forward keeps the bf16/fp16 logits (the D of gemm_lse, M x V x 2 bytes) and the
    backward turns them into dlogits in place (cross_entropy_bwd_), then the same two GEMMs.
  grad_in_forward=True (reductions "mean" and "sum", when a gradient is wanted): the gradients are computed
    in the forward, as Liger-Kernel's fused linear cross-entropy does: per chunk of rows, gemm_lse keeping
    that chunk's logits, lse_finish, cross_entropy_bwd_ in place (dlogits with alpha = 1 / count or 1), then
    dx = dlogits @ W and dW += dlogits.T @ x; the backward scales them by grad_output in place. Three GEMMs
    over the logits' shape instead of the recomputing path's four, for one chunk of logits (chunk_rows x V x 2
    bytes) and a pass over them; dW and dx live from the forward to the backward (as they would from the
    backward's start).
alpha (grad_output / count for "mean", grad_output for "sum"; in grad_in_forward 1 / count or 1, grad_output
applied after) is a device scalar: no host sync. For reduction="none" the per-row grad_output scales the rows
of dx and of x in dW's GEMM. grad_in_forward is taken for bf16 / fp32 only: fp16's range cannot hold dlogits
without the loss scale (a GradScaler's factor), which the forward does not know.
"""
from __future__ import annotations

import torch

from ._core import ops as _ops

_REDUCTIONS = ("mean", "sum", "none")


def _default_chunk_rows(m):
    """Rows per chunk of the recomputing backward: M / 8 rounded up to 128 rows, at least 256 (at most
    8 chunks: dW accumulates one rounding per chunk in the weight's dtype)."""
    return max(256, -(-((m + 7) // 8) // 128) * 128)


def _dx(d, w, g_rows):
    """dx = d @ w for a block of rows (g_rows: the per-row grad_output of reduction "none", else None)."""
    dx = d @ w
    return dx if g_rows is None else (dx * g_rows[:, None]).to(w.dtype)


def _dw_into(dw, d, x, g_rows):
    """dW (+)= d.T @ x for a block of rows: the first block allocates dW, the next add in place (addmm_:
    one rounding to the weight's dtype per block, no [V, H] temporary)."""
    xs = x if g_rows is None else (x * g_rows[:, None]).to(x.dtype)
    if dw is None:
        return d.t() @ xs
    return dw.addmm_(d.t(), xs)


def _reduce(loss_rows, count, reduction):
    """The loss from the per-row losses: their mean over the `count` rows not ignored (0 when none), sum, or the rows."""
    if reduction == "mean":
        return loss_rows.sum() / count.clamp(min=1)
    return loss_rows.sum() if reduction == "sum" else loss_rows


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, x, target, ignore_index, reduction, recompute, chunk_rows, grads=None):
        ops = _ops()
        if grads is not None:  # (need_dw, need_dx): the gradients in the forward
            return _forward_with_grads(ctx, ops, weight, x, target, ignore_index, reduction, chunk_rows, *grads)
        if recompute:
            partials, tl = ops.gemm_lse(x, weight, None, target, False, ignore_index, 0)
            logits = None
        else:
            partials, logits, tl = ops.gemm_lse(x, weight, None, target, True, ignore_index, 0)
        lse, loss_rows = ops.lse_finish(partials, target, tl, ignore_index)
        count = (target != ignore_index).sum()
        loss = _reduce(loss_rows, count, reduction)
        ctx.save_for_backward(weight, x, target, lse, count, logits)
        ctx.opts = (ignore_index, reduction, recompute, chunk_rows)
        return loss

    @staticmethod
    def backward(ctx, grad):
        if ctx.opts is None:  # the gradients from the forward, times grad_output (a device scalar) in place
            if torch.is_grad_enabled():
                raise RuntimeError("FusedLinearCrossEntropyLoss(grad_in_forward=True): no double backward (create_graph=True); "
                                   "use the recompute mode")
            dw, dx = ctx.saved_tensors
            g = grad.reshape(()).float()
            for t in (dw, dx):
                _scale_(t, g)  # bumps the version: a second backward (retain_graph) is refused, not scaled twice
            need_dw, need_dx = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
            return (dw if need_dw else None), (dx if need_dx else None), None, None, None, None, None, None
        weight, x, target, lse, count, logits = ctx.saved_tensors
        ignore_index, reduction, recompute, chunk_rows = ctx.opts
        need_dw, need_dx = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_dw or need_dx):
            return None, None, None, None, None, None, None, None
        g_rows = alpha = None
        if reduction == "none":
            g_rows = grad.float()
        elif reduction == "mean":
            alpha = (grad.float() / count.clamp(min=1)).reshape(1)
        else:
            alpha = grad.float().reshape(1)
        ops = _ops()
        if not recompute:
            ops.cross_entropy_bwd_(logits, lse, target, alpha, ignore_index)  # the saved logits become dlogits
            # a second backward (retain_graph) must not read them as logits: autograd's saved-tensor
            # version check raises instead
            torch.autograd.graph.increment_version(logits)
            dx = _dx(logits, weight, g_rows) if need_dx else None
            dw = _dw_into(None, logits, x, g_rows) if need_dw else None
            return dw, dx, None, None, None, None, None, None
        m = x.shape[0]
        step = chunk_rows or _default_chunk_rows(m)
        dxs, dw = [], None
        for r0 in range(0, m, step):
            r1 = min(m, r0 + step)
            xc = x[r0:r1]
            d = ops.gemm_epilogue("ce_bwd", xc, weight, None, None, None, None, None, alpha, target[r0:r1], True, 0, 128,
                                  ignore_index, "auto", None, None, lse[r0:r1])[0]
            gc = None if g_rows is None else g_rows[r0:r1]
            if need_dx:
                dxs.append(_dx(d, weight, gc))
            if need_dw:
                dw = _dw_into(dw, d, xc, gc)
            del d
        dx = (dxs[0] if len(dxs) == 1 else torch.cat(dxs)) if need_dx else None
        return dw, dx, None, None, None, None, None, None


def _scale_(t, g, block=1 << 25):
    """t *= g in place with g (a float32 device scalar) applied in fp32, not rounded to t's dtype first (as a
    bf16 tensor times a 0-d float32 tensor would: 1 / num_items off by up to 2^-9); by blocks of `block`
    elements so the fp32 temporary stays small (128 MB)."""
    if t.numel() == 0:
        return
    if t.dtype == torch.float32:
        t.mul_(g)
        return
    flat = t.view(-1)
    for e0 in range(0, flat.numel(), block):
        c = flat[e0:e0 + block]
        c.copy_(c.float().mul_(g))


def _forward_with_grads(ctx, ops, weight, x, target, ignore_index, reduction, chunk_rows, need_dw, need_dx):
    """The loss and, chunk by chunk of rows, dlogits (alpha = 1 / count for "mean", 1 for "sum"), dx and dW: saved
    for the backward, which scales them by grad_output."""
    count = (target != ignore_index).sum()
    alpha = (1.0 / count.clamp(min=1).float()).reshape(1) if reduction == "mean" else torch.ones(1, device=x.device)
    m = x.shape[0]
    step = chunk_rows or _default_chunk_rows(m)
    losses, dw = [], None
    dx = torch.empty_like(x) if need_dx else x.new_empty(0)
    for r0 in range(0, m, step):
        r1 = min(m, r0 + step)
        xc, tc = x[r0:r1], target[r0:r1]
        partials, logits, tl = ops.gemm_lse(xc, weight, None, tc, True, ignore_index, 0)
        lse, loss_rows = ops.lse_finish(partials, tc, tl, ignore_index)
        losses.append(loss_rows)
        ops.cross_entropy_bwd_(logits, lse, tc, alpha, ignore_index)  # the chunk's logits become dlogits
        if need_dx:
            torch.matmul(logits, weight, out=dx[r0:r1])
        if need_dw:
            dw = _dw_into(dw, logits, xc, None)
        del logits
    loss_rows = losses[0] if len(losses) == 1 else torch.cat(losses)
    loss = _reduce(loss_rows, count, reduction)
    ctx.save_for_backward(dw if need_dw else weight.new_empty(0), dx)
    ctx.opts = None
    return loss


def fused_linear_cross_entropy(weight, x, target, ignore_index=-100, reduction="mean", recompute=True, chunk_rows=None,
                               grad_in_forward=False):
    """Cross-entropy of the logits x @ weight.T (weight [V, H], x [..., H], target [...] of class indices)
    without materializing float logits; see FusedLinearCrossEntropyLoss."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction: one of {_REDUCTIONS}, got {reduction!r}")
    if weight.ndim != 2:
        raise ValueError(f"lin_weight: expected [V, H], got {tuple(weight.shape)}")
    v, h = weight.shape
    if x.ndim < 1 or x.shape[-1] != h:
        raise ValueError(f"_input: expected [..., {h}] (lin_weight is [V, H] = {tuple(weight.shape)}), got {tuple(x.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"_input: dtype {x.dtype} differs from lin_weight's {weight.dtype}")
    if x.device != weight.device or target.device != x.device:
        raise ValueError(f"_input, lin_weight, target: on one device, got {x.device}, {weight.device}, {target.device}")
    if target.dtype not in (torch.int32, torch.int64, torch.int16, torch.uint8, torch.int8):
        raise ValueError(f"target: expected integer class indices, got {target.dtype}")
    rows = x.reshape(-1, h)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    t = target.reshape(-1)
    if t.shape[0] != rows.shape[0]:
        raise ValueError(f"target: expected {rows.shape[0]} class indices (one per row of _input {tuple(x.shape)}), got "
                         f"{tuple(target.shape)}")
    if chunk_rows is not None and int(chunk_rows) < 1:
        raise ValueError(f"chunk_rows: must be >= 1, got {chunk_rows}")
    t32 = t.to(torch.int32)
    w = weight if weight.is_contiguous() else weight.contiguous()
    grads = None
    if (grad_in_forward and reduction != "none" and rows.dtype != torch.float16 and rows.shape[0] > 0 and torch.is_grad_enabled()
            and (w.requires_grad or rows.requires_grad)):
        grads = (w.requires_grad, rows.requires_grad)
    loss = FusedLinearCrossEntropyFunction.apply(w, rows, t32, int(ignore_index), reduction, bool(recompute),
                                                 None if chunk_rows is None else int(chunk_rows), grads)
    return loss.reshape(target.shape) if reduction == "none" else loss


class FusedLinearCrossEntropyLoss(torch.nn.Module):
    """Liger-compatible fused linear cross-entropy: ``loss = cross_entropy(_input @ lin_weight.T, target)``
    with ``forward(lin_weight, _input, target, bias=None)`` (lin_weight [V, H], _input [BT, H] (or [..., H]),
    target [BT] class indices), never materializing float logits.

    ignore_index: rows with this target add 0 to the loss and get zero gradients (an all-ignored batch gives
    loss 0 for "mean" and "sum", no NaN). reduction: "mean" (over the rows not ignored), "sum" or "none"
    (per-row float32 losses). The loss is float32. recompute=True (default) keeps no logits and recomputes
    them in the backward's ce_bwd GEMM over chunks of chunk_rows rows (None: at most 8 chunks); recompute=False
    keeps the bf16/fp16 logits of the forward (M x V x 2 bytes) and turns them into their gradient in place.
    grad_in_forward=True computes the gradients in the forward, chunk by chunk (as Liger's does: three GEMMs over
    the logits' shape instead of four, one chunk of logits in memory), when a gradient is wanted, the reduction
    is "mean" or "sum" and the dtype bf16 or fp32 (fp16 takes the recompute mode: its dlogits need the loss
    scale); the backward then only scales them by grad_output (it may run once, no double backward).
    bf16/fp16 on CUDA (H a multiple of 8), bf16/fp16/fp32 on the CPU backend. A target outside [0, V) other
    than ignore_index raises ValueError on CPU tensors; on CUDA (not checked, to avoid a sync) its row's loss
    and gradients are NaN. The Function's backward may run once (recompute=False overwrites the kept logits).
    """

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", recompute: bool = True, chunk_rows=None,
                 grad_in_forward: bool = False):
        super().__init__()
        if reduction not in _REDUCTIONS:
            raise ValueError(f"reduction: one of {_REDUCTIONS}, got {reduction!r}")
        self.ignore_index, self.reduction, self.recompute, self.chunk_rows = int(ignore_index), reduction, bool(recompute), chunk_rows
        self.grad_in_forward = bool(grad_in_forward)

    def forward(self, lin_weight, _input, target, bias=None):
        if bias is not None:
            raise NotImplementedError("FusedLinearCrossEntropyLoss: bias is not supported (the LM heads it targets have none); "
                                      "add the bias to the logits' GEMM yourself or pass bias=None")
        return fused_linear_cross_entropy(lin_weight, _input, target, self.ignore_index, self.reduction, self.recompute,
                                          self.chunk_rows, self.grad_in_forward)

    def extra_repr(self):
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, recompute={self.recompute}, "
                f"grad_in_forward={self.grad_in_forward}")
