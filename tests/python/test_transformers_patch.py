"""encore.transformers (the Hugging Face module patch) on tiny random Llama, Qwen3 and Qwen3-MoE models:
patched against unpatched logits, loss and every parameter's gradient; the state dict and a
save_pretrained / from_pretrained round trip bit for bit; the class-level patch; generate with the KV
cache; refusals that leave the model unpatched; the report. CPU backend (fp32 and bf16); on a CUDA
build with a device the same tests run in bf16 on CUDA (encore's CUDA GEMMs take bf16 / fp16).

Tolerances: fp32 runs the same math in another order (1e-5 relative). bf16 is held to the bf16 error of
the unpatched model itself: both are compared with an fp32 copy, and the patched model's error may be at
most twice the unpatched one's (plus 2e-3 for quantities whose own error is near zero, e.g. the loss)."""
import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", minversion="5.25")  # encore.transformers' minimum

import encore  # noqa: E402
import encore.transformers as et  # noqa: E402
from transformers import (AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,  # noqa: E402
                          MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
                          Qwen3MoeConfig, Qwen3MoeForCausalLM)

CUDA = encore.built_with_cuda() and encore.cuda_device_count() > 0 and torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])
CASES = [(d, dt) for d in DEVICES for dt in ((torch.float32, torch.bfloat16) if d == "cpu" else (torch.bfloat16,))]
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             vocab_size=128, max_position_embeddings=256)
FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM), "mistral": (MistralConfig, MistralForCausalLM),
            "qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM)}


def config(family, **kw):
    cfg_cls = FAMILIES[family][0]
    extra = dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2) if family == "qwen3_moe" else {}
    cfg = cfg_cls(**{**SHAPE, **extra, **kw})
    cfg._attn_implementation = "sdpa"
    return cfg


def build(family, seed=0, **kw):
    """A random fp32 model (RMSNorm weights and routers drawn too, so that none is trivially 1 or 0)."""
    cls = FAMILIES[family][1]
    torch.manual_seed(seed)
    model = cls(config(family, **kw))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif n.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    return model


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def patched_modules(model):
    return [n for n, m in model.named_modules() if et._is_patched(m)]


def run(model, ids, dev):
    """(logits without labels, loss with labels in train mode, {name: grad})."""
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    out.loss.backward()
    with torch.no_grad():
        logits = model(ids).logits
    return logits, out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def check_close(pat, ref, f32, name, dtype):
    if dtype == torch.float32:
        assert rel(pat, ref) < 1e-5, (name, rel(pat, ref))
    else:
        bound = 2 * rel(ref, f32) + 2e-3
        assert rel(pat, f32) <= bound, (name, rel(pat, f32), rel(ref, f32))


@pytest.mark.parametrize("dev,dtype", CASES)
@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "qwen2"])
def test_logits_loss_and_gradients_match(family, dev, dtype):
    f32 = build(family).to(dev)
    ref = copy.deepcopy(f32).to(dtype)
    pat = copy.deepcopy(ref)
    et.apply_encore(pat, rope=family != "qwen2")  # Qwen2's q/k/v biases: no fused QKV + RoPE
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1)).to(dev)
    (l0, s0, g0), (l1, s1, g1), (l2, s2, g2) = (run(m, ids, dev) for m in (f32, ref, pat))
    assert torch.isfinite(l2).all() and torch.isfinite(s2)
    check_close(l2, l1, l0, "logits", dtype)
    check_close(s2, s1, s0, "loss", dtype)
    assert set(g2) == set(g1)
    for n in g1:
        assert g2[n] is not None and g2[n].dtype == g1[n].dtype, n
        check_close(g2[n], g1[n], g0[n], n, dtype)


@pytest.mark.parametrize("dev", DEVICES)
def test_training_loss_returns_no_logits_and_eval_returns_logits(dev):
    dtype = torch.float32 if dev == "cpu" else torch.bfloat16
    model = build("llama").to(dev, dtype)
    et.apply_encore(model)
    ids = torch.randint(0, 128, (2, 8)).to(dev)
    model.train()
    out = model(ids, labels=ids)
    assert out.logits is None and out.loss is not None
    tup = model(ids, labels=ids, return_dict=False)
    assert isinstance(tup, tuple) and torch.equal(tup[0], out.loss)
    model.eval()
    out = model(ids, labels=ids)
    assert out.logits is not None and out.logits.shape == (2, 8, 128) and out.loss is not None
    assert model(ids).loss is None


@pytest.mark.parametrize("dev", DEVICES)
def test_num_items_in_batch_and_ignore_index(dev):
    dtype = torch.float32 if dev == "cpu" else torch.bfloat16
    ref = build("llama").to(dev, dtype).train()
    pat = copy.deepcopy(ref)
    et.apply_encore(pat)
    ids = torch.randint(0, 128, (2, 12)).to(dev)
    labels = ids.clone()
    labels[0, :5] = -100
    n = torch.tensor(17, device=dev)
    a = ref(ids, labels=labels, num_items_in_batch=n).loss
    b = pat(ids, labels=labels, num_items_in_batch=n).loss
    assert rel(b, a) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dev,dtype", CASES)
def test_qwen3_qk_norm_without_rope(dev, dtype):
    """rope=False: the attention stays transformers', q_norm / k_norm run encore.rms_norm per head."""
    ref = build("qwen3").to(dev, dtype)
    pat = copy.deepcopy(ref)
    rep = et.apply_encore(pat, rope=False)
    assert len(rep.patched["qk_norm"]) == 4 and all(n.endswith(("q_norm", "k_norm")) for n in rep.patched["qk_norm"])
    assert "rope" not in rep.patched and rep.not_applied["rope"] == "turned off"
    ids = torch.randint(0, 128, (2, 10)).to(dev)
    with torch.no_grad():
        assert rel(pat(ids).logits, ref(ids).logits) < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_generate_with_kv_cache_matches(family, dev):
    """Greedy decoding through the KV cache (K stored in the paired order) gives the unpatched tokens."""
    dtype = torch.float32 if dev == "cpu" else torch.bfloat16
    ref = build(family).to(dev, dtype).eval()
    pat = copy.deepcopy(ref)
    et.apply_encore(pat)
    ids = torch.randint(0, 128, (1, 6)).to(dev)
    kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    a, b = ref.generate(ids, **kw), pat.generate(ids, **kw)
    if dtype == torch.float32:
        assert torch.equal(a, b)
    else:  # bf16: a near tie may flip one token; the first ones agree
        assert torch.equal(a[:, :8], b[:, :8])


@pytest.mark.parametrize("dev", DEVICES)
def test_qwen3_moe_inference_through_moe_forward(dev):
    dtype = torch.float32 if dev == "cpu" else torch.bfloat16
    ref = build("qwen3_moe").to(dev, dtype)
    pat = copy.deepcopy(ref)
    rep = et.apply_encore(pat)
    assert len(rep.patched["moe"]) == 2 and any("inference only" in n for n in rep.notes)
    ids = torch.randint(0, 128, (2, 10)).to(dev)
    with torch.no_grad():
        a, b = ref(ids).logits, pat(ids).logits
    assert rel(b, a) < (1e-5 if dtype == torch.float32 else 2e-2)
    # under autograd the original MoE block runs: the loss, aux loss and gradients follow
    ref.train()
    pat.train()
    la, lb = ref(ids, labels=ids, output_router_logits=True), pat(ids, labels=ids, output_router_logits=True)
    # the same MoE module on hidden states from the patched layers around it: equal in fp32, within bf16 rounding in bf16
    assert lb.logits is None and rel(lb.aux_loss, la.aux_loss) < (1e-6 if dtype == torch.float32 else 2e-2)
    la.loss.backward()
    lb.loss.backward()
    for (n, p), q in zip(ref.named_parameters(), pat.parameters()):
        assert rel(q.grad, p.grad) < (1e-4 if dtype == torch.float32 else 5e-2), n


def test_state_dict_unchanged_same_tensors():
    model = build("qwen3")
    before = {k: (v.shape, v.dtype, v.data_ptr()) for k, v in model.state_dict().items()}
    params = {n: p for n, p in model.named_parameters()}
    et.apply_encore(model)
    after = {k: (v.shape, v.dtype, v.data_ptr()) for k, v in model.state_dict().items()}
    assert list(after) == list(before) and after == before
    assert all(p is params[n] for n, p in model.named_parameters())
    assert {n for n, _ in model.named_modules()} == {n for n, _ in build("qwen3").named_modules()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_save_pretrained_from_pretrained_bit_exact(family, dtype, tmp_path):
    ref = build(family).to(dtype)
    pat = copy.deepcopy(ref)
    et.apply_encore(pat)
    pat.save_pretrained(tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype)
    assert type(back) is type(ref) and not patched_modules(back)
    sd0, sd1 = ref.state_dict(), back.state_dict()
    assert list(sd0) == list(sd1)
    for k in sd0:
        assert sd1[k].dtype == sd0[k].dtype and sd1[k].shape == sd0[k].shape and torch.equal(sd1[k], sd0[k]), k
    et.apply_encore(back)
    ids = torch.randint(0, 128, (1, 7))
    with torch.no_grad():
        a, b = back(ids).logits, pat(ids).logits
    # bf16: ref.to(bf16) also rounded the rotary module's inv_freq buffer (not saved), from_pretrained keeps it
    # fp32; transformers' own forward differs the same way
    assert torch.equal(a, b) if dtype == torch.float32 else rel(a, b) < 2e-2


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_class_level_patch(family, tmp_path):
    cfg_cls, cls = FAMILIES[family]
    ref = build(family)
    ref.save_pretrained(tmp_path)
    apply = et.apply_encore_to_llama if family == "llama" else et.apply_encore_to_qwen3
    apply()
    try:
        built = cls(config(family))
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    finally:
        et.revert_encore_classes()
    plain = cls(config(family))
    assert not patched_modules(plain) and not hasattr(plain, "encore_report")
    for m in (built, loaded):
        assert m.encore_report.counts()["rms_norm"] == 5 and m.encore_report.counts()["swiglu"] == 2
        assert len(patched_modules(m)) == sum(m.encore_report.counts().values()) - (2 if family == "qwen3" else 0)
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        assert rel(loaded(ids).logits, ref(ids).logits) < 1e-5


def test_patch_survives_train_eval_after_from_pretrained(tmp_path):
    """from_pretrained turns on transformers' hub kernels, whose kernelize re-binds the RMSNorm forwards on
    train() / eval(): apply_encore turns them off for the model it patches."""
    build("llama").save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    rep = et.apply_encore(model)
    assert any("hub kernels" in n for n in rep.notes) and not model.use_kernels
    n = len(patched_modules(model))
    model.train()
    model.eval()
    assert len(patched_modules(model)) == n == 10


def test_class_level_patch_refuses_at_construction():
    et.apply_encore_to_llama()
    try:
        with pytest.raises(et.EncorePatchError, match="mlp_bias"):
            LlamaForCausalLM(config("llama", mlp_bias=True))
    finally:
        et.revert_encore_classes()


def test_report_contents(caplog):
    model = build("qwen3")
    with caplog.at_level("INFO", logger="encore.transformers"):
        rep = et.apply_encore(model)
    assert rep is model.encore_report and rep.family == "qwen3" and rep.model_class == "Qwen3ForCausalLM"
    assert rep.counts() == {"rms_norm": 5, "swiglu": 2, "rope": 2, "qk_norm": 2, "fused_linear_cross_entropy": 1}
    assert rep.patched["rms_norm"] == ["model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm",
                                       "model.layers.1.input_layernorm", "model.layers.1.post_attention_layernorm", "model.norm"]
    assert rep.patched["rope"] == rep.patched["qk_norm"] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert rep.patched["fused_linear_cross_entropy"] == [""]
    assert "no MoE layers" in rep.not_applied["moe"]
    assert "Qwen3ForCausalLM" in caplog.text and "rms_norm: 5 modules patched" in caplog.text
    rep = et.apply_encore(model, rms_norm=False, fused_linear_cross_entropy=False)  # re-patching replaces the patch
    assert rep.not_applied["rms_norm"] == "turned off" and "rms_norm" not in rep.patched
    assert not et._is_patched(model.model.norm) and not et._is_patched(model)
    llama = et.apply_encore(build("llama"))
    assert "no q_norm / k_norm" in llama.not_applied["qk_norm"]
    assert et.remove_encore(model) == 4 and not patched_modules(model)  # swiglu 2 + rope 2


def test_deepcopy_keeps_the_patch_on_the_copy():
    model = build("llama")
    et.apply_encore(model)
    cp = copy.deepcopy(model)
    mlp = cp.model.layers[0].mlp
    assert et._is_patched(mlp) and mlp.forward.args[0] is mlp
    assert cp.model.layers[0].self_attn._encore_rotary is cp.model.rotary_emb


def test_autocast_cpu():
    ref = build("llama")
    pat = copy.deepcopy(ref)
    et.apply_encore(pat)
    ids = torch.randint(0, 128, (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = ref(ids).logits, pat(ids).logits
        loss = pat.train()(ids, labels=ids).loss
    assert rel(b, a) < 2e-2
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in pat.parameters())


def unpatched_after(fn, model):
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(et.EncorePatchError) as e:
        fn(model)
    assert not patched_modules(model) and not hasattr(model, "encore_report")
    assert all(torch.equal(v, sd[k]) for k, v in model.state_dict().items())
    return str(e.value)


def test_compile_fullgraph():
    """torch.compile(fullgraph=True) of a patched model (aot_eager: the ops' fakes and autograd, no graph break):
    logits, the fused loss and its gradients as in eager."""
    for family in ("llama", "qwen3"):
        torch._dynamo.reset()
        model = build(family)
        et.apply_encore(model)
        ids = torch.randint(0, 128, (2, 8))
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        with torch.no_grad():
            assert rel(compiled(ids, use_cache=False).logits, model(ids, use_cache=False).logits) < 1e-5
        model.train()
        compiled(ids, labels=ids, use_cache=False).loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        model(ids, labels=ids, use_cache=False).loss.backward()
        for n, p in model.named_parameters():
            assert rel(grads[n], p.grad) < 1e-5, n


def test_encore_imports_without_transformers():
    """encore and encore.transformers import with transformers absent; the patch then says what is missing."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['transformers'] = None\n"
            "import encore, encore.transformers as et, torch\n"
            "assert encore.transformers is et\n"
            "try:\n    et.apply_encore(torch.nn.Linear(2, 2))\nexcept ImportError as e:\n    print('ImportError', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ImportError" in out.stdout


def test_unknown_family_is_refused():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=32))
    msg = unpatched_after(et.apply_encore, gpt2)
    assert "unknown model family: GPT2LMHeadModel" in msg and "LlamaForCausalLM" in msg
    with pytest.raises(et.EncorePatchError, match="unknown model family"):
        et.apply_encore(torch.nn.Linear(4, 4))


@pytest.mark.parametrize("family,kw,flags,expect", [
    ("llama", dict(mlp_bias=True), {}, r"model.layers.0.mlp \(LlamaMLP\): gate_proj, up_proj, down_proj with bias"),
    ("llama", dict(attention_bias=True), {}, r"model.layers.1.self_attn \(LlamaAttention\): q_proj, k_proj, v_proj with bias"),
    ("llama", dict(hidden_act="gelu"), {}, r"LlamaMLP\): hidden_act 'gelu'"),
    ("llama", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}), {}, r"rope_type 'dynamic'"),
    ("qwen3", {}, dict(qk_norm=False), r"rope=True needs qk_norm=True"),
    ("qwen2", {}, {}, r"model.layers.0.self_attn \(Qwen2Attention\): q_proj, k_proj, v_proj with bias"),
])
def test_unsupported_config_is_refused(family, kw, flags, expect):
    model = build(family, **kw)
    msg = unpatched_after(lambda m: et.apply_encore(m, **flags), model)
    assert "nothing was patched" in msg
    import re
    assert re.search(expect, msg), msg


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device and a CUDA build of encore")
@pytest.mark.parametrize("family,kw,dtype,expect", [
    ("llama", {}, torch.float32, r"parameters in \['torch.float32'\] on CUDA"),
    ("qwen3", dict(head_dim=512), torch.bfloat16, r"head_dim 512; the CUDA QK-norm \+ RoPE backward takes head_dim <= 256"),
])
def test_cuda_limits_are_refused(family, kw, dtype, expect):
    model = build(family, **kw).to("cuda", dtype)
    msg = unpatched_after(et.apply_encore, model)
    import re
    assert re.search(expect, msg), msg


def test_unsupported_module_only_refused_when_its_feature_is_on():
    """attention biases block rope, not the rest: rope=False patches the model."""
    model = build("llama", attention_bias=True)
    rep = et.apply_encore(model, rope=False)
    assert rep.counts()["rms_norm"] == 5 and "rope" not in rep.patched
