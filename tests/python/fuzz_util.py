"""Shared by the property-based tests tests/python/test_fuzz_*.py (hypothesis, fixed seeds): the
settings of the valid and invalid draws, input arrays from a drawn seed in the drawn framework and
dtype, row-strided views, output buffers guarded by canary bytes, the float64 comparison and the
refusal check (ValueError or TypeError naming the argument, canaries intact), and the autouse fixture
one_torch_thread each fuzz module imports."""
import re

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from helpers import torch  # noqa: E402  (None without torch)

_QUIET = list(HealthCheck)
# derandomize: the examples follow from the test's name alone, so a CI failure reproduces anywhere.
VALID = settings(max_examples=200, deadline=None, derandomize=True, database=None, suppress_health_check=_QUIET)
INVALID = settings(max_examples=100, deadline=None, derandomize=True, database=None, suppress_health_check=_QUIET)

SEEDS = st.integers(0, 2**32 - 1)
# Frameworks and dtypes of the CPU backend: "np<bits>" numpy float, "t<name>" CPU torch.
NP_KINDS = ("np32", "np16", "np64")
TORCH_KINDS = ("t32", "tbf16", "t16") if torch is not None else ()
_EPS = {"float64": 2.0**-53, "float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}
_TINY = {"float64": 1e-300, "float32": 1.5e-45, "float16": 6e-8, "bfloat16": 1e-38}


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """One torch thread while a fuzz module runs (imported by each: an autouse fixture): the draws' arrays
    are tiny, and a thread pool on a loaded machine makes each torch call ~100x slower."""
    if torch is None:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def kinds(*allowed):
    """The available kinds among `allowed` (torch kinds only with torch)."""
    return [k for k in allowed if k in NP_KINDS or k in TORCH_KINDS]


def dtype_name(a):
    return str(a.dtype).rsplit(".", 1)[-1]


def is_torch(a):
    return torch is not None and isinstance(a, torch.Tensor)


def np_dtype(kind):
    return {"np32": np.float32, "np16": np.float16, "np64": np.float64}[kind]


def torch_dtype(kind):
    return {"t32": torch.float32, "tbf16": torch.bfloat16, "t16": torch.float16}[kind]


def make(values, kind):
    """The float64 numpy `values` as a contiguous array of `kind` (rounded to its dtype)."""
    values = np.asarray(values, np.float64)
    if kind.startswith("np"):
        return np.ascontiguousarray(values.astype(np_dtype(kind)))
    return torch.from_numpy(values.copy()).to(torch_dtype(kind))


def as_float64(a):
    """a in float64 in its own framework (a wrong-dtype input for the invalid draws)."""
    return a.double() if is_torch(a) else np.asarray(a, np.float64)


def f64(a):
    """Any array (numpy, torch of any float / int dtype) as float64 numpy."""
    if is_torch(a):
        a = a.detach()
        return (a.double() if a.is_floating_point() else a.to(torch.float64)).numpy()
    return np.asarray(a, np.float64)


def bits(a):
    """The bytes of an array as a uint8 numpy array of its shape + (itemsize,) (a copy)."""
    if is_torch(a):
        a = a.detach().contiguous()
        return a.view(torch.uint8).numpy().reshape(tuple(a.shape) + (-1,)).copy()
    a = np.ascontiguousarray(a)
    return a.view(np.uint8).reshape(a.shape + (-1,)).copy()


def same_values(a, b):
    """Equal values, NaN where the other has NaN (NaN payloads may differ)."""
    return np.array_equal(f64(a), f64(b), equal_nan=True)


def empty_like_kind(shape, like):
    """An uninitialized contiguous array of `shape` on like's framework in like's dtype."""
    if is_torch(like):
        return torch.empty(shape, dtype=like.dtype)
    return np.empty(shape, like.dtype)


def aligned_empty(shape, dtype, align=64):
    """A numpy array whose data is `align`-byte aligned (numpy guarantees 16 at most)."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(n + align, np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off:off + n].view(dtype).reshape(shape)


def strided(a, pad):
    """A view with a's values whose rows (first dimension of a 2-D array) are `pad` elements longer than
    needed: a slice of a wider buffer (pad 0: `a` itself)."""
    if pad == 0 or a.ndim != 2:
        return a
    rows, cols = a.shape
    if is_torch(a):
        buf = torch.zeros((rows, cols + pad), dtype=a.dtype)
    else:
        buf = aligned_empty((rows, cols + pad), a.dtype)
        buf[...] = 0
    buf[:, :cols] = a
    return buf[:, :cols]


class Guard:
    """An output buffer of `shape` as a view into a larger array filled with sentinel bytes: `lead`
    extra rows above and below, `offset` extra elements before and `pad` after each row. intact()
    says whether every byte outside the view is still the sentinel."""

    SENTINEL = 0xA5

    def __init__(self, shape, like, dtype=None, pad=3, offset=1, lead=1, align=64):
        """like: an array giving the framework (and the dtype unless `dtype`, of that framework, is given)."""
        shape = tuple(int(s) for s in shape)
        big = (shape[0] + 2 * lead,) + shape[1:-1] + (offset + shape[-1] + pad,) if len(shape) > 1 else (offset + shape[0] + 2 * lead + pad,)
        if is_torch(like):
            dt = dtype if dtype is not None else like.dtype
            nbytes = int(np.prod(big)) * torch.empty((), dtype=dt).element_size()
            raw = torch.full((nbytes + align,), self.SENTINEL, dtype=torch.uint8)
            skip = (-raw.data_ptr()) % align
            self.buffer = raw[skip:skip + nbytes].view(dt).reshape(big)
        else:
            dt = np.dtype(dtype if dtype is not None else like.dtype)
            self.buffer = aligned_empty(big, dt, align)
            self.buffer.view(np.uint8)[...] = self.SENTINEL
        index = (slice(lead, lead + shape[0]),) + (slice(None),) * (len(shape) - 2)
        if len(shape) > 1:
            index += (slice(offset, offset + shape[-1]),)
        else:
            index = (slice(lead + offset, lead + offset + shape[0]),)
        self.view = self.buffer[index]
        mask = np.zeros(big, bool)
        mask[index] = True
        self._outside = ~mask
        self._before = bits(self.buffer)

    def set(self, values):
        """Writes `values` into the view and takes them as the buffer's state to compare against."""
        self.view[...] = values
        self._before = bits(self.buffer)
        return self.view

    def intact(self):
        """Every byte outside the view is as before."""
        return np.array_equal(bits(self.buffer)[self._outside], self._before[self._outside])

    def untouched(self):
        """Every byte of the buffer, the view's included, is as before (a refused call wrote nothing)."""
        return np.array_equal(bits(self.buffer), self._before)


def names_in(msg, names):
    """Whether the message names one of `names` as a word (not inside another identifier)."""
    return any(re.search(r"(?<![\w.])" + re.escape(n) + r"(?![\w])", msg) for n in names)


def refused(call, names, guards=(), kinds=(ValueError, TypeError)):
    """call() raises ValueError (or TypeError) whose message names one of `names`, and every guard's
    canary bytes are intact; returns the message."""
    with pytest.raises(kinds) as info:
        call()
    msg = str(info.value)
    assert names_in(msg, names), f"message does not name {names}: {msg!r}"
    for g in guards:
        assert g.untouched(), f"a refused call wrote into a guarded buffer ({msg!r})"
    return msg


def close(out, ref, dtype, rtol_ulps=2.0, atol=0.0):
    """out (any array) against the float64 reference elementwise: |out - ref| <= rtol·|ref| + atol + a
    floor for subnormals, rtol = rtol_ulps · eps(dtype); NaN / inf exactly where the reference has them."""
    o, r = f64(out), np.asarray(ref, np.float64)
    assert o.shape == r.shape, (o.shape, r.shape)
    bad_nan = np.isnan(o) != np.isnan(r)
    assert not bad_nan.any(), f"NaN at {np.argwhere(bad_nan)[:4].tolist()}: out {o[bad_nan][:4]} ref {r[bad_nan][:4]}"
    inf = np.isinf(r)
    assert np.array_equal(o[inf], r[inf]), "infinities differ"
    fin = np.isfinite(r)
    name = str(dtype).rsplit(".", 1)[-1]
    eps, tiny = _EPS[name], _TINY[name]
    err = np.abs(o[fin] - r[fin])
    lim = rtol_ulps * eps * np.abs(r[fin]) + atol + 8 * tiny
    if err.size:
        worst = int(np.argmax(err - lim))
        assert (err <= lim).all(), f"max excess at {worst}: out {o[fin][worst]!r} ref {r[fin][worst]!r} (dtype {name})"


def inject(values, rng, prob, specials=(np.nan, np.inf, -np.inf)):
    """values with a few elements (probability prob each) replaced by NaN / ±inf (a copy)."""
    v = np.array(values, np.float64)
    hit = rng.random(v.shape) < prob
    v[hit] = rng.choice(np.array(specials), size=int(hit.sum()))
    return v
