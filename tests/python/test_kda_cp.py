"""chunk_kda with cp_group (context parallelism) over a gloo process group of 2 and 4 CPU processes: each rank's
output and gradients of its slice against chunk_kda on the whole batch in one process (float64: equal to
rounding), dA_log / dt_bias summed over the ranks; sequences crossing ranks, one spanning all, short ones."""
import socket

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
import encore  # noqa: E402

H, K, V = 2, 8, 6


def inputs(T, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, sd=1.0: (torch.randn(*s, generator=g, dtype=torch.float64) * sd)  # noqa: E731
    return {"q": r(1, T, H, K), "k": r(1, T, H, K, sd=0.4), "v": r(1, T, H, V), "g": r(1, T, H, K, sd=2.0),
            "beta": torch.rand(1, T, H, generator=g, dtype=torch.float64) * 0.8 + 0.1,
            "A_log": r(H, sd=0.5), "dt_bias": r(H * K, sd=0.5)}, r(1, T, H, V)


def run(t, cu, group=None, sl=slice(None)):
    leaves = {n: x[:, sl].clone().requires_grad_(True) if x.dim() > 1 else x.clone().requires_grad_(True) for n, x in t.items()}
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


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("cu,bounds", [
    ([0, 150, 220, 520], [0, 130, 260, 390, 520]),   # sequences crossing ranks, CP 4
    ([0, 400], [0, 100, 200, 300, 400]),             # one sequence over every rank
    ([0, 10, 25, 60, 61, 90, 130, 200], [0, 100, 200]),  # many short sequences, CP 2
])
def test_cp_equals_the_whole_batch(cu, bounds):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    errq = ctx.SimpleQueue()
    world = len(bounds) - 1
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=worker, args=(r, world, init, cu, bounds, errq)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    errors = []
    while not errq.empty():
        errors.append(errq.get())
    assert not alive, "a rank hung"
    assert not errors and all(p.exitcode == 0 for p in procs), errors or [p.exitcode for p in procs]


def test_cp_refuses_states_and_cuda():
    t, _ = inputs(16)
    with pytest.raises(ValueError, match="initial_state"):
        encore.chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=torch.zeros(1, H, K, V, dtype=torch.float64),
                         cu_seqlens=torch.tensor([0, 16]), cp_group=object())
    with pytest.raises(ValueError, match="output_final_state"):
        encore.chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], output_final_state=True, cu_seqlens=torch.tensor([0, 16]),
                         cp_group=object())
