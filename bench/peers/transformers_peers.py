"""Hugging Face transformers models patched in place (issue 50, docs/transformers.md): one training step
(forward with labels + backward; with TF_PEER_MODES=train_opt also a fused AdamW step at lr 0), one inference
forward (no grad, logits: the prefill) and one decode step (TF_PEER_MODES=decode: TF_PEER_DECODE = BxP, default
32x1024, B sequences of P tokens in the KV cache, one new token each; the cache cropped back after each step) of a bf16,
randomly initialized LlamaForCausalLM / Qwen3ForCausalLM / Qwen3MoeForCausalLM with a few layers, in five variants in one
process on the same inputs and the same weights (the four model instances share their parameter tensors):

  eager    the unpatched model (attention by SDPA)
  compile  torch.compile of that same unpatched model (default mode; its first call's seconds and the
           graph breaks dynamo counted are recorded)
  liger    Liger-Kernel's patch (_apply_liger_kernel_to_instance: apply_liger_kernel_to_llama / _qwen3 with
           model=, RoPE, RMSNorm, SwiGLU, fused linear cross-entropy). Liger's RoPE and module-class swaps are
           globals of the transformers modeling module: they are switched on only while the liger variant
           runs, so the other variants run transformers' own code
  encore   encore.transformers.apply_encore (RMSNorm, SwiGLU, fused QKV + RoPE / QK-norm, fused linear
           cross-entropy in training)
  encore_block  apply_encore(block_schedule=True): in training the decoder stack through encore's shifted
           LLaMA block ops (Llama only: recorded as not run for Qwen3); inference as `encore`

Timing: CUDA events around each step; TF_PEER_WARMUP steps per variant first (the compile variant's first
call, its compilation, timed apart), then ROUNDS rounds, the variants in a rotated order each round and
TF_PEER_STEPS steps each; median over all timed steps (each round's median is in the JSON too). Per
variant: median ms, tokens/s, peak memory of one step (torch.cuda.max_memory_allocated, reset before the
step; the absolute peak, with the shared weights and the batch, and the extra above what was allocated
before the step), the loss on the same batch and its difference from eager's (training), the logits'
largest difference from eager's on every 16th token (inference), and the modules each patch changed
(per class the instance modules whose forward was replaced, and the module globals Liger replaced). A
variant that fails (Liger or encore missing, a patch refused, an error in a step) is recorded with its
error and the others still run. The JSON is written after every model and mode: a call cut by its
timeout keeps what it measured; results are keyed <model>/<mode>, so the files of several calls merge.

Models (TF_PEER_MODELS, default all three; real dimensions, untied embeddings, sdpa attention):
  llama_1B   Llama-3.2-1B: hidden 2048, intermediate 8192, 32 heads, 8 KV heads, head_dim 64, vocab 128256
  llama_8B   Llama-3-8B:   hidden 4096, intermediate 14336, 32 heads, 8 KV heads, head_dim 128, vocab 128256
  qwen3_8B   Qwen3-8B:     hidden 4096, intermediate 12288, 32 heads, 8 KV heads, head_dim 128, vocab 151936
  qwen3_1B   Qwen3-1.7B:   hidden 2048, intermediate 6144, 16 heads, 8 KV heads, head_dim 128, vocab 151936 (on request)
  qwen3_moe_30B  Qwen3-30B-A3B: hidden 2048, 128 experts of intermediate 768, 8 per token, 32 heads, 4 KV heads,
             head_dim 128, vocab 151936 (on request; encore's MoE serves inference: infer and decode)
TF_PEER_LAYERS decoder layers (default 4: the 8B shapes' fwd + bwd at 8192 tokens then need about 25 GB),
TF_PEER_TOKENS tokens per step (default 8192), TF_PEER_SEQ the sequence length (default = the tokens: batch 1),
TF_PEER_WHO variants (default eager,compile,liger,encore,encore_block; encore_ce<rows>: the module patch with its loss in chunks of <rows> rows), TF_PEER_MODES (train,infer; also train_opt, decode), ROUNDS (3),
TF_PEER_STEPS (5), TF_PEER_WARMUP (3), TF_PEER_PROFILE=1 (one more step per variant under torch.profiler: its CUDA
time and top kernels in the JSON). torch.compile takes one to two minutes per model and mode on a fresh
machine (cached on disk for later calls on the same warm machine): give a call one or two models.

--smoke: on the CPU, a tiny Llama, Qwen3 and Qwen3-MoE (hidden 64, 2 layers, 64 tokens; decode 2x16), eager, encore and encore_block, one
step each (Liger's patch is applied to a copy to list what it changes, not run: its kernels are Triton);
exits 1 when a variant fails or encore's loss / logits leave bf16 noise.
Usage: python3 bench/peers/transformers_peers.py OUT.json [--smoke]"""
import copy
import json
import os
import statistics
import sys
import time
import traceback

import torch

SMOKE = "--smoke" in sys.argv[1:]
ARGS = [a for a in sys.argv[1:] if a != "--smoke"]
OUT = ARGS[0] if ARGS else "transformers_peers.json"
DEV = "cpu" if SMOKE else "cuda"
BF = torch.bfloat16
# name: (family, hidden, intermediate, heads, kv heads, head_dim, vocab, rope theta)
MODELS = {
    "llama_1B": ("llama", 2048, 8192, 32, 8, 64, 128256, 500000.0),
    "llama_8B": ("llama", 4096, 14336, 32, 8, 128, 128256, 500000.0),
    "qwen3_8B": ("qwen3", 4096, 12288, 32, 8, 128, 151936, 1000000.0),
    "qwen3_1B": ("qwen3", 2048, 6144, 16, 8, 128, 151936, 1000000.0),
    "qwen3_moe_30B": ("qwen3_moe", 2048, 768, 32, 4, 128, 151936, 1000000.0),  # intermediate: each expert's
}
MOE = {"qwen3_moe_30B": (128, 8), "qwen3_moe_tiny": (8, 2)}  # experts, experts per token (Qwen3-30B-A3B's)
if SMOKE:
    MODELS = {"llama_tiny": ("llama", 64, 128, 4, 2, 16, 256, 500000.0), "qwen3_tiny": ("qwen3", 64, 128, 4, 2, 16, 256, 1000000.0),
              "qwen3_moe_tiny": ("qwen3_moe", 64, 32, 4, 2, 16, 256, 1000000.0)}
    NAMES, LAYERS, TOKENS, SEQ = list(MODELS), 2, 64, 32
    WHO, MODES, ROUNDS, STEPS, WARMUP = ["eager", "encore", "encore_block"], ["train", "infer", "decode"], 1, 1, 0
    DECODE_BATCH, DECODE_PREFIX = 2, 16
else:
    NAMES = os.environ.get("TF_PEER_MODELS", "llama_1B,llama_8B,qwen3_8B").split(",")
    LAYERS = int(os.environ.get("TF_PEER_LAYERS", "4"))
    TOKENS = int(os.environ.get("TF_PEER_TOKENS", "8192"))
    SEQ = int(os.environ.get("TF_PEER_SEQ", str(TOKENS)))
    WHO = os.environ.get("TF_PEER_WHO", "eager,compile,liger,encore,encore_block").split(",")
    MODES = os.environ.get("TF_PEER_MODES", "train,infer").split(",")
    DECODE_BATCH, DECODE_PREFIX = (int(v) for v in os.environ.get("TF_PEER_DECODE", "32x1024").split("x"))
    ROUNDS = int(os.environ.get("ROUNDS", "3"))
    STEPS = int(os.environ.get("TF_PEER_STEPS", "5"))
    WARMUP = int(os.environ.get("TF_PEER_WARMUP", "3"))
PROFILE = not SMOKE and os.environ.get("TF_PEER_PROFILE", "0") == "1"
if TOKENS % SEQ:
    sys.exit(f"TF_PEER_TOKENS {TOKENS} is not a multiple of TF_PEER_SEQ {SEQ}")
LOSS_RTOL = 2e-2  # |loss - eager's| / eager's within this: bf16 noise (the tests bound the error far tighter)

RES = {"smoke": SMOKE, "device": DEV, "torch": torch.__version__,
       "setup": {"layers": LAYERS, "tokens": TOKENS, "seq": SEQ, "batch": TOKENS // SEQ, "variants": WHO, "modes": MODES,
                 "rounds": ROUNDS, "steps_per_round": STEPS, "warmup": WARMUP, "dtype": "bfloat16", "attn_implementation": "sdpa",
                 "tie_word_embeddings": False, "optimizer": None, "loss_rtol": LOSS_RTOL},
       "results": {}, "complete": False}
if DEV == "cuda":
    RES["gpu"] = torch.cuda.get_device_name(0)


def save():
    with open(OUT, "w") as f:
        json.dump(RES, f, indent=1)


def version(pkg):
    try:
        import importlib.metadata as md
        return md.version(pkg)
    except Exception:  # noqa: BLE001
        return None


def error_text(e):
    return f"{type(e).__name__}: {e}"[:600]


def build(name):
    import transformers
    fam, d, f, hq, hkv, hd, vocab, theta = MODELS[name]
    common = dict(hidden_size=d, intermediate_size=f, num_attention_heads=hq, num_key_value_heads=hkv, head_dim=hd, vocab_size=vocab,
                  num_hidden_layers=LAYERS, max_position_embeddings=max(SEQ, 8192), rope_theta=theta, rms_norm_eps=1e-6 if fam.startswith("qwen3") else 1e-5,
                  tie_word_embeddings=False, attn_implementation="sdpa")
    if fam == "llama":
        cfg, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    elif fam == "qwen3_moe":  # every layer sparse, no shared expert; f is each expert's intermediate size
        experts, top_k = MOE[name]
        cfg = transformers.Qwen3MoeConfig(**common, moe_intermediate_size=f, num_experts=experts, num_experts_per_tok=top_k,
                                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
        cls = transformers.Qwen3MoeForCausalLM
    else:
        cfg, cls = transformers.Qwen3Config(**common), transformers.Qwen3ForCausalLM
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(BF)
    try:
        with torch.device(DEV):
            model = cls(cfg)
    finally:
        torch.set_default_dtype(old)
    shape = {"family": fam, "class": cls.__name__, "hidden": d, "intermediate": f, "heads": hq, "kv_heads": hkv, "head_dim": hd,
             "vocab": vocab, "layers": LAYERS, "params": sum(p.numel() for p in model.parameters())}
    if name in MOE:
        shape["experts"], shape["experts_per_token"] = MOE[name]
    return model, shape


def share(model):
    """A new instance of `model` (own modules, so its own patches) on the same parameter and buffer tensors."""
    memo = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return copy.deepcopy(model, memo)


def forwards(model):
    return {n: (type(m), m.__dict__.get("forward")) for n, m in model.named_modules()}


def changed(model, before):
    """Per class name, the instance modules whose forward (or class) the patch replaced."""
    out = {}
    for n, m in model.named_modules():
        if before.get(n) != (type(m), m.__dict__.get("forward")):
            key = type(m).__name__ if before.get(n, (type(m),))[0] is type(m) else f"{before[n][0].__name__}->{type(m).__name__}"
            out[key] = out.get(key, 0) + 1
    return out


class GlobalSwap:
    """The module-level attributes a patch function replaced (Liger's apply_rotary_pos_emb, <Family>RMSNorm,
    <Family>MLP, class forwards): recorded, put back at once, and switched on only inside `with swap:`."""

    def __init__(self, owners):
        self.owners = owners
        self.before = [dict(vars(o)) for o in owners]
        self.diffs = []

    def record(self):
        for o, old in zip(self.owners, self.before):
            now = dict(vars(o))
            for k in set(old) | set(now):
                if old.get(k, _MISSING) is not now.get(k, _MISSING) and not k.startswith("__"):
                    self.diffs.append((o, k, old.get(k, _MISSING), now.get(k, _MISSING)))
        self._set(2)
        return [f"{getattr(o, '__name__', o)}.{k}" for o, k, _, _ in self.diffs]

    def _set(self, which):
        for d in self.diffs:
            o, k, v = d[0], d[1], d[which]
            if v is _MISSING:
                if k in vars(o):
                    delattr(o, k)
            else:
                setattr(o, k, v)

    def __enter__(self):
        self._set(3)

    def __exit__(self, *exc):
        self._set(2)


_MISSING = object()


class ChunkRows:
    """encore's fused linear cross-entropy with `rows` rows per chunk (its default: encore._ce_autograd's
    _default_chunk_rows), switched on only inside `with`: the variants encore_ce<rows>."""

    def __init__(self, rows):
        self.rows = rows

    def __enter__(self):
        import encore._ce_autograd as ce
        self.saved, ce._default_chunk_rows = ce._default_chunk_rows, lambda m: self.rows

    def __exit__(self, *exc):
        import encore._ce_autograd as ce
        ce._default_chunk_rows = self.saved


def liger_patch(model, fam):
    import importlib
    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    mod = importlib.import_module(f"transformers.models.{fam}.modeling_{fam}")
    owners = [mod] + [c for c in vars(mod).values() if isinstance(c, type) and c.__module__ == mod.__name__]
    loss_utils = importlib.import_module("transformers.loss.loss_utils")
    owners += [loss_utils, torch.nn.functional]
    swap = GlobalSwap(owners)
    before = forwards(model)
    try:
        _apply_liger_kernel_to_instance(model=model)
    finally:
        globals_changed = swap.record()
    return swap, {"modules": changed(model, before), "globals": sorted(globals_changed), "liger_kernel": version("liger-kernel")}


def encore_patch(model, **flags):
    import encore.transformers as et
    before = forwards(model)
    report = et.apply_encore(model, **flags)
    return {"modules": changed(model, before), "report": {k: len(v) for k, v in report.patched.items()},
            "not_applied": dict(report.not_applied)}


class Timer:
    def __init__(self):
        self.cuda = DEV == "cuda"

    def __call__(self, fn):
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b), out
        t = time.perf_counter()
        out = fn()
        return (time.perf_counter() - t) * 1e3, out


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def peak_of(fn):
    if DEV != "cuda":
        return {}
    sync()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    sync()
    peak = torch.cuda.max_memory_allocated()
    return {"peak_GB": peak / 1e9, "peak_extra_GB": (peak - base) / 1e9, "allocated_before_GB": base / 1e9}


def profile_of(fn, top=30):
    """One step under torch.profiler: its CUDA time and the `top` kernels by total device time (name cut to
    120 characters, calls, ms)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    rows = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    rows.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in rows) / 1e3
    return {"cuda_ms": total, "kernels": [[e.key[:120], e.count, e.self_device_time_total / 1e3] for e in rows[:top]]}


def graph_breaks():
    try:
        from torch._dynamo.utils import counters
        return sum(counters["graph_break"].values())
    except Exception:  # noqa: BLE001
        return None


def run_model(name):
    model, shape = build(name)
    fam = shape["family"]
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, shape["vocab"], (TOKENS // SEQ, SEQ), generator=g).to(DEV)
    dids = torch.randint(0, shape["vocab"], (DECODE_BATCH, DECODE_PREFIX + 1), generator=g).to(DEV)
    variants, patched, errors, swaps, skipped = {}, {}, {}, {}, {}
    for who in WHO:
        try:
            if who == "eager":
                variants[who] = model
            elif who == "compile":
                variants[who] = torch.compile(model)
            elif who == "liger":
                m = share(model)
                swaps[who], patched[who] = liger_patch(m, fam)
                variants[who] = m
            elif who == "encore":
                m = share(model)
                patched[who] = encore_patch(m)
                variants[who] = m
            elif who.startswith("encore_ce"):  # the module patch with the loss's chunk rows set (the chunk-size study)
                m = share(model)
                patched[who] = encore_patch(m)
                swaps[who] = ChunkRows(int(who[len("encore_ce"):]))
                variants[who] = m
            elif who == "encore_block":
                if fam not in ("llama", "mistral"):
                    skipped[who] = "block_schedule supports Llama/Mistral dense models"
                    continue
                m = share(model)
                patched[who] = encore_patch(m, block_schedule=True)
                variants[who] = m
            else:
                raise ValueError(f"unknown variant {who}")
        except Exception as e:  # noqa: BLE001 (recorded; the other variants still run)
            errors[who] = error_text(e)
            traceback.print_exc()
    if SMOKE and "liger" not in WHO:  # the CPU cannot run Liger's Triton kernels: its patch is listed, then dropped
        try:
            swap, patched["liger"] = liger_patch(share(model), fam)
            patched["liger"]["note"] = "applied to a copy on the CPU, not run"
        except Exception as e:  # noqa: BLE001
            patched["liger"] = {"error": error_text(e)}
    for mode in MODES:
        key = f"{name}/{mode}"
        entry = RES["results"][key] = {"shape": shape, "mode": mode, "tokens": TOKENS, "seq": SEQ, "variants": {}}
        for who, e in errors.items():
            entry["variants"][who] = {"error": e}
        for who in set(patched) - set(variants):  # --smoke: Liger's patch listed, not run
            entry["variants"][who] = {"patched": patched[who], "not_run": True}
        for who, why in skipped.items():
            entry["variants"][who] = {"not_run": True, "reason": why}
        if mode == "decode":  # a batch of sequences, each a prefix in the KV cache and one new token
            entry["decode_batch"], entry["decode_prefix"] = DECODE_BATCH, DECODE_PREFIX
        measure(entry, mode, variants, swaps, patched, dids if mode == "decode" else ids)
        save()
    del variants, model
    if DEV == "cuda":
        torch._dynamo.reset()
        torch.cuda.empty_cache()


def measure(entry, mode, variants, swaps, patched, ids):
    train = mode in ("train", "train_opt")
    for m in variants.values():
        m.train(train)
    params = [p for p in next(iter(variants.values())).parameters()] if variants else []
    # train_opt: the step ends with a (fused on CUDA) AdamW step at lr 0: the optimizer's kernels, time and state memory
    # of a real step, the shared weights unchanged (so every variant still sees the same model)
    opt = torch.optim.AdamW(params, lr=0.0, fused=DEV == "cuda") if mode == "train_opt" and params else None

    def clear():
        for p in params:
            p.grad = None

    def step_of(who, m):
        swap = swaps.get(who)

        cache = {}

        def step():
            if swap is not None:
                swap.__enter__()
            try:
                if mode == "decode":  # the prefix's cache once per variant (a patched model's K heads are permuted), then
                    with torch.no_grad():  # one token per sequence, the cache cropped back to the prefix after each step
                        if "kv" not in cache:
                            cache["kv"] = m(input_ids=ids[:, :DECODE_PREFIX], use_cache=True).past_key_values
                        logits = m(input_ids=ids[:, DECODE_PREFIX:], past_key_values=cache["kv"], use_cache=True).logits
                        cache["kv"].crop(-1)  # the new token out again
                        return logits
                if train:
                    clear()
                    loss = m(input_ids=ids, labels=ids, use_cache=False).loss
                    loss.backward()
                    if opt is not None:
                        opt.step()
                    return loss.detach()
                with torch.no_grad():
                    return m(input_ids=ids, use_cache=False).logits
            finally:
                if swap is not None:
                    swap.__exit__()
        return step

    steps = {who: step_of(who, m) for who, m in variants.items()}
    timer = Timer()
    recs, firsts = {}, {}
    for who in list(steps):
        r = entry["variants"][who] = {}
        if who in patched:
            r["patched"] = patched[who]
        try:
            breaks = graph_breaks()
            ms, out = timer(steps[who])  # the first call: compilation, autotuning
            r["first_call_ms"] = ms
            if who == "compile" and breaks is not None:
                r["graph_breaks"] = graph_breaks() - breaks
            firsts[who] = out.float().cpu() if train else out[:, ::16].float().cpu()
            for _ in range(WARMUP):
                steps[who]()
            clear()
            sync()
        except Exception as e:  # noqa: BLE001 (recorded; the other variants still run)
            r["error"] = error_text(e)
            traceback.print_exc()
            del steps[who]
            clear()
            continue
        recs[who] = []
    names = list(steps)
    rounds = {who: [] for who in names}
    for rnd in range(ROUNDS):
        for who in names[rnd % max(len(names), 1):] + names[:rnd % max(len(names), 1)]:
            if who not in steps:
                continue
            try:
                times = [timer(steps[who])[0] for _ in range(STEPS)]
            except Exception as e:  # noqa: BLE001
                entry["variants"][who]["error"] = error_text(e)
                traceback.print_exc()
                del steps[who]
                continue
            recs[who] += times
            rounds[who].append(statistics.median(times))
            clear()
    ref = firsts.get("eager")
    for who in list(steps):
        r = entry["variants"][who]
        med = statistics.median(recs[who])
        r.update({"median_ms": med, "tokens_per_s": (DECODE_BATCH if mode == "decode" else TOKENS) / (med / 1e3),
                  "rounds_ms_min": min(rounds[who]), "rounds_ms_max": max(rounds[who])})
        clear()
        r.update(peak_of(steps[who]))
        clear()
        if PROFILE:
            r["profile"] = profile_of(steps[who])
            clear()
        if train:
            r["loss"] = firsts[who].item()
            if ref is not None:
                r["loss_diff_vs_eager"] = abs(r["loss"] - ref.item())
                r["loss_close"] = r["loss_diff_vs_eager"] <= LOSS_RTOL * abs(ref.item())
        elif ref is not None:
            r["logits_max_diff_vs_eager"] = (firsts[who] - ref).abs().max().item()
            r["logits_eager_max_abs"] = ref.abs().max().item()
        print(f"{entry['shape']['class']:18s} L{LAYERS} M{TOKENS} {mode:9s} {who:8s} {med:9.3f} ms  {r['tokens_per_s']:12.0f} tok/s  "
              f"peak {r.get('peak_GB', float('nan')):6.2f} GB  " + (f"loss {r['loss']:.5f}" if train else
                                                                    f"logits diff {r.get('logits_max_diff_vs_eager', 0):.4f}"), flush=True)
    for who in names:
        if who in steps and "eager" in steps and who != "eager":
            entry["variants"][who]["speedup_vs_eager"] = entry["variants"]["eager"]["median_ms"] / entry["variants"][who]["median_ms"]
    for a, b in (("encore", "liger"), ("encore", "compile"), ("encore_block", "encore"), ("encore_block", "liger"),
                 ("encore_block", "compile")):
        if a in steps and b in steps:
            entry[f"{a}_over_{b}_time"] = entry["variants"][a]["median_ms"] / entry["variants"][b]["median_ms"]
            pa, pb = entry["variants"][a].get("peak_GB"), entry["variants"][b].get("peak_GB")
            if pa and pb:
                entry[f"{a}_over_{b}_peak"] = pa / pb


def main():
    try:
        import transformers
        RES["transformers"] = transformers.__version__
    except ImportError as e:
        RES["error"] = f"transformers is not importable: {e}"
        save()
        return 1
    RES["liger_kernel"] = version("liger-kernel")
    try:
        import encore
        RES["encore_cuda"] = bool(encore.built_with_cuda() and encore.cuda_device_count() > 0)
    except Exception as e:  # noqa: BLE001
        RES["encore_import_error"] = error_text(e)
    save()
    for name in NAMES:
        if name not in MODELS:
            RES["results"][name] = {"error": f"unknown model {name} (known: {', '.join(MODELS)})"}
            continue
        try:
            run_model(name)
        except Exception as e:  # noqa: BLE001 (recorded; the next model still runs)
            RES["results"].setdefault(name, {})["error"] = error_text(e)
            traceback.print_exc()
        save()
    RES["complete"] = True
    save()
    if SMOKE:
        return smoke_verdict()
    return 0


def smoke_verdict():
    bad = []
    for key, entry in RES["results"].items():
        if "error" in entry:
            bad.append(f"{key}: {entry['error']}")
            continue
        for who, r in entry["variants"].items():
            if r.get("not_run"):
                continue
            if "error" in r:
                bad.append(f"{key} {who}: {r['error']}")
            elif r.get("loss_close") is False:
                bad.append(f"{key} {who}: loss {r['loss']} against eager's differs by {r['loss_diff_vs_eager']}")
            elif "logits_max_diff_vs_eager" in r and r["logits_max_diff_vs_eager"] > 0.05 * max(r["logits_eager_max_abs"], 1.0):
                bad.append(f"{key} {who}: logits differ by {r['logits_max_diff_vs_eager']}")
            elif who in ("encore", "encore_block") and not r.get("patched", {}).get("modules"):
                bad.append(f"{key} {who}: nothing patched")
    for b in bad:
        print("smoke:", b, flush=True)
    print(f"smoke: {'FAILED' if bad else 'ok'} ({len(RES['results'])} model/mode entries)", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
