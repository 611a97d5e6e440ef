"""Trains a small LLaMA-style decoder with encore's training modules and with plain PyTorch from the same seed
and the same data, and prints both loss curves (issue 30's example).

The model: token embedding, `layers` pre-norm decoder layers (attention norm + fused QKV projection, RoPE,
causal scaled-dot-product attention, output projection + residual; MLP norm + SwiGLU MLP + residual), final
norm, LM head, mean cross-entropy on next-token targets. Implementations:
  torch    every piece in plain PyTorch (F.rms_norm, nn.Linear, F.silu, F.cross_entropy)
  encore   attention norm + QKV = encore.nn.RMSNormLinear; MLP norm + SwiGLU MLP = encore.nn.SwiGLUMLP (the norm
           fused into the gate/up GEMM, the backward on the swiglu_bwd / rmsnorm_bwd epilogues); LM head + loss =
           encore.nn.FusedLinearCrossEntropyLoss (no float logits); attention, RoPE, the final norm and the
           output projection stay PyTorch's
  encore_block  the decoder as encore's shifted blocks: encore.nn.LlamaBlock l covers layer l's output projection +
           residual + MLP norm + SwiGLU MLP + residual and layer l+1's attention norm + QKV projection + RoPE (forward
           and backward each a handful of fused GEMM-epilogue kernels); layer 0's attention norm + QKV (RMSNormLinear),
           the last layer's output projection + MLP (SwiGLUMLP) and the loss (FusedLinearCrossEntropyLoss) around
           them. The blocks keep Q and K in the pair-adjacent RoPE order (the rotate-half partners of each head at
           adjacent columns: the QKV weight's Q and K rows permuted so); attention is invariant to that common
           permutation of q's and k's head dimensions, so scaled-dot-product attention takes them as they are.
Six more torch runs are the same math with other reduction orders (the sequences of each batch reversed, or
rotated by 1, 2, 3, half or three quarters of a batch): each one's largest distance to `torch` over the steps
is one sample of the rounding noise an implementation of the same math shows. The encore curves (their
distance to `torch` likewise) are judged against the bound mean + 4 standard deviations of those six samples
(and at least their largest): a curve with the same rounding noise exceeds it with a probability well under 1%
where the samples are near normal, while a bound of the samples' largest alone is exceeded by one such curve
in seven.

Data: a fixed random first-order Markov chain over the vocabulary (each token has 4 likely successors), so the
loss falls from log(vocab) towards the chain's entropy.

Usage: python3 examples/train_llama.py [--steps 50] [--layers 4] [--hidden 1024] [--device cuda] [--out curves.json]
(bf16 on CUDA, fp32 on the CPU backend). Needs encore built with its Python module (PYTHONPATH=build/python)."""
from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

import encore.nn


class Config:
    def __init__(self, vocab=4096, hidden=1024, layers=4, heads=8, ffn=2816, seq=256, batch=8, eps=1e-5, lr=3e-4):
        self.vocab, self.hidden, self.layers, self.heads, self.ffn = vocab, hidden, layers, heads, ffn
        self.seq, self.batch, self.eps, self.lr = seq, batch, eps, lr


def rope_tables(cfg, device):
    hd = cfg.hidden // cfg.heads
    inv = 10000.0 ** (-torch.arange(0, hd, 2, device=device, dtype=torch.float64) / hd)
    ang = torch.arange(cfg.seq, device=device, dtype=torch.float64)[:, None] * inv[None]
    return ang.cos().float(), ang.sin().float()


def rope(x, cos, sin):  # x [B, H, T, hd], rotate-half convention
    h = x.shape[-1] // 2
    a, b = x[..., :h].float(), x[..., h:].float()
    return torch.cat((a * cos - b * sin, b * cos + a * sin), -1).to(x.dtype)


def attention(qkv, cfg, cos, sin):
    B, T = qkv.shape[0], qkv.shape[1]
    hd = cfg.hidden // cfg.heads
    q, k, v = qkv.view(B, T, 3, cfg.heads, hd).permute(2, 0, 3, 1, 4)
    o = F.scaled_dot_product_attention(rope(q, cos, sin), rope(k, cos, sin), v, is_causal=True)
    return o.transpose(1, 2).reshape(B, T, cfg.hidden)


class TorchLayer(torch.nn.Module):
    def __init__(self, cfg, **kw):
        super().__init__()
        d, f = cfg.hidden, cfg.ffn
        self.cfg = cfg
        self.attn_norm = torch.nn.Parameter(torch.ones(d, **kw))
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False, **kw)
        self.o = torch.nn.Linear(d, d, bias=False, **kw)
        self.mlp_norm = torch.nn.Parameter(torch.ones(d, **kw))
        self.gate = torch.nn.Linear(d, f, bias=False, **kw)
        self.up = torch.nn.Linear(d, f, bias=False, **kw)
        self.down = torch.nn.Linear(f, d, bias=False, **kw)

    def forward(self, x, cos, sin):
        eps = self.cfg.eps
        x = x + self.o(attention(self.qkv(F.rms_norm(x, (x.shape[-1],), self.attn_norm, eps)), self.cfg, cos, sin))
        h = F.rms_norm(x, (x.shape[-1],), self.mlp_norm, eps)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class EncoreLayer(torch.nn.Module):
    def __init__(self, cfg, src: TorchLayer):
        super().__init__()
        d = cfg.hidden
        kw = {"device": src.qkv.weight.device, "dtype": src.qkv.weight.dtype}
        self.cfg = cfg
        self.qkv = encore.nn.RMSNormLinear(d, 3 * d, eps=cfg.eps, **kw)
        self.o = torch.nn.Linear(d, d, bias=False, **kw)
        self.mlp = encore.nn.SwiGLUMLP.from_linear(src.gate, src.up, src.down, norm_weight=src.mlp_norm, eps=cfg.eps)
        with torch.no_grad():
            self.qkv.weight.copy_(src.qkv.weight)
            self.qkv.norm_weight.copy_(src.attn_norm)
            self.o.weight.copy_(src.o.weight)

    def forward(self, x, cos, sin):
        x = x + self.o(attention(self.qkv(x), self.cfg, cos, sin))
        return x + self.mlp(x)


def attention_rotated(qkv, cfg):
    """Causal attention on a QKV whose Q and K are already rotated (in any common order of their head dims)."""
    B, T = qkv.shape[0], qkv.shape[1]
    hd = cfg.hidden // cfg.heads
    q, k, v = qkv.view(B, T, 3, cfg.heads, hd).permute(2, 0, 3, 1, 4)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return o.transpose(1, 2).reshape(B, T, cfg.hidden)


def pair_adjacent_qk(w_qkv, cfg):
    """The QKV weight [3d, d] with each Q and K head's rows (i, i + hd/2) moved to (2i, 2i + 1); V as is."""
    hd = cfg.hidden // cfg.heads
    w = w_qkv.view(3, cfg.heads, 2, hd // 2, -1)
    qk = w[:2].transpose(2, 3).reshape(2, cfg.heads, hd, -1)
    return torch.cat((qk.reshape(2 * cfg.hidden, -1), w_qkv[2 * cfg.hidden:]))


class EncoreBlockModel(torch.nn.Module):
    """The decoder on encore.nn.LlamaBlock (see the module docstring), with the weights of a torch Model."""

    def __init__(self, cfg, src):
        super().__init__()
        self.cfg, self.impl = cfg, "encore_block"
        d, hd = cfg.hidden, cfg.hidden // cfg.heads
        kw = {"device": src.embed.weight.device, "dtype": src.embed.weight.dtype}
        L = src.layers
        self.embed = torch.nn.Embedding(cfg.vocab, d, **kw)
        self.qkv0 = encore.nn.RMSNormLinear(d, 3 * d, eps=cfg.eps, **kw)
        self.blocks = torch.nn.ModuleList(encore.nn.LlamaBlock(d, cfg.ffn, cfg.heads, cfg.heads, hd, rope_base=10000.0, eps=cfg.eps,
                                                               **kw) for _ in range(len(L) - 1))
        self.o_last = torch.nn.Linear(d, d, bias=False, **kw)
        self.mlp_last = encore.nn.SwiGLUMLP.from_linear(L[-1].gate, L[-1].up, L[-1].down, norm_weight=L[-1].mlp_norm, eps=cfg.eps)
        self.norm = torch.nn.Parameter(torch.ones(d, **kw))
        self.head = torch.nn.Linear(d, cfg.vocab, bias=False, **kw)
        self.loss_fn = encore.nn.FusedLinearCrossEntropyLoss()
        with torch.no_grad():
            self.embed.weight.copy_(src.embed.weight)
            self.qkv0.weight.copy_(L[0].qkv.weight)
            self.qkv0.norm_weight.copy_(L[0].attn_norm)
            for l, b in enumerate(self.blocks):
                b.w0.copy_(L[l].o.weight)
                b.w1.copy_(torch.stack((L[l].gate.weight, L[l].up.weight), 1).reshape(2 * cfg.ffn, d))
                b.w2.copy_(L[l].down.weight)
                b.gamma0.copy_(L[l].mlp_norm)
                b.w3.copy_(pair_adjacent_qk(L[l + 1].qkv.weight, cfg))
                b.gamma1.copy_(L[l + 1].attn_norm)
            self.o_last.weight.copy_(L[-1].o.weight)
            self.norm.copy_(src.norm)
            self.head.weight.copy_(src.head.weight)

    def forward(self, tokens, targets, cos, sin):
        B, T, d = tokens.shape[0], tokens.shape[1], self.cfg.hidden
        x = self.embed(tokens).reshape(B * T, d)
        y = attention(self.qkv0(x).view(B, T, 3 * d), self.cfg, cos, sin).reshape(B * T, d)
        pos = torch.arange(T, device=tokens.device, dtype=torch.int32).repeat(B)
        for b in self.blocks:
            x, qkv = b(y, x, pos)
            y = attention_rotated(qkv.view(B, T, 3 * d), self.cfg).reshape(B * T, d)
        x = x + self.o_last(y)
        x = x + self.mlp_last(x)
        h = F.rms_norm(x, (d,), self.norm, self.cfg.eps)
        return self.loss_fn(self.head.weight, h, targets.reshape(-1))


class Model(torch.nn.Module):
    def __init__(self, cfg, impl, src=None, **kw):
        super().__init__()
        self.cfg, self.impl = cfg, impl
        if impl == "encore":
            kw = {"device": src.embed.weight.device, "dtype": src.embed.weight.dtype}
        self.embed = torch.nn.Embedding(cfg.vocab, cfg.hidden, **kw)
        self.norm = torch.nn.Parameter(torch.ones(cfg.hidden, **kw))
        self.head = torch.nn.Linear(cfg.hidden, cfg.vocab, bias=False, **kw)
        if impl == "encore":
            self.layers = torch.nn.ModuleList(EncoreLayer(cfg, s) for s in src.layers)
            self.loss_fn = encore.nn.FusedLinearCrossEntropyLoss()
            with torch.no_grad():
                self.embed.weight.copy_(src.embed.weight)
                self.norm.copy_(src.norm)
                self.head.weight.copy_(src.head.weight)
        else:
            self.layers = torch.nn.ModuleList(TorchLayer(cfg, **kw) for _ in range(cfg.layers))
            with torch.no_grad():
                for n, p in self.named_parameters():
                    if p.dim() == 2:
                        p.normal_(0.0, 0.02 if "embed" in n else p.shape[1] ** -0.5)

    def forward(self, tokens, targets, cos, sin):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        h = F.rms_norm(x, (x.shape[-1],), self.norm, self.cfg.eps).reshape(-1, self.cfg.hidden)
        if self.impl == "encore":
            return self.loss_fn(self.head.weight, h, targets.reshape(-1))
        return F.cross_entropy(self.head(h).float(), targets.reshape(-1))


def markov_batches(cfg, steps, device, seed=0):
    """`steps` batches of [batch, seq + 1] tokens from a fixed random Markov chain (4 likely successors each)."""
    g = torch.Generator().manual_seed(seed)
    succ = torch.randint(0, cfg.vocab, (cfg.vocab, 4), generator=g)
    out = []
    for _ in range(steps):
        t = torch.empty(cfg.batch, cfg.seq + 1, dtype=torch.long)
        t[:, 0] = torch.randint(0, cfg.vocab, (cfg.batch,), generator=g)
        for i in range(cfg.seq):
            pick = torch.randint(0, 4, (cfg.batch,), generator=g)
            noise = torch.rand(cfg.batch, generator=g) < 0.1
            t[:, i + 1] = torch.where(noise, torch.randint(0, cfg.vocab, (cfg.batch,), generator=g), succ[t[:, i], pick])
        out.append(t.to(device))
    return out


def train(model, batches, cfg, permute=None, log=None):
    cos, sin = rope_tables(cfg, batches[0].device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    losses = []
    for step, b in enumerate(batches):
        if permute == "flip":
            b = b.flip(0)
        elif permute is not None:  # "roll<k>": rotated by k / 4 of the batch (k < 0: by -k sequences)
            k = int(permute[4:])
            b = b.roll(b.shape[0] * k // 4 if k > 0 else -k, 0)
        loss = model(b[:, :-1], b[:, 1:], cos, sin)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if log and (step % 10 == 0 or step == len(batches) - 1):
            log(f"  {model.impl:7s}{' ' + permute if permute else ''} step {step:3d} loss {losses[-1]:.4f}")
    return losses


# The reduction orders of the extra torch runs (train's permute): reversed, rotated by 1, 2, 3 sequences,
# by half and by three quarters of the batch.
ORDERS = ("flip", "roll-1", "roll-2", "roll-3", "roll2", "roll3")


def build(cfg, device, dtype, seed=0, orders=ORDERS):
    torch.manual_seed(seed)
    ref = Model(cfg, "torch", device=device, dtype=dtype)
    twins = []
    for _ in range(len(orders)):
        twins.append(Model(cfg, "torch", device=device, dtype=dtype))
        twins[-1].load_state_dict(ref.state_dict())
    ours = Model(cfg, "encore", src=ref)
    return ref, twins, ours, EncoreBlockModel(cfg, ref)


def run(cfg, steps, device, dtype, log=print, orders=ORDERS):
    """The loss curves of every implementation; with two or more `orders`, the torch noise bound too."""
    batches = markov_batches(cfg, steps, device)
    ref, twins, ours, blocks = build(cfg, device, dtype, orders=orders)
    res = {}
    runs = [("torch", ref, None)] + [(f"torch_{o}", twin, o) for o, twin in zip(orders, twins)]
    runs += [("encore", ours, None), ("encore_block", blocks, None)]
    for name, model, perm in runs:
        t0 = time.time()
        res[name] = train(model, batches, cfg, permute=perm, log=log)
        log(f"  {name}: {time.time() - t0:.1f} s")

    def dist(curve):
        return max(abs(a - b) for a, b in zip(res["torch"], curve))

    res["encore_vs_torch"], res["encore_block_vs_torch"] = dist(res["encore"]), dist(res["encore_block"])
    if len(orders) < 2:
        return res
    samples = [dist(res[f"torch_{o}"]) for o in orders]
    mean = sum(samples) / len(samples)
    sd = (sum((x - mean) ** 2 for x in samples) / (len(samples) - 1)) ** 0.5
    res["torch_order_distances"] = samples
    res["bound_torch"] = max(mean + 4 * sd, max(samples))
    log(f"max |loss difference| to torch over {steps} steps: other reduction orders {', '.join(f'{x:.3g}' for x in samples)} "
        f"(bound mean + 4 sd {res['bound_torch']:.4g}), encore {res['encore_vs_torch']:.4g}, "
        f"encore_block {res['encore_block_vs_torch']:.4g} "
        f"(start {res['torch'][0]:.3f} ~ log(vocab) {math.log(cfg.vocab):.3f}, end {res['torch'][-1]:.3f})")
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32
    cfg = Config(vocab=a.vocab, hidden=a.hidden, layers=a.layers, heads=max(1, a.hidden // 128), ffn=(a.hidden * 11 // 4 + 7) // 8 * 8)
    print(f"training {a.layers} layers, hidden {a.hidden}, vocab {a.vocab}, {a.steps} steps on {a.device} ({dtype})", flush=True)
    res = run(cfg, a.steps, a.device, dtype)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
