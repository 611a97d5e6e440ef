"""Compositions of ops: the shifted LLaMA block forward and backward and the first layer's QKV-norm
backward (include/encore/blocks/llama.hpp), the last layer + loss forward and backward
(include/encore/blocks/llama_last.hpp), on the CPU backend for numpy / CPU torch arrays and on
CUDA for CUDA torch tensors. These functions take no autograd; encore.nn.LlamaBlock and
encore.nn.LlamaLastLayer are the trainable modules over them (python/encore/_block_autograd.py,
_last_autograd.py)."""
from __future__ import annotations

from . import _encore
from ._util import _dl, _empty, _given_outputs, _ops, _stream_for, _via_torch_op, _workspace

__all__ = ["llama_block_forward", "llama_block_workspace_bytes", "llama_block_backward", "qkv_norm_backward",
           "llama_last_block_forward", "llama_last_block_backward"]

_BLOCK_OUTPUTS = ("x1", "x2", "z1", "qkv", "r1", "r2")



def _block_grads(y0, weights):
    """The block backwards' outputs: d_y0, d_x0 [M, d] and each weight's gradient in y0's dtype, then the
    two dgammas [d] float32."""
    m, d = y0.shape[0], y0.shape[1]
    return ((_empty(y0, (m, d), "like"), _empty(y0, (m, d), "like")) + tuple(_empty(y0, tuple(w.shape), "like") for w in weights) +
            (_empty(y0, (d,), "f32"), _empty(y0, (d,), "f32")))

def llama_block_forward(y0, x0, w0, w1, w2, w3, gamma0, gamma1, pos, freq, eps: float = 1e-5, out=None, workspace=None,
                        stream=None):
    """The shifted LLaMA block: x1 = y0 @ w0.T + x0; z1 = rmsnorm(x1)*gamma0 @ w1.T (gate/up
    interleaved); x2 = swiglu(z1) @ w2.T + x1; qkv = RoPE(rmsnorm(x2)*gamma1 @ w3.T).
    Returns (x1, x2, z1, qkv, r1, r2) - what the backward saves.

    out: optional (x1, x2, z1, qkv, r1, r2) to write into (shapes [M, d], [M, d], [M, 2F], [M, Nqkv] in
    y0's dtype, r1 and r2 [M] float32), returned as given. workspace: optional 1-D uint8 array on y0's
    device of at least llama_block_workspace_bytes(...) bytes; without it each call allocates one.
    Both together make a call allocation-free (fixed addresses, e.g. for CUDA graph capture)."""
    if _via_torch_op(stream, y0, x0, w0, w1, w2, w3, gamma0, gamma1, pos, freq, workspace):
        ins = (y0, x0, w0, w1, w2, w3, gamma0, gamma1, pos, freq, float(eps))
        if out is None:
            return _ops().llama_block_forward(*ins, workspace)
        out = _given_outputs(out, _BLOCK_OUTPUTS)
        _ops().llama_block_forward_out(*ins, *out, workspace)
        return out
    m, d, f2, nq = y0.shape[0], y0.shape[1], w1.shape[0], w3.shape[0]
    if out is None:
        x1, x2, z1, qkv = _empty(y0, (m, d), "like"), _empty(y0, (m, d), "like"), _empty(y0, (m, f2), "like"), _empty(y0, (m, nq), "like")
        r1, r2 = _empty(y0, (m,), "f32"), _empty(y0, (m,), "f32")
    else:
        x1, x2, z1, qkv, r1, r2 = _given_outputs(out, _BLOCK_OUTPUTS)
    args = (y0, x0, w0, w1, w2, w3, gamma0, gamma1, pos, freq, x1, x2, z1, qkv, r1, r2)
    nbytes = _encore.llama_block_workspace_bytes(*_dl(*args), float(eps))  # a capsule is used once: _dl per call
    ws = _workspace(workspace, y0, nbytes, 256, "llama_block_workspace_bytes")
    _encore.llama_block_forward_out(*_dl(*args), float(eps), *_dl(ws), _stream_for(y0, stream))
    return x1, x2, z1, qkv, r1, r2


def llama_block_workspace_bytes(y0, x0, w0, w1, w2, w3, gamma0, gamma1, pos, freq, out, eps: float = 1e-5) -> int:
    """The size in bytes to allocate for llama_block_forward's `workspace` with these arguments and
    outputs `out` = (x1, x2, z1, qkv, r1, r2): what the block needs plus 256 for alignment."""
    args = (y0, x0, w0, w1, w2, w3, gamma0, gamma1, pos, freq, *_given_outputs(out, _BLOCK_OUTPUTS))
    return int(_encore.llama_block_workspace_bytes(*_dl(*args), float(eps))) + 256


_BWD_OUTPUTS = ("d_y0", "d_x0", "dw0", "dw1", "dw2", "dw3", "dgamma0", "dgamma1")


def llama_block_backward(y0, w0, w1, w2, w3, gamma0, gamma1, pos, freq, x1, x2, z1, qkv, r1, r2, d_qkv, d_x2, out=None,
                         workspace=None, stream=None):
    """The shifted block's backward (math-coda.md §5): from the forward's inputs (x0 is not read) and
    saved outputs (x1, x2, z1, qkv, r1, r2 as llama_block_forward returned them) and the incoming
    gradients d_qkv [M, Nqkv] and d_x2 [M, d], returns (d_y0, d_x0, dw0, dw1, dw2, dw3, dgamma0,
    dgamma1): d_y0, d_x0 [M, d] and the weight gradients in y0's dtype and the weights' shapes,
    dgamma0, dgamma1 [d] float32.

    out: optional outputs to write into (d_x0 may be d_x2 itself: the residual gradient in place),
    returned as given; workspace: optional 1-D uint8 array (see llama_block_forward)."""
    ins = (y0, w0, w1, w2, w3, gamma0, gamma1, pos, freq, x1, x2, z1, qkv, r1, r2, d_qkv, d_x2)
    if _via_torch_op(stream, *ins, workspace):
        if out is None:
            return tuple(_ops().llama_block_backward(*ins, workspace))
        out = _given_outputs(out, _BWD_OUTPUTS)
        _ops().llama_block_backward_out(*ins, *out, workspace)
        return out
    out = _block_grads(y0, (w0, w1, w2, w3)) if out is None else _given_outputs(out, _BWD_OUTPUTS)
    args = (*ins, *out)
    nbytes = _encore.llama_block_backward_workspace_bytes(*_dl(*args))
    ws = _workspace(workspace, y0, nbytes, 256, "llama_block_backward_workspace_bytes")
    _encore.llama_block_backward_out(*_dl(*args), *_dl(ws), _stream_for(y0, stream))
    return tuple(out)


def qkv_norm_backward(x, gamma, w3, pos, freq, r, qkv, d_qkv, d_x_prev=None, out=None, workspace=None, stream=None):
    """The first layer's backward of qkv = RoPE(rmsnorm(x) * gamma @ w3.T) (r = rsqrt(mean(x**2) + eps),
    the forward's row scale, float32 [M]): returns (dx [M, d], dw3 [Nqkv, d], dgamma [d] float32), dx
    including d_x_prev (the residual gradient of x from above) when given."""
    ins = (x, gamma, w3, pos, freq, r, qkv, d_qkv, d_x_prev)
    if _via_torch_op(stream, *ins, workspace):
        if out is None:
            return tuple(_ops().qkv_norm_backward(*ins, workspace))
        out = _given_outputs(out, ("dx", "dw3", "dgamma"))
        _ops().qkv_norm_backward_out(*ins, *out, workspace)
        return out
    if out is None:
        out = (_empty(x, tuple(x.shape), "like"), _empty(x, tuple(w3.shape), "like"), _empty(x, (x.shape[1],), "f32"))
    else:
        out = _given_outputs(out, ("dx", "dw3", "dgamma"))
    args = (*ins, *out)
    nbytes = _encore.qkv_norm_backward_workspace_bytes(*_dl(*args))
    ws = _workspace(workspace, x, nbytes, 256, "qkv_norm_backward_workspace_bytes")
    _encore.qkv_norm_backward_out(*_dl(*args), *_dl(ws), _stream_for(x, stream))
    return tuple(out)


_LAST_OUTPUTS = ("x1", "x2", "z1", "h2", "r1", "r2", "lse", "loss")


def llama_last_block_forward(y0, x0, w0, w1, w2, gamma0, gamma_final, w_lm, target, eps: float = 1e-5, ignore_index: int = -100,
                             out=None, workspace=None, stream=None):
    """The last layer + loss: x1 = y0 @ w0.T + x0; x2 = swiglu(rmsnorm(x1)*gamma0 @ w1.T) @ w2.T + x1;
    logits = rmsnorm(x2)*gamma_final @ w_lm.T (never stored); loss = mean cross-entropy over the rows
    whose target (int32 [M]) is not ignore_index (0 when none). Returns (x1, x2, z1, h2, r1, r2, lse,
    loss): what llama_last_block_backward reads (h2 = x2*gamma_final, the LM head's input; lse, loss
    float32 [M], [1]). out / workspace as for llama_block_forward (torch.ops.encore.llama_last_block_forward:
    no out=)."""
    ins = (y0, x0, w0, w1, w2, gamma0, gamma_final, w_lm, target)
    if out is None and _via_torch_op(stream, *ins, workspace):
        return tuple(_ops().llama_last_block_forward(*ins, float(eps), int(ignore_index), workspace))
    m, d, f2 = y0.shape[0], y0.shape[1], w1.shape[0]
    if out is None:
        out = (_empty(y0, (m, d), "like"), _empty(y0, (m, d), "like"), _empty(y0, (m, f2), "like"), _empty(y0, (m, d), "like"),
               _empty(y0, (m,), "f32"), _empty(y0, (m,), "f32"), _empty(y0, (m,), "f32"), _empty(y0, (1,), "f32"))
    else:
        out = _given_outputs(out, _LAST_OUTPUTS)
    args = (y0, x0, w0, w1, w2, gamma0, gamma_final, w_lm, target, *out)
    nbytes = _encore.llama_last_block_workspace_bytes(list(_dl(*args)), float(eps), int(ignore_index))
    ws = _workspace(workspace, y0, nbytes, 256, "llama_last_block_workspace_bytes")
    _encore.llama_last_block_forward_out(list(_dl(*args)), float(eps), int(ignore_index), *_dl(ws), _stream_for(y0, stream))
    return tuple(out)


_LAST_BWD_OUTPUTS = ("d_y0", "d_x0", "dw0", "dw1", "dw2", "dw_lm", "dgamma0", "dgamma_final")


def llama_last_block_backward(y0, w0, w1, w2, gamma0, gamma_final, w_lm, target, x1, x2, z1, h2, r1, r2, lse, d_loss,
                              ignore_index: int = -100, out=None, workspace=None, stream=None):
    """The last layer + loss's backward from d_loss (float32 [1], the gradient of the mean loss) and the
    forward's inputs (x0 is not read) and saved outputs: returns (d_y0, d_x0, dw0, dw1, dw2, dw_lm,
    dgamma0, dgamma_final), the matrices in y0's dtype and the weights' shapes, the dgammas float32."""
    ins = (y0, w0, w1, w2, gamma0, gamma_final, w_lm, target, x1, x2, z1, h2, r1, r2, lse, d_loss)
    if out is None and _via_torch_op(stream, *ins, workspace):
        return tuple(_ops().llama_last_block_backward(*ins, int(ignore_index), workspace))
    out = _block_grads(y0, (w0, w1, w2, w_lm)) if out is None else _given_outputs(out, _LAST_BWD_OUTPUTS)
    args = (y0, w0, w1, w2, gamma0, gamma_final, w_lm, target, x1, x2, z1, h2, r1, r2, lse, d_loss, *out)
    nbytes = _encore.llama_last_block_backward_workspace_bytes(list(_dl(*args)), int(ignore_index))
    ws = _workspace(workspace, y0, nbytes, 256, "llama_last_block_backward_workspace_bytes")
    _encore.llama_last_block_backward_out(list(_dl(*args)), int(ignore_index), *_dl(ws), _stream_for(y0, stream))
    return tuple(out)
