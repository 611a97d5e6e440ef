"""encore inside Hugging Face transformers models, in one call (docs/transformers.md).

    import encore.transformers as et
    report = et.apply_encore(model)          # an instantiated LlamaForCausalLM / Qwen3ForCausalLM / ..., in place
    et.apply_encore_to_llama()               # or: every LlamaForCausalLM built from now on

What is patched (module forwards replaced on the instance; no parameter, buffer or state_dict entry is
added, removed or changed, so save_pretrained / from_pretrained round-trip bit for bit):

- rms_norm: every RMSNorm of the family -> encore.rms_norm (forward; the backward is torch's fused RMSNorm
  backward on CUDA, a torch composite on the CPU);
- swiglu: the MLP's silu(gate_proj(x)) * up_proj(x) -> encore's swiglu GEMM row on an interleaved
  gate/up weight derived in the forward and again in the backward (a copy of 2·F·d weights each, not
  kept between them), down_proj's GEMM in torch;
- rope: the attention's q/k/v projections and the rotation -> one fused QKV GEMM with the rope
  epilogue (Q/K rows paired per head, a derived copy; attention and the KV cache see permuted Q/K
  heads, which leaves q·k unchanged); with qk_norm (Qwen3) the QKV GEMM with per-head sums of squares
  and encore's QK-norm + RoPE finisher and its backward;
- qk_norm: Qwen3's q_norm / k_norm (fused as above when rope is on, else encore.rms_norm per head);
- fused_linear_cross_entropy: the causal-LM loss in training (model.training and labels given) through
  encore's fused linear cross-entropy, logits never materialized (returned as None, as Liger does);
  with labels=None or in eval mode the original forward runs and returns logits;
- moe (Qwen3-MoE): the sparse MoE block -> encore.moe_forward, for inference only (no gradient needed:
  torch.no_grad / inference_mode / generate); under autograd the original block runs.
- block_schedule (off by default; Llama / Mistral causal LMs): in training with labels the whole decoder
  stack and the loss run through encore's shifted LLaMA block ops, attention by the model's own
  attention function in between (python/encore/_hf_blocks.py); every other call runs the forward above.

Everything is validated before anything is patched: an unknown family or a configuration a kernel
cannot serve raises EncorePatchError naming each module and reason, and the model is left as it was.
transformers is imported only inside these functions: `import encore` never needs it.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import logging
import threading

import torch

from . import _hf_autograd as _hf
from . import _hf_blocks
from . import moe as _moe
from ._ce_autograd import fused_linear_cross_entropy as _flce

__all__ = ["apply_encore", "remove_encore", "apply_encore_to_llama", "apply_encore_to_mistral", "apply_encore_to_qwen2",
           "apply_encore_to_qwen3", "apply_encore_to_qwen3_moe", "revert_encore_classes", "EncorePatchError", "EncoreReport",
           "FEATURES"]

logger = logging.getLogger("encore.transformers")

FEATURES = ("rms_norm", "swiglu", "rope", "qk_norm", "fused_linear_cross_entropy", "moe", "block_schedule")
# RoPE types whose frequencies are fixed in the rotary module's inv_freq with attention_scaling 1 (the
# table encore's rope epilogue reads); dynamic / longrope / yarn change inv_freq per call or scale cos/sin.
_STATIC_ROPE = ("default", "linear", "llama3")


class EncorePatchError(ValueError):
    """The model (or a module of it) cannot be patched; nothing was patched."""


@dataclasses.dataclass(frozen=True)
class _Family:
    name: str
    module: str      # the transformers modeling module
    prefix: str      # class-name prefix: <prefix>ForCausalLM, <prefix>RMSNorm, ...
    qk_norm: bool    # q_norm / k_norm in the attention
    moe: bool        # <prefix>SparseMoeBlock layers
    sliding: str     # how the attention passes sliding_window: "none", "config", "attr"

    def cls(self, suffix):
        return getattr(importlib.import_module(self.module), self.prefix + suffix, None)


_FAMILIES = {f.name: f for f in (
    _Family("llama", "transformers.models.llama.modeling_llama", "Llama", False, False, "none"),
    _Family("mistral", "transformers.models.mistral.modeling_mistral", "Mistral", False, False, "config"),
    _Family("qwen2", "transformers.models.qwen2.modeling_qwen2", "Qwen2", False, False, "attr"),
    _Family("qwen3", "transformers.models.qwen3.modeling_qwen3", "Qwen3", True, False, "attr"),
    _Family("qwen3_moe", "transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3Moe", True, True, "attr"),
)}


@dataclasses.dataclass
class EncoreReport:
    """What apply_encore patched: per feature the patched modules' names ("" is the model itself), and
    per feature not applied the reason (turned off, or absent from this family); notes on behaviour."""
    family: str
    model_class: str
    patched: dict = dataclasses.field(default_factory=dict)
    not_applied: dict = dataclasses.field(default_factory=dict)
    notes: list = dataclasses.field(default_factory=list)

    def counts(self):
        return {k: len(v) for k, v in self.patched.items()}

    def __str__(self):
        lines = [f"encore.transformers: {self.model_class} ({self.family})"]
        for k, v in self.patched.items():
            lines.append(f"  {k}: {len(v)} module{'s' if len(v) != 1 else ''} patched")
        for k, why in self.not_applied.items():
            lines.append(f"  {k}: not applied ({why})")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


# --- installing and removing forwards -----------------------------------------------------------------

def _install(module, impl, state):
    """module.forward -> impl(module, original forward, state, ...) as an instance attribute (a partial,
    so copy.deepcopy carries it to the copy); the signature seen by inspect stays the original's."""
    orig = type(module).forward

    @functools.wraps(orig)
    def forward(self, *args, **kwargs):
        return impl(self, orig, state, *args, **kwargs)

    forward.__encore_patch__ = impl.__name__
    module.forward = functools.partial(forward, module)


def _is_patched(module):
    f = module.__dict__.get("forward")
    return isinstance(f, functools.partial) and hasattr(f.func, "__encore_patch__")


def remove_encore(model):
    """Undoes apply_encore on `model` (every module's original forward back); returns the number of
    modules restored."""
    n = 0
    for m in model.modules():
        if _is_patched(m):
            del m.__dict__["forward"]
            n += 1
        m.__dict__.pop("_encore_rotary", None)
    model.__dict__.pop("encore_report", None)
    return n


# --- the patched forwards -----------------------------------------------------------------------------

def _rms_norm_forward(self, orig, state, hidden_states):
    return _hf.rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _mlp_forward(self, orig, state, x):
    x, g, u, dn = _hf.autocast_cast(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)
    rows = x.reshape(-1, g.shape[1])
    if not rows.is_contiguous():
        rows = rows.contiguous()
    return _hf.swiglu_mlp(rows, g, u, dn).reshape(*x.shape[:-1], dn.shape[0])


def _attention_forward(self, orig, state, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
    if cache is None and "past_key_values" in kwargs:
        cache = kwargs.pop("past_key_values")
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        raise RuntimeError(f"encore.transformers: {type(self).__name__} was called without position_ids; encore's RoPE takes the "
                           "positions themselves (the decoder layers of transformers pass them)")
    hq, hkv, hd = state["heads"]
    input_shape = hidden_states.shape[:-1]
    pos = position_ids.expand(input_shape).reshape(-1).to(torch.int32)
    inv_freq = self.__dict__["_encore_rotary"].inv_freq.to(hidden_states.device)
    qn = kn = None
    eps = 1e-6
    if state["qk_norm"]:
        qn, kn, eps = self.q_norm.weight, self.k_norm.weight, self.q_norm.variance_epsilon
    qkv = _hf.qkv_rope(hidden_states.reshape(-1, hidden_states.shape[-1]), self.q_proj.weight, self.k_proj.weight,
                       self.v_proj.weight, pos, inv_freq, hq, hkv, hd, qn, kn, eps)
    shape = (*input_shape, -1, hd)
    q, k, v = (t.reshape(shape).transpose(1, 2) for t in qkv.split((hq * hd, hkv * hd, hkv * hd), -1))
    if cache is not None:
        k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
    interface = state["attention_functions"].get_interface(self.config._attn_implementation, state["eager"])
    extra = {}
    if state["sliding"] == "config":
        extra["sliding_window"] = getattr(self.config, "sliding_window", None)
    elif state["sliding"] == "attr":
        extra["sliding_window"] = getattr(self, "sliding_window", None)
    out, weights = interface(self, q, k, v, attention_mask, dropout=0.0 if not self.training else self.attention_dropout,
                             scaling=self.scaling, **extra, **kwargs)
    out = out.reshape(*input_shape, -1).contiguous()
    return self.o_proj(out), weights


def _moe_forward(self, orig, state, hidden_states):
    if torch.is_grad_enabled() and (hidden_states.requires_grad or any(p.requires_grad for p in self.parameters())):
        return orig(self, hidden_states)  # training: encore's MoE has no backward yet
    shape = hidden_states.shape
    rows = hidden_states.reshape(-1, shape[-1]).contiguous()
    router_logits = self.gate(rows)[0]  # the router module itself (output recording sees it)
    out = _moe.moe_forward(rows, router_logits.contiguous(), self.experts.gate_up_proj, self.experts.down_proj, int(self.gate.top_k),
                           scoring="softmax", renormalize=bool(self.gate.norm_topk_prob))
    return out.reshape(shape)


def _causal_lm_loss(hidden, weight, labels, shift_labels, num_items_in_batch, ignore_index):
    """transformers' ForCausalLMLoss (shift, ignore_index, mean or sum / num_items_in_batch) on the hidden
    states through encore's fused linear cross-entropy, its gradients computed in the forward (Liger's
    schedule: three GEMMs over the logits' shape, one chunk of logits in memory)."""
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    x = hidden.reshape(-1, hidden.shape[-1])
    x, w = _hf.autocast_cast(x, weight)
    t = shift_labels.reshape(-1).to(x.device)
    if num_items_in_batch is None:
        return _flce(w, x, t, ignore_index, "mean", grad_in_forward=True)
    loss = _flce(w, x, t, ignore_index, "sum", grad_in_forward=True)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def _causal_lm_forward(self, orig, state, *args, **kwargs):
    a = dict(zip(state["params"], args))
    a.update(kwargs)
    if not self.training or (a.get("labels") is None and a.get("shift_labels") is None):
        return orig(self, *args, **kwargs)
    return_dict = a.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    labels = a.pop("labels", None)
    logits_to_keep = a.pop("logits_to_keep", 0)
    if state["moe"]:
        if a.get("output_router_logits") is None:
            a["output_router_logits"] = self.config.output_router_logits
    outputs = self.model(**a)
    hidden = state["slice_logits_to_keep"](outputs.last_hidden_state, logits_to_keep)
    loss = _causal_lm_loss(hidden, self.lm_head.weight, labels, a.get("shift_labels"), a.get("num_items_in_batch"),
                           a.get("ignore_index", -100))
    fields = {"loss": loss, "logits": None}
    out_cls = state["output"]
    if state["moe"]:
        fields["aux_loss"] = None
        if a["output_router_logits"]:
            aux = state["load_balancing_loss"](outputs.router_logits, self.num_experts, self.num_experts_per_tok, a.get("attention_mask"))
            fields["aux_loss"] = aux
            fields["loss"] = loss + self.router_aux_loss_coef * aux.to(loss.device)
    for k in ("cache", "past_key_values", "hidden_states", "attentions", "router_logits"):
        if k in out_cls.__dataclass_fields__:
            fields[k] = getattr(outputs, k, None)
    out = out_cls(**fields)
    return out if return_dict else out.to_tuple()


# --- validation: every module checked before anything is patched -----------------------------------------

def _family_of(model):
    import transformers  # noqa: F401  (the optional dependency: a clear ImportError where missing)

    mt = getattr(getattr(model, "config", None), "model_type", None)
    fam = _FAMILIES.get(mt)
    if fam is not None:
        lm, base = fam.cls("ForCausalLM"), fam.cls("Model")
        if lm is not None and isinstance(model, lm):
            return fam, True
        if base is not None and isinstance(model, base):
            return fam, False
    known = ", ".join(f"{f.prefix}ForCausalLM" for f in _FAMILIES.values())
    raise EncorePatchError(f"encore.transformers: unknown model family: {type(model).__name__} (model_type {mt!r}); "
                           f"supported: {known} (and their base models); nothing was patched")


def _bias(*linears):
    return [n for n, m in linears if getattr(m, "bias", None) is not None]


def _plan(model, fam, causal_lm, flags):
    """(plan [(module, name, feature, impl, state)], report, errors [str])."""
    plan, errors = [], []
    report = EncoreReport(fam.name, type(model).__name__, {k: [] for k in FEATURES if flags[k]})
    for k in FEATURES:
        if not flags[k]:
            report.not_applied[k] = "turned off"
    cfg = model.config
    base = model.model if causal_lm else model
    cuda = any(p.is_cuda for p in model.parameters())
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if cuda and not dtypes <= {torch.bfloat16, torch.float16}:
        errors.append(f"{type(model).__name__}: parameters in {sorted(map(str, dtypes))} on CUDA; encore's CUDA kernels take bf16 / fp16 "
                      "(cast the model, or train under torch.autocast with the model in bf16)")
    rms, mlp, attn, moe = fam.cls("RMSNorm"), fam.cls("MLP"), fam.cls("Attention"), fam.cls("SparseMoeBlock")
    modeling = importlib.import_module(fam.module)
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, slice_logits_to_keep
    except ImportError as e:  # older transformers: the forwards this patch mirrors differ
        import transformers
        raise EncorePatchError(f"transformers {transformers.__version__}: encore.transformers needs transformers >= 5.25 "
                               f"(the causal-LM forward it mirrors): {e}") from None
    qk_ids = set()
    for name, m in model.named_modules():
        if isinstance(m, attn):
            qk_ids |= {id(getattr(m, "q_norm", None)), id(getattr(m, "k_norm", None))}
    qk_ids.discard(id(None))
    rotary = getattr(base, "rotary_emb", None)
    if flags["rope"]:
        errors += _hf_blocks.rope_errors(rotary, f"{type(base).__name__}.rotary_emb", _STATIC_ROPE)
    act = getattr(cfg, "hidden_act", None)
    for name, m in model.named_modules():
        where = f"{name or '<model>'} ({type(m).__name__})"
        if rms is not None and isinstance(m, rms):
            feature = "qk_norm" if id(m) in qk_ids else "rms_norm"
            if not flags[feature] or (feature == "qk_norm" and flags["rope"]):
                continue  # q_norm / k_norm: fused into the attention's QK-norm + RoPE when rope is on
            if getattr(m, "weight", None) is None or m.weight.ndim != 1 or not hasattr(m, "variance_epsilon"):
                errors.append(f"{where}: expected a weight [hidden] and variance_epsilon")
                continue
            plan.append((m, name, feature, _rms_norm_forward, {}))
        elif mlp is not None and isinstance(m, mlp) and flags["swiglu"]:
            if act not in ("silu", "swish"):
                errors.append(f"{where}: hidden_act {act!r}; encore's SwiGLU is the SiLU-gated MLP")
            b = _bias(("gate_proj", m.gate_proj), ("up_proj", m.up_proj), ("down_proj", m.down_proj))
            if b:
                errors.append(f"{where}: {', '.join(b)} with bias (mlp_bias); encore's swiglu GEMM row has no bias")
            f, d = m.gate_proj.weight.shape
            if cuda and (f % 8 or d % 8):
                errors.append(f"{where}: intermediate {f} / hidden {d} not multiples of 8 (16-byte rows of the CUDA GEMMs)")
            plan.append((m, name, "swiglu", _mlp_forward, {}))
        elif attn is not None and isinstance(m, attn) and (flags["rope"] or (fam.qk_norm and flags["qk_norm"])):
            if not flags["rope"]:
                continue  # qk_norm alone: the q_norm / k_norm modules themselves (above)
            if fam.qk_norm and not flags["qk_norm"]:
                errors.append(f"{where}: rope=True needs qk_norm=True in this family (q_norm / k_norm sit between the projection "
                              "and the rotation; encore runs the three fused)")
                continue
            b = _bias(("q_proj", m.q_proj), ("k_proj", m.k_proj), ("v_proj", m.v_proj))
            if b:
                errors.append(f"{where}: {', '.join(b)} with bias; encore's fused QKV + RoPE GEMM has no bias (pass rope=False)")
            hd = int(m.head_dim)
            hq, hkv = m.q_proj.weight.shape[0] // hd, m.k_proj.weight.shape[0] // hd
            if hd % 2 or hq * hd != m.q_proj.weight.shape[0] or hkv * hd != m.k_proj.weight.shape[0]:
                errors.append(f"{where}: head_dim {hd} must be even and divide q_proj / k_proj's rows (RoPE rotates column pairs)")
            elif rotary is not None and getattr(rotary, "inv_freq", None) is not None and rotary.inv_freq.numel() != hd // 2:
                errors.append(f"{where}: partial rotary (inv_freq has {rotary.inv_freq.numel()} entries, head_dim {hd}); encore rotates "
                              "whole heads")
            if cuda and (((hq + 2 * hkv) * hd) % 8 or m.q_proj.weight.shape[1] % 8):
                errors.append(f"{where}: QKV width {(hq + 2 * hkv) * hd} / hidden {m.q_proj.weight.shape[1]} not multiples of 8 on CUDA")
            if cuda and fam.qk_norm and hd > 256:
                errors.append(f"{where}: head_dim {hd}; the CUDA QK-norm + RoPE backward takes head_dim <= 256")
            if fam.qk_norm:
                qn, kn = getattr(m, "q_norm", None), getattr(m, "k_norm", None)
                if qn is None or kn is None or qn.weight.shape != (hd,) or kn.weight.shape != (hd,):
                    errors.append(f"{where}: expected q_norm / k_norm weights [head_dim]")
                elif qn.variance_epsilon != kn.variance_epsilon:
                    errors.append(f"{where}: q_norm eps {qn.variance_epsilon} != k_norm eps {kn.variance_epsilon}")
            state = {"heads": (hq, hkv, hd), "qk_norm": fam.qk_norm, "sliding": fam.sliding, "eager": modeling.eager_attention_forward,
                     "attention_functions": ALL_ATTENTION_FUNCTIONS}
            plan.append((m, name, "rope", _attention_forward, state))
        elif moe is not None and isinstance(m, moe) and flags["moe"]:
            ex, gate = getattr(m, "experts", None), getattr(m, "gate", None)
            w13, w2 = getattr(ex, "gate_up_proj", None), getattr(ex, "down_proj", None)
            if not (isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor) and w13.ndim == 3 and w2.ndim == 3
                    and w2.shape == (w13.shape[0], w13.shape[2], w13.shape[1] // 2) and hasattr(gate, "top_k")):
                errors.append(f"{where}: expected experts.gate_up_proj [E, 2F, D], experts.down_proj [E, D, F] and a top-k router")
            elif act not in ("silu", "swish"):
                errors.append(f"{where}: hidden_act {act!r}; encore's MoE experts are SiLU-gated")
            elif any(getattr(ex, b, None) is not None for b in ("gate_up_proj_bias", "down_proj_bias")):
                errors.append(f"{where}: expert biases; encore's MoE has none")
            plan.append((m, name, "moe", _moe_forward, {}))
    if flags["rope"]:
        for m, name, feature, impl, state in plan:
            if feature == "rope" and fam.qk_norm:
                report.patched.setdefault("qk_norm", []).append(name)
    if flags["fused_linear_cross_entropy"]:
        if not causal_lm:
            report.not_applied["fused_linear_cross_entropy"] = "not a causal LM (no lm_head)"
            report.patched.pop("fused_linear_cross_entropy", None)
        else:
            errors += _hf_blocks.loss_head_errors(model, f"<model> ({type(model).__name__})", "encore's fused linear cross-entropy")
            params = [p.name for p in inspect.signature(type(model).forward).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][1:]
            state = {"params": tuple(params), "moe": fam.moe, "slice_logits_to_keep": slice_logits_to_keep,
                     "output": MoeCausalLMOutputWithPast if fam.moe else CausalLMOutputWithPast,
                     "load_balancing_loss": getattr(modeling, "load_balancing_loss_func", None)}
            plan.append((model, "", "fused_linear_cross_entropy", _causal_lm_forward, state))
    if flags["block_schedule"]:
        block_errs, bstate = _hf_blocks.block_errors(model, fam, causal_lm, rotary, _STATIC_ROPE)
        errors += block_errs
        if bstate is not None:
            # one forward on the model: the block schedule, falling back to the fused-CE forward (if planned) or the original
            flce = [e for e in plan if e[2] == "fused_linear_cross_entropy"]
            plan[:] = [e for e in plan if e[2] != "fused_linear_cross_entropy"]
            params = [p.name for p in inspect.signature(type(model).forward).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][1:]
            bstate.update(params=tuple(params), fallback=(flce[0][3], flce[0][4]) if flce else None, output=CausalLMOutputWithPast)
            if flce:
                report.patched.setdefault("fused_linear_cross_entropy", []).append("")
            plan.append((model, "", "block_schedule", _hf_blocks.block_causal_lm_forward, bstate))
            n = len(base.layers[: cfg.num_hidden_layers])
            blocks = f"{n - 1} shifted block{'s' if n != 2 else ''}"
            report.notes.append(f"block_schedule: in training with labels the {n} decoder layers run encore's LLaMA block ops (first "
                                f"layer's norm + QKV, {blocks}, the last layer + final norm + LM head + loss), attention by the "
                                "model's own attention function; every other call runs the forward it replaced")
    for k in ("qk_norm", "moe"):
        if flags[k] and not getattr(fam, k):
            report.not_applied[k] = f"no {'q_norm / k_norm' if k == 'qk_norm' else 'MoE layers'} in the {fam.name} family"
            report.patched.pop(k, None)
    for m, name, feature, impl, state in plan:
        report.patched.setdefault(feature, []).append(name)
    if flags["moe"] and fam.moe:
        report.notes.append("moe: inference only (no gradient needed); under autograd the original MoE block runs")
    if flags["swiglu"]:
        report.notes.append("swiglu: gate/up interleaved in the forward and again in the backward (a copy of 2·F·d weights each, not kept)")
    if flags["rope"]:
        report.notes.append("rope: QKV weight with Q/K rows paired per head built in the forward and again in the backward (a copy "
                            "each, not kept); the KV cache holds the permuted Q/K order")
    return plan, report, errors, rotary


def apply_encore(model, rms_norm=True, swiglu=True, rope=True, qk_norm=True, fused_linear_cross_entropy=True, moe=True,
                 block_schedule=False):
    """Patches an instantiated transformers model in place with encore's kernels and returns (and logs at
    INFO) an EncoreReport. Supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
    Qwen3ForCausalLM, Qwen3MoeForCausalLM and their base models. Parameters and state_dict are left
    exactly as they are. Raises EncorePatchError (nothing patched) for an unknown family or any module
    a kernel cannot serve. Calling it again replaces the previous patch (remove_encore undoes it).
    block_schedule=True (Llama / Mistral causal LMs): training forwards with labels run the decoder stack
    through encore's shifted LLaMA block ops (docs/transformers.md)."""
    flags = dict(rms_norm=rms_norm, swiglu=swiglu, rope=rope, qk_norm=qk_norm, fused_linear_cross_entropy=fused_linear_cross_entropy,
                 moe=moe, block_schedule=block_schedule)
    fam, causal_lm = _family_of(model)
    plan, report, errors, rotary = _plan(model, fam, causal_lm, {k: bool(v) for k, v in flags.items()})
    if errors:
        raise EncorePatchError(f"encore.transformers: cannot patch {type(model).__name__}; nothing was patched:\n  " +
                               "\n  ".join(errors))
    remove_encore(model)
    if getattr(model, "use_kernels", False):  # transformers' hub kernels: kernelize re-binds RMSNorm forwards on train() / eval()
        model.use_kernels = False
        report.notes.append("transformers' hub kernels (use_kernels) turned off on this model: kernelize would re-bind the "
                            "patched forwards on every train() / eval()")
    for m, name, feature, impl, state in plan:
        if feature == "rope":
            object.__setattr__(m, "_encore_rotary", rotary)  # not a submodule: no state_dict or named_modules entry
        _install(m, impl, state)
    model.__dict__["encore_report"] = report
    logger.info("%s", report)
    return report


# --- class-level patches: every model built after the call ---------------------------------------------

_CLASS_PATCHES = {}  # class -> (its original __init__, its own from_pretrained or None)
_LOADING = threading.local()  # inside a patched from_pretrained: the __init__ patch waits for the loaded model


def _apply_to_family(family, flags):
    fam = _FAMILIES[family]
    cls = fam.cls("ForCausalLM")
    if cls is None:
        raise EncorePatchError(f"encore.transformers: this transformers has no {fam.prefix}ForCausalLM")
    orig_init, own_fp, orig_fp = _CLASS_PATCHES.get(cls, (cls.__init__, cls.__dict__.get("from_pretrained"), cls.from_pretrained.__func__))

    @functools.wraps(orig_init)
    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        if not getattr(_LOADING, "depth", 0):
            apply_encore(self, **flags)

    @functools.wraps(orig_fp)
    def from_pretrained(klass, *args, **kwargs):
        # from_pretrained kernelizes the built model at its end (hub kernels), which would undo a patch made in
        # __init__: the loaded model is patched once, here
        _LOADING.depth = getattr(_LOADING, "depth", 0) + 1
        try:
            out = orig_fp(klass, *args, **kwargs)
        finally:
            _LOADING.depth -= 1
        apply_encore(out[0] if isinstance(out, tuple) else out, **flags)
        return out

    cls.__init__ = __init__
    cls.from_pretrained = classmethod(from_pretrained)
    _CLASS_PATCHES[cls] = (orig_init, own_fp, orig_fp)
    logger.info("encore.transformers: %s instances are patched when built (%s)", cls.__name__,
                ", ".join(k for k, v in flags.items() if v) or "nothing")


def revert_encore_classes():
    """Restores every class patched by apply_encore_to_<family>() (models already built stay patched:
    remove_encore(model) undoes those)."""
    for cls, (init, own_fp, _) in list(_CLASS_PATCHES.items()):
        cls.__init__ = init
        if own_fp is None:
            del cls.from_pretrained
        else:
            cls.from_pretrained = own_fp
        del _CLASS_PATCHES[cls]


def apply_encore_to_llama(rms_norm=True, swiglu=True, rope=True, fused_linear_cross_entropy=True, block_schedule=False):
    """Every LlamaForCausalLM built from now on (constructor, from_pretrained, from_config) gets
    apply_encore with these features on construction (its errors raised there)."""
    _apply_to_family("llama", dict(rms_norm=rms_norm, swiglu=swiglu, rope=rope, qk_norm=False,
                                   fused_linear_cross_entropy=fused_linear_cross_entropy, moe=False, block_schedule=block_schedule))


def apply_encore_to_mistral(rms_norm=True, swiglu=True, rope=True, fused_linear_cross_entropy=True, block_schedule=False):
    """apply_encore_to_llama for MistralForCausalLM."""
    _apply_to_family("mistral", dict(rms_norm=rms_norm, swiglu=swiglu, rope=rope, qk_norm=False,
                                     fused_linear_cross_entropy=fused_linear_cross_entropy, moe=False, block_schedule=block_schedule))


def apply_encore_to_qwen2(rms_norm=True, swiglu=True, rope=False, fused_linear_cross_entropy=True):
    """apply_encore_to_llama for Qwen2ForCausalLM; rope defaults to False (Qwen2's q/k/v projections have
    biases, which the fused QKV + RoPE GEMM does not take)."""
    _apply_to_family("qwen2", dict(rms_norm=rms_norm, swiglu=swiglu, rope=rope, qk_norm=False,
                                   fused_linear_cross_entropy=fused_linear_cross_entropy, moe=False))


def apply_encore_to_qwen3(rms_norm=True, swiglu=True, rope=True, qk_norm=True, fused_linear_cross_entropy=True):
    """apply_encore_to_llama for Qwen3ForCausalLM (qk_norm: q_norm / k_norm, fused with RoPE when rope)."""
    _apply_to_family("qwen3", dict(rms_norm=rms_norm, swiglu=swiglu, rope=rope, qk_norm=qk_norm,
                                   fused_linear_cross_entropy=fused_linear_cross_entropy, moe=False))


def apply_encore_to_qwen3_moe(rms_norm=True, swiglu=True, rope=True, qk_norm=True, fused_linear_cross_entropy=True, moe=True):
    """apply_encore_to_qwen3 for Qwen3MoeForCausalLM (moe: the sparse blocks through encore.moe_forward in
    inference; under autograd the original block runs)."""
    _apply_to_family("qwen3_moe", dict(rms_norm=rms_norm, swiglu=swiglu, rope=rope, qk_norm=qk_norm,
                                       fused_linear_cross_entropy=fused_linear_cross_entropy, moe=moe))
