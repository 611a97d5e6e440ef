"""Helpers shared by the encore Python wrappers: framework detection, output allocation on the
caller's framework and device, the CUDA stream, the no-autograd guard, and the dispatch of torch
tensors to the torch.library ops (encore.torch_ops)."""
from __future__ import annotations


def _is_torch(a) -> bool:
    return type(a).__module__.startswith("torch")


def _rows(a, name):
    """View `a` as [rows, hidden] (leading dimensions flattened)."""
    if getattr(a, "ndim", 0) < 1:
        raise ValueError(f"{name}: expected at least 1 dimension [..., hidden]")
    return a if a.ndim == 2 else a.reshape(-1, a.shape[-1])


def _rows_view(a, name):
    """`a` as a [rows, hidden] view (an output written through it): raises where that needs a copy."""
    if getattr(a, "ndim", 0) < 1:
        raise ValueError(f"{name}: expected at least 1 dimension [..., hidden]")
    if _is_torch(a):
        try:
            return a.view(-1, a.shape[-1])
        except RuntimeError:
            pass
    else:
        v = a.view()
        try:
            v.shape = (-1, a.shape[-1])
            return v
        except AttributeError:
            pass
    raise ValueError(f"{name}: must be viewable as [rows, hidden] (it is written in place)")


def _empty_like(a):
    return _empty(a, a.shape, "like")


def _stream_for(a, stream):
    if stream is not None:
        return int(stream)
    return _torch_stream(a) if _is_torch(a) else 0


def _torch_stream(t):
    """torch's current CUDA stream on t's device as an integer handle; 0 for a CPU tensor."""
    if t.is_cuda:
        import torch

        return torch._C._cuda_getCurrentRawStream(t.get_device())
    return 0


def _no_autograd(*tensors):
    if any(_is_torch(t) and t.requires_grad for t in tensors):
        import torch

        if torch.is_grad_enabled():
            raise RuntimeError("encore: autograd is not wired for this op yet; call it under torch.no_grad()")


def _via_torch_op(stream, *arrays):
    """The no-autograd check on `arrays`; then True when the call is to go through torch.ops.encore:
    no explicit stream, every array (None skipped) a torch tensor, and something to trace it for
    (torch.compile / export, a dispatch or torch-function mode such as FakeTensorMode or make_fx, or
    a tensor subclass). Plain eager calls on plain tensors take the direct path, the op's own
    kernel, without the dispatcher's few microseconds (bench/peers/host_overhead.py)."""
    every, plain = True, True
    for a in arrays:
        if a is None:
            continue
        if _is_torch(a):
            if a.requires_grad:
                _no_autograd(a)
            plain = plain and type(a) is _torch().Tensor
        else:
            every = False
    if stream is not None or not every:
        return False
    torch = _torch()
    return not plain or torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0 or \
        torch._C._is_torch_function_mode_enabled()


_TORCH = None


def _torch():
    global _TORCH
    if _TORCH is None:
        import torch

        _TORCH = torch
    return _TORCH


_TO_DLPACK = None


def _dl(*arrays):
    """The arrays as the binding takes them: a torch tensor as its DLPack capsule, others (numpy
    arrays, None) as given. torch.utils.dlpack.to_dlpack costs a tenth of the Tensor.__dlpack__
    the binding would call otherwise, and skips its default-stream event sync (encore launches on
    the stream it is given)."""
    global _TO_DLPACK
    if _TO_DLPACK is None and any(_is_torch(a) for a in arrays):
        from torch.utils.dlpack import to_dlpack

        _TO_DLPACK = to_dlpack
    return tuple(_TO_DLPACK(a) if _is_torch(a) else a for a in arrays)


_OPS = None


def _ops():
    """The torch.ops.encore overloads (registered on first use, by importing encore.torch_ops)."""
    global _OPS
    if _OPS is None:
        from .torch_ops import OPS

        _OPS = OPS
    return _OPS


def _with_absent(outs, present):
    """The op's outputs `outs` (the present ones, in order) spread over the flags `present`, None
    where a flag is false: the public functions' optional outputs from an op's Tensor[]."""
    it = iter(outs)
    return tuple(next(it) if p else None for p in present)


_KINDS = {"f32": "float32", "u8": "uint8", "i32": "int32", "bf16": "bfloat16"}  # torch names (numpy: no bfloat16)


def _empty(like, shape, kind):
    """An uninitialized array of `shape` on `like`'s framework and device; kind: "f32", "u8", "i32",
    "bf16" (torch only) or "like" (like's dtype)."""
    if _is_torch(like):
        import torch

        if kind == "like" and shape == like.shape:
            return torch.empty_like(like, memory_format=torch.contiguous_format)
        dtype = like.dtype if kind == "like" else getattr(torch, _KINDS[kind])
        return torch.empty(shape, dtype=dtype, device=like.device)
    import numpy as np

    if kind == "bf16":
        raise ValueError("bfloat16 outputs need torch tensors (numpy has no bfloat16)")
    return np.empty(shape, dtype=like.dtype if kind == "like" else getattr(np, _KINDS[kind]))


def _address(a):
    return a.data_ptr() if _is_torch(a) else a.ctypes.data


def _given_outputs(out, names):
    """The caller's output arrays `out`, checked to be one per name in `names`."""
    if len(out) != len(names):
        raise ValueError(f"out: expected the {len(names)} arrays ({', '.join(names)}), got {len(out)}")
    return tuple(out)


def _workspace(ws, like, nbytes, align, sized_by):
    """The aligned nbytes of a workspace: `ws` (the caller's; checked to be a 1-D uint8 array on
    `like`'s framework and device, large enough from an align-byte aligned address), or, when it is
    None, a fresh one with room for the alignment."""
    if ws is None:
        ws = _empty(like, (nbytes + align,), "u8")
    elif getattr(ws, "ndim", 0) != 1 or str(ws.dtype).rsplit(".", 1)[-1] != "uint8":
        raise ValueError("workspace: expected a 1-D uint8 array")
    elif _is_torch(ws) != _is_torch(like) or (_is_torch(ws) and ws.device != like.device):
        raise ValueError("workspace: expected an array on the inputs' framework and device")
    skip = (-_address(ws)) % align
    if ws.shape[0] < nbytes + skip:
        raise ValueError(f"workspace: {ws.shape[0]} bytes, this call needs {nbytes} from a {align}-byte aligned address "
                         f"(allocate {sized_by}(...) bytes)")
    return ws[skip:skip + nbytes]
