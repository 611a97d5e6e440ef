"""Compositions of ops: the shifted LLaMA block forward and backward and the first layer's QKV-norm
backward (include/encore/blocks/llama.hpp), the last layer + loss forward and backward
(include/encore/blocks/llama_last.hpp), on the CPU backend for numpy / CPU torch arrays and on
CUDA for CUDA torch tensors. These functions take no autograd; encore.nn.LlamaBlock and
encore.nn.LlamaLastLayer are the trainable modules over them (python/encore/_block_autograd.py,
_last_autograd.py).

Each public function calls its launcher (the op's Args struct, then <op>_workspace and <op>_run)
directly for numpy arrays and eager torch tensors, and torch.ops.encore.<op> (declared here on the
same launcher) when traced (_core.eager)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from . import _encore as _b
from ._core import as_float, dl, eager, empty, given_outputs, matrix_shape, ops, stream_for, torch_op, workspace

if TYPE_CHECKING:  # the ops' string annotations (torch.library.infer_schema reads them)
    from torch import Tensor

__all__ = ["llama_block_forward", "llama_block_workspace_bytes", "llama_block_backward", "qkv_norm_backward",
           "llama_last_block_forward", "llama_last_block_backward"]

_BLOCK_OUTPUTS = ("x1", "x2", "z1", "qkv", "r1", "r2")
_BWD_OUTPUTS = ("d_y0", "d_x0", "dw0", "dw1", "dw2", "dw3", "dgamma0", "dgamma1")
_QKV_BWD_OUTPUTS = ("dx", "dw3", "dgamma")
_LAST_OUTPUTS = ("x1", "x2", "z1", "h2", "r1", "r2", "lse", "loss")
_LAST_BWD_OUTPUTS = ("d_y0", "d_x0", "dw0", "dw1", "dw2", "dw_lm", "dgamma0", "dgamma_final")
_ALIGN = 256  # the workspaces' alignment

_OPTIONS = {}  # (struct, values) -> options object: built once per distinct value


def _options(cls, *values):
    key = (cls, values)
    o = _OPTIONS.get(key)
    if o is None:
        o = _OPTIONS[key] = cls(*values)
    return o


# --- outputs (the launchers' and the fakes': on the inputs' framework) ----------------------------------

def _block_outputs(y0, w1, w3):
    """x1, x2 [M, d], z1 [M, 2F], qkv [M, Nqkv] in y0's dtype, r1, r2 [M] float32."""
    m, d = matrix_shape(y0, "y0", 2, "[M, d]")
    f2, n = matrix_shape(w1, "w1", 2, "[2F, d]")[0], matrix_shape(w3, "w3", 2, "[Nqkv, d]")[0]
    return (empty(y0, (m, d)), empty(y0, (m, d)), empty(y0, (m, f2)), empty(y0, (m, n)), empty(y0, (m,), "f32"), empty(y0, (m,), "f32"))


def _block_grads(y0, weights, names=("w0", "w1", "w2", "w3")):
    """The block backwards' outputs: d_y0, d_x0 [M, d] and each weight's gradient in y0's dtype, then the
    two dgammas [d] float32."""
    m, d = matrix_shape(y0, "y0", 2, "[M, d]")
    for w, name in zip(weights, names):
        matrix_shape(w, name, 2, "[rows, cols]")
    return ((empty(y0, (m, d)), empty(y0, (m, d))) + tuple(empty(y0, tuple(w.shape)) for w in weights) +
            (empty(y0, (d,), "f32"), empty(y0, (d,), "f32")))


def _qkv_grads(x, w3):
    m, d = matrix_shape(x, "x", 2, "[M, d]")
    return empty(x, (m, d)), empty(x, matrix_shape(w3, "w3", 2, "[Nqkv, d]")), empty(x, (d,), "f32")


def _last_outputs(y0, w1):
    m, d = y0.shape[0], y0.shape[1]
    return (empty(y0, (m, d)), empty(y0, (m, d)), empty(y0, (m, w1.shape[0])), empty(y0, (m, d)), empty(y0, (m,), "f32"),
            empty(y0, (m,), "f32"), empty(y0, (m,), "f32"), empty(y0, (1,), "f32"))


# --- launchers: the op's workspace query (validates) and one run; stream None is torch's current stream ---

def _launch(query, run, args, opts, ws, like, sized_by, stream):
    """The op's workspace query (validates) then its run over `args` (opts None: an op without options)."""
    call = (args,) if opts is None else (args, opts)
    run(*call, dl(workspace(ws, like, query(*call), _ALIGN, sized_by)), stream_for(like, stream))


def _llama_block_forward_launch(ins, eps, out, ws, stream):
    y0 = ins[0]
    out = _block_outputs(y0, ins[3], ins[5]) if out is None else given_outputs(out, _BLOCK_OUTPUTS)
    _launch(_b.llama_block_forward_workspace, _b.llama_block_forward_run, _b.LlamaBlockArgs(*map(dl, (*ins, *out))),
            _options(_b.LlamaBlockOptions, as_float(eps, "eps")), ws, y0, "llama_block_workspace_bytes", stream)
    return out


def _llama_block_backward_launch(ins, out, ws, stream):
    y0 = ins[0]
    out = _block_grads(y0, ins[1:5]) if out is None else given_outputs(out, _BWD_OUTPUTS)
    _launch(_b.llama_block_backward_workspace, _b.llama_block_backward_run, _b.LlamaBlockBwdArgs(*map(dl, (*ins, *out))), None, ws,
            y0, "encore._encore.llama_block_backward_workspace", stream)
    return out


def _qkv_norm_backward_launch(ins, out, ws, stream):
    x = ins[0]
    out = _qkv_grads(x, ins[2]) if out is None else given_outputs(out, _QKV_BWD_OUTPUTS)
    _launch(_b.qkv_norm_backward_workspace, _b.qkv_norm_backward_run, _b.QkvNormBwdArgs(*map(dl, (*ins, *out))), None, ws, x,
            "encore._encore.qkv_norm_backward_workspace", stream)
    return out


def _llama_last_block_forward_launch(ins, eps, ignore_index, out, ws, stream):
    y0 = ins[0]
    out = _last_outputs(y0, ins[3]) if out is None else given_outputs(out, _LAST_OUTPUTS)
    _launch(_b.llama_last_block_forward_workspace, _b.llama_last_block_forward_run, _b.LlamaLastBlockArgs(*map(dl, (*ins, *out))),
            _options(_b.LlamaLastBlockOptions, float(eps), int(ignore_index)), ws, y0,
            "encore._encore.llama_last_block_forward_workspace", stream)
    return out


def _llama_last_block_backward_launch(ins, ignore_index, out, ws, stream):
    y0 = ins[0]
    out = _block_grads(y0, (*ins[1:4], ins[6]), ("w0", "w1", "w2", "w_lm")) if out is None else given_outputs(out, _LAST_BWD_OUTPUTS)
    _launch(_b.llama_last_block_backward_workspace, _b.llama_last_block_backward_run, _b.LlamaLastBlockBwdArgs(*map(dl, (*ins, *out))),
            _options(_b.LlamaLastBlockBwdOptions, int(ignore_index)), ws, y0, "encore._encore.llama_last_block_backward_workspace",
            stream)
    return out


# --- torch.ops.encore: the launchers on torch's current stream ----------------------------------------

def _nothing(*_):
    return None


@torch_op("llama_block_forward", fake=lambda y0, x0, w0, w1, w2, w3, *_: _block_outputs(y0, w1, w3), mutates=("workspace",))
def _llama_block_forward(y0: Tensor, x0: Tensor, w0: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, gamma0: Tensor, gamma1: Tensor,
                         pos: Tensor, freq: Tensor, eps: float, workspace: Tensor | None
                         ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _llama_block_forward_launch((y0, x0, w0, w1, w2, w3, gamma0, gamma1, pos, freq), eps, None, workspace, None)


@torch_op("llama_block_forward_out", fake=_nothing, mutates=("x1", "x2", "z1", "qkv", "r1", "r2", "workspace"))
def _llama_block_forward_out(y0: Tensor, x0: Tensor, w0: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, gamma0: Tensor, gamma1: Tensor,
                             pos: Tensor, freq: Tensor, eps: float, x1: Tensor, x2: Tensor, z1: Tensor, qkv: Tensor, r1: Tensor, r2: Tensor,
                             workspace: Tensor | None) -> None:
    _llama_block_forward_launch((y0, x0, w0, w1, w2, w3, gamma0, gamma1, pos, freq), eps, (x1, x2, z1, qkv, r1, r2), workspace, None)


def _block_backward_fake(y0, w0, w1, w2, w3, *_):
    return _block_grads(y0, (w0, w1, w2, w3))


@torch_op("llama_block_backward", fake=_block_backward_fake, mutates=("workspace",))
def _llama_block_backward(y0: Tensor, w0: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, gamma0: Tensor, gamma1: Tensor, pos: Tensor,
                          freq: Tensor, x1: Tensor, x2: Tensor, z1: Tensor, qkv: Tensor, r1: Tensor, r2: Tensor, d_qkv: Tensor,
                          d_x2: Tensor, workspace: Tensor | None
                          ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _llama_block_backward_launch((y0, w0, w1, w2, w3, gamma0, gamma1, pos, freq, x1, x2, z1, qkv, r1, r2, d_qkv, d_x2), None,
                                        workspace, None)


@torch_op("llama_block_backward_out", fake=_nothing,
          mutates=("d_y0", "d_x0", "dw0", "dw1", "dw2", "dw3", "dgamma0", "dgamma1", "workspace"))
def _llama_block_backward_out(y0: Tensor, w0: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, gamma0: Tensor, gamma1: Tensor, pos: Tensor,
                              freq: Tensor, x1: Tensor, x2: Tensor, z1: Tensor, qkv: Tensor, r1: Tensor, r2: Tensor, d_qkv: Tensor,
                              d_x2: Tensor, d_y0: Tensor, d_x0: Tensor, dw0: Tensor, dw1: Tensor, dw2: Tensor, dw3: Tensor, dgamma0: Tensor,
                              dgamma1: Tensor, workspace: Tensor | None) -> None:
    _llama_block_backward_launch((y0, w0, w1, w2, w3, gamma0, gamma1, pos, freq, x1, x2, z1, qkv, r1, r2, d_qkv, d_x2),
                                 (d_y0, d_x0, dw0, dw1, dw2, dw3, dgamma0, dgamma1), workspace, None)


@torch_op("qkv_norm_backward", fake=lambda x, gamma, w3, *_: _qkv_grads(x, w3), mutates=("workspace",))
def _qkv_norm_backward(x: Tensor, gamma: Tensor, w3: Tensor, pos: Tensor, freq: Tensor, r: Tensor, qkv: Tensor, d_qkv: Tensor,
                       d_x_prev: Tensor | None, workspace: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    return _qkv_norm_backward_launch((x, gamma, w3, pos, freq, r, qkv, d_qkv, d_x_prev), None, workspace, None)


@torch_op("qkv_norm_backward_out", fake=_nothing, mutates=("dx", "dw3", "dgamma", "workspace"))
def _qkv_norm_backward_out(x: Tensor, gamma: Tensor, w3: Tensor, pos: Tensor, freq: Tensor, r: Tensor, qkv: Tensor, d_qkv: Tensor,
                           d_x_prev: Tensor | None, dx: Tensor, dw3: Tensor, dgamma: Tensor, workspace: Tensor | None) -> None:
    _qkv_norm_backward_launch((x, gamma, w3, pos, freq, r, qkv, d_qkv, d_x_prev), (dx, dw3, dgamma), workspace, None)


@torch_op("llama_last_block_forward", fake=lambda y0, x0, w0, w1, *_: _last_outputs(y0, w1), mutates=("workspace",))
def _llama_last_block_forward(y0: Tensor, x0: Tensor, w0: Tensor, w1: Tensor, w2: Tensor, gamma0: Tensor, gamma_final: Tensor,
                              w_lm: Tensor, target: Tensor, eps: float, ignore_index: int, workspace: Tensor | None
                              ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _llama_last_block_forward_launch((y0, x0, w0, w1, w2, gamma0, gamma_final, w_lm, target), eps, ignore_index, None,
                                            workspace, None)


def _last_backward_fake(y0, w0, w1, w2, gamma0, gamma_final, w_lm, *_):
    return _block_grads(y0, (w0, w1, w2, w_lm), ("w0", "w1", "w2", "w_lm"))


@torch_op("llama_last_block_backward", fake=_last_backward_fake, mutates=("workspace",))
def _llama_last_block_backward(y0: Tensor, w0: Tensor, w1: Tensor, w2: Tensor, gamma0: Tensor, gamma_final: Tensor, w_lm: Tensor,
                               target: Tensor, x1: Tensor, x2: Tensor, z1: Tensor, h2: Tensor, r1: Tensor, r2: Tensor, lse: Tensor,
                               d_loss: Tensor, ignore_index: int, workspace: Tensor | None
                               ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _llama_last_block_backward_launch((y0, w0, w1, w2, gamma0, gamma_final, w_lm, target, x1, x2, z1, h2, r1, r2, lse, d_loss),
                                             ignore_index, None, workspace, None)


# --- public API ---------------------------------------------------------------------------------------

def llama_block_forward(y0, x0, w0, w1, w2, w3, gamma0, gamma1, pos, freq, eps: float = 1e-5, out=None, workspace=None,
                        stream=None):
    """The shifted LLaMA block: x1 = y0 @ w0.T + x0; z1 = rmsnorm(x1)*gamma0 @ w1.T (gate/up
    interleaved); x2 = swiglu(z1) @ w2.T + x1; qkv = RoPE(rmsnorm(x2)*gamma1 @ w3.T).
    Returns (x1, x2, z1, qkv, r1, r2) - what the backward saves.

    out: optional (x1, x2, z1, qkv, r1, r2) to write into (shapes [M, d], [M, d], [M, 2F], [M, Nqkv] in
    y0's dtype, r1 and r2 [M] float32), returned as given. workspace: optional 1-D uint8 array on y0's
    device of at least llama_block_workspace_bytes(...) bytes; without it each call allocates one.
    Both together make a call allocation-free (fixed addresses, e.g. for CUDA graph capture)."""
    ins = (y0, x0, w0, w1, w2, w3, gamma0, gamma1, pos, freq)
    if stream is None and not eager(*ins, workspace):
        if out is None:
            return ops().llama_block_forward(*ins, float(eps), workspace)
        out = given_outputs(out, _BLOCK_OUTPUTS)
        ops().llama_block_forward_out(*ins, float(eps), *out, workspace)
        return out
    return tuple(_llama_block_forward_launch(ins, eps, out, workspace, stream))


def llama_block_workspace_bytes(y0, x0, w0, w1, w2, w3, gamma0, gamma1, pos, freq, out, eps: float = 1e-5) -> int:
    """The size in bytes to allocate for llama_block_forward's `workspace` with these arguments and
    outputs `out` = (x1, x2, z1, qkv, r1, r2): what the block needs plus 256 for alignment."""
    args = (y0, x0, w0, w1, w2, w3, gamma0, gamma1, pos, freq, *given_outputs(out, _BLOCK_OUTPUTS))
    return int(_b.llama_block_forward_workspace(_b.LlamaBlockArgs(*map(dl, args)), _options(_b.LlamaBlockOptions, as_float(eps, "eps")))) + _ALIGN


def llama_block_backward(y0, w0, w1, w2, w3, gamma0, gamma1, pos, freq, x1, x2, z1, qkv, r1, r2, d_qkv, d_x2, out=None,
                         workspace=None, stream=None):
    """The shifted block's backward (docs/math/gemm_epilogues.md §5): from the forward's inputs (x0 is not read) and
    saved outputs (x1, x2, z1, qkv, r1, r2 as llama_block_forward returned them) and the incoming
    gradients d_qkv [M, Nqkv] and d_x2 [M, d], returns (d_y0, d_x0, dw0, dw1, dw2, dw3, dgamma0,
    dgamma1): d_y0, d_x0 [M, d] and the weight gradients in y0's dtype and the weights' shapes,
    dgamma0, dgamma1 [d] float32.

    out: optional outputs to write into (d_x0 may be d_x2 itself: the residual gradient in place),
    returned as given; workspace: optional 1-D uint8 array (see llama_block_forward)."""
    ins = (y0, w0, w1, w2, w3, gamma0, gamma1, pos, freq, x1, x2, z1, qkv, r1, r2, d_qkv, d_x2)
    if stream is None and not eager(*ins, workspace):
        if out is None:
            return tuple(ops().llama_block_backward(*ins, workspace))
        out = given_outputs(out, _BWD_OUTPUTS)
        ops().llama_block_backward_out(*ins, *out, workspace)
        return out
    return tuple(_llama_block_backward_launch(ins, out, workspace, stream))


def qkv_norm_backward(x, gamma, w3, pos, freq, r, qkv, d_qkv, d_x_prev=None, out=None, workspace=None, stream=None):
    """The first layer's backward of qkv = RoPE(rmsnorm(x) * gamma @ w3.T) (r = rsqrt(mean(x**2) + eps),
    the forward's row scale, float32 [M]): returns (dx [M, d], dw3 [Nqkv, d], dgamma [d] float32), dx
    including d_x_prev (the residual gradient of x from above) when given."""
    ins = (x, gamma, w3, pos, freq, r, qkv, d_qkv, d_x_prev)
    if stream is None and not eager(*ins, workspace):
        if out is None:
            return tuple(ops().qkv_norm_backward(*ins, workspace))
        out = given_outputs(out, _QKV_BWD_OUTPUTS)
        ops().qkv_norm_backward_out(*ins, *out, workspace)
        return out
    return tuple(_qkv_norm_backward_launch(ins, out, workspace, stream))


def llama_last_block_forward(y0, x0, w0, w1, w2, gamma0, gamma_final, w_lm, target, eps: float = 1e-5, ignore_index: int = -100,
                             out=None, workspace=None, stream=None):
    """The last layer + loss: x1 = y0 @ w0.T + x0; x2 = swiglu(rmsnorm(x1)*gamma0 @ w1.T) @ w2.T + x1;
    logits = rmsnorm(x2)*gamma_final @ w_lm.T (never stored); loss = mean cross-entropy over the rows
    whose target (int32 [M]) is not ignore_index (0 when none). Returns (x1, x2, z1, h2, r1, r2, lse,
    loss): what llama_last_block_backward reads (h2 = x2*gamma_final, the LM head's input; lse, loss
    float32 [M], [1]). out / workspace as for llama_block_forward (torch.ops.encore.llama_last_block_forward:
    no out=)."""
    ins = (y0, x0, w0, w1, w2, gamma0, gamma_final, w_lm, target)
    if out is None and stream is None and not eager(*ins, workspace):
        return tuple(ops().llama_last_block_forward(*ins, float(eps), int(ignore_index), workspace))
    return tuple(_llama_last_block_forward_launch(ins, eps, ignore_index, out, workspace, stream))


def llama_last_block_backward(y0, w0, w1, w2, gamma0, gamma_final, w_lm, target, x1, x2, z1, h2, r1, r2, lse, d_loss,
                              ignore_index: int = -100, out=None, workspace=None, stream=None):
    """The last layer + loss's backward from d_loss (float32 [1], the gradient of the mean loss) and the
    forward's inputs (x0 is not read) and saved outputs: returns (d_y0, d_x0, dw0, dw1, dw2, dw_lm,
    dgamma0, dgamma_final), the matrices in y0's dtype and the weights' shapes, the dgammas float32."""
    ins = (y0, w0, w1, w2, gamma0, gamma_final, w_lm, target, x1, x2, z1, h2, r1, r2, lse, d_loss)
    if out is None and stream is None and not eager(*ins, workspace):
        return tuple(ops().llama_last_block_backward(*ins, int(ignore_index), workspace))
    return tuple(_llama_last_block_backward_launch(ins, ignore_index, out, workspace, stream))
