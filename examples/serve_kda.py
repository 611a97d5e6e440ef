"""One KDA layer served the way an inference engine runs it (docs/kda_serving.md): a pool of recurrent states,
prefills of new requests with chunk_kda on the pool, decode steps of a fixed batch with
fused_recurrent_kda_fwd (padding rows at index -1, so every step has the same shapes, as a CUDA graph
needs), and speculative steps of S tokens per request whose accepted count picks the slot the request's
state continues from. At the end every request's outputs and its final state are compared with chunk_kda
over its whole sequence (what a training framework computes).

The engine's bookkeeping: each running request owns a row of S slots of the pool and a column c (the
slot holding its state). A prefill writes row[0] (c = 0); a decode step reads and writes row[c]; a
speculative step passes the rows as ssm_state_indices [N, S] with num_accepted_tokens = c + 1 (start from
column c), the state after token t lands in row[t], and after a accepted tokens c = a - 1. A finished
request's slots go back to the free list and are reused.

The layer's inputs are synthetic (random q, k, v, raw gate and beta per token, fixed per request): in a model
they come from the projections of the previous layer, which does not change what the kernels do.

Usage: python3 examples/serve_kda.py [--device cpu|cuda] [--pool-dtype float32|bfloat16] [--requests 12]
       [--batch 8] [--steps 48] [--spec-every 6] [--seed 0]
Prints one line per engine step and the largest relative RMS difference of the outputs and states."""
import argparse
import collections

import torch

from encore.kda import chunk_kda, fused_recurrent_kda_fwd

H, HV, K, V, S = 2, 4, 64, 64, 4  # q/k heads, value heads (grouped), head dims, speculative tokens per step
KW = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)


class Request:
    def __init__(self, rid, prompt, gen_len, dtype, device, seed):
        n = prompt + gen_len + S  # room for drafts past the end
        g = torch.Generator().manual_seed(seed * 1000 + rid)
        r = lambda *s: torch.randn(*s, generator=g).to(dtype).to(device)  # noqa: E731
        self.rid, self.prompt, self.total = rid, prompt, prompt + gen_len
        self.q, self.k, self.v, self.g, self.beta = r(n, H, K), r(n, H, K), r(n, HV, V), r(n, HV, K), r(n, HV)
        self.pos, self.row, self.col, self.out = 0, None, 0, []

    def inputs(self, a, b):
        return [x[a:b] for x in (self.q, self.k, self.v, self.g, self.beta)]


def rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--pool-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8, help="decode batch (running requests + padding rows)")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--spec-every", type=int, default=6, help="every n-th step is speculative (0: never)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    gen = torch.Generator().manual_seed(a.seed)
    rint = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=gen))  # noqa: E731
    A_log = torch.randn(HV, generator=gen).to(dev) * 0.5
    dt_bias = torch.randn(HV * K, generator=gen).to(dev) * 0.5
    kw = dict(KW, A_log=A_log, dt_bias=dt_bias)

    pool = torch.full((a.batch * S, HV, K, V), float("nan"), dtype=getattr(torch, a.pool_dtype), device=dev)
    free = collections.deque(range(pool.shape[0]))
    waiting = collections.deque(Request(i, rint(1, 150), rint(4, 40), dtype, dev, a.seed) for i in range(a.requests))
    running, done = [], []
    with torch.no_grad():
        for step in range(a.steps):
            # Admit: requests join while the batch has room; their prompts go through one varlen prefill.
            new = []
            while waiting and len(running) + len(new) < a.batch:
                r = waiting.popleft()
                r.row = [free.popleft() for _ in range(S)]
                pool[r.row[0]].zero_()  # a new request starts from the zero state
                new.append(r)
            if new:
                segs = [r.inputs(0, r.prompt) for r in new]
                q, k, v, g, beta = (torch.cat([s[j] for s in segs])[None] for j in range(5))
                cu = torch.tensor([0] + [r.prompt for r in new]).cumsum(0)
                slots = torch.tensor([r.row[0] for r in new], dtype=torch.int32, device=dev)
                o, _ = chunk_kda(q, k, v, g, beta, initial_state=pool, ssm_state_indices=slots, cu_seqlens=cu, **kw)
                for n, r in enumerate(new):
                    r.out.append(o[0, cu[n]:cu[n + 1]])
                    r.pos, r.col = r.prompt, 0
                running += new
            if not running:
                break
            spec = a.spec_every > 0 and step % a.spec_every == a.spec_every - 1
            # One step of the fixed batch: running requests on random rows, the rest padding (index -1).
            rows = torch.randperm(a.batch, generator=gen).tolist()[: len(running)]
            T = S if spec else 1
            x = [torch.zeros(a.batch, T, *shape, dtype=dtype, device=dev) for shape in ((H, K), (H, K), (HV, V), (HV, K), (HV,))]
            idx = torch.full((a.batch, S) if spec else (a.batch,), -1, dtype=torch.int32)
            nat = torch.ones(a.batch, dtype=torch.int32)
            for i, r in zip(rows, running):
                for buf, src in zip(x, r.inputs(r.pos, r.pos + T)):
                    buf[i] = src  # spec: the request's next tokens as its draft; its accepted count is drawn below
                if spec:
                    idx[i] = torch.tensor(r.row)
                    nat[i] = r.col + 1
                else:
                    idx[i] = r.row[r.col]
            o, _ = fused_recurrent_kda_fwd(*x, initial_state=pool, ssm_state_indices=idx.to(dev),
                                           num_accepted_tokens=nat.to(dev) if spec else None, **kw)
            for i, r in zip(rows, running):
                acc = min(rint(1, S + 1), r.total - r.pos) if spec else 1
                r.out.append(o[i, :acc])
                r.pos += acc
                r.col = acc - 1 if spec else r.col
            finished = [r for r in running if r.pos >= r.total]
            for r in finished:
                r.final = pool[r.row[r.col]].clone()
                free.extend(r.row)
            running = [r for r in running if r.pos < r.total]
            done += finished
            print(f"step {step:3d} {'spec  ' if spec else 'decode'} running {len(running) + len(finished):2d} "
                  f"prefilled {len(new):2d} finished {len(finished):2d} free slots {len(free):3d}")
    # Every request's outputs and state against chunk_kda over its whole sequence (no pool).
    o_err = s_err = 0.0
    for r in done + running:
        ref_o, ref_s = chunk_kda(*[x[None] for x in r.inputs(0, r.pos)], output_final_state=True, **kw)
        o_err = max(o_err, rel(torch.cat(r.out), ref_o[0]))
        s_err = max(s_err, rel(r.final if hasattr(r, "final") else pool[r.row[r.col]], ref_s[0]))
    print(f"{len(done)} requests finished, {len(running)} running; against chunk_kda over each whole sequence: "
          f"outputs {o_err:.2e}, states {s_err:.2e} (relative RMS)")
    return o_err, s_err, len(done)


if __name__ == "__main__":
    main()
