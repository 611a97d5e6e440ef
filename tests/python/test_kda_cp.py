"""chunk_kda with cp_group (context parallelism) over a gloo process group of 2 and 4 CPU processes: each rank's
output and gradients of its slice against chunk_kda on the whole batch in one process (float64: equal to
rounding), dA_log / dt_bias summed over the ranks; sequences crossing ranks, one spanning all, short ones.
The ranks emulated in one process (an exchange object as cp_group that hands each rank the contributions
precomputed with _kda_cp's own summary functions): on CPU (float64, exact) and on CUDA (float32 / bf16
against the unsplit CUDA chunk_kda and float64 on the CPU); NCCL over >= 2 GPUs (skipped with fewer)."""
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
import encore  # noqa: E402
from helpers import spawn_ranks  # noqa: E402

H, K, V = 2, 8, 6


def inputs(T, seed=0, dims=(H, K, V)):
    H, K, V = dims
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, sd=1.0: (torch.randn(*s, generator=g, dtype=torch.float64) * sd)  # noqa: E731
    return {"q": r(1, T, H, K), "k": r(1, T, H, K, sd=0.4), "v": r(1, T, H, V), "g": r(1, T, H, K, sd=2.0),
            "beta": torch.rand(1, T, H, generator=g, dtype=torch.float64) * 0.8 + 0.1,
            "A_log": r(H, sd=0.5), "dt_bias": r(H * K, sd=0.5)}, r(1, T, H, V)


def leaves_of(t, sl=slice(None), device="cpu", dtype=None):
    """Fresh leaves of the slice sl of t on device (q, k, v, g, beta in dtype; A_log, dt_bias float32 on CUDA)."""
    def leaf(n, x):
        x = x[:, sl] if x.dim() > 1 else x
        if n in ("A_log", "dt_bias"):
            x = x.float() if device != "cpu" else x
        elif dtype is not None:
            x = x.to(dtype)
        return x.to(device).clone().requires_grad_(True)
    return {n: leaf(n, x) for n, x in t.items()}


def run(t, cu, group=None, sl=slice(None), device="cpu", dtype=None):
    leaves = leaves_of(t, sl, device, dtype)
    kw = dict(A_log=leaves["A_log"], dt_bias=leaves["dt_bias"], use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
              cu_seqlens=torch.tensor(cu), cp_group=group)
    o, _ = encore.chunk_kda(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], **kw)
    return o, leaves


def worker(rank, world, init, cu, bounds, errq):
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        T = cu[-1]
        t, cot = inputs(T)
        o_ref, lr = run(t, cu)
        (o_ref * cot).sum().backward()
        sl = slice(bounds[rank], bounds[rank + 1])
        o, lc = run(t, cu, dist.group.WORLD, sl)
        (o * cot[:, sl]).sum().backward()

        def close(a, b, what):
            err = float((a - b).norm() / b.norm().clamp_min(1e-300))
            assert err < 1e-10, f"rank {rank} {what}: {err}"
        close(o, o_ref[:, sl], "o")
        for n in ("q", "k", "v", "g", "beta"):
            close(lc[n].grad, lr[n].grad[:, sl], "d" + n)
        for n in ("A_log", "dt_bias"):
            gsum = lc[n].grad.clone()
            dist.all_reduce(gsum)
            close(gsum, lr[n].grad, "d" + n)
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 (sent to the parent, which fails the test with it)
        errq.put(f"rank {rank}: {e!r}")
        raise


@pytest.mark.parametrize("cu,bounds", [
    ([0, 150, 220, 520], [0, 130, 260, 390, 520]),   # sequences crossing ranks, CP 4
    ([0, 400], [0, 100, 200, 300, 400]),             # one sequence over every rank
    ([0, 10, 25, 60, 61, 90, 130, 200], [0, 100, 200]),  # many short sequences, CP 2
])
def test_cp_equals_the_whole_batch(cu, bounds):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    spawn_ranks(worker, len(bounds) - 1, cu, bounds)


def test_cp_refuses_states_and_cuda():
    t, _ = inputs(16)
    with pytest.raises(ValueError, match="initial_state"):
        encore.chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=torch.zeros(1, H, K, V, dtype=torch.float64),
                         cu_seqlens=torch.tensor([0, 16]), cp_group=object())
    with pytest.raises(ValueError, match="output_final_state"):
        encore.chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], output_final_state=True, cu_seqlens=torch.tensor([0, 16]),
                         cp_group=object())


def rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


class EmulatedExchange:
    """cp_group for one emulated rank: all_gather hands out the contributions of every rank, precomputed for
    each call in order (slice lengths, forward summaries, backward summaries), after checking its own."""

    def __init__(self, rank, calls):
        self.rank, self.world_size, self.calls, self.i = rank, len(calls[0]), calls, 0

    def all_gather(self, t):
        parts = self.calls[self.i]
        self.i += 1
        own = parts[self.rank].to(t.device)
        assert t.shape == own.shape and torch.allclose(t, own, rtol=1e-6, atol=1e-7), f"rank {self.rank}: call {self.i} differs"
        return [p.to(t.device) for p in parts]


def emulated(t, cot, cu, bounds, device, dtype):
    """Each rank's o and leaves (chunk_kda with an EmulatedExchange), ranks run one after the other."""
    from encore import _encore
    from encore import _kda_cp
    from encore.kda import _opts

    split = _encore.kda_cp_split(cu, bounds)
    opts = _opts(None, True, True, None)
    sizes, fwd, bwd = [], [], []
    for r, (local, pre, post) in enumerate(split):
        sl = slice(bounds[r], bounds[r + 1])
        lv = leaves_of(t, sl, device, dtype)
        x = [lv[n].detach() for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")]
        cu_local = torch.tensor(local, dtype=torch.long)
        sizes.append(torch.tensor([bounds[r + 1] - bounds[r]], dtype=torch.long))
        fwd.append(_kda_cp._forward_packed(*x, cu_local, opts, post))
        d_o = cot[:, sl].to(device=device, dtype=x[2].dtype).contiguous()
        bwd.append(_kda_cp._backward_packed(*x, cu_local, opts, pre, d_o))
    outs = []
    for r in range(len(split)):
        sl = slice(bounds[r], bounds[r + 1])
        ex = EmulatedExchange(r, [sizes, fwd, bwd])
        o, lv = run(t, cu, ex, sl, device, dtype)
        (o.double() * cot[:, sl].to(device)).sum().backward()
        assert ex.i == 3, f"rank {r}: {ex.i} exchanges, expected 3 (slice lengths, forward, backward)"
        outs.append((o, lv))
    return outs


CUDA_DIMS = (2, 64, 64)  # H, K, V of the CUDA tests (the chunk kernels' usual tiles)


def check_emulated(cu, bounds, device, dtype, tol):
    T = cu[-1]
    t, cot = inputs(T, seed=3, dims=CUDA_DIMS if device != "cpu" else (H, K, V))
    if dtype is not None:  # the inputs rounded to dtype, so every run sees the same values
        t = {n: (x.to(dtype).double() if n not in ("A_log", "dt_bias") else x.float().double()) for n, x in t.items()}
    o_ref, lr = run(t, cu)  # float64 on the CPU
    (o_ref * cot).sum().backward()
    unsplit = None
    if device != "cpu":
        o_u, lu = run(t, cu, None, slice(None), device, dtype)
        (o_u.double() * cot.to(device)).sum().backward()
        unsplit = (o_u, lu)
    outs = emulated(t, cot, cu, bounds, device, dtype)
    cat = lambda xs: torch.cat([x.detach().double().cpu() for x in xs], dim=1)  # noqa: E731
    got = {"o": cat([o for o, _ in outs])}
    for n in ("q", "k", "v", "g", "beta"):
        got["d" + n] = cat([lv[n].grad for _, lv in outs])
    for n in ("A_log", "dt_bias"):
        got["d" + n] = sum(lv[n].grad.double().cpu() for _, lv in outs)
    want = {"o": o_ref, **{"d" + n: lr[n].grad for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")}}
    errors = {}
    for n in got:
        fragile = n in ("dg", "dbeta", "dA_log", "dt_bias", "ddt_bias")
        errors[n] = rel(got[n], want[n])
        limit = tol * (2 if fragile else 1)
        assert errors[n] < limit, f"{n}: {errors[n]:.2e} against float64 (limit {limit:.0e}); all: {errors}"
        if unsplit is not None:
            u = unsplit[0] if n == "o" else unsplit[1][n[1:]].grad
            e = rel(got[n], u)
            assert e < limit, f"{n}: {e:.2e} against the unsplit CUDA chunk_kda (limit {limit:.0e})"
    print(f"[ cp emulated {device} {dtype} ] " + " ".join(f"{n} {e:.1e}" for n, e in errors.items()))


def test_torch_merge_equals_the_reference_merge():
    from encore import _kda_cp

    hv, k, v = 3, 5, 4
    g = torch.Generator().manual_seed(1)
    parts = [torch.randn(hv * k * (v + k), generator=g, dtype=torch.float64) for _ in range(4)]
    for ranks in ([0], [2, 0, 3], range(3, 0, -1)):
        want = _kda_cp._merge(parts, ranks, hv, k, v)  # the CPU reference
        assert rel(_kda_cp._merge_torch(parts, ranks, hv, k, v), want) < 1e-14


def test_summary_binding_on_cpu():
    """The summary entry points as _kda_cp calls them on CUDA, on CPU tensors: no workspace, the reference."""
    from encore import _encore
    from encore import _kda_cp
    from encore.kda import _opts

    t, cot = inputs(70, seed=2)
    x = [t[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")]
    cu = torch.tensor([0, 30, 70], dtype=torch.long)
    opts = _opts(None, True, True, None)
    S, M = torch.empty(H, K, V, dtype=torch.float64), torch.empty(H, K, K, dtype=torch.float64)
    for d_o in (None, cot):
        kind = "kda_cp_forward_summary" if d_o is None else "kda_cp_backward_summary"
        fwd = _encore.KdaForwardArgs(**{n: t[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")}, cu_seqlens=cu)
        args = _encore.KdaCpSummaryArgs(fwd=fwd, d_o=d_o, piece=1, S=S, M=M)
        assert getattr(_encore, kind + "_workspace")(args, opts) == 0
        getattr(_encore, kind + "_run")(args, opts, None, 0)
        want = _kda_cp._summary(*x, cu, opts, 1, d_o=d_o)
        assert torch.equal(torch.cat((S.flatten(), M.flatten())), want)


LAYOUTS = [([0, 150, 220, 520], [0, 130, 260, 390, 520]), ([0, 400], [0, 100, 250, 400]),
           ([0, 10, 25, 60, 61, 90, 130, 200], [0, 100, 200])]


@pytest.mark.parametrize("cu,bounds", LAYOUTS)
def test_cp_emulated_ranks_cpu(cu, bounds):
    check_emulated(cu, bounds, "cpu", None, 1e-10)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("cu,bounds", LAYOUTS)
def test_cp_emulated_ranks_cuda(cu, bounds, dtype):
    if not torch.cuda.is_available() or not hasattr(encore._encore, "kda_cp_forward_summary_workspace"):
        pytest.skip("needs a CUDA device and a CUDA build")
    check_emulated(cu, bounds, "cuda", getattr(torch, dtype), 5e-3)


def nccl_worker(rank, world, init, cu, bounds, errq):
    try:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world)
        t, cot = inputs(cu[-1], seed=5, dims=CUDA_DIMS)
        t = {n: x.float().double() for n, x in t.items()}  # float32 values throughout
        o_ref, lr = run(t, cu)
        (o_ref * cot).sum().backward()
        sl = slice(bounds[rank], bounds[rank + 1])
        o, lc = run(t, cu, dist.group.WORLD, sl, "cuda", torch.float32)
        (o.double() * cot[:, sl].cuda()).sum().backward()
        errs = {"o": rel(o, o_ref[:, sl])}
        for n in ("q", "k", "v", "g", "beta"):
            errs["d" + n] = rel(lc[n].grad, lr[n].grad[:, sl])
        for n in ("A_log", "dt_bias"):
            gsum = lc[n].grad.clone()
            dist.all_reduce(gsum)
            errs["d" + n] = rel(gsum, lr[n].grad)
        bad = {n: e for n, e in errs.items() if e > (1e-2 if n in ("dg", "dbeta", "dA_log", "ddt_bias") else 5e-3)}
        assert not bad, f"rank {rank}: {errs}"
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 (sent to the parent, which fails the test with it)
        errq.put(f"rank {rank}: {e!r}")
        raise


def test_cp_nccl_equals_the_whole_batch():
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2 or not dist.is_nccl_available():
        pytest.skip("needs >= 2 CUDA devices and NCCL")
    world = min(torch.cuda.device_count(), 4)
    cu, bounds = [0, 150, 220, 520], [0, 130, 260, 390, 520][:world] + [520]
    spawn_ranks(nccl_worker, world, cu, bounds)
