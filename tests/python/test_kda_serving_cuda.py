"""encore.kda.fused_recurrent_kda / fused_recurrent_kda_fwd on CUDA tensors (the decode kernel,
src/kda/cuda/kda_decode.cu) and chunk_kda(..., ssm_state_indices=...) on CUDA tensors (the chunked prefill
on the pool: the CUDA forward reading and writing the slots; K or V > 128 the decode kernel) against the
CPU backend (fp64) on the same values: decode on fp32 / bf16 pools with padding, speculative slots with
num_accepted_tokens, fla's fused_recurrent_kda with initial and final state, the varlen prefill with an
empty and a padding sequence; untouched slots bit-identical; bad device indices (out of range, duplicates,
num_accepted_tokens out of [1, S]) refused by name with nothing written on eager calls, and with the check off
(check_indices=False, as under CUDA-graph capture) an out-of-range index gives NaN rows and writes nothing;
host indices with CUDA tensors refused. Skipped without CUDA."""
import pytest

torch = pytest.importorskip("torch")

import encore  # noqa: E402
from encore.kda import chunk_kda, fused_recurrent_kda, fused_recurrent_kda_fwd, kda_forward_pool  # noqa: E402

HAS_CUDA = encore.built_with_cuda() and encore.cuda_device_count() > 0 and torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")

H, HV, K, V = 2, 4, 128, 128
KW = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)


def rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).pow(2).sum() / b.pow(2).sum().clamp_min(1e-300)).sqrt().item()


def inputs(b, t, seed, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    x = (r(b, t, H, K), r(b, t, H, K), r(b, t, HV, V), r(b, t, HV, K), r(b, t, HV))
    gate = dict(A_log=torch.log(torch.rand(HV, generator=gen) + 0.5), dt_bias=0.5 * torch.randn(HV * K, generator=gen))
    return x, gate


def both(x, gate, pool, **kw):
    """(o, pool after) on CUDA and on the CPU backend (fp64) from the same values."""
    cu = [t.cuda() for t in x]
    gcu = {n: t.cuda() for n, t in gate.items()}
    pc = pool.cuda()
    kwc = {n: (t.cuda() if torch.is_tensor(t) else t) for n, t in kw.items()}
    oc, _ = fused_recurrent_kda_fwd(*cu, initial_state=pc, **gcu, **KW, **kwc)
    ph = pool.double()
    oh, _ = fused_recurrent_kda_fwd(*(t.double() for t in x), initial_state=ph, **{n: t.double() for n, t in gate.items()}, **KW, **kw)
    torch.cuda.synchronize()
    return oc.cpu(), pc.cpu(), oh, ph


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_decode_on_the_pool(pool_dtype):
    x, gate = inputs(5, 1, seed=1)
    pool = (0.3 * torch.randn(8, HV, K, V, generator=torch.Generator().manual_seed(2))).to(pool_dtype)
    idx = torch.tensor([5, -1, 2, 7, 0], dtype=torch.int32)
    oc, pc, oh, ph = both(x, gate, pool, ssm_state_indices=idx)
    assert rel(oc, oh) < 5e-3
    assert torch.all(oc[1] == 0)
    for s in range(8):
        if s in (5, 2, 7, 0):
            assert rel(pc[s], ph[s]) < 5e-3
        else:
            assert torch.equal(pc[s], pool[s])


def test_speculative_slots():
    x, gate = inputs(3, 4, seed=3)
    pool = 0.3 * torch.randn(12, HV, K, V, generator=torch.Generator().manual_seed(4))
    idx = torch.tensor([[0, 1, 2, 3], [4, 5, -1, 6], [-1, 8, 9, 10]])
    nat = torch.tensor([2, 1, 1])
    oc, pc, oh, ph = both(x, gate, pool, ssm_state_indices=idx, num_accepted_tokens=nat)
    assert rel(oc, oh) < 5e-3
    for s in range(12):
        if s in range(7):
            assert rel(pc[s], ph[s]) < 5e-3
        else:
            assert torch.equal(pc[s], pool[s])


def test_fused_recurrent_kda_with_states():
    x, gate = inputs(1, 9, seed=5, dtype=torch.float32)
    h0 = 0.3 * torch.randn(3, HV, K, V)
    cu = torch.tensor([0, 4, 4, 9])
    o, ht = fused_recurrent_kda(*(t.cuda() for t in x), **{n: t.cuda() for n, t in gate.items()}, initial_state=h0.cuda(),
                                output_final_state=True, cu_seqlens=cu, **KW)
    o_ref, ht_ref = fused_recurrent_kda(*(t.double() for t in x), **{n: t.double() for n, t in gate.items()}, initial_state=h0.double(),
                                        output_final_state=True, cu_seqlens=cu, **KW)
    assert rel(o, o_ref) < 5e-3 and rel(ht, ht_ref) < 5e-3
    assert torch.equal(ht[1].cpu(), h0[1])  # the empty sequence: its initial state


@pytest.mark.parametrize("bad", ["range", "duplicate", "range_2d", "duplicate_2d", "accepted"])
def test_bad_device_indices_refused_with_nothing_written(bad):
    """Eager calls check device indices from a host copy: ValueError naming the argument, pool and out untouched."""
    x, gate = inputs(3, 1, seed=6)
    pool = torch.randn(4, HV, K, V).cuda()
    before = pool.clone()
    idx, nat, match = {
        "range": ([1, 9, -1], None, r"state_indices: entry \[1\] = 9 is out of the pool's range \[0, 4\)"),
        "duplicate": ([2, 0, 2], None, r"state_indices: slot 2 is used twice"),
        "range_2d": ([[1, 0], [3, 4], [-1, 0]], [1, 2, 1], r"state_indices: entry \[1, 1\] = 4 is out of the pool's range"),
        "duplicate_2d": ([[1, 0], [2, 1], [-1, 0]], [1, 2, 1], r"state_indices: slot 1 is used twice"),
        "accepted": ([[1, 0], [2, 3], [-1, 0]], [1, 3, 1], r"num_accepted_tokens: entry \[1\] = 3 must lie in \[1, S = 2\]"),
    }[bad]
    kw = dict(ssm_state_indices=torch.tensor(idx, device="cuda"))
    if nat is not None:
        kw["num_accepted_tokens"] = torch.tensor(nat, device="cuda")
    out = torch.full((3, 1, HV, V), 7.0, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=match):
        fused_recurrent_kda_fwd(*(t.cuda() for t in x), **{n: t.cuda() for n, t in gate.items()}, initial_state=pool, out=out, **kw,
                                **KW)
    torch.cuda.synchronize()
    assert torch.equal(pool, before) and torch.all(out == 7.0)


def test_explicit_stream_indices_checked_as_written_on_it():
    """stream=: the check reads the indices in that stream's order (written there just before the call)."""
    x, gate = inputs(3, 1, seed=9)
    args = [t.cuda() for t in x]
    g = {n: t.cuda() for n, t in gate.items()}
    pool = torch.randn(4, HV, K, V).cuda()
    before = pool.clone()
    src = torch.tensor([1, 9, -1], dtype=torch.int32, device="cuda")
    idx = torch.zeros(3, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(2_000_000)  # the write below lands well after the current stream could read idx
        idx.copy_(src)
    with pytest.raises(ValueError, match=r"state_indices: entry \[1\] = 9 is out of the pool's range"):
        fused_recurrent_kda_fwd(*args, **g, initial_state=pool, ssm_state_indices=idx, stream=side.cuda_stream, **KW)
    torch.cuda.synchronize()
    assert torch.equal(pool, before)


def test_unchecked_bad_device_index_gives_nan_rows_and_writes_nothing():
    """check_indices=False (the contract under CUDA-graph capture): NaN rows for the bad sequence, nothing written."""
    x, gate = inputs(3, 1, seed=6)
    pool = torch.randn(4, HV, K, V).cuda()
    before = pool.clone()
    o, _ = fused_recurrent_kda_fwd(*(t.cuda() for t in x), **{n: t.cuda() for n, t in gate.items()}, initial_state=pool,
                                   ssm_state_indices=torch.tensor([1, 9, -1], device="cuda"), check_indices=False, **KW)
    torch.cuda.synchronize()
    assert torch.isnan(o[1]).all() and torch.isfinite(o[0]).all() and torch.all(o[2] == 0)
    assert not torch.equal(pool[1], before[1])
    for s in (0, 2, 3):
        assert torch.equal(pool[s], before[s])


def test_graph_capture_skips_the_check():
    """Under torch.cuda.graph the call captures (no host copy) and replays like the eager call."""
    x, gate = inputs(4, 1, seed=8)
    args = [t.cuda() for t in x]
    g = {n: t.cuda() for n, t in gate.items()}
    pool = (0.3 * torch.randn(6, HV, K, V)).cuda()
    ref_pool = pool.clone()
    idx = torch.tensor([5, 0, -1, 3], device="cuda", dtype=torch.int32)
    out = torch.empty(4, 1, HV, V, device="cuda", dtype=torch.bfloat16)
    o_ref, _ = fused_recurrent_kda_fwd(*args, **g, initial_state=ref_pool, ssm_state_indices=idx, **KW)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (the first call's one-time setup)
        fused_recurrent_kda_fwd(*args, **g, initial_state=pool.clone(), ssm_state_indices=idx, out=out, **KW)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_recurrent_kda_fwd(*args, **g, initial_state=pool, ssm_state_indices=idx, out=out, **KW)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, o_ref) and torch.equal(pool, ref_pool)


def test_host_indices_with_cuda_tensors_refused():
    x, gate = inputs(2, 1, seed=7)
    pool = torch.randn(4, HV, K, V).cuda()
    with pytest.raises((RuntimeError, ValueError), match="state_indices: in host memory, but q is on cuda:0"):
        fused_recurrent_kda_fwd(*(t.cuda() for t in x), **{n: t.cuda() for n, t in gate.items()}, initial_state=pool,
                                ssm_state_indices=torch.tensor([0, 1]), **KW)


def prefill_both(x, gate, pool, idx, cu, **kw):
    """chunk_kda on the pool: (o, pool after) on CUDA (device indices) and on the CPU backend (fp64)."""
    pc = pool.cuda()
    with torch.no_grad():
        oc, ret = chunk_kda(*(t.cuda() for t in x), **{n: t.cuda() for n, t in gate.items()}, initial_state=pc,
                            ssm_state_indices=idx.cuda(), cu_seqlens=cu, **kw)
        assert ret is pc
        ph = pool.double()
        oh, _ = chunk_kda(*(t.double() for t in x), **{n: t.double() for n, t in gate.items()}, initial_state=ph,
                          ssm_state_indices=idx, cu_seqlens=cu, **kw)
    torch.cuda.synchronize()
    return oc.cpu(), pc.cpu(), oh, ph


@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_chunk_kda_prefill_on_the_pool(in_dtype, pool_dtype, index_dtype):
    """Varlen 130 / 0 (slot 1: untouched) / 37 (padding, NaN inputs) / 64 tokens on a pool of 6 slots."""
    cu = torch.tensor([0, 130, 130, 167, 231])
    x, gate = inputs(1, 231, seed=11, dtype=in_dtype)
    x[2][:, 130:167] = float("nan")  # the padding sequence's v: never read into the pool
    pool = (0.3 * torch.randn(6, HV, K, V, generator=torch.Generator().manual_seed(12))).to(pool_dtype)
    idx = torch.tensor([4, 1, -1, 0], dtype=index_dtype)
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True)
    oc, pc, oh, ph = prefill_both(x, gate, pool, idx, cu, **kw)
    assert torch.all(oc[:, 130:167] == 0)
    assert torch.isfinite(oc).all()
    assert rel(oc, oh) < 5e-3
    for s in range(6):
        if s in (4, 0):
            assert rel(pc[s], ph[s]) < 5e-3
        else:
            assert torch.equal(pc[s], pool[s])


def test_chunk_kda_prefill_beta_sigmoid_and_wide_heads():
    """beta = sigmoid(beta) (fp32 beta beside bf16 inputs) at K = V = 128; K 200 / V 256 (the decode kernel)."""
    cu = torch.tensor([0, 70, 75])
    x, gate = inputs(1, 75, seed=13)
    pool = 0.3 * torch.randn(3, HV, K, V, generator=torch.Generator().manual_seed(14))
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    oc, pc, oh, ph = prefill_both(x, gate, pool, torch.tensor([2, 0]), cu, **kw)
    assert rel(oc, oh) < 5e-3 and rel(pc[2], ph[2]) < 5e-3 and rel(pc[0], ph[0]) < 5e-3
    assert torch.equal(pc[1], pool[1])
    gen = torch.Generator().manual_seed(15)
    kd, vd = 200, 256
    r = lambda *s: torch.randn(*s, generator=gen).to(torch.bfloat16)  # noqa: E731
    xw = (r(1, 75, H, kd), r(1, 75, H, kd), r(1, 75, HV, vd), r(1, 75, HV, kd), r(1, 75, HV))
    gw = dict(A_log=torch.log(torch.rand(HV, generator=gen) + 0.5), dt_bias=0.5 * torch.randn(HV * kd, generator=gen))
    poolw = 0.3 * torch.randn(3, HV, kd, vd, generator=gen)
    oc, pc, oh, ph = prefill_both(xw, gw, poolw, torch.tensor([1, -1]), cu, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True)
    assert rel(oc, oh) < 5e-3 and rel(pc[1], ph[1]) < 5e-3
    assert torch.all(oc[:, 70:] == 0)
    assert torch.equal(pc[0], poolw[0]) and torch.equal(pc[2], poolw[2])


def test_chunk_kda_prefill_bad_device_index_and_host_indices():
    """An index >= P on the device: ValueError on an eager call, nothing written; unchecked (check_indices=False):
    NaN rows, nothing written; host indices with CUDA tensors refused."""
    cu = torch.tensor([0, 70, 79])
    x, gate = inputs(1, 79, seed=16)
    pool = torch.randn(4, HV, K, V).cuda()
    before = pool.clone()
    args = [t.cuda() for t in x]
    kw = dict(**{n: t.cuda() for n, t in gate.items()}, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, cu_seqlens=cu)
    bad = torch.tensor([7, 2], device="cuda")
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"state_indices: entry \[0\] = 7 is out of the pool's range \[0, 4\)"):
            chunk_kda(*args, initial_state=pool, ssm_state_indices=bad, **kw)
        with pytest.raises(ValueError, match=r"state_indices: slot 2 is used twice"):
            chunk_kda(*args, initial_state=pool, ssm_state_indices=torch.tensor([2, 2], device="cuda"), **kw)
    torch.cuda.synchronize()
    assert torch.equal(pool, before)
    o = kda_forward_pool(*args, pool, bad, A_log=kw["A_log"], dt_bias=kw["dt_bias"], use_qk_l2norm=True, use_gate_in_kernel=True,
                         cu_seqlens=cu, check_indices=False)
    torch.cuda.synchronize()
    assert torch.isnan(o[:, :70]).all() and torch.isfinite(o[:, 70:]).all()
    assert not torch.equal(pool[2], before[2])
    for s in (0, 1, 3):
        assert torch.equal(pool[s], before[s])
    with pytest.raises((RuntimeError, ValueError), match="state_indices: in host memory, but q is on cuda:0"):
        with torch.no_grad():
            chunk_kda(*args, initial_state=pool, ssm_state_indices=torch.tensor([0, 1]), **kw)
