"""examples/serving_loop.py as a test: a transformers Llama decoding greedily over a paged KV cache
(shuffled pages, NaN-poisoned), prefill through flash_attn_varlen_func(block_table=...) and every
decoding step through flash_attn_with_kvcache (append + rotary), on a GPU replayed from one CUDA
graph; speculative steps of several tokens (causal among them; rejected rows rolled back through
cache_seqlens and written over); the logits against the model's own forward in float64 by the
FlashAttention rule, the pages holding exactly the sequences' rows. The same loop through flash-attn 3's
packed-query KV-cache call (flashmonoid.flash_attn3_interface, as SGLang's backend makes it) and the
example's baseline (transformers' static cache with torch's SDPA) pass the same checks."""

import importlib.util
import pathlib

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import flashmonoid as fm  # noqa: E402

HAS_CUDA = torch.cuda.is_available() and fm.cuda_available()
_path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "serving_loop.py"
_spec = importlib.util.spec_from_file_location("serving_loop", _path)
serving_loop = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(serving_loop)

cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and a CUDA build")


@pytest.mark.parametrize("device, dtype, page_size, graph, draft, engine", [
    ("cpu", torch.float32, 16, False, 1, "flashmonoid"),
    ("cpu", torch.bfloat16, 3, False, 1, "flashmonoid"),
    ("cpu", torch.float32, 1, False, 1, "flashmonoid"),
    ("cpu", torch.float32, 16, False, 4, "flashmonoid"),
    ("cpu", torch.bfloat16, 5, False, 9, "flashmonoid"),
    ("cpu", torch.float32, 16, False, 4, "sdpa"),  # the example's baseline passes the same checks
    ("cpu", torch.float32, 1, False, 1, "fa3_packed"),  # flash-attn 3's packed-query call (SGLang's form)
    ("cpu", torch.bfloat16, 16, False, 4, "fa3_packed"),
    ("cpu", torch.float32, 16, False, 1, "vllm"),  # vLLM's flash_attn_varlen_func over the pages
    ("cpu", torch.bfloat16, 1, False, 4, "vllm"),
    pytest.param("cuda", torch.bfloat16, 16, True, 1, "flashmonoid", marks=cuda),
    pytest.param("cuda", torch.float16, 1, True, 1, "flashmonoid", marks=cuda),
    pytest.param("cuda", torch.bfloat16, 64, False, 1, "flashmonoid", marks=cuda),
    pytest.param("cuda", torch.bfloat16, 16, True, 4, "flashmonoid", marks=cuda),
    pytest.param("cuda", torch.float16, 3, True, 17, "flashmonoid", marks=cuda),
    pytest.param("cuda", torch.bfloat16, 16, True, 4, "sdpa", marks=cuda),
    pytest.param("cuda", torch.bfloat16, 1, True, 1, "fa3_packed", marks=cuda),
    pytest.param("cuda", torch.float16, 16, True, 4, "fa3_packed", marks=cuda),
    pytest.param("cuda", torch.bfloat16, 16, True, 1, "vllm", marks=cuda),
    pytest.param("cuda", torch.float16, 1, True, 4, "vllm", marks=cuda),
])
def test_greedy_decoding_over_a_paged_cache(device, dtype, page_size, graph, draft, engine):
    r = serving_loop.run(device, dtype, layers=2, batch=5, steps=20 if draft == 1 else 8, page_size=page_size,
                         graph=graph, draft=draft, engine=engine)
    assert r["finite"]
    assert r["lengths_ok"], "cache_seqlens after the loop is not prompt length + the tokens kept"
    if engine != "sdpa":  # the pages (the baseline's contiguous cache has no poison to check)
        assert r["cache_ok"], "a row was appended outside the sequences' positions, or one was not written"
    assert r["err"] <= r["bound"], r
    if draft > 1:  # both outcomes of a speculative step happened: guesses kept and guesses rejected
        assert 1.0 < r["tokens_per_step"] < draft, r


@pytest.mark.parametrize("device, dtype", [("cpu", torch.float32),
                                           pytest.param("cuda", torch.bfloat16, marks=cuda)])
def test_long_prompts(device, dtype):
    """Prompts of 350-700 tokens (rotary angles in the hundreds of radians, where tables that differ
    from the model's in the last bits show), both engines."""
    for engine in ("flashmonoid", "sdpa"):
        r = serving_loop.run(device, dtype, layers=2, batch=3, steps=4, context=700, engine=engine)
        assert r["finite"] and r["lengths_ok"] and r["cache_ok"] is not False
        assert r["err"] <= r["bound"], r
