"""What the family modules share (and nothing else of encore: each family imports this module, this
module imports no family). Arrays are numpy arrays (CPU backend) or torch tensors; torch is
imported only once a torch tensor arrives or torch is already loaded.

- Arrays: `dl` (the binding's form of an array), `empty` (outputs on the caller's framework and
  device), `rows` / `rows_view`, `stream_for` (torch's current CUDA stream), `workspace`.
- Ops: `torch_op` declares a family's torch.library op (namespace ``encore``) on its kernel, the
  family's private launcher: the schema is derived from the kernel's Python signature
  (torch.library.infer_schema), the fake and the autograd formula are registered beside it.
  Declarations are recorded at import and registered with torch on first need (`ops()`, or
  `register_torch_ops()` when torch is already loaded at ``import encore``).
- `eager(*arrays)`: True when a public function may call its launcher directly (numpy arrays, or
  plain torch tensors outside any tracing); False sends it through torch.ops.encore, which is what
  torch.compile, export, fake / dispatch modes and tensor subclasses see.
"""
from __future__ import annotations

import operator
import sys
import types

_TORCH = None   # the torch module, once needed
_TENSOR = None  # torch.Tensor, once torch is loaded
_TO_DLPACK = None
_DECLARED = []  # (name, kernel, mutates, fake, autograd) in declaration order
_OPS = types.SimpleNamespace()  # name -> torch.ops.encore.<name>.default, once registered
_LIB = None


def torch_module():
    """torch, imported on first need; the declared ops are registered with it then."""
    global _TORCH, _TENSOR, _TO_DLPACK, _GRAD_ENABLED, _COMPILING, _DISPATCH_MODES, _FUNCTION_MODE
    if _TORCH is None:
        import torch
        from torch.utils.dlpack import to_dlpack

        _TORCH, _TENSOR, _TO_DLPACK = torch, torch.Tensor, to_dlpack
        _GRAD_ENABLED, _COMPILING = torch.is_grad_enabled, torch.compiler.is_compiling
        _DISPATCH_MODES, _FUNCTION_MODE = torch._C._len_torch_dispatch_stack, torch._C._is_torch_function_mode_enabled
        _register_all(torch)
    return _TORCH


_GRAD_ENABLED = _COMPILING = _DISPATCH_MODES = _FUNCTION_MODE = None


def _tensor_type():
    """torch.Tensor once torch is imported (binding encore to it here when this is encore's first need of
    it: a helper below may be a process's first call), else None."""
    if _TENSOR is None and "torch" in sys.modules:
        torch_module()
    return _TENSOR


def is_torch(a) -> bool:
    if _TENSOR is None:
        if "torch" not in sys.modules:
            return False
        torch_module()
    return isinstance(a, _TENSOR)


# --- the eager / traced decision ----------------------------------------------------------------------


def eager(*arrays) -> bool:
    """True: call the launcher directly (numpy arrays; plain torch tensors, eager, no mode active).
    False: go through torch.ops.encore (torch.compile / export, FakeTensorMode, make_fx, dispatch or
    torch-function modes, tensor subclasses). Tensors that require grad under grad mode are refused:
    the ops without an autograd formula say so rather than silently dropping the gradient. (On every
    eager call: kept to a few attribute reads.)"""
    t = _TENSOR
    if t is None:
        if "torch" not in sys.modules:
            return True
        torch_module()
        t = _TENSOR
    for a in arrays:
        if type(a) is t:
            if a.requires_grad and _GRAD_ENABLED():
                raise RuntimeError("encore: autograd is not wired for this op; call it under torch.no_grad()")
        elif a is not None and isinstance(a, t):
            return False  # a tensor subclass (FakeTensor, DTensor, ...)
    return not (_COMPILING() or _DISPATCH_MODES() or _FUNCTION_MODE())


# --- scalar arguments ---------------------------------------------------------------------------------


def as_int(v, name):
    """v as an int (Python or numpy integers; bool counts as an int); TypeError naming the argument
    for anything else (a float, a str, None): int() would truncate 2.5 or parse "2" silently."""
    if type(v) is int:
        return v
    try:
        return operator.index(v)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}") from None


def as_float(v, name):
    """v as a float (Python, numpy or 0-d array numbers); TypeError naming the argument for anything
    else (a str, None, a sequence): float() would parse "1e-6" silently."""
    if type(v) is float:
        return v
    if isinstance(v, (str, bytes)) or v is None:
        raise TypeError(f"{name}: expected a float, got {type(v).__name__}")
    try:
        return float(v)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a float, got {type(v).__name__}") from None


def matrix_shape(a, name, ndim=2, layout="[M, K]"):
    """a's shape, checked to have `ndim` dimensions: ValueError naming the argument otherwise (TypeError
    for an object that is not an array)."""
    shape = getattr(a, "shape", None)
    if shape is None or not hasattr(a, "ndim"):
        raise TypeError(f"{name}: expected an array (a numpy array or a torch tensor), got {type(a).__name__}")
    if a.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimension{'s' if ndim != 1 else ''} {layout}, got {list(shape)}")
    return tuple(shape)


# --- arrays -------------------------------------------------------------------------------------------


def dl(a):
    """`a` as the binding takes it: a torch tensor as a DLPack capsule (torch.utils.dlpack.to_dlpack
    costs a tenth of the Tensor.__dlpack__ the binding would call, and skips its stream sync: encore
    launches on the stream it is given), anything else (numpy arrays, None) as it is."""
    t = _TENSOR or _tensor_type()
    if t is not None and (type(a) is t or isinstance(a, t)):
        return _TO_DLPACK(a)
    return a


def stream_for(a, stream=None) -> int:
    """The stream handle for a call on `a`: the caller's, else torch's current stream on a's CUDA
    device, else 0."""
    if stream is not None:
        return as_int(stream, "stream")
    t = _TENSOR or _tensor_type()
    if t is not None and (type(a) is t or isinstance(a, t)) and a.is_cuda:
        return _TORCH._C._cuda_getCurrentRawStream(a.get_device())
    return 0


_KINDS = {"f32": "float32", "u8": "uint8", "i32": "int32", "bf16": "bfloat16"}


def empty(like, shape, kind="like"):
    """An uninitialized array of `shape` on like's framework and device; kind "like" (like's
    dtype), "f32", "u8", "i32" or "bf16" (torch only)."""
    t = _TENSOR or _tensor_type()
    if t is not None and isinstance(like, t):
        if kind == "like":
            return like.new_empty(shape)
        return like.new_empty(shape, dtype=getattr(_TORCH, _KINDS[kind]))
    import numpy as np

    if kind == "bf16":
        raise ValueError("bfloat16 outputs need torch tensors (numpy has no bfloat16)")
    return np.empty(shape, dtype=like.dtype if kind == "like" else getattr(np, _KINDS[kind]))


def empty_like(a):
    """An uninitialized contiguous array of a's shape and dtype."""
    t = _TENSOR or _tensor_type()
    if t is not None and (type(a) is t or isinstance(a, t)):
        return _TORCH.empty_like(a) if a.is_contiguous() else _TORCH.empty_like(a, memory_format=_TORCH.contiguous_format)
    import numpy as np

    return np.empty(a.shape, a.dtype)


def rows(a, name):
    """`a` as [rows, hidden] (leading dimensions flattened; a copy where a view cannot be)."""
    if getattr(a, "ndim", 0) < 1:
        raise ValueError(f"{name}: expected at least 1 dimension [..., hidden]")
    return a if a.ndim == 2 else a.reshape(-1, a.shape[-1])


def rows_view(a, name):
    """`a` as a [rows, hidden] view (an output written through it): raises where that needs a copy."""
    if getattr(a, "ndim", 0) < 1:
        raise ValueError(f"{name}: expected at least 1 dimension [..., hidden]")
    if is_torch(a):
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


def address(a):
    return a.data_ptr() if is_torch(a) else a.ctypes.data


def given_outputs(out, names):
    """The caller's output arrays `out`, checked to be a tuple (or list) of one per name in `names`."""
    if not isinstance(out, (tuple, list)):
        raise TypeError(f"out: expected a tuple of the {len(names)} arrays ({', '.join(names)}), got {type(out).__name__}")
    if len(out) != len(names):
        raise ValueError(f"out: expected the {len(names)} arrays ({', '.join(names)}), got {len(out)}")
    return tuple(out)


def workspace(ws, like, nbytes, align, sized_by, name="workspace"):
    """The aligned nbytes of a workspace: `ws` (the caller's argument `name`; checked to be a 1-D uint8
    array on like's framework and device, large enough from an align-byte aligned address), or, when it
    is None, a fresh one with room for the alignment; None when nbytes is 0 and none was given."""
    if ws is None:
        if not nbytes:
            return None
        ws = empty(like, (nbytes + align,), "u8")
    elif getattr(ws, "ndim", 0) != 1 or str(ws.dtype).rsplit(".", 1)[-1] != "uint8":
        raise ValueError(f"{name}: expected a 1-D uint8 array")
    elif is_torch(ws) != is_torch(like) or (is_torch(ws) and ws.device != like.device):
        raise ValueError(f"{name}: expected an array on the inputs' framework and device")
    skip = (-address(ws)) % align
    if ws.shape[0] < nbytes + skip:
        raise ValueError(f"{name}: {ws.shape[0]} bytes, this call needs {nbytes} from a {align}-byte aligned address "
                         f"(allocate {sized_by}(...) bytes)")
    return ws[skip:skip + nbytes]


def with_absent(outs, present):
    """An op's outputs `outs` (the present ones, in order) spread over the flags `present`, None
    where a flag is false."""
    it = iter(outs)
    return tuple(next(it) if p else None for p in present)


def present(outs):
    """The outputs that are not None, in order (an op's Tensor[])."""
    return [t for t in outs if t is not None]


# --- torch.library ops --------------------------------------------------------------------------------


def torch_op(name, *, fake, mutates=(), autograd=None):
    """Declares torch.ops.encore.<name> on the decorated kernel (the family's launcher, annotated
    with Tensor / float / int / bool / str types as strings): its schema comes from the signature,
    `fake(*args)` gives the outputs' shapes, dtypes and strides without running anything,
    `mutates` names the arguments written in place, and `autograd` = (backward, setup_context) of
    torch.library.register_autograd where the op has a gradient formula. The kernel is called with
    the op's arguments and launches on torch's current stream."""
    def record(kernel):
        _DECLARED.append((name, kernel, tuple(mutates), fake, autograd))
        if _LIB is not None:
            _register(*_DECLARED[-1])
        return kernel

    return record


def _register(name, kernel, mutates, fake, autograd):
    """Defines encore::<name> from the kernel's signature, with its fake and autograd; the Python
    kernel unless _encore_torch registered a C++ one (NATIVE)."""
    torch = _TORCH
    kernel.__globals__.setdefault("Tensor", torch.Tensor)  # the string annotations' name
    _LIB.define(name + torch.library.infer_schema(kernel, mutates_args=mutates))
    native_kernel = torch._C._dispatch_has_kernel_for_dispatch_key(f"encore::{name}", "CompositeExplicitAutograd")
    if not native_kernel:
        _LIB.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"encore::{name}", fake, lib=_LIB)
    if autograd is not None:
        torch.library.register_autograd(f"encore::{name}", autograd[0], setup_context=autograd[1], lib=_LIB)
    overload = getattr(torch.ops.encore, name).default
    setattr(_OPS, name, overload)
    if native_kernel:
        NATIVE[name] = getattr(overload, "_op", overload)  # the dispatcher's entry without OpOverload's Python frame


NATIVE = {}  # op name -> its dispatcher entry, for the ops whose kernel is C++ (encore._encore_torch)


def plain_op(name, a, b):
    """The C++ dispatcher entry of op `name` (NATIVE) when `a` and `b` are plain torch tensors that
    need no gradient and nothing is being traced, else None: the eager fast path of a two-tensor op
    (rms_norm). The dispatcher itself serves dispatch modes and fake tensors; the rest (numpy
    arrays, subclasses, autograd refusals, tracing) takes the general path."""
    t = _TENSOR
    if type(a) is t and type(b) is t and not (a.requires_grad or b.requires_grad or _COMPILING() or _FUNCTION_MODE()):
        return NATIVE.get(name)
    return None


def native(a, name, *others):
    """The dispatcher entry of op `name` when its kernel is C++ and `a` is a plain torch tensor
    (an eager call is then cheaper through it than through the Python launcher), else None; None
    too when one of `others` (the op's other array arguments that are given) is not a plain tensor
    (None included): the Python launcher takes numpy arrays beside torch tensors and names a wrong or
    missing argument, where the dispatcher would raise RuntimeError on its schema."""
    if type(a) is not _TENSOR:
        return None
    for o in others:
        if type(o) is not _TENSOR:
            return None
    return NATIVE.get(name)


def _load_native(torch):
    """Loads encore._encore_torch (C++ kernels for some ops) where the build made it and only under
    the torch it was built against (_encore_torch.version beside it: its C++ ABI is that torch's);
    otherwise, or where loading fails, the Python kernels serve."""
    import glob
    import os

    here = os.path.dirname(__file__)
    try:
        with open(os.path.join(here, "_encore_torch.version")) as f:
            built_for = f.read().strip()
    except OSError:
        return
    if built_for != torch.__version__:
        return
    for path in glob.glob(os.path.join(here, "_encore_torch*.so")):
        try:
            torch.ops.load_library(path)
        except (OSError, RuntimeError) as e:  # built for this torch but not loadable: say so, the Python kernels serve
            import warnings

            warnings.warn(f"encore: {os.path.basename(path)} (C++ op kernels for torch {built_for}) did not load, the Python "
                          f"kernels serve: {e}", RuntimeWarning, stacklevel=2)
            return


def _register_all(torch):
    """The library `encore`: the C++ kernels first (they attach as the schemas are defined), then every
    declared op. Once, when torch is first bound (torch_module)."""
    global _LIB
    _LIB = torch.library.Library("encore", "DEF")
    _load_native(torch)
    for d in _DECLARED:
        _register(*d)


def register_torch_ops():
    """Registers every declared op with torch (once); returns the namespace of their overloads."""
    torch_module()
    return _OPS


def ops():
    """The torch.ops.encore overloads by name (registering them on first use)."""
    return _OPS if _LIB is not None else register_torch_ops()
