"""Shared by the tests in tests/python (imported as `helpers`: pytest puts this folder on sys.path):
random fp32 inputs, the relative error, the RoPE reference, the optional torch import and the CUDA
skip markers."""
import numpy as np
import pytest

import encore

try:
    import torch
except ImportError:  # torch is optional on the CPU machines
    torch = None

rng = np.random.default_rng()


def randn(*shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(np.float32)


def rel(a, b):
    return np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(b), 1e-30)


def rope_ref(z, pos, freq):
    f = freq[0::2].astype(np.float64) + freq[1::2].astype(np.float64)
    th = 2 * np.pi * pos[:, None].astype(np.float64) * f[None, :]
    a, b = z[:, 0::2], z[:, 1::2]
    out = np.empty_like(z)
    out[:, 0::2] = a * np.cos(th) - b * np.sin(th)
    out[:, 1::2] = b * np.cos(th) + a * np.sin(th)
    return out


# A CUDA build of encore with a visible device (the tests import torch themselves, importorskip).
needs_cuda_device = pytest.mark.skipif(not (encore.built_with_cuda() and encore.cuda_device_count() > 0),
                                       reason="needs a CUDA device")
# torch with CUDA and a CUDA build of encore.
needs_torch_cuda = pytest.mark.skipif(torch is None or not torch.cuda.is_available() or not encore.built_with_cuda(),
                                      reason="needs torch with CUDA and a CUDA build of encore")


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(target, world, *args, timeout=300):
    """Runs target(rank, world, init_method, *args, errq) in `world` fresh processes (torch.multiprocessing,
    spawn), one per rank of a process group the target creates with init_method; fails the calling test with
    every rank's error (a target puts f"rank {rank}: {e!r}" on errq) or when a rank hangs past `timeout` s."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    errq = ctx.SimpleQueue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=target, args=(r, world, init, *args, errq)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    errors = []
    while not errq.empty():
        errors.append(errq.get())
    assert not alive, "a rank hung"
    assert not errors and all(p.exitcode == 0 for p in procs), errors or [p.exitcode for p in procs]


def dispatch_recorder():
    """A TorchDispatchMode that records the name of every op dispatched under it (in `.ops`)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    return Seen()
