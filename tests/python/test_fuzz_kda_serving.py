"""Property-based fuzzing of KDA's serving entry points on the CPU backend: fused_recurrent_kda (the token
recurrence, no pool: initial / final state, varlen with empty sequences), fused_recurrent_kda_fwd (the
decode step on a state pool: ssm_state_indices [N] with padding, [N, S] speculative slots with
num_accepted_tokens) and chunk_kda(..., ssm_state_indices=) (the prefill on the pool). Valid draws: CPU
torch float32 / bfloat16 / float64 inputs, N 1-4 sequences of 1-4 tokens (prefill: up to 70), H 1-2,
grouped value heads, K, V 1-16, the precomputed / softplus / lower-bound gates, L2 norm, beta sigmoid
(allow_neg_eigval), float32 / bfloat16 pools, int32 / int64 indices, out in a canary-guarded buffer;
against a float64 token recurrence (docs/math/kda.md) from the pool's slots, every slot the call does
not write bit-identical. Invalid draws: ValueError naming the argument, the pool and out untouched.

Seeds: hypothesis with derandomize=True (fuzz_util.VALID: 200 draws, INVALID: 100 draws per test)."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzz_util import INVALID, SEEDS, VALID, Guard, f64, refused, torch, one_torch_thread  # noqa: F401 (autouse fixture)

if torch is None:
    pytest.skip("needs torch (the serving entry points take torch tensors)", allow_module_level=True)

from encore.kda import chunk_kda, fused_recurrent_kda, fused_recurrent_kda_fwd  # noqa: E402

_DT = {"t32": torch.float32, "tbf16": torch.bfloat16, "t64": torch.float64}
_POOL = {"f32": torch.float32, "bf16": torch.bfloat16}


def _gate(rng, hv, k, mode):
    """Keyword arguments of the gate mode and the float64 map raw g -> log gate."""
    if mode == "log":
        return {}, lambda g, j: g
    a_log, dt_bias = rng.uniform(-1, 0.5, hv), 0.3 * rng.standard_normal(hv * k)
    kw = {"use_gate_in_kernel": True, "A_log": torch.tensor(a_log, dtype=torch.float32),
          "dt_bias": torch.tensor(dt_bias, dtype=torch.float32)}
    a32, b32 = f64(kw["A_log"]), f64(kw["dt_bias"]).reshape(hv, k)
    if mode == "lower":
        kw["lower_bound"] = float(rng.choice([-5.0, -1.0]))
        lb = kw["lower_bound"]
        return kw, lambda g, j: lb / (1 + np.exp(-np.exp(a32[j]) * (g + b32[j])))
    return kw, lambda g, j: -np.exp(a32[j]) * np.logaddexp(0, g + b32[j])


def _recur(s, q, k, v, g, beta, scale, l2, gmap, j, sig, neg):
    """One value head's tokens from state s [K, V] (float64): (o rows, the state after each token)."""
    o, states = [], []
    for t in range(q.shape[0]):
        qq, kk = q[t], k[t]
        if l2:
            qq, kk = qq / np.sqrt(qq @ qq + 1e-6), kk / np.sqrt(kk @ kk + 1e-6)
        b = beta[t]
        if sig:
            b = (2.0 if neg else 1.0) / (1 + np.exp(-b))
        s = np.exp(gmap(g[t], j))[:, None] * s
        s = s + np.outer(kk, b * (v[t] - s.T @ kk))
        o.append(scale * s.T @ qq)
        states.append(s.copy())
    return np.array(o).reshape(q.shape[0], -1), states


def _draw(rng, kind, n, t, h, group, k, v):
    hv, dt = h * group, _DT[kind]
    mk = lambda *s: torch.tensor(rng.standard_normal(s)).to(dt)  # noqa: E731
    return mk(n, t, h, k), mk(n, t, h, k), mk(n, t, hv, v), mk(n, t, hv, k), mk(n, t, hv)


def _rel(a, b):
    a, b = f64(a), np.asarray(b, np.float64)
    return float(np.sqrt(((a - b) ** 2).sum() / max((b * b).sum(), 1e-300)))


_TOL = {torch.float32: 1e-5, torch.float64: 1e-10, torch.bfloat16: 8e-3}


@VALID
@given(seed=SEEDS, kind=st.sampled_from(["t32", "t32", "tbf16", "t64"]), n=st.integers(1, 4), t=st.integers(1, 4), h=st.integers(1, 2),
       group=st.integers(1, 2), k=st.sampled_from([1, 2, 3, 8, 16]), v=st.sampled_from([1, 2, 5, 8, 16]),
       gate=st.sampled_from(["log", "softplus", "lower"]), l2=st.booleans(), sig=st.sampled_from([None, "sigmoid", "neg"]),
       spec=st.booleans(), nat=st.booleans(), pool=st.sampled_from(["f32", "bf16"]), i64=st.booleans())
def test_decode_on_the_pool_valid(seed, kind, n, t, h, group, k, v, gate, l2, sig, spec, nat, pool, i64):
    rng = np.random.default_rng(seed)
    hv = h * group
    q, kk, vv, g, beta = _draw(rng, kind, n, t, h, group, k, v)
    if gate == "log":
        g = (-0.3 * torch.rand(g.shape, generator=torch.Generator().manual_seed(seed % 2**31))).to(g.dtype)
    gkw, gmap = _gate(rng, hv, k, gate)
    s_cols = t if spec else 1
    slots = n * s_cols + int(rng.integers(0, 4))
    perm = rng.permutation(slots)[:n * s_cols].reshape(n, s_cols) if spec else rng.permutation(slots)[:n].reshape(n)
    idx = perm.copy()
    idx[rng.random(idx.shape) < 0.2] = -1  # padding starts / skipped writes
    nat_v = rng.integers(1, s_cols + 1, n) if spec and nat else None
    pool_t = torch.tensor(0.5 * rng.standard_normal((slots, hv, k, v))).to(_POOL[pool])
    before = pool_t.clone()
    itype = torch.int64 if i64 else torch.int32
    kw = dict(initial_state=pool_t, ssm_state_indices=torch.tensor(idx, dtype=itype), use_qk_l2norm_in_kernel=l2,
              use_beta_sigmoid_in_kernel=sig is not None, allow_neg_eigval=sig == "neg", **gkw)
    if nat_v is not None:
        kw["num_accepted_tokens"] = torch.tensor(nat_v, dtype=itype)
    guard = Guard(tuple(vv.shape), vv)
    o, fin = fused_recurrent_kda_fwd(q, kk, vv, g, beta, out=guard.view, **kw)
    assert o is guard.view and fin is pool_t and guard.intact()
    qf, kf, vf, gf, bf = (f64(x) for x in (q, kk, vv, g, beta))
    scale, written = k ** -0.5, set()
    o_ref = np.zeros(vf.shape)
    state_ref = {}
    for i in range(n):
        start = int(idx[i] if not spec else idx[i, (nat_v[i] - 1) if nat_v is not None else 0])
        if start < 0:
            continue  # padding: o rows zero, the pool untouched
        for j in range(hv):
            s0 = f64(before[start, j])
            oj, states = _recur(s0, qf[i, :, j // group], kf[i, :, j // group], vf[i, :, j], gf[i, :, j], bf[i, :, j], scale, l2, gmap, j,
                                sig is not None, sig == "neg")
            o_ref[i, :, j] = oj
            if spec:
                for tt in range(t):
                    if idx[i, tt] >= 0:
                        state_ref.setdefault(int(idx[i, tt]), {})[j] = states[tt]
            else:
                state_ref.setdefault(start, {})[j] = states[-1]
    tol = max(_TOL[q.dtype], _TOL[pool_t.dtype])
    assert np.isfinite(f64(o)).all()
    assert _rel(o, o_ref) <= tol, _rel(o, o_ref)
    for slot, heads in state_ref.items():
        written.add(slot)
        for j, s in heads.items():
            assert _rel(pool_t[slot, j], s) <= _TOL[pool_t.dtype] + (_TOL[q.dtype] if q.dtype == torch.bfloat16 else 0), (slot, j)
    for slot in set(range(slots)) - written:
        assert torch.equal(pool_t[slot], before[slot]), f"slot {slot} not written by the call changed"


@VALID
@given(seed=SEEDS, kind=st.sampled_from(["t32", "tbf16", "t64"]), lens=st.lists(st.integers(0, 70), min_size=1, max_size=4),
       h=st.integers(1, 2), group=st.integers(1, 2), k=st.sampled_from([1, 3, 8, 16]), v=st.sampled_from([1, 4, 8]),
       gate=st.sampled_from(["log", "softplus", "lower"]), l2=st.booleans(), pool=st.sampled_from(["f32", "bf16"]))
def test_prefill_on_the_pool_valid(seed, kind, lens, h, group, k, v, gate, l2, pool):
    rng = np.random.default_rng(seed)
    hv, total = h * group, max(sum(lens), 1)
    q, kk, vv, g, beta = _draw(rng, kind, 1, total, h, group, k, v)
    beta = torch.sigmoid(beta.double()).to(beta.dtype)
    if gate == "log":
        g = (-0.3 * torch.rand(g.shape, generator=torch.Generator().manual_seed(seed % 2**31))).to(g.dtype)
    gkw, gmap = _gate(rng, hv, k, gate)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    if cu[-1] == 0:
        cu[-1] = total  # at least one token in all
    n = len(cu) - 1
    slots = n + int(rng.integers(0, 3))
    idx = rng.permutation(slots)[:n]
    idx[rng.random(n) < 0.2] = -1
    pool_t = torch.tensor(0.5 * rng.standard_normal((slots, hv, k, v))).to(_POOL[pool])
    before = pool_t.clone()
    with torch.no_grad():
        o, back = chunk_kda(q, kk, vv, g, beta, initial_state=pool_t, ssm_state_indices=torch.tensor(idx), cu_seqlens=torch.tensor(cu),
                            use_qk_l2norm_in_kernel=l2, **gkw)
    assert back is pool_t
    qf, kf, vf, gf, bf = (f64(x) for x in (q, kk, vv, g, beta))
    o_ref = np.zeros(vf.shape)
    for i in range(n):
        s0, s1, slot = int(cu[i]), int(cu[i + 1]), int(idx[i])
        if slot < 0 or s1 == s0:
            continue
        for j in range(hv):
            oj, states = _recur(f64(before[slot, j]), qf[0, s0:s1, j // group], kf[0, s0:s1, j // group], vf[0, s0:s1, j], gf[0, s0:s1, j],
                                bf[0, s0:s1, j], k ** -0.5, l2, gmap, j, False, False)
            o_ref[0, s0:s1, j] = oj
            assert _rel(pool_t[slot, j], states[-1]) <= _TOL[pool_t.dtype] + (_TOL[q.dtype] if q.dtype == torch.bfloat16 else 0)
    tol = max(_TOL[q.dtype], _TOL[pool_t.dtype])
    assert _rel(o, o_ref) <= tol, _rel(o, o_ref)
    touched = {int(idx[i]) for i in range(n) if idx[i] >= 0 and cu[i + 1] > cu[i]}
    for slot in set(range(slots)) - touched:
        assert torch.equal(pool_t[slot], before[slot]), f"slot {slot} not written by the call changed"


@VALID
@given(seed=SEEDS, kind=st.sampled_from(["t32", "tbf16", "t64"]), b=st.integers(1, 2), t=st.integers(1, 40), h=st.integers(1, 2),
       group=st.integers(1, 2), k=st.sampled_from([1, 3, 8, 16]), v=st.sampled_from([1, 4, 8]), gate=st.sampled_from(["log", "softplus", "lower"]),
       l2=st.booleans(), sig=st.sampled_from([None, "sigmoid", "neg"]), h0=st.booleans(), fin=st.booleans(), varlen=st.booleans())
def test_fused_recurrent_kda_valid(seed, kind, b, t, h, group, k, v, gate, l2, sig, h0, fin, varlen):
    """fla's fused_recurrent_kda (no pool): initial state, final state, varlen with empty sequences."""
    rng = np.random.default_rng(seed)
    hv = h * group
    if varlen:
        b = 1
    q, kk, vv, g, beta = _draw(rng, kind, b, t, h, group, k, v)
    if gate == "log":
        g = (-0.3 * torch.rand(g.shape, generator=torch.Generator().manual_seed(seed % 2**31))).to(g.dtype)
    gkw, gmap = _gate(rng, hv, k, gate)
    cu = None
    if varlen:
        cu = np.array([0] + sorted(rng.integers(0, t + 1, int(rng.integers(0, 3))).tolist()) + [t], np.int64)
    seqs = [(i, 0, t) for i in range(b)] if cu is None else [(0, int(cu[i]), int(cu[i + 1])) for i in range(len(cu) - 1)]
    s0 = torch.tensor(0.5 * rng.standard_normal((len(seqs), hv, k, v)), dtype=torch.float64 if kind == "t64" else torch.float32) if h0 else None
    s0_before = None if s0 is None else s0.clone()
    o, fs = fused_recurrent_kda(q, kk, vv, g, beta, initial_state=s0, output_final_state=fin, use_qk_l2norm_in_kernel=l2,
                                use_beta_sigmoid_in_kernel=sig is not None, allow_neg_eigval=sig == "neg",
                                cu_seqlens=None if cu is None else torch.tensor(cu), **gkw)
    qf, kf, vf, gf, bf = (f64(x) for x in (q, kk, vv, g, beta))
    o_ref = np.zeros(vf.shape)
    fin_ref = np.zeros((len(seqs), hv, k, v))
    for i, (bi, a, e) in enumerate(seqs):
        for j in range(hv):
            st0 = f64(s0_before[i, j]) if h0 else np.zeros((k, v))
            if e > a:
                oj, states = _recur(st0, qf[bi, a:e, j // group], kf[bi, a:e, j // group], vf[bi, a:e, j], gf[bi, a:e, j], bf[bi, a:e, j],
                                    k ** -0.5, l2, gmap, j, sig is not None, sig == "neg")
                o_ref[bi, a:e, j], fin_ref[i, j] = oj, states[-1]
            else:
                fin_ref[i, j] = st0
    tol = _TOL[q.dtype]
    assert _rel(o, o_ref) <= tol, _rel(o, o_ref)
    if fin:
        assert tuple(fs.shape) == fin_ref.shape
        assert _rel(fs, fin_ref) <= max(tol, 1e-5)
    else:
        assert fs is None
    if h0:
        assert torch.equal(s0, s0_before), "initial_state changed"


_BAD = ["index_high", "index_dup", "index_float", "index_2d_short", "nat_high", "nat_zero", "nat_without_2d", "pool_fp16", "pool_heads",
        "pool_layout", "out_shape", "no_pool", "prefill_dup", "prefill_high"]


@INVALID
@given(seed=SEEDS, case=st.sampled_from(_BAD), i64=st.booleans())
def test_serving_invalid(seed, case, i64):
    rng = np.random.default_rng(seed)
    n, t, h, k, v = 2, int(rng.integers(1, 4)), 2, 4, 3
    q, kk, vv, g, beta = _draw(rng, "t32", n, t, h, 1, k, v)
    g = -0.2 * torch.rand(g.shape)
    slots = 6
    pool_t = torch.randn(slots, h, k, v)
    before = pool_t.clone()
    itype = torch.int64 if i64 else torch.int32
    idx = torch.tensor([1, 4], dtype=itype)
    kw, names = dict(initial_state=pool_t, ssm_state_indices=idx), ["state_indices"]
    guard = Guard(tuple(vv.shape), vv)
    kw["out"] = guard.view
    if case == "index_high":
        kw["ssm_state_indices"] = torch.tensor([1, slots + int(rng.integers(0, 5))], dtype=itype)
    elif case == "index_dup":
        kw["ssm_state_indices"] = torch.tensor([3, 3], dtype=itype)
    elif case == "index_float":
        kw["ssm_state_indices"] = torch.tensor([1.0, 2.0])
    elif case == "index_2d_short":  # [N, S] with S < T tokens
        if t == 1:
            q, kk, vv, g, beta = _draw(rng, "t32", n, 2, h, 1, k, v)
            g = -0.2 * torch.rand(g.shape)
            guard = Guard(tuple(vv.shape), vv)
            kw["out"] = guard.view
        kw["ssm_state_indices"] = torch.tensor([[0], [1]], dtype=itype)
    elif case.startswith("nat"):
        kw["ssm_state_indices"] = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=itype)[:, :max(t, 1)]
        s_cols = kw["ssm_state_indices"].shape[1]
        nat = {"nat_high": [1, s_cols + 1], "nat_zero": [0, 1], "nat_without_2d": [1, 1]}[case]
        if case == "nat_without_2d":
            kw["ssm_state_indices"] = idx
        kw["num_accepted_tokens"], names = torch.tensor(nat, dtype=itype), ["num_accepted_tokens"]
    elif case == "pool_fp16":
        kw["initial_state"], names = pool_t.half(), ["initial_state"]
    elif case == "pool_heads":
        kw["initial_state"], names = pool_t[:, :1], ["initial_state"]
    elif case == "pool_layout":
        kw["initial_state"], names = torch.zeros(slots, h, v, k).transpose(2, 3), ["initial_state"]
    elif case == "out_shape":
        kw["out"], names = torch.empty(n, t, h, v + 1), ["out"]
    elif case == "no_pool":
        kw["initial_state"], names = None, ["inplace_final_state", "initial_state"]
    if case.startswith("prefill"):
        bad = torch.tensor([2, 2] if case == "prefill_dup" else [0, slots + 1], dtype=itype)
        with torch.no_grad():
            refused(lambda: chunk_kda(q.reshape(1, n * t, h, k), kk.reshape(1, n * t, h, k), vv.reshape(1, n * t, h, v),
                                      g.reshape(1, n * t, h, k), beta.reshape(1, n * t, h), initial_state=pool_t, ssm_state_indices=bad,
                                      cu_seqlens=torch.tensor([0, t, n * t])), ["state_indices"], kinds=(ValueError,))
    else:
        refused(lambda: fused_recurrent_kda_fwd(q, kk, vv, g, beta, **kw), names, [guard] if kw.get("out") is guard.view else [],
                kinds=(ValueError,))
    assert torch.equal(pool_t, before)
