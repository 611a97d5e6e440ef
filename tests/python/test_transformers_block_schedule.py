"""encore.transformers' block_schedule (python/encore/_hf_blocks.py) on tiny random Llama and Mistral models,
CPU backend: the training loss and every parameter's gradient against the unpatched model; the state dict
untouched by patching and by a backward; eval / no-labels / no-grad / generate running the forward the
schedule replaced (identical logits); refusals leaving the model unpatched; the report; a fullgraph compile.

Each test that expects the schedule to run counts its calls (a spy on _hf_blocks._block_loss), so a silent
fallback to the original forward fails the test.

Tolerances. fp32: the schedule computes the same math as transformers in another order (RMSNorm deferred
into the GEMM epilogues as a row scale, the fused QKV + RoPE angle reduced in turns, the loss from a
per-tile log-sum-exp); measured relative errors are <= ~6e-7 on the loss and every gradient over these
shapes, so 1e-5 leaves ~15x margin while a wrong layout, a dropped residual or a gamma applied twice gives
errors of order 1e-2..1. bf16: held to the unpatched bf16 model's own error against the fp32 model, as in
test_transformers_patch.py: at most twice that plus 2e-3."""
import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", minversion="5.25")

import encore.transformers as et  # noqa: E402
from encore import _hf_blocks  # noqa: E402
from test_transformers_patch import build, check_close, patched_modules, rel, unpatched_after  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

NONE = dict(rms_norm=False, swiglu=False, rope=False, qk_norm=False, fused_linear_cross_entropy=False, moe=False)


@pytest.fixture
def block_calls(monkeypatch):
    """The number of forwards that went through the block schedule."""
    calls = []
    real = _hf_blocks._block_loss

    def spy(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(_hf_blocks, "_block_loss", spy)
    return calls


def ids_for(seed, shape=(2, 16)):
    return torch.randint(0, 128, shape, generator=torch.Generator().manual_seed(seed))


def train_step(model, ids, **kw):
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(ids, **kw)
    out.loss.backward()
    return out, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family,kw", [("llama", {}), ("mistral", dict(sliding_window=5)), ("llama", dict(tie_word_embeddings=True))])
def test_loss_and_gradients_match(family, kw, dtype, block_calls):
    """3 layers (the first layer's piece, two shifted blocks, the last layer + loss), padded batch with an
    attention mask and ignored labels; Mistral with a sliding window shorter than the sequence."""
    f32 = build(family, num_hidden_layers=3, **kw)
    ref = copy.deepcopy(f32).to(dtype)
    pat = copy.deepcopy(ref)
    rep = et.apply_encore(pat, block_schedule=True)
    assert rep.patched["block_schedule"] == [""]
    ids = ids_for(1)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding on the second row
    labels = ids.masked_fill(mask == 0, -100)
    (o0, g0), (o1, g1), (o2, g2) = (train_step(m, ids, attention_mask=mask, labels=labels) for m in (f32, ref, pat))
    assert len(block_calls) == 1 and o2.logits is None and torch.isfinite(o2.loss)
    check_close(o2.loss, o1.loss, o0.loss, "loss", dtype)
    assert set(g2) == set(g1)
    for n in g1:
        assert g2[n] is not None and g2[n].dtype == g1[n].dtype and g2[n].shape == g1[n].shape, n
        check_close(g2[n], g1[n], g0[n], n, dtype)


def test_num_items_in_batch_shift_labels_and_ignore_index(block_calls):
    ref = build("llama")
    pat = copy.deepcopy(ref)
    et.apply_encore(pat, **NONE, block_schedule=True)  # the schedule alone
    ids = ids_for(2)
    labels = ids.clone()
    labels[0, :5] = -100
    for kw in (dict(labels=labels, num_items_in_batch=torch.tensor(17)), dict(labels=labels, num_items_in_batch=9),
               dict(labels=ids, shift_labels=labels), dict(labels=ids.masked_fill(ids % 5 == 0, 3), ignore_index=3)):
        (a, ga), (b, gb) = train_step(ref, ids, **kw), train_step(pat, ids, **kw)
        assert abs(b.loss.item() - a.loss.item()) <= 1e-5 * abs(a.loss.item()), kw
        for n in ga:
            assert rel(gb[n], ga[n]) < 1e-5, (kw, n)
    # every label ignored: transformers' mean is 0/0 = nan; encore's last-layer op returns 0 with zero gradients
    b, gb = train_step(pat, ids, labels=torch.full_like(ids, -100))
    assert b.loss.item() == 0 and all(g is None or not g.any() for g in gb.values())
    assert len(block_calls) == 5
    tup = pat.train()(ids, labels=ids, return_dict=False)
    assert isinstance(tup, tuple) and tup[0].ndim == 0


def test_other_calls_run_the_replaced_forward(block_calls):
    """eval, no labels, no_grad, inference_mode, use_cache=True, output_hidden_states and generate: the
    original forward (the schedule alone: transformers' logits bit for bit; with the module patches: the
    module-patched forward's, bit for bit)."""
    ref = build("llama")
    alone, full, mods = copy.deepcopy(ref), copy.deepcopy(ref), copy.deepcopy(ref)
    et.apply_encore(alone, **NONE, block_schedule=True)
    et.apply_encore(full, block_schedule=True)
    et.apply_encore(mods)
    ids = ids_for(3)
    for pair in ((alone, ref), (full, mods)):
        for m in pair:
            m.eval()
        with torch.no_grad():
            assert torch.equal(pair[0](ids).logits, pair[1](ids).logits)
            assert torch.equal(pair[0](ids, labels=ids).loss, pair[1](ids, labels=ids).loss)  # eval with labels
        for m in pair:
            m.train()
        assert torch.equal(pair[0](ids).logits, pair[1](ids).logits)  # training, no labels
        with torch.no_grad():
            assert torch.equal(pair[0](ids, labels=ids).loss, pair[1](ids, labels=ids).loss)
        with torch.inference_mode():
            assert torch.equal(pair[0](ids, labels=ids).loss, pair[1](ids, labels=ids).loss)
        a, b = pair[0](ids, labels=ids, use_cache=True), pair[1](ids, labels=ids, use_cache=True)
        assert a.past_key_values is not None and torch.equal(a.loss, b.loss)
        a = pair[0](ids, labels=ids, output_hidden_states=True)
        assert len(a.hidden_states) == 3
        for m in pair:
            m.eval()
        kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(pair[0].generate(ids[:1, :5], **kw), pair[1].generate(ids[:1, :5], **kw))
    assert not block_calls


def test_state_dict_unchanged_after_patch_and_backward(tmp_path, block_calls):
    model = build("mistral")
    sd0 = {k: v.clone() for k, v in model.state_dict().items()}
    ptrs = {k: (v.shape, v.dtype, v.data_ptr()) for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    et.apply_encore(model, block_schedule=True)
    train_step(model, ids_for(4), labels=ids_for(4))
    assert len(block_calls) == 1
    sd1 = model.state_dict()
    assert list(sd1) == list(sd0) and {k: (v.shape, v.dtype, v.data_ptr()) for k, v in sd1.items()} == ptrs
    assert all(torch.equal(sd1[k], sd0[k]) for k in sd0)
    assert all(p is params[n] for n, p in model.named_parameters())
    model.save_pretrained(tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert not patched_modules(back)
    sd2 = back.state_dict()
    assert list(sd2) == list(sd0)
    assert all(sd2[k].dtype == sd0[k].dtype and torch.equal(sd2[k], sd0[k]) for k in sd0)


def test_report_and_remove(block_calls):
    model = build("llama")
    rep = et.apply_encore(model, block_schedule=True)
    assert rep.counts() == {"rms_norm": 5, "swiglu": 2, "rope": 2, "fused_linear_cross_entropy": 1, "block_schedule": 1}
    assert any(n.startswith("block_schedule: in training with labels the 2 decoder layers") for n in rep.notes)
    assert "block_schedule: 1 module patched" in str(rep)
    assert et.apply_encore(build("llama")).not_applied["block_schedule"] == "turned off"
    assert et.apply_encore(copy.deepcopy(model), fused_linear_cross_entropy=False, block_schedule=True).counts()["block_schedule"] == 1
    et.remove_encore(model)
    assert not patched_modules(model)
    train_step(model, ids_for(5), labels=ids_for(5))
    assert not block_calls


def test_class_level_patch(block_calls):
    et.apply_encore_to_mistral(block_schedule=True)
    try:
        model = build("mistral")
    finally:
        et.revert_encore_classes()
    assert model.encore_report.counts()["block_schedule"] == 1
    train_step(model, ids_for(6), labels=ids_for(6))
    assert len(block_calls) == 1


@pytest.mark.parametrize("family,kw,expect", [
    ("qwen3", {}, r"Qwen3ForCausalLM: block_schedule supports Llama/Mistral dense models"),
    ("qwen2", {}, r"block_schedule supports Llama/Mistral dense models"),
    ("llama", dict(mlp_bias=True), r"block_schedule: mlp_bias / attention_bias"),
    ("llama", dict(hidden_act="gelu"), r"block_schedule: hidden_act 'gelu'"),
    ("llama", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
     r"block_schedule: rope_type 'dynamic'"),
    ("mistral", dict(head_dim=32), r"o_proj \(64, 128\) is not square"),
])
def test_unsupported_config_is_refused(family, kw, expect):
    import re
    flags = dict(NONE, block_schedule=True)  # the schedule's own refusals, not the module patches'
    msg = unpatched_after(lambda m: et.apply_encore(m, **flags), build(family, **kw))
    assert "nothing was patched" in msg and re.search(expect, msg), msg


def test_base_model_and_differing_eps_refused():
    msg = unpatched_after(lambda m: et.apply_encore(m, **NONE, block_schedule=True), build("llama").model)
    assert "block_schedule needs the causal LM" in msg
    model = build("llama")
    model.model.layers[1].post_attention_layernorm.variance_epsilon = 1e-5
    assert "RMSNorm eps differ" in unpatched_after(lambda m: et.apply_encore(m, **NONE, block_schedule=True), model)


def test_compile_fullgraph_training(block_calls):
    """torch.compile(fullgraph=True, backend="aot_eager") of the block-scheduled training forward +
    backward: no graph break, the loss and gradients as in eager."""
    torch._dynamo.reset()
    model = build("llama")
    et.apply_encore(model, block_schedule=True)
    ids = ids_for(7, (2, 8))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    out, _ = train_step(compiled, ids, labels=ids)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert len(block_calls) == 1  # traced once through the schedule
    ref, g_eager = train_step(model, ids, labels=ids)
    assert len(block_calls) == 2
    assert rel(out.loss, ref.loss) < 1e-6
    for n in grads:
        assert rel(grads[n], g_eager[n]) < 1e-5, n


def test_subclassed_model_refused():
    class Base(transformers.LlamaModel):
        pass

    class LM(transformers.LlamaForCausalLM):
        pass

    model = build("llama")
    model.__class__, model.model.__class__ = LM, Base
    msg = unpatched_after(lambda m: et.apply_encore(m, **NONE, block_schedule=True), model)
    assert "LM is not LlamaForCausalLM" in msg and "Base is not LlamaModel" in msg, msg


class _Adapted(torch.nn.Module):
    """A LoRA-like wrapper: .weight is the base layer's, the forward adds a low-rank term."""

    def __init__(self, base):
        super().__init__()
        self.base_layer = base
        self.lora_A = torch.nn.Linear(base.in_features, 2, bias=False)
        self.lora_B = torch.nn.Linear(2, base.out_features, bias=False)
        torch.nn.init.normal_(self.lora_B.weight, std=0.02)

    @property
    def weight(self):
        return self.base_layer.weight

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


@pytest.mark.parametrize("change", ["adapter", "hook", "config_outputs"])
def test_calls_the_schedule_would_bypass_run_the_replaced_forward(change, block_calls):
    """An adapter on a projection, a forward hook on a layer (what FSDP2 / ZeRO-3 / accelerate install)
    or per-layer outputs asked for by the config: the original forward runs, equal to the unpatched model."""
    ref = build("llama")
    fired = []
    if change == "adapter":
        for layer in ref.model.layers:
            layer.self_attn.v_proj = _Adapted(layer.self_attn.v_proj)
    elif change == "config_outputs":
        ref.config.output_hidden_states = True
    pat = copy.deepcopy(ref)
    et.apply_encore(pat, **NONE, block_schedule=True)
    if change == "hook":
        for m in (ref, pat):
            m.model.layers[0].register_forward_hook(lambda *_: fired.append(1))
    ids = ids_for(7)
    a, ga = train_step(ref, ids, labels=ids)
    b, gb = train_step(pat, ids, labels=ids)
    assert not block_calls
    assert torch.equal(a.loss, b.loss)
    for n in ga:
        assert (ga[n] is None) == (gb[n] is None) and (ga[n] is None or torch.equal(ga[n], gb[n])), n
    if change == "hook":
        assert len(fired) == 2
    if change == "config_outputs":
        assert b.hidden_states is not None


def test_packed_sequences_mask_as_transformers(block_calls):
    """Packed rows (position_ids restarting, no attention_mask), use_cache left to the config (True): the
    original forward builds its mask with an empty cache, so no packed-sequence mask; the schedule the same."""
    ref = build("llama")
    pat = copy.deepcopy(ref)
    et.apply_encore(pat, **NONE, block_schedule=True)
    ids = ids_for(8, (1, 16))
    pos = torch.cat((torch.arange(6), torch.arange(10))).unsqueeze(0)
    for use_cache in (None, False):
        kw = dict(labels=ids, position_ids=pos) if use_cache is None else dict(labels=ids, position_ids=pos, use_cache=False)
        a, ga = train_step(ref, ids, **kw)
        b, gb = train_step(pat, ids, **kw)
        assert rel(b.loss, a.loss) < 1e-5, (use_cache, a.loss, b.loss)
        for n in ga:
            assert rel(gb[n], ga[n]) < 1e-5, (use_cache, n)
    assert len(block_calls) == 2
