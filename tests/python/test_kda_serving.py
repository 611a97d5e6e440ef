"""KDA for serving engines on the CPU backend (encore.kda.fused_recurrent_kda, fused_recurrent_kda_fwd,
chunk_kda(ssm_state_indices=...)): fla-core 0.6.0's signatures and semantics against a numpy token
recurrence; decode on a state pool (padding slots, untouched slots bit-identical, speculative slots);
one KDA layer serving a mix of requests equal to chunk_kda over each whole sequence (fp32 and bf16
pools); bad input refused with nothing written; no autograd; torch.compile."""
import inspect

import numpy as np
import pytest

from helpers import rel

torch = pytest.importorskip("torch")

import encore  # noqa: E402
from encore.kda import chunk_kda, fused_recurrent_kda, fused_recurrent_kda_fwd  # noqa: E402

H, HV, K, V = 2, 4, 16, 8  # grouped value heads (HV = 2H), K != V
HAS_CUDA = encore.built_with_cuda() and encore.cuda_device_count() > 0 and torch.cuda.is_available()


def fla_ref(q, k, v, g, beta, scale=None, h0=None, cu=None, A_log=None, dt_bias=None, l2=False, gate=False, lower_bound=None,
            beta_sigmoid=False, neg=False):
    """fla's fused_recurrent_kda_fwd_kernel per token, in fp64 numpy (o, final states [N, HV, K, V])."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    b, t, h, kd = q.shape
    hv, vd = v.shape[2], v.shape[3]
    scale = kd ** -0.5 if scale is None else scale
    seqs = [(i, 0, t) for i in range(b)] if cu is None else [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    o = np.zeros(v.shape)
    fin = np.zeros((len(seqs), hv, kd, vd))
    for n, (bi, t0, t1) in enumerate(seqs):
        for j in range(hv):
            s = np.zeros((kd, vd)) if h0 is None else np.asarray(h0[n, j], np.float64).copy()
            for ti in range(t0, t1):
                qq, kk = q[bi, ti, j // (hv // h)], k[bi, ti, j // (hv // h)]
                if l2:
                    qq, kk = qq / np.sqrt(qq @ qq + 1e-6), kk / np.sqrt(kk @ kk + 1e-6)
                gg = g[bi, ti, j]
                if gate:
                    x = gg + (0 if dt_bias is None else np.asarray(dt_bias, np.float64).reshape(hv, kd)[j])
                    a = 1.0 if A_log is None else np.exp(float(np.asarray(A_log).reshape(hv)[j]))
                    gg = lower_bound / (1 + np.exp(-a * x)) if lower_bound is not None else -a * np.logaddexp(0, x)
                bb = beta[bi, ti, j]
                if beta_sigmoid:
                    bb = (2.0 if neg else 1.0) / (1 + np.exp(-bb))
                s = np.exp(gg)[:, None] * s
                s = s + np.outer(kk, bb * (v[bi, ti, j] - s.T @ kk))
                o[bi, ti, j] = scale * s.T @ qq
            fin[n, j] = s
    return o, fin


def inputs(b, t, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return (r(b, t, H, K).to(dtype), r(b, t, H, K).to(dtype), r(b, t, HV, V).to(dtype), r(b, t, HV, K).to(dtype),
            r(b, t, HV).to(dtype))


GATES = {"softplus": dict(gate=True, A_log=True, dt_bias=True), "lower_bound": dict(gate=True, dt_bias=True, lower_bound=-4.0),
         "precomputed": dict(gate=False)}


@pytest.mark.parametrize("gate", sorted(GATES))
@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_fused_recurrent_kda_equals_the_token_recurrence(gate, framework):
    """fla's fused_recurrent_kda: varlen with an empty sequence, initial state, L2 norm, beta sigmoid with
    negative eigenvalues, every gate, against fla's per-token recurrence in fp64."""
    q, k, v, g, beta = inputs(1, 9, seed=1)
    opt = GATES[gate]
    if not opt["gate"]:
        g = -torch.nn.functional.softplus(g)
    gen = torch.Generator().manual_seed(2)
    A_log = torch.log(torch.rand(HV, generator=gen) + 0.5) if opt.get("A_log") else None
    dt_bias = torch.randn(HV, K, generator=gen) * 0.5 if opt.get("dt_bias") else None  # fla's [HV, K] shape
    h0 = torch.randn(4, HV, K, V, generator=gen) * 0.5
    cu = np.array([0, 2, 3, 3, 9], np.int64)
    args = (q, k, v, g, beta)
    if framework == "numpy":
        args = tuple(x.numpy() for x in args)
        A_log, dt_bias, h0 = (None if x is None else x.numpy() for x in (A_log, dt_bias, h0))
    else:
        cu = torch.from_numpy(cu)
    o, fin = fused_recurrent_kda(*args, A_log=A_log, dt_bias=dt_bias, initial_state=h0, output_final_state=True,
                                 use_qk_l2norm_in_kernel=True, use_gate_in_kernel=opt["gate"], use_beta_sigmoid_in_kernel=True,
                                 allow_neg_eigval=True, lower_bound=opt.get("lower_bound"), cu_seqlens=cu)
    o_ref, fin_ref = fla_ref(*args, h0=h0, cu=np.asarray(cu), A_log=A_log, dt_bias=dt_bias, l2=True, gate=opt["gate"],
                             lower_bound=opt.get("lower_bound"), beta_sigmoid=True, neg=True)
    assert str(o.dtype).endswith("float32") and str(fin.dtype).endswith("float32") and tuple(fin.shape) == (4, HV, K, V)
    assert rel(np.asarray(o), o_ref) < 1e-6 and rel(np.asarray(fin), fin_ref) < 1e-6
    np.testing.assert_array_equal(np.asarray(fin)[2], np.asarray(h0)[2])  # the empty sequence: its final state = its initial state
    # fused_recurrent_kda_fwd with inplace_final_state (fla's default): the initial states updated in place, returned.
    h0c = h0.copy() if framework == "numpy" else h0.clone()
    o2, fin2 = fused_recurrent_kda_fwd(*args, A_log=A_log, dt_bias=dt_bias, initial_state=h0c, use_qk_l2norm_in_kernel=True,
                                       use_gate_in_kernel=opt["gate"], use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                                       lower_bound=opt.get("lower_bound"), cu_seqlens=cu)
    assert fin2 is h0c
    np.testing.assert_array_equal(np.asarray(o2), np.asarray(o))
    np.testing.assert_array_equal(np.asarray(h0c), np.asarray(fin))


def test_signatures_are_fla_060s():
    """fla-core 0.6.0's parameters, in order, with its defaults (encore adds `stream` and `check_indices` before
    **kwargs)."""
    fr = ("q k v g beta A_log=None dt_bias=None scale=None initial_state=None output_final_state=False "
          "use_qk_l2norm_in_kernel=False use_gate_in_kernel=False use_beta_sigmoid_in_kernel=False allow_neg_eigval=False "
          "lower_bound=None state_v_first=False cu_seqlens=None **kwargs")
    fwd = ("q k v g beta A_log=None dt_bias=None initial_state=None scale=None output_final_state=False inplace_final_state=True "
           "state_v_first=False cu_seqlens=None ssm_state_indices=None num_accepted_tokens=None use_qk_l2norm_in_kernel=False "
           "use_gate_in_kernel=False use_beta_sigmoid_in_kernel=False allow_neg_eigval=False lower_bound=None out=None")

    def params(f):
        return [str(p) for p in inspect.signature(f).parameters.values()]
    assert params(fused_recurrent_kda) == fr.split()
    assert params(fused_recurrent_kda_fwd)[:len(fwd.split())] == fwd.split()
    assert params(fused_recurrent_kda_fwd)[len(fwd.split()):] == ["stream=None", "check_indices=True", "**kwargs"]


def pool_of(p, dtype, seed=3):
    return torch.randn(p, HV, K, V, generator=torch.Generator().manual_seed(seed)).to(dtype)


def ref_from(pool, slot, args, gate_kw):
    """(o, final state) of one sequence from the pool slot's values (fp64 recurrence)."""
    o, fin = fla_ref(*args, h0=pool[slot:slot + 1].double().numpy(), **gate_kw)
    return o[0], fin[0]


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_decode_on_the_pool(pool_dtype, index_dtype):
    """ssm_state_indices [N]: sequence n from slot idx[n], back into it; padding (-1, NaN inputs) rows zero;
    every other slot bit-identical; out written and returned."""
    q, k, v, g, beta = inputs(5, 1, seed=4)
    idx = torch.tensor([5, -1, 2, 7, -1], dtype=index_dtype)
    for x in (q, k, v, g, beta):
        x[idx < 0] = float("nan")
    pool = pool_of(8, pool_dtype)
    before = pool.clone()
    out = torch.full_like(v, 7.0)
    kw = dict(A_log=torch.zeros(HV), dt_bias=torch.zeros(HV * K), use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True)
    o, fin = fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool, ssm_state_indices=idx, out=out, **kw)
    assert o is out and fin is pool
    gate_kw = dict(A_log=kw["A_log"], dt_bias=kw["dt_bias"], l2=True, gate=True)
    for n, s in enumerate(idx.tolist()):
        if s < 0:
            assert torch.equal(o[n], torch.zeros_like(o[n]))
            continue
        o_ref, fin_ref = ref_from(before, s, (q[n:n + 1], k[n:n + 1], v[n:n + 1], g[n:n + 1], beta[n:n + 1]), gate_kw)
        assert rel(o[n].numpy(), o_ref) < 1e-6
        assert rel(pool[s].double().numpy(), fin_ref) < (1e-6 if pool_dtype == torch.float32 else 4e-3)
    for s in set(range(8)) - {5, 2, 7}:
        assert torch.equal(pool[s], before[s])


def test_speculative_slots_per_token():
    """ssm_state_indices [N, S] with num_accepted_tokens: sequence n starts from column nat[n] - 1, the state
    after token t goes to column t (not where < 0); a start entry < 0 makes the sequence padding."""
    q, k, v, g, beta = inputs(3, 4, seed=5)
    beta = torch.sigmoid(beta)
    idx = torch.tensor([[0, 1, 2, 3], [4, 5, -1, 6], [-1, 8, 9, 10]])
    nat = torch.tensor([2, 1, 1], dtype=torch.int32)
    pool = pool_of(12, torch.float32)
    before = pool.clone()
    o, _ = fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool, ssm_state_indices=idx, num_accepted_tokens=nat)
    for n, start in ((0, 1), (1, 4)):
        for t in range(4):
            sl = slice(0, t + 1)
            o_ref, fin_ref = ref_from(before, start, (q[n:n + 1, sl], k[n:n + 1, sl], v[n:n + 1, sl], g[n:n + 1, sl], beta[n:n + 1, sl]), {})
            assert rel(o[n, :t + 1].numpy(), o_ref) < 1e-6
            if idx[n, t] >= 0:
                assert rel(pool[idx[n, t]].numpy(), fin_ref) < 1e-6
    assert torch.equal(o[2], torch.zeros_like(o[2]))
    for s in (7, 8, 9, 10, 11):
        assert torch.equal(pool[s], before[s])


# --- one KDA layer serving a mix of requests -----------------------------------------------------------------

class Server:
    """Kimi-Linear's KDA options (in-kernel softplus gate with A_log / dt_bias, q/k L2 norm, beta sigmoid); a pool
    of BATCH * SPEC slots; decode steps of a fixed batch (padding rows: index -1, NaN inputs)."""
    BATCH, SPEC = 6, 4

    def __init__(self, pool_dtype, seed):
        self.gen = torch.Generator().manual_seed(seed)
        self.pool = pool_of(self.BATCH * self.SPEC, pool_dtype, seed)
        self.free = list(range(self.BATCH * self.SPEC - 1, -1, -1))
        self.kw = dict(A_log=torch.log(0.5 + 0.25 * torch.arange(HV, dtype=torch.float32)),
                       dt_bias=0.5 * torch.randn(HV, K, generator=self.gen), use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                       use_beta_sigmoid_in_kernel=True)
        self.reqs, self.used, self.reuses, self.paddings = [], set(), 0, 0

    def tokens(self, n, nan=False):
        r = lambda *s: torch.full(s, float("nan")) if nan else torch.randn(*s, generator=self.gen)  # noqa: E731
        return [r(n, H, K), r(n, H, K), r(n, HV, V), r(n, HV, K), r(n, HV)]

    def take(self):
        s = self.free.pop()
        self.reuses += s in self.used
        self.used.add(s)
        return s

    def active(self):
        return [r for r in self.reqs if not r["done"]]

    def call(self, touched, f):
        before = self.pool.clone()
        with torch.no_grad():
            out = f()
        for s in set(range(self.pool.shape[0])) - set(touched):
            assert torch.equal(self.pool[s], before[s]), f"slot {s} changed"
        return out

    def join(self, prompts):
        new = []
        for n in prompts:
            if len(self.active()) >= self.BATCH:
                break
            total = n + 10 + int(torch.randint(40, (1,), generator=self.gen))
            r = dict(seq=self.tokens(total), prompt=n, pos=n, slot=self.take(), o=[], done=False, row=None)
            self.pool[r["slot"]] = 0  # a new request starts from the zero state
            self.reqs.append(r)
            new.append(r)
        segs, idx = [], []
        for i, r in enumerate(new):
            segs.append([x[:r["prompt"]] for x in r["seq"]])
            idx.append(r["slot"])
            if i == 0:
                segs.append(self.tokens(3, nan=True))
                idx.append(-1)
                self.paddings += 1
        if not new:
            return
        cu = torch.tensor([0] + np.cumsum([s[0].shape[0] for s in segs]).tolist())
        q, k, v, g, beta = (torch.cat([s[j] for s in segs])[None] for j in range(5))
        o, pool = self.call(idx, lambda: chunk_kda(q, k, v, g, beta, initial_state=self.pool, ssm_state_indices=torch.tensor(idx),
                                                   cu_seqlens=cu, **self.kw))
        assert pool is self.pool
        for n, r in enumerate(segs):
            rows = o[0, cu[n]:cu[n + 1]]
            if idx[n] < 0:
                assert torch.equal(rows, torch.zeros_like(rows))
        for r, n in zip(new, [i for i, s in enumerate(idx) if s >= 0]):
            r["o"].append(o[0, cu[n]:cu[n + 1]])

    def leave(self):
        for r in self.active():
            if r["pos"] == r["seq"][0].shape[0]:
                r["done"] = True
                for s in r["row"] or [r["slot"]]:
                    self.free.insert(0, s)

    def decode(self):
        act = self.active()
        rows = torch.randperm(self.BATCH, generator=self.gen).tolist()
        of = {rows[i]: r for i, r in enumerate(act)}
        toks = [self.tokens(1, nan=True) if i not in of else [x[of[i]["pos"]:of[i]["pos"] + 1] for x in of[i]["seq"]]
                for i in range(self.BATCH)]
        self.paddings += self.BATCH - len(act)
        idx = torch.tensor([of[i]["slot"] if i in of else -1 for i in range(self.BATCH)], dtype=torch.int32)
        q, k, v, g, beta = (torch.stack([t[j] for t in toks]) for j in range(5))
        out = torch.empty(self.BATCH, 1, HV, V)
        o, pool = self.call([r["slot"] for r in act], lambda: fused_recurrent_kda_fwd(
            q, k, v, g, beta, initial_state=self.pool, ssm_state_indices=idx, out=out, **self.kw))
        assert o is out and pool is self.pool
        for i in range(self.BATCH):
            if i in of:
                of[i]["o"].append(o[i])
                of[i]["pos"] += 1
            else:
                assert torch.equal(o[i], torch.zeros_like(o[i]))

    def spec(self, first):
        """4 tokens per request over its 4 slots: its next 1-3 accepted tokens, then rejected drafts. The first
        step starts from column 0 (the request's slot), the second from num_accepted_tokens - 1 of the first;
        after it the accepted column becomes the request's slot."""
        act = self.active()
        toks, acc = [], []
        for r in act:
            if first:
                r["row"] = [r["slot"], self.take(), self.take(), self.take()]
            a = min(1 + int(torch.randint(3, (1,), generator=self.gen)), r["seq"][0].shape[0] - r["pos"])
            acc.append(a)
            drafts = self.tokens(self.SPEC - a)
            toks.append([torch.cat([x[r["pos"]:r["pos"] + a], d]) for x, d in zip(r["seq"], drafts)])
        q, k, v, g, beta = (torch.stack([t[j] for t in toks]) for j in range(5))
        idx = torch.tensor([r["row"] for r in act])
        nat = None if first else torch.tensor([r["accepted"] for r in act])
        o, _ = self.call([s for r in act for s in r["row"]], lambda: fused_recurrent_kda_fwd(
            q, k, v, g, beta, initial_state=self.pool, ssm_state_indices=idx, num_accepted_tokens=nat, **self.kw))
        for i, (r, a) in enumerate(zip(act, acc)):
            r["o"].append(o[i, :a])
            r["pos"] += a
            r["accepted"] = a
            if not first:
                r["slot"] = r["row"][a - 1]
                self.free += [s for s in r["row"] if s != r["slot"]]
                r["row"] = None


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_serving_a_mix_of_requests_equals_chunk_kda_over_each_sequence(pool_dtype):
    """Prefills of different lengths (1 to 130 tokens, chunk boundaries included) on the pool, then 64 decode
    steps with continuous batching (requests joining and leaving, slots reused, padding rows), two of them a
    speculative step of 4 tokens accepting 1-3; each request's outputs and state equal chunk_kda over its
    whole sequence (fp64 reference; the pool's rounding: 1e-5 fp32, 5e-3 bf16 relative RMS)."""
    sv = Server(pool_dtype, 2026)
    sv.join([37, 64, 1])
    joins = [[65, 5], [100], [17, 2], [130], [63, 9], [4]]
    for step in range(64):
        sv.leave()
        if step % 9 == 4 and step // 9 < len(joins) and step != 22:
            sv.join(joins[step // 9])
        if step in (20, 21):
            sv.spec(step == 20)
        else:
            sv.decode()
    o_err = s_err = 0.0
    for r in sv.reqs:
        seq = [x[:r["pos"]][None] for x in r["seq"]]
        o_ref, fin_ref = chunk_kda(*seq, output_final_state=True, **sv.kw)
        o = torch.cat([x.reshape(-1, HV, V) for x in r["o"]])
        o_err = max(o_err, rel(o.numpy(), o_ref[0].double().numpy()))
        if not r["done"]:
            s_err = max(s_err, rel(sv.pool[r["slot"]].double().numpy(), fin_ref[0].double().numpy()))
    bound = 1e-5 if pool_dtype == torch.float32 else 5e-3
    assert o_err < bound and s_err < bound, (o_err, s_err)
    assert len(sv.reqs) >= 10 and sum(r["done"] for r in sv.reqs) > 3 and sv.reuses > 3 and sv.paddings > 10


# --- refusals ----------------------------------------------------------------------------------------------

def test_bad_input_refused_with_nothing_written():
    q, k, v, g, beta = inputs(2, 4, seed=6)
    pool = pool_of(8, torch.float32)
    before = pool.clone()
    idx2 = torch.arange(8).reshape(2, 4)
    cases = [
        (dict(ssm_state_indices=torch.tensor([5, 8])), ValueError, r"state_indices: entry \[1\] = 8 is out of the pool's range \[0, 8\)"),
        (dict(ssm_state_indices=torch.tensor([2, 2])), ValueError, "state_indices: slot 2 is used twice in one call"),
        (dict(ssm_state_indices=torch.tensor([[0, 1], [2, 3]])), ValueError, r"holds S = 2 slots per sequence \(one per token\)"),
        (dict(ssm_state_indices=idx2, num_accepted_tokens=torch.tensor([1, 5])), ValueError,
         r"num_accepted_tokens: entry \[1\] = 5 must lie in \[1, S = 4\]"),
        (dict(ssm_state_indices=torch.tensor([0, 1]), num_accepted_tokens=torch.tensor([1, 1])), ValueError,
         r"num_accepted_tokens: needs state_indices \[N, S\]"),
        (dict(ssm_state_indices=torch.tensor([0.0, 1.0])), ValueError, r"state_indices: dtype must be one of \{int32, int64\}"),
        (dict(ssm_state_indices=torch.tensor([0, 1]), initial_state=pool.half()), ValueError,
         r"initial_state: dtype must be one of \{bf16, fp32, fp64\}, got fp16"),
        (dict(ssm_state_indices=torch.tensor([0, 1]), initial_state=pool[:, :2]), ValueError, r"initial_state: expected \[P, HV, K, V\]"),
        (dict(ssm_state_indices=torch.tensor([0, 1]), initial_state=torch.zeros(8, HV, V, K).transpose(2, 3)), ValueError,
         r"initial_state: each slot's \[HV, K, V\] must be contiguous"),
        (dict(ssm_state_indices=torch.tensor([0, 1]), inplace_final_state=False), ValueError,
         "inplace_final_state=False with ssm_state_indices: not supported"),
        (dict(initial_state=None), ValueError, "inplace_final_state: needs initial_state"),
        (dict(ssm_state_indices=torch.tensor([0, 1]), out=torch.empty(2, 4, HV, 4)), ValueError, "out: expected v's shape"),
        (dict(ssm_state_indices=torch.tensor([0, 1]), state_v_first=True), ValueError,
         r"initial_state: expected \[P, HV, V, K\] \(state_v_first\)"),
        (dict(ssm_state_indices=torch.tensor([0, 1]), intermediate=True), ValueError, "not supported by encore: intermediate"),
    ]
    for kw, exc, match in cases:
        kw = {"initial_state": pool, **kw}
        with pytest.raises(exc, match=match):
            fused_recurrent_kda_fwd(q, k, v, g, beta, **kw)
        assert torch.equal(pool, before), match
    with pytest.raises(ValueError, match="ssm_state_indices: needs initial_state"):
        chunk_kda(q, k, v, g, beta, ssm_state_indices=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"state_indices: slot 3 is used twice"):
        chunk_kda(q, k, v, g, beta, initial_state=pool, ssm_state_indices=torch.tensor([3, 3]))
    with pytest.raises(ValueError, match="allow_neg_eigval=True. requires"):
        fused_recurrent_kda(q, k, v, g, beta, allow_neg_eigval=True)
    assert torch.equal(pool, before)


def test_no_autograd():
    """Forward only: tensors that require grad under grad mode are refused (allowed under no_grad)."""
    q, k, v, g, beta = inputs(2, 1, seed=7)
    pool = pool_of(4, torch.float32)
    q.requires_grad_()
    with pytest.raises(RuntimeError, match="autograd is not wired"):
        fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool, ssm_state_indices=torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="inference only"):
        chunk_kda(q, k, v, g, beta, initial_state=pool, ssm_state_indices=torch.tensor([0, 1]))
    with torch.no_grad():
        fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool, ssm_state_indices=torch.tensor([0, 1]))
        chunk_kda(q, k, v, g, beta, initial_state=pool, ssm_state_indices=torch.tensor([2, 3]))


def test_compiles_and_mutates_the_pool():
    """torch.compile(fullgraph=True) of a decode step and a prefill on the pool: the same pool as eager."""
    q, k, v, g, beta = inputs(3, 1, seed=8)
    idx = torch.tensor([4, -1, 1])
    eager_pool, compiled_pool = pool_of(6, torch.float32), pool_of(6, torch.float32)

    def step(pool):
        o, _ = fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool, ssm_state_indices=idx, use_qk_l2norm_in_kernel=True)
        o2, _ = chunk_kda(q.reshape(1, 3, H, K), k.reshape(1, 3, H, K), v.reshape(1, 3, HV, V), g.reshape(1, 3, HV, K),
                          beta.reshape(1, 3, HV), initial_state=pool, ssm_state_indices=torch.tensor([0, 2]),
                          cu_seqlens=torch.tensor([0, 1, 3]))
        return o + 1, o2
    with torch.no_grad():
        o_e = step(eager_pool)
        o_c = torch.compile(step, fullgraph=True, backend="aot_eager")(compiled_pool)
    assert torch.equal(o_e[0], o_c[0]) and torch.equal(o_e[1], o_c[1]) and torch.equal(eager_pool, compiled_pool)
