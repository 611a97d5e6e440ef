"""encore.transformers' block_schedule: a dense Llama / Mistral causal LM's decoder stack in training run
through encore's shifted LLaMA block (docs/blocks.md, docs/transformers.md "block_schedule").

One training forward with labels becomes, for L decoder layers and the rows x [M, d] of the embeddings:

    qkv_0 = RoPE(rmsnorm(x)·γ_in,0 @ W_qkv,0ᵀ)                         _FirstQkvFunction (gemm_rope with the
                                                                      row scale; backward qkv_norm_backward)
    for l < L-1:  y_l = attention_l(qkv_l)                            the model's own attention function
                  (x, qkv_l+1) = block(y_l, x; W_o,l, W_gu,l, W_down,l, W_qkv,l+1, γ_post,l, γ_in,l+1)
                                                                      encore.nn.LlamaBlockFunction
    y_L-1 = attention_L-1(qkv_L-1)
    x1 = y_L-1 @ W_oᵀ + x                                             one cuBLAS GEMM (addmm)
    x2 = swiglu(rmsnorm(x1)·γ_post @ W_guᵀ) @ W_downᵀ + x1            SwigluMlpFunction (the norm's row scale
                                                                      in the SwiGLU GEMM's epilogue)
    loss = cross_entropy(rmsnorm(x2)·γ_final @ W_lmᵀ, shifted labels)  the final norm, then the fused linear
                                                                      cross-entropy with its gradients in the
                                                                      forward (three GEMMs over the logits'
                                                                      shape, as the module patch's loss)

The layouts the ops read are derived per forward from the model's own parameters, differentiably (so
gradients land on the parameters in their own layout and the state dict never changes): W_gu the gate /
up rows interleaved (row 2j gate j, 2j+1 up j), W_qkv = [Wq; Wk; Wv] with each Q / K head's rows
(i, i + D/2) made adjacent (the rope patch's pairing, python/encore/_hf_autograd.py), the frequency
table from the rotary module's inv_freq. Attention sees the permuted Q / K heads, which leaves q·k
unchanged. Any call this schedule does not serve runs the forward it replaced.
"""
from __future__ import annotations

import torch

from . import _hf_autograd as _hf
from . import gemm as _gemm
from ._block_autograd import LlamaBlockFunction as _Block
from ._ce_autograd import fused_linear_cross_entropy as _flce
from ._core import ops as _ops
from ._mlp_autograd import SwigluMlpFunction as _Mlp

# model-forward arguments under which the original forward runs (what the block path cannot return)
_FALLBACK_TRUE = ("use_cache", "output_attentions", "output_hidden_states", "output_router_logits")


class _FirstQkvFunction(torch.autograd.Function):
    """qkv = RoPE(rmsnorm(x)·γ @ w3ᵀ): the first layer's piece before its attention. Forward: the
    `rope` GEMM row on h = x⊙γ with the row scale r = rsqrt(mean(x²) + eps) in its epilogue (the norm
    deferred into the GEMM, as in the block); backward: encore's qkv_norm_backward (dx, dw3, dγ)."""

    @staticmethod
    def forward(ctx, x, gamma, w3, pos, freq, eps):
        r = torch.rsqrt(x.float().pow(2).mean(1) + eps)
        h = (x.float() * gamma.float()).to(x.dtype)
        qkv = _gemm.gemm_rope(h, w3, pos, freq, r)
        ctx.save_for_backward(x, gamma, w3, pos, freq, r, qkv)
        return qkv

    @staticmethod
    def backward(ctx, d_qkv):
        x, gamma, w3, pos, freq, r, qkv = ctx.saved_tensors
        dx, dw3, dg = _ops().qkv_norm_backward(x, gamma, w3, pos, freq, r, qkv, d_qkv.to(qkv.dtype).contiguous(), None, None)
        return dx, dg.to(gamma.dtype), dw3, None, None, None


def _w13(mlp):
    return _hf.interleave(mlp.gate_proj.weight, mlp.up_proj.weight)


def _w3(attn, heads):
    return _hf.qkv_weight(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, heads)


def _plain(model):
    """Whether every module whose weights the schedule reads without calling it is as validated: the
    linears plain nn.Linear, no forward hook on them, on the decoder layers, their attention / MLP /
    norms, the base model, its final norm or the LM head, no global module hook, no accelerate hook. An
    adapter (LoRA) or a sharding / offload hook (FSDP2, ZeRO-3, accelerate) would be bypassed: then the
    original forward runs."""
    mm = torch.nn.modules.module
    if mm._global_forward_hooks or mm._global_forward_pre_hooks:
        return False
    base = model.model
    linears, mods = [model.lm_head], [base, base.norm]
    for layer in base.layers[: model.config.num_hidden_layers]:
        at, mlp = layer.self_attn, layer.mlp
        linears += [at.q_proj, at.k_proj, at.v_proj, at.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        mods += [layer, at, mlp, layer.input_layernorm, layer.post_attention_layernorm]
    if any(type(m) is not torch.nn.Linear for m in linears):
        return False
    return not any(m._forward_hooks or m._forward_pre_hooks or hasattr(m, "_hf_hook") for m in mods + linears)


def _serves(model, a):
    """Whether this call is one the block schedule serves: training with labels under autograd, no cache
    passed or asked for, no per-layer outputs (by the call or the config), no logits slice, no autocast,
    no gradient checkpointing, the modules as validated (_plain)."""
    if not model.training or not torch.is_grad_enabled():  # (False under inference_mode too)
        return False
    if a.get("labels") is None:  # (transformers computes no loss from shift_labels alone)
        return False
    if any(a.get(k) for k in _FALLBACK_TRUE) or a.get("cache") is not None or a.get("past_key_values") is not None:
        return False
    for k in ("output_attentions", "output_hidden_states"):
        if a.get(k) is None and getattr(model.config, k, False):
            return False
    keep = a.get("logits_to_keep", 0)
    if torch.is_tensor(keep) or keep != 0:
        return False
    if getattr(model.model, "gradient_checkpointing", False):
        return False
    dev = (a.get("input_ids") if a.get("input_ids") is not None else a.get("inputs_embeds")).device.type
    return not torch.is_autocast_enabled(dev) and _plain(model)


def block_causal_lm_forward(self, orig, state, *args, **kwargs):
    """The causal LM's forward: through the block schedule when _serves, else the forward it replaced
    (the fused-linear-cross-entropy patch's when that feature is on, else transformers')."""
    a = dict(zip(state["params"], args))
    a.update(kwargs)
    if a.get("input_ids") is None and a.get("inputs_embeds") is None or not _serves(self, a):
        fallback = state["fallback"]
        if fallback is None:
            return orig(self, *args, **kwargs)
        return fallback[0](self, orig, fallback[1], *args, **kwargs)
    return_dict = a.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    loss = _block_loss(self, state, a)
    out = state["output"](loss=loss, logits=None)
    return out if return_dict else out.to_tuple()


def _block_loss(model, state, a):
    base, cfg = model.model, model.config
    ids, embeds = a.pop("input_ids", None), a.pop("inputs_embeds", None)
    if (ids is None) == (embeds is None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    labels, shift_labels = a.pop("labels", None), a.pop("shift_labels", None)
    ignore_index = int(a.pop("ignore_index", -100))
    num_items = a.pop("num_items_in_batch", None)
    attention_mask, position_ids = a.pop("attention_mask", None), a.pop("position_ids", None)
    use_cache = a.pop("use_cache", None)
    for k in ("cache", "past_key_values", "logits_to_keep", *_FALLBACK_TRUE):
        a.pop(k, None)
    x = base.embed_tokens(ids) if embeds is None else embeds
    bsz, seq, d = x.shape
    if position_ids is None:
        position_ids = torch.arange(seq, device=x.device).unsqueeze(0)
    # The original forward makes an empty cache when use_cache resolves to True (config.use_cache, its
    # default, in training too), and with a cache the mask function builds no packed-sequence mask from
    # position_ids: the same cache here gives the same mask (this forward returns no cache).
    cache = None
    if use_cache is None and getattr(cfg, "use_cache", False):
        from transformers.cache_utils import DynamicCache
        cache = DynamicCache(config=cfg)
    mask = state["mask_function"](cfg)(config=cfg, inputs_embeds=x, attention_mask=attention_mask, cache=cache,
                                        position_ids=position_ids)
    hq, hkv, hd = heads = state["heads"]
    pos = position_ids.expand(bsz, seq).reshape(-1).to(torch.int32)
    freq = _hf.freq_table(base.rotary_emb.inv_freq.to(x.device), hq, hkv, hd)
    eps = state["eps"]
    layers = base.layers[: cfg.num_hidden_layers]
    rows = x.reshape(-1, d).contiguous()
    qkv = _FirstQkvFunction.apply(rows, layers[0].input_layernorm.weight, _w3(layers[0].self_attn, heads), pos, freq, eps)
    interface = state["attention_functions"].get_interface(cfg._attn_implementation, state["eager"])
    extra = {"sliding_window": getattr(cfg, "sliding_window", None)} if state["sliding"] == "config" else {}
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    target = shift_labels.reshape(-1).to(device=x.device, dtype=torch.int32).contiguous()
    if target.numel() != rows.shape[0]:
        raise ValueError(f"encore.transformers block_schedule: labels give {target.numel()} targets for {rows.shape[0]} tokens")
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        q, k, v = (t.reshape(bsz, seq, -1, hd).transpose(1, 2) for t in qkv.split((hq * hd, hkv * hd, hkv * hd), -1))
        y, _ = interface(attn, q, k, v, mask, dropout=attn.attention_dropout if attn.training else 0.0, scaling=attn.scaling,
                         position_ids=position_ids, **extra, **a)
        y0 = y.reshape(bsz * seq, -1).contiguous()
        mlp, post = layer.mlp, layer.post_attention_layernorm.weight
        if i + 1 < len(layers):
            nxt = layers[i + 1]
            rows, qkv = _Block.apply(y0, rows, attn.o_proj.weight, _w13(mlp), mlp.down_proj.weight, _w3(nxt.self_attn, heads), post,
                                     nxt.input_layernorm.weight, pos, freq, eps)
        else:  # the last layer's MLP half and the loss: the logits' GEMM three times (not recomputed in the backward)
            x1 = torch.addmm(rows, y0, attn.o_proj.weight.t())
            x2 = x1 + _Mlp.apply(x1, post, _w13(mlp), mlp.down_proj.weight, eps)
            loss = _flce(model.lm_head.weight, _hf.rms_norm(x2, base.norm.weight, eps), target, ignore_index, "mean",
                         grad_in_forward=True)
    if num_items is not None:  # ForCausalLMLoss: the sum over counted rows / num_items_in_batch
        if torch.is_tensor(num_items):
            num_items = num_items.to(loss.device)
        loss = loss * (target != ignore_index).sum().to(loss.dtype) / num_items
    return loss


def loss_head_errors(model, where, op):
    """Why `op` (encore's fused linear cross-entropy or last-layer op: raw logits of a bias-free lm_head,
    transformers' ForCausalLMLoss) cannot take this causal LM's head and loss ([] when it can)."""
    errors = []
    if getattr(model.lm_head, "bias", None) is not None:
        errors.append(f"{where}: lm_head with bias; {op} has none")
    if getattr(model.config, "final_logit_softcapping", None) is not None:
        errors.append(f"{where}: final_logit_softcapping; {op} takes raw logits")
    lf = getattr(model, "loss_function", None)
    if getattr(lf, "__name__", None) != "ForCausalLMLoss":
        errors.append(f"{where}: loss_function {getattr(lf, '__name__', lf)!r}; {op} computes transformers' ForCausalLMLoss only")
    return errors


def rope_errors(rotary, where, static_rope):
    """Why encore's RoPE (a fixed frequency table, unscaled cos / sin) cannot take this rotary module
    ([] when it can)."""
    rt = getattr(rotary, "rope_type", None)
    if rotary is None or getattr(rotary, "inv_freq", None) is None:
        return [f"{where}: no rotary_emb with inv_freq to read RoPE frequencies from"]
    if rt not in static_rope or float(getattr(rotary, "attention_scaling", 1.0)) != 1.0:
        return [f"{where}: rope_type {rt!r} (attention_scaling {getattr(rotary, 'attention_scaling', None)}); encore's RoPE "
                f"takes a fixed frequency table with unscaled cos/sin ({', '.join(static_rope)})"]
    return []


def block_errors(model, fam, causal_lm, rotary, static_rope):
    """Why block_schedule cannot serve this model ([] when it can); also the state for
    block_causal_lm_forward (without params / fallback / output)."""
    name = type(model).__name__
    if fam.name not in ("llama", "mistral"):
        return [f"{name}: block_schedule supports Llama/Mistral dense models (LlamaForCausalLM, MistralForCausalLM)"], None
    if not causal_lm:
        return [f"{name}: block_schedule needs the causal LM (its lm_head and loss run in encore's last-layer op)"], None
    cfg, base = model.config, model.model
    errors = []
    where = f"<model> ({name}) block_schedule"
    for obj, suffix in ((model, "ForCausalLM"), (base, "Model")):
        want = fam.cls(suffix)
        if type(obj) is not want:
            errors.append(f"{where}: {type(obj).__name__} is not {getattr(want, '__name__', suffix)} (a subclass's forward may "
                          "compute something else; block_schedule replaces it)")
    if getattr(cfg, "hidden_act", None) not in ("silu", "swish"):
        errors.append(f"{where}: hidden_act {cfg.hidden_act!r}; encore's block is SiLU-gated")
    if getattr(cfg, "mlp_bias", False) or getattr(cfg, "attention_bias", False):
        errors.append(f"{where}: mlp_bias / attention_bias; encore's block GEMMs have no bias")
    errors += loss_head_errors(model, where, "encore's fused linear cross-entropy")
    errors += rope_errors(rotary, where, static_rope)
    layers = list(base.layers[: cfg.num_hidden_layers])
    dec = fam.cls("DecoderLayer")
    heads = None
    eps = {float(base.norm.variance_epsilon)}
    for i, layer in enumerate(layers):
        lw = f"model.layers.{i} ({type(layer).__name__})"
        if type(layer) is not dec:
            errors.append(f"{lw}: block_schedule runs {dec.__name__} only (a subclass may compute something else)")
            continue
        attn = layer.self_attn
        hd = int(attn.head_dim)
        h = (attn.q_proj.weight.shape[0] // hd, attn.k_proj.weight.shape[0] // hd, hd)
        if hd % 2 or h[0] * hd != attn.q_proj.weight.shape[0] or h[1] * hd != attn.k_proj.weight.shape[0]:
            errors.append(f"{lw}: head_dim {hd} must be even and divide q_proj / k_proj's rows")
        elif rotary is not None and getattr(rotary, "inv_freq", None) is not None and rotary.inv_freq.numel() != hd // 2:
            errors.append(f"{lw}: partial rotary (inv_freq has {rotary.inv_freq.numel()} entries, head_dim {hd}); encore rotates "
                          "whole heads")
        if attn.o_proj.weight.shape[0] != attn.o_proj.weight.shape[1]:
            errors.append(f"{lw}: o_proj {tuple(attn.o_proj.weight.shape)} is not square (heads x head_dim != hidden); encore's "
                          "block takes a [d, d] o_proj")
        if heads is not None and h != heads:
            errors.append(f"{lw}: heads {h} differ from layer 0's {heads}")
        heads = heads or h
        eps |= {float(layer.input_layernorm.variance_epsilon), float(layer.post_attention_layernorm.variance_epsilon)}
        if any(p.is_cuda for p in layer.parameters()):
            d, f = attn.o_proj.weight.shape[0], layer.mlp.gate_proj.weight.shape[0]
            if d % 8 or f % 8 or (h[0] + 2 * h[1]) * hd % 8:
                errors.append(f"{lw}: hidden {d} / intermediate {f} / QKV width not multiples of 8 (16-byte rows of the CUDA GEMMs)")
    if not layers:
        errors.append(f"{where}: no decoder layers")
    if len(eps) != 1:
        errors.append(f"{where}: RMSNorm eps differ ({sorted(eps)}); encore's block takes one eps")
    if errors:
        return errors, None
    modeling = __import__(fam.module, fromlist=["create_causal_mask"])
    causal, sliding = modeling.create_causal_mask, getattr(modeling, "create_sliding_window_causal_mask", None)

    def mask_function(c):
        return sliding if fam.sliding == "config" and getattr(c, "sliding_window", None) is not None else causal

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    return [], {"heads": heads, "eps": eps.pop(), "sliding": fam.sliding, "eager": modeling.eager_attention_forward,
                "attention_functions": ALL_ATTENTION_FUNCTIONS, "mask_function": mask_function}
