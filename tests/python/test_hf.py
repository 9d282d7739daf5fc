"""flashmonoid.hf: transformers models with attn_implementation="monoid" against transformers' own
sdpa and eager attention (the same math in the model's dtype) and the model in float64, by the
FlashAttention rule: logits, greedy tokens, gradients on padded batches, Gemma 2's softcap, gpt-oss's
sinks."""

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import flashmonoid as fm  # noqa: E402
from flashmonoid import hf, sdpa  # noqa: E402

from torch_reference import assert_rule  # noqa: E402

HAS_CUDA = torch.cuda.is_available() and fm.cuda_available()
# CPU: float32, head dim 32. GPU: bf16, head dim 64.
DEVICES = [("cpu", torch.float32), pytest.param("cuda", torch.bfloat16, marks=pytest.mark.skipif(
    not HAS_CUDA, reason="needs a CUDA GPU and a CUDA build"))]

hf.register()


def small(config_class, model_class, device, dtype, **extra):
    torch.manual_seed(0)
    config = config_class(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                          num_attention_heads=8, num_key_value_heads=2,
                          head_dim=64 if device == "cuda" else 32, **extra)
    model = model_class(config).to(device, dtype)
    with torch.no_grad():  # peaked attention, not the near-uniform one of 0.02-std weights
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
    return model


def padded(device, b=3, s=21):
    ids = torch.randint(1, 256, (b, s), device=device)  # 0 is the pad token
    mask = torch.ones_like(ids)
    mask[1, :4], mask[2, :15] = 0, 0
    return ids, mask


def in_float64(model, impl):
    ref = copy.deepcopy(model).double()
    ref.set_attn_implementation(impl)
    return ref


@pytest.mark.parametrize("device, dtype", DEVICES)
def test_llama_inference_as_sdpa(device, dtype):
    """A left-padded batch: logits of the held positions and greedy generate, every call routed."""
    model = small(transformers.LlamaConfig, transformers.LlamaForCausalLM, device, dtype).eval()
    ids, mask = padded(device)
    runs = {}
    for impl in ("sdpa", hf.NAME):
        model.set_attn_implementation(impl)
        sdpa.reset_stats()
        with torch.no_grad():
            logits = model(ids, attention_mask=mask).logits
            tokens = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        runs[impl] = (logits, tokens, sdpa.stats())
    (same_math, ref_tokens, _), (out, tokens, stats) = runs["sdpa"], runs[hf.NAME]
    assert stats == {"routed": 2 * 7, "fallback": 0}
    with torch.no_grad():
        ref = in_float64(model, "sdpa")(ids, attention_mask=mask).logits  # eager: NaN from padding rows
    held = mask.bool()
    assert_rule(out[held], same_math[held], ref[held])
    if dtype == torch.float32:  # bf16 greedy tokens may part at a near tie
        assert torch.equal(tokens, ref_tokens)


@pytest.mark.parametrize("device, dtype", DEVICES)
def test_static_cache_generate_compiled(device, dtype):
    """generate with a static cache compiles its decoding step (on a GPU by default, with CUDA graphs;
    here on the CPU too): under torch.compile the mask's values cannot be read, and the per-row route,
    which never reads them on the host, runs every decoding call in the compiled graph: the op
    flashmonoid::fwd_kvcache, no PyTorch SDPA; the same greedy tokens as transformers' sdpa."""
    torch._dynamo.reset()
    model = small(transformers.LlamaConfig, transformers.LlamaForCausalLM, device, dtype).eval()
    check_compiled_static_generate(model, "sdpa", device, dtype)


def check_compiled_static_generate(model, same_impl, device, dtype, new=6):
    """generate over a static cache, its decoding step compiled with attn_implementation="monoid": the
    prefill routed eagerly, at least one flashmonoid::fwd_kvcache per layer and compiled step, no
    PyTorch SDPA, and (float32) the greedy tokens of same_impl's generate without compiling."""
    ids, mask = padded(device)
    kw = dict(attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0, cache_implementation="static")
    compile_config = transformers.CompileConfig(fullgraph=True, mode="default" if device == "cpu" else "reduce-overhead")
    compile_config._compile_all_devices = True  # transformers compiles only on accelerators by default
    with torch.no_grad():
        model.set_attn_implementation(same_impl)
        expected = model.generate(ids, disable_compile=True, **kw)
        model.set_attn_implementation(hf.NAME)
        sdpa.reset_stats()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            tokens = model.generate(ids, compile_config=compile_config, **kw)
    names = [e.name for e in prof.events()]
    layers = len(model.model.layers)
    assert sdpa.stats() == {"routed": layers, "fallback": 0}  # the prefill, eager
    assert sum(n == "flashmonoid::fwd_kvcache" for n in names) >= layers * (new - 1)
    assert not [n for n in names if "scaled_dot_product" in n]
    if dtype == torch.float32:  # bf16 greedy tokens may part at a near tie
        assert torch.equal(tokens, expected)


def training_runs(model, same_impl, params, *args, **kwargs):
    """{"same math" (same_impl), "ours" (attn_implementation="monoid"), "float64" (same_impl on a float64
    copy): (loss, gradients of params(model), sdpa.stats())} of one training step each."""
    runs = {}
    for name, impl, m in (("same math", same_impl, model), ("ours", hf.NAME, model),
                          ("float64", same_impl, in_float64(model, same_impl))):
        m.set_attn_implementation(impl)
        m.train()
        m.zero_grad()
        sdpa.reset_stats()
        loss = m(*args, **kwargs).loss
        loss.backward()
        runs[name] = (loss.detach(), [p.grad.clone() for p in params(m)], sdpa.stats())
    return runs


@pytest.mark.parametrize("device, dtype", DEVICES)
def test_llama_training_step_on_a_right_padded_batch(device, dtype):
    model = small(transformers.LlamaConfig, transformers.LlamaForCausalLM, device, dtype).train()
    ids, mask = padded(device)
    mask = mask.flip(-1)  # right padding, as training batches are padded
    labels = ids.masked_fill(mask == 0, -100)
    runs = training_runs(model, "sdpa", lambda m: list(m.parameters()), ids, attention_mask=mask, labels=labels)
    (same_loss, same_grads, _), (loss, grads, stats) = runs["same math"], runs["ours"]
    ref_loss, ref_grads, _ = runs["float64"]
    assert stats == {"routed": 2, "fallback": 0}
    assert_rule(loss, same_loss, ref_loss)
    for g, same, r in zip(grads, same_grads, ref_grads):
        assert_rule(g, same, r)


@pytest.mark.parametrize("device, dtype", DEVICES)
def test_padding_free_training_step(device, dtype, monkeypatch):
    """A padding-free batch (three sequences packed in one row, position_ids restarting at each, as
    transformers' DataCollatorWithFlattening gives): transformers' sdpa mask is block-diagonal, and
    every layer runs it as one varlen call (sequences do not see each other); loss and gradients by
    the rule against transformers' sdpa and float64."""
    model = small(transformers.LlamaConfig, transformers.LlamaForCausalLM, device, dtype)
    ids = torch.randint(1, 256, (1, 24), device=device)
    position_ids = torch.cat([torch.arange(n, device=device) for n in (9, 11, 4)])[None]
    calls = []
    packed_route = sdpa._per_sequence_varlen
    monkeypatch.setattr(sdpa, "_per_sequence_varlen", lambda *a, **k: calls.append(1) or packed_route(*a, **k))
    runs = training_runs(model, "sdpa", lambda m: list(m.parameters()), ids, position_ids=position_ids, labels=ids,
                         use_cache=False)  # transformers looks for packing only without a cache
    assert runs["ours"][2] == {"routed": 2, "fallback": 0} and len(calls) == 2
    assert_rule(runs["ours"][0], runs["same math"][0], runs["float64"][0])
    for g, same, r in zip(runs["ours"][1], runs["same math"][1], runs["float64"][1]):
        assert_rule(g, same, r)


@pytest.mark.parametrize("device, dtype", DEVICES)
@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_flash_attn_kwargs_of_a_padding_free_batch(device, dtype, arch):
    """flash-attn's padding-free kwargs (cu_seq_lens_q / _k, max_length_q / _k, as
    DataCollatorWithFlattening(return_flash_attn_kwargs=True) gives) with no mask: one varlen call,
    as transformers' flash_attention_2 runs them (sdpa would let the sequences see each other); the
    logits of each sequence run alone, by the rule (Gemma 2: its sliding window of 4 and softcap)."""
    if arch == "llama":
        model = small(transformers.LlamaConfig, transformers.LlamaForCausalLM, device, dtype).eval()
    else:
        model = small(transformers.Gemma2Config, transformers.Gemma2ForCausalLM, device, dtype, sliding_window=4,
                      attn_logit_softcapping=50.0).eval()
    lengths = (9, 11, 4)
    ids = torch.randint(1, 256, (1, sum(lengths)), device=device)
    cu = torch.tensor([0, 9, 20, 24], dtype=torch.int32, device=device)
    position_ids = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
    fa_kwargs = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=11, max_length_k=11)
    impl = "sdpa" if arch == "llama" else "eager"

    def alone(m):
        return torch.cat([m(ids[:, a:b]).logits for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())], dim=1)

    with torch.no_grad():
        model.set_attn_implementation(impl)
        same = alone(model)
        ref = alone(in_float64(model, impl))
        model.set_attn_implementation(hf.NAME)
        sdpa.reset_stats()
        out = model(ids, position_ids=position_ids, **fa_kwargs).logits
    assert sdpa.stats() == {"routed": 0, "fallback": 0}  # the kwargs' varlen call, not the mask routing
    assert_rule(out, same, ref)


@pytest.mark.parametrize("device, dtype", DEVICES)
def test_gemma2_softcap_and_sliding_window_as_eager(device, dtype):
    """Gemma 2: attention logit softcap 50 (which transformers' sdpa refuses) and a sliding window of
    8 on every other layer, both in the kernels; against transformers' eager attention."""
    model = small(transformers.Gemma2Config, transformers.Gemma2ForCausalLM, device, dtype, sliding_window=8,
                  attn_logit_softcapping=50.0, final_logit_softcapping=30.0).eval()
    ids = torch.randint(1, 256, (2, 30), device=device)
    runs = {}
    for impl in ("eager", hf.NAME):
        model.set_attn_implementation(impl)
        sdpa.reset_stats()
        with torch.no_grad():
            runs[impl] = (model(ids).logits, sdpa.stats())
    (same_math, _), (out, stats) = runs["eager"], runs[hf.NAME]
    assert stats == {"routed": 2, "fallback": 0}
    with torch.no_grad():
        ref = in_float64(model, "eager")(ids).logits
    assert_rule(out, same_math, ref)


def small_gpt_oss(device, dtype):
    """A 2-layer gpt-oss (a sliding window of 8, then full attention; sinks drawn with std 2, so that
    they take a visible share of each row's softmax)."""
    if not hasattr(transformers, "GptOssConfig"):
        pytest.skip("this transformers has no gpt-oss")
    torch.manual_seed(0)
    config = transformers.GptOssConfig(vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                                       num_attention_heads=8, num_key_value_heads=2,
                                       head_dim=64 if device == "cuda" else 32, num_local_experts=4,
                                       num_experts_per_tok=2, sliding_window=8, attention_dropout=0.0,
                                       layer_types=["sliding_attention", "full_attention"])
    model = transformers.GptOssForCausalLM(config).to(device, dtype)
    model.config._experts_implementation = "eager"  # the grouped-GEMM experts have no float64
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
    return model


@pytest.mark.parametrize("device, dtype", DEVICES)
def test_gpt_oss_sinks_as_eager(device, dtype):
    """gpt-oss passes its attention sinks as s_aux, and the kernels run them: an unpadded and a
    left-padded batch's logits (both layers routed), and training steps' loss and gradients (the
    sinks' too) unpadded and right-padded, by the rule against transformers' eager attention (the
    same math) and float64."""
    model = small_gpt_oss(device, dtype)
    ids, mask = padded(device)
    for kw in ({}, {"attention_mask": mask}):
        runs = {}
        for name, impl, m in (("same math", "eager", model), ("ours", hf.NAME, model),
                              ("float64", "eager", in_float64(model, "eager"))):
            m.set_attn_implementation(impl)
            m.eval()
            sdpa.reset_stats()
            with torch.no_grad():
                runs[name] = (m(ids, **kw).logits, sdpa.stats())
        held = mask.bool() if kw else torch.ones_like(mask, dtype=torch.bool)
        assert runs["ours"][1] == {"routed": 2, "fallback": 0}
        assert_rule(runs["ours"][0][held], runs["same math"][0][held], runs["float64"][0][held])
    # The sinks' gradients and the first layer's q projection's (the rest passes through the experts'
    # top-k routing, whose near ties may part between dtypes).
    def params(m):
        return [layer.self_attn.sinks for layer in m.model.layers] + [m.model.layers[0].self_attn.q_proj.weight]

    mask = mask.flip(-1)  # right padding, as training batches are padded
    # Right-padded, the sliding-window layer's mask is no band (padding rows past the end still see
    # the window's last keys): that layer runs the eager formula, the full layer the varlen kernels.
    for kw, stats in (({}, {"routed": 2, "fallback": 0}),
                      ({"attention_mask": mask}, {"routed": 1, "fallback": 1})):
        runs = training_runs(model, "eager", params, ids, labels=ids.masked_fill(mask == 0, -100) if kw else ids, **kw)
        assert runs["ours"][2] == stats
        assert_rule(runs["ours"][0], runs["same math"][0], runs["float64"][0])
        for g, same, r in zip(runs["ours"][1], runs["same math"][1], runs["float64"][1]):
            assert_rule(g, same, r)


@pytest.mark.parametrize("device, dtype", DEVICES)
def test_gpt_oss_static_cache_generate_compiled(device, dtype):
    """gpt-oss's decoding step compiled over a static cache: its sinks ride the per-row route (which
    reads nothing on the host) in every compiled decoding call, flashmonoid::fwd_kvcache and no
    PyTorch SDPA; the greedy tokens of transformers' eager attention."""
    torch._dynamo.reset()
    model = small_gpt_oss(device, dtype).eval()
    model.config._experts_implementation = "grouped_mm"  # the eager experts loop over data: no fullgraph
    check_compiled_static_generate(model, "eager", device, dtype)


@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_unroutable_calls_run_as_transformers_would(softcap):
    """A float (additive) mask is not routed: transformers' sdpa runs it, or with a softcap the eager
    formula in torch; either agrees with the routed boolean form of the same mask."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 9, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    band = torch.ones(9, 9, dtype=torch.bool).tril()
    additive = torch.zeros(9, 9).masked_fill(~band, float("-inf"))
    module = torch.nn.Module()
    module.num_key_value_groups = 2
    sdpa.reset_stats()
    routed, _ = hf.attention_forward(module, q, k, v, band, scaling=0.3, softcap=softcap)
    fallback, _ = hf.attention_forward(module, q, k, v, additive, scaling=0.3, softcap=softcap)
    assert sdpa.stats() == {"routed": 1, "fallback": 1}
    torch.testing.assert_close(fallback, routed, rtol=1e-5, atol=1e-6)


def test_compiles_fullgraph():
    """torch.compile(fullgraph=True) of a model with attn_implementation="monoid": no graph break; a
    padded batch's mask (data torch.compile cannot read) takes transformers' sdpa path inside it."""
    torch._dynamo.reset()
    model = small(transformers.LlamaConfig, transformers.LlamaForCausalLM, "cpu", torch.float32).eval()
    model.set_attn_implementation(hf.NAME)
    ids, mask = padded("cpu")
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        for kw in ({}, {"attention_mask": mask}):
            expected = model(ids, **kw).logits
            out = compiled(ids, **kw).logits
            held = mask.bool() if kw else torch.ones_like(mask, dtype=torch.bool)
            torch.testing.assert_close(out[held], expected[held], rtol=1e-5, atol=1e-5)
