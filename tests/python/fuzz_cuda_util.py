"""Shared by the CUDA property-based tests tests/python/test_fuzz_cuda*.py (the GPU machine; skipped
elsewhere): the same values as a CUDA and a CPU tensor (pair), the relative RMS comparison against the
CPU backend's result (rel, close_to_cpu; NaN and infinities exactly where the reference has them), the
2x rule of a composition against the CPU backend in float32 (within_2x), and CUDA output buffers whose
bytes around the view are canaries (CudaGuard, guarded)."""
import numpy as np

from helpers import torch  # None without torch

DT = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}
TOL = {"bfloat16": 1e-2, "float16": 2e-3, "float32": 1e-5}  # the output rounding (a few ulps at most)
# fp32 statistics of a bf16 / fp16 GEMM (partials, target logits, r, lse, dgamma): fp32 accumulation over K on
# CUDA against the CPU's fp64 (tests/gemm/test_gemm_gpu.cpp bounds them elementwise at 2e-5 plus half a unit
# of the dtype's last place of the largest statistic, where one backend rounds an intermediate): 1e-4 rel-RMS.
STAT_TOL = 1e-4
# The 2x rule's allowance (within_2x) per output dtype: a few units of the dtype's rounding, which both
# backends add to every stored output (bf16: 2^-9 / sqrt(3) ~ 1.1e-3 rel-RMS).
SLACK = {"bfloat16": 4e-3, "float16": 1e-3, "float32": STAT_TOL}


def pair(rng, shape, dt, scale=1.0):
    """The same values as a CUDA tensor and a CPU tensor of dtype `dt` (a torch dtype name)."""
    cpu = torch.from_numpy(scale * rng.standard_normal(shape)).to(getattr(torch, dt))
    return cpu.cuda(), cpu


def rel(got, ref, floor=1e-30):
    """Relative RMS of `got` against `ref` (either device): NaN and +-inf in the same places (the infinities
    equal), the norm over the finite rest; the denominator at least `floor`."""
    g, r = got.detach().double().cpu(), ref.detach().double().cpu()
    assert g.shape == r.shape, (tuple(g.shape), tuple(r.shape))
    assert torch.equal(torch.isnan(g), torch.isnan(r)), "NaN in other places than the reference's"
    inf = torch.isinf(r)
    assert torch.equal(g[inf], r[inf]), "infinities differ from the reference's"
    m = torch.isfinite(r)
    assert torch.isfinite(g[m]).all(), "inf where the reference is finite"
    return float((g[m] - r[m]).norm()) / max(float(r[m].norm()), floor)


def close_to_cpu(got, ref, dt, tol=None, floor=1e-30):
    """The CUDA result against the CPU backend's: relative RMS under the dtype's tolerance (or `tol`)."""
    err = rel(got, ref, floor)
    assert err <= (TOL[dt] if tol is None else tol), (err, dt, tol)


def within_2x(got, ref_dt, ref32, dt):
    """The 2x rule of a composition of ops (blocks, the MoE layer): the CUDA result `got` is at most twice as far
    from the CPU backend in float32 (`ref32`, the same values) as the CPU backend in the inputs' dtype (`ref_dt`,
    every stored intermediate rounded as on CUDA), plus SLACK[dt] of `got`'s dtype. Returns the two errors."""
    err, base = rel(got, ref32), rel(ref_dt, ref32)
    assert err <= 2 * base + SLACK[dt], (err, base, dt)
    return err, base


class CudaGuard:
    """A CUDA output view of `shape` and torch dtype name `dt` inside a NaN-filled buffer: `pad` elements before
    and after, and (2-D) `row_pad` more after each row (a row-strided view). intact(): every byte outside the
    view as before; untouched(): every byte, the view's too (a refused call wrote nothing); set(values): the
    view holds `values` (an in-place operand) and the buffer is taken as it is now."""

    def __init__(self, shape, dt, pad=64, row_pad=0):
        shape = tuple(int(s) for s in shape)
        rows, cols = (shape[0], shape[1]) if len(shape) == 2 else (1, int(np.prod(shape)))
        n = rows * (cols + row_pad)
        self.buffer = torch.full((n + 2 * pad,), float("nan"), dtype=getattr(torch, dt), device="cuda")
        inner = self.buffer[pad:pad + n].view(rows, cols + row_pad)[:, :cols]
        self.view = inner if len(shape) == 2 else inner.reshape(shape)
        mask = torch.zeros(n + 2 * pad, dtype=torch.bool)
        mask[pad:pad + n].view(rows, cols + row_pad)[:, :cols] = True
        self._outside = ~mask
        self._before = self._bytes()

    def _bytes(self):
        return self.buffer.view(torch.uint8).to("cpu", copy=True).view(self.buffer.shape[0], -1)

    def set(self, values):
        self.view.copy_(values)
        self._before = self._bytes()
        return self.view

    def intact(self):
        return torch.equal(self._bytes()[self._outside], self._before[self._outside])

    def untouched(self):
        return torch.equal(self._bytes(), self._before)


def guarded(shape, dt, pad=64):
    """A CUDA output view [shape] inside a buffer whose remaining bytes hold a canary; (view, check)."""
    g = CudaGuard(shape, dt, pad)

    def check():
        assert g.intact()

    return g.view, check
