"""encore.moe_forward_ep / encore.nn.ExpertParallelMoE over gloo process groups of 2 and 4 CPU processes (the
collective path; NCCL takes the same calls on CUDA tensors): expert parallel equals moe_forward on every rank's
tokens in one process bit for bit (ranks with no tokens, experts nobody picks, the grouped sigmoid routing with
a bias and a scaling factor, bf16 and fp32), reruns are identical, tensor parallel equals it to the fp32 sum
order, and a rank with bad inputs makes every rank raise instead of hanging. On CUDA the peer-memory transport
(transport="peer": rows written into the other ranks' GPU memory) equals it bit for bit too. The FP8 dispatch
(e4m3 rows and 1x128 scales) equals moe_forward on the dequantized tokens bit for bit; the residual add + RMSNorm
after the layer equals encore.add_rms_norm on its output; NCCL's inter-node transport is forced on one node."""
import os

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
import encore  # noqa: E402
from helpers import spawn_ranks  # noqa: E402

D, F = 16, 24  # multiples of 8: the CUDA grouped GEMMs take 16-byte rows


def data(counts, E, dtype, seed=0):
    """Every rank's tokens and router logits (the same on every rank: each takes its slice), the weights of all E experts."""
    g = torch.Generator().manual_seed(seed)
    T = sum(counts)
    x = torch.randn(T, D, generator=g).to(dtype)
    logits = torch.randn(T, E, generator=g) * 2.0
    logits[:, E - 1] -= 1e4  # the last expert: never picked
    w13 = (torch.randn(E, 2 * F, D, generator=g) * D ** -0.5).to(dtype)
    w2 = (torch.randn(E, D, F, generator=g) * F ** -0.5).to(dtype)
    bias = torch.randn(E, generator=g) * 0.1
    return x, logits, w13, w2, bias


def check_case(rank, world, case, device="cpu"):
    counts, E, k, dtype, routing = case["counts"], case["E"], case["k"], case["dtype"], dict(case["routing"])
    x, logits, w13, w2, bias = (t.to(device) for t in data(counts, E, dtype))
    if routing.pop("bias", False):
        routing["correction_bias"] = bias
    ref = encore.moe_forward(x, logits, w13, w2, k, **routing)  # every token in one process
    el = E // world
    mine = slice(rank * el, (rank + 1) * el)
    lo = sum(counts[:rank])
    tok = slice(lo, lo + counts[rank])
    out = encore.moe_forward_ep(x[tok], logits[tok], w13[mine], w2[mine], k, **routing)
    assert out.dtype == x.dtype and out.shape == (counts[rank], D)
    assert torch.equal(out, ref[tok]), f"ep: {float((out.float() - ref[tok].float()).abs().max())}"
    again = encore.moe_forward_ep(x[tok], logits[tok], w13[mine], w2[mine], k, **routing)
    assert torch.equal(again, out), "ep rerun differs"
    if device != "cpu":  # the peer-memory transport: the same result bit for bit, twice on the same peer group
        for _ in range(2):
            peer = encore.moe_forward_ep(x[tok], logits[tok], w13[mine], w2[mine], k, transport="peer", **routing)
            assert torch.equal(peer, ref[tok]), f"ep peer: {float((peer.float() - ref[tok].float()).abs().max())}"
    tp = encore.moe_forward_ep(x, logits, w13[mine], w2[mine], k, mode="tp", **routing)
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: two ulps of the largest output (one rounding flip)
    err = float((tp.float() - ref.float()).abs().max() / ref.float().abs().max())
    assert err <= tol, f"tp: {err}"
    # the next residual add + RMSNorm on the layer's output: as encore.add_rms_norm on the plain outputs
    gn = torch.Generator().manual_seed(11)
    res = torch.randn(x.shape, generator=gn).to(dtype).to(device)
    nw = (torch.rand(D, generator=gn) + 0.5).to(dtype).to(device)
    y, h = encore.moe_forward_ep(x[tok], logits[tok], w13[mine], w2[mine], k, residual=res[tok], norm_weight=nw, **routing)
    if counts[rank] > 0:
        y_ref, h_ref = encore.add_rms_norm(out, res[tok], nw)
        assert torch.equal(h, h_ref) and torch.equal(y, y_ref), "ep + add_rms_norm"
    y, h = encore.moe_forward_ep(x, logits, w13[mine], w2[mine], k, mode="tp", residual=res, norm_weight=nw, **routing)
    y_ref, h_ref = encore.add_rms_norm(tp, res, nw)
    assert torch.equal(h, h_ref) and torch.equal(y, y_ref), "tp + add_rms_norm"
    layer = encore.nn.MoE.from_weights(torch.randn(E, D, generator=torch.Generator().manual_seed(3)).to(dtype).to(device), w13, w2, k,
                                       **{n: v for n, v in routing.items() if n != "correction_bias"})
    ep_layer = encore.nn.ExpertParallelMoE.from_layer(layer)
    y = ep_layer(x[tok].view(1, -1, D)).view(-1, D)  # every rank joins, the one without tokens too
    if counts[rank] > 0:  # the router GEMM on the same rows as the module's (CPU GEMM results may depend on M)
        assert torch.equal(y, layer(x[tok])), "ExpertParallelMoE"


def check_fp8(rank, world, device="cpu"):
    """dispatch_fp8: e4m3 rows and 1x128 scales over the wire, dequantized by the receivers; bit-equal to moe_forward
    on the dequantized tokens (and not to moe_forward on the tokens themselves: the fp8 rows do travel)."""
    D8, F8, E, k = 256, 32, 4 * world, 2
    counts = {1: [29], 2: [17, 0], 4: [11, 0, 23, 5]}[world]
    g = torch.Generator().manual_seed(5)
    T = sum(counts)
    x = (torch.randn(T, D8, generator=g) * 3).to(torch.bfloat16).to(device)
    logits = (torch.randn(T, E, generator=g) * 2).to(device)
    w13 = (torch.randn(E, 2 * F8, D8, generator=g) * D8 ** -0.5).to(torch.bfloat16).to(device)
    w2 = (torch.randn(E, D8, F8, generator=g) * F8 ** -0.5).to(torch.bfloat16).to(device)
    q, scales = encore.fp8_group_quant(x)
    xq = (q.to(torch.float32) * scales.repeat_interleave(128, dim=1)).to(torch.bfloat16)
    ref = encore.moe_forward(xq, logits, w13, w2, k)
    assert not torch.equal(ref, encore.moe_forward(x, logits, w13, w2, k)), "the fp8 round trip changed nothing: no test"
    el = E // world
    mine = slice(rank * el, (rank + 1) * el)
    lo = sum(counts[:rank])
    tok = slice(lo, lo + counts[rank])
    transports = ["collective"] + (["peer", "peer"] if device != "cpu" else [])
    for transport in transports:
        out = encore.moe_forward_ep(x[tok], logits[tok], w13[mine], w2[mine], k, transport=transport, dispatch_fp8=True)
        assert out.dtype == torch.bfloat16 and torch.equal(out, ref[tok]), \
            f"{transport} fp8: {float((out.float() - ref[tok].float()).abs().max())}"
    with pytest.raises(ValueError, match=r"dispatch_fp8: needs mode 'ep'"):  # refused on every rank
        encore.moe_forward_ep(x, logits, w13[mine], w2[mine], k, mode="tp", dispatch_fp8=True)
    if world > 1:  # ranks disagreeing on dispatch_fp8: every rank raises, none waits
        for transport in transports[:2]:
            with pytest.raises(ValueError, match=r"dispatch_fp8 differs between the ranks"):
                encore.moe_forward_ep(x[tok], logits[tok], w13[mine], w2[mine], k, transport=transport, dispatch_fp8=rank == 0)


def check_bad_input(rank, world):
    """Rank 1 passes w13 with D - 1 columns: every rank raises, naming rank 1, and nothing waits."""
    x, logits, w13, w2, _ = data([5] * world, 4 * world, torch.float32)
    el = 4
    w = w13[rank * el:(rank + 1) * el]
    if rank == 1:
        w = w[:, :, :-1]
    with pytest.raises(ValueError, match=r"rank 1: w13: expected"):
        encore.moe_forward_ep(x[:5], logits[:5], w, w2[rank * el:(rank + 1) * el], 2)
    with pytest.raises(ValueError, match=r"rank 1: transport 'peer': needs CUDA tensors"):  # CPU tensors: refused on every rank
        encore.moe_forward_ep(x[:5], logits[:5], w13[rank * el:(rank + 1) * el], w2[rank * el:(rank + 1) * el], 2, transport="peer")
    res = torch.zeros(5 if rank != 1 else 4, D)  # rank 1's residual has a row too few: every rank raises, in both modes
    for mode, xs, ls in (("ep", x[:5], logits[:5]), ("tp", x[:5], logits[:5])):
        with pytest.raises(ValueError, match=r"rank 1: residual: expected"):
            encore.moe_forward_ep(xs, ls, w13[rank * el:(rank + 1) * el], w2[rank * el:(rank + 1) * el], 2, mode=mode, residual=res,
                                  norm_weight=torch.ones(D))
    with pytest.raises(ValueError, match=r"transport: must be 'collective' or 'peer'"):
        encore.moe_forward_ep(x[:5], logits[:5], w13[rank * el:(rank + 1) * el], w2[rank * el:(rank + 1) * el], 2, transport="nvls")


def worker(rank, world, init, names, backend, errq):
    try:
        device = "cpu"
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device = f"cuda:{rank}"
        if "force_net" in names:  # NCCL's inter-node transport between GPUs of one node: no P2P, no shared memory
            os.environ.update(NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1")
            names = [n for n in names if n != "force_net"]
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
        for name in names:
            if name == "bad_input":
                check_bad_input(rank, world)
            elif name == "fp8":
                check_fp8(rank, world, device)
            else:  # moe_forward on CUDA takes bf16: the fp32 cases run in bf16 there
                case = CASES[name] if device == "cpu" else dict(CASES[name], dtype=torch.bfloat16)
                check_case(rank, world, case, device)
        # every rank past its last collective before any tears the group down (CI once saw rank 1 abort at exit,
        # "terminate called without an active exception", after both ranks had passed every check)
        dist.barrier()
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 (sent to the parent, which fails the test with it)
        errq.put(f"rank {rank}: {e!r}")
        raise


def spawn(world, names, backend="gloo"):
    if not dist.is_available() or not (dist.is_gloo_available() if backend == "gloo" else dist.is_nccl_available()):
        pytest.skip(f"torch.distributed with {backend} is not available")
    spawn_ranks(worker, world, names, backend)


CASES = {  # by world size (the length of counts: tokens per rank)
    "ep1_fp32": dict(counts=[37], E=8, k=3, dtype=torch.float32, routing={}),
    "ep1_bf16": dict(counts=[61], E=8, k=2, dtype=torch.bfloat16, routing={"align_m": 8}),
    "ep2_softmax_fp32": dict(counts=[37, 0], E=8, k=3, dtype=torch.float32, routing={}),
    "ep4_softmax_bf16": dict(counts=[13, 1, 40, 7], E=8, k=2, dtype=torch.bfloat16, routing={"align_m": 8}),
    "ep4_grouped_sigmoid_bias": dict(counts=[9, 20, 0, 33], E=16, k=4, dtype=torch.float32,
                                     routing={"scoring": "sigmoid", "n_group": 4, "topk_group": 2, "bias": True,
                                              "routed_scaling_factor": 2.5}),
}


@pytest.mark.parametrize("world", [2, 4])
def test_ep_equals_one_process(world):
    """One process group per world size runs its cases (and, at world 2, the bad-input check)."""
    names = [n for n, c in CASES.items() if len(c["counts"]) == world] + ["fp8"] + (["bad_input"] if world == 2 else [])
    spawn(world, names)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_nccl_on_cuda(world):
    """The same cases on CUDA tensors over NCCL, one process per GPU (world 1 on a single GPU: the CUDA kernels and
    NCCL's calls with one rank); skipped without that many GPUs."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < world or not encore.built_with_cuda():
        pytest.skip(f"needs {world} CUDA device(s) and encore built with CUDA")
    spawn(world, [n for n, c in CASES.items() if len(c["counts"]) == world] + ["fp8"], backend="nccl")


@pytest.mark.parametrize("world", [2, 4])
def test_nccl_inter_node_transport_forced(world):
    """The collective path is the inter-node path (NCCL's all-to-all-v picks its network transport across
    nodes): here forced between the GPUs of one node (NCCL_P2P_DISABLE, NCCL_SHM_DISABLE), the same cases."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < world or not encore.built_with_cuda():
        pytest.skip(f"needs {world} CUDA devices and encore built with CUDA")
    spawn(world, ["force_net"] + [n for n, c in CASES.items() if len(c["counts"]) == world], backend="nccl")
