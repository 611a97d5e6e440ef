"""Helpers shared by the encore Python wrappers: framework detection, output allocation on the
caller's framework and device, the CUDA stream, and the no-autograd guard."""
from __future__ import annotations


def _is_torch(a) -> bool:
    return type(a).__module__.startswith("torch")


def _rows(a, name):
    """View `a` as [rows, hidden] (leading dimensions flattened)."""
    if getattr(a, "ndim", 0) < 1:
        raise ValueError(f"{name}: expected at least 1 dimension [..., hidden]")
    return a.reshape(-1, a.shape[-1])


def _empty_like(a):
    return _empty(a, a.shape, "like")


def _stream_for(a, stream):
    if stream is not None:
        return int(stream)
    if _is_torch(a) and a.is_cuda:
        import torch

        return torch.cuda.current_stream(a.device).cuda_stream
    return 0


def _no_autograd(*tensors):
    if any(_is_torch(t) and t.requires_grad for t in tensors):
        import torch

        if torch.is_grad_enabled():
            raise RuntimeError("encore: autograd is not wired for this op yet; call it under torch.no_grad()")


_KINDS = {"f32": "float32", "u8": "uint8", "i32": "int32", "bf16": "bfloat16"}  # torch names (numpy: no bfloat16)


def _empty(like, shape, kind):
    """An uninitialized array of `shape` on `like`'s framework and device; kind: "f32", "u8", "i32",
    "bf16" (torch only) or "like" (like's dtype)."""
    if _is_torch(like):
        import torch

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
