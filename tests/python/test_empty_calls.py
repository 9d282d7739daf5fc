"""Calls with nothing on one side, through every flash_attn entry point and autograd: no query row, no
key row. Each must run and write what attention means there: an empty output, or out = 0 with lse =
-inf where a row has no key, and zero gradients for inputs nothing reads (a workspace query on the
GPU once divided by zero rows). No batch entry is flash-attn's error, as there (the C++ API runs it)."""

import pytest

torch = pytest.importorskip("torch")

import flashmonoid as fm  # noqa: E402
from flashmonoid import flash_attn_interface as fa  # noqa: E402

HAS_CUDA = torch.cuda.is_available() and fm.cuda_available()
CONFIGS = [("cpu", torch.float32)] + [
    pytest.param("cuda", dt, marks=pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and a CUDA build"))
    for dt in (torch.float16, torch.bfloat16)]
NEG_INF = float("-inf")


def rand(*shape, device, dtype, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
    return x.requires_grad_() if grad else x


def grads_are_zero(out, inputs):
    """out.sum()'s gradients: the shapes of the inputs, all zero (nothing reads them, or no row has a key)."""
    grads = torch.autograd.grad(out.sum(), inputs, allow_unused=False)
    for x, g in zip(inputs, grads):
        assert g.shape == x.shape and torch.all(g == 0)


@pytest.mark.parametrize("device,dtype", CONFIGS)
def test_no_batch_entry_is_flash_attns_error(device, dtype):
    q = rand(0, 5, 4, 64, device=device, dtype=dtype)
    k, v = (rand(0, 7, 2, 64, device=device, dtype=dtype, seed=s) for s in (1, 2))
    with pytest.raises(RuntimeError, match="batch size must be positive"):
        fa.flash_attn_func(q, k, v, causal=True)
    with pytest.raises(RuntimeError, match="batch size must be positive"):
        fa.flash_attn_qkvpacked_func(rand(0, 5, 3, 4, 64, device=device, dtype=dtype))
    cu = torch.zeros(1, dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match="batch size must be positive"):
        fa.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, 0, 0)
    cache = rand(2, 8, 2, 64, device=device, dtype=dtype, grad=False)
    with pytest.raises(RuntimeError, match="batch size must be positive"):
        fa.flash_attn_with_kvcache(q.detach(), cache, cache, cache_seqlens=torch.zeros(0, dtype=torch.int32,
                                                                                      device=device))


@pytest.mark.parametrize("device,dtype", CONFIGS)
def test_packed_without_rows(device, dtype):
    qkv = rand(2, 0, 3, 4, 64, device=device, dtype=dtype)
    out = fa.flash_attn_qkvpacked_func(qkv, causal=True)
    assert out.shape == (2, 0, 4, 64)
    grads_are_zero(out, (qkv,))
    q = rand(2, 9, 4, 64, device=device, dtype=dtype)
    kv = rand(2, 0, 2, 2, 64, device=device, dtype=dtype, seed=1)
    out = fa.flash_attn_kvpacked_func(q, kv)
    assert out.shape == q.shape and torch.all(out == 0)
    grads_are_zero(out, (q, kv))


@pytest.mark.parametrize("device,dtype", CONFIGS)
@pytest.mark.parametrize("lens_q,lens_k", [([0, 0, 0], [5, 0, 12]), ([3, 4, 0], [0, 0, 0])],
                         ids=["no_query_row", "no_key_row"])
def test_varlen(device, dtype, lens_q, lens_k):
    cu = lambda lens: torch.tensor([0] + list(torch.tensor(lens, dtype=torch.int64).cumsum(0)),  # noqa: E731
                                   dtype=torch.int32, device=device)
    q = rand(sum(lens_q), 4, 64, device=device, dtype=dtype)
    k, v = (rand(sum(lens_k), 2, 64, device=device, dtype=dtype, seed=s) for s in (1, 2))
    out, lse, _ = fa.flash_attn_varlen_func(q, k, v, cu(lens_q), cu(lens_k), max(lens_q, default=0),
                                            max(lens_k, default=0), causal=True, return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (4, sum(lens_q))
    assert torch.all(out == 0) and torch.all(lse == NEG_INF)  # vacuous without query rows
    grads_are_zero(out, (q, k, v))


@pytest.mark.parametrize("device,dtype", CONFIGS)
@pytest.mark.parametrize("page", [0, 16])
def test_kvcache_without_rows(device, dtype, page):
    """No query row; caches of zero length without an append (out = 0, lse = -inf);
    an append of one token into empty caches (out = that token's v: softmax over one key is 1)."""
    h, h_k, d, b = 4, 2, 64, 3
    if page:
        k_cache, v_cache = (rand(2 * b, page, h_k, d, device=device, dtype=dtype, seed=s, grad=False) for s in (1, 2))
        table = torch.arange(2 * b, dtype=torch.int32, device=device).reshape(b, 2)
    else:
        k_cache, v_cache = (rand(b, 32, h_k, d, device=device, dtype=dtype, seed=s, grad=False) for s in (1, 2))
        table = None
    zeros = torch.zeros(b, dtype=torch.int32, device=device)

    q = rand(b, 2, h, d, device=device, dtype=dtype, grad=False)
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=zeros, block_table=table,
                                          return_softmax_lse=True)
    assert out.shape == q.shape and torch.all(out == 0) and torch.all(lse == NEG_INF)

    q0 = rand(b, 0, h, d, device=device, dtype=dtype, grad=False)
    out, lse = fa.flash_attn_with_kvcache(q0, k_cache, v_cache, cache_seqlens=zeros + 5, block_table=table,
                                          return_softmax_lse=True)
    assert out.shape == q0.shape and lse.shape == (b, h, 0)

    k_new, v_new = (rand(b, 1, h_k, d, device=device, dtype=dtype, seed=s, grad=False) for s in (3, 4))
    q1 = q[:, :1]
    out = fa.flash_attn_with_kvcache(q1, k_cache, v_cache, k_new, v_new, cache_seqlens=zeros, block_table=table,
                                     causal=True)
    expect = v_new.repeat_interleave(h // h_k, dim=2)  # query head i reads KV head i // (h / h_k)
    torch.testing.assert_close(out, expect, rtol=0, atol=0)
    first = k_cache[table[:, 0].long(), 0] if page else k_cache[:, 0]
    assert torch.equal(first, k_new[:, 0])


@pytest.mark.parametrize("device,dtype", CONFIGS)
@pytest.mark.parametrize("s_q,s_k", [(0, 47), (33, 0)])
@pytest.mark.parametrize("kw", [dict(deterministic=True), dict(softcap=5.0, alibi=True), dict(window_size=(3, 0)),
                                dict(d=59), dict(dropout_p=0.1, return_attn_probs=True)],
                         ids=["deterministic", "softcap_alibi", "window", "hdim59", "dropout_probs"])
def test_options_without_rows(device, dtype, s_q, s_k, kw):
    kw = dict(kw)
    d = kw.pop("d", 64)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.rand(4, device=device, dtype=torch.float32)
    q = rand(2, s_q, 4, d, device=device, dtype=dtype)
    k, v = (rand(2, s_k, 2, d, device=device, dtype=dtype, seed=s) for s in (1, 2))
    res = fa.flash_attn_func(q, k, v, causal=True, **kw)
    out = res[0] if isinstance(res, tuple) else res
    assert out.shape == q.shape and torch.all(out == 0)  # vacuous when s_q = 0
    grads_are_zero(out, (q, k, v))


@pytest.mark.parametrize("device,dtype", CONFIGS)
def test_paged_varlen_without_query_rows(device, dtype):
    """flash_attn_varlen_func(block_table=...) (chunked prefill into a paged cache) with no query row."""
    h, h_k, d, page = 4, 2, 64, 16
    pages = rand(6, page, h_k, d, device=device, dtype=dtype, grad=False)
    table = torch.arange(6, dtype=torch.int32, device=device).reshape(3, 2)
    cu_q = torch.zeros(4, dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 5, 5, 30], dtype=torch.int32, device=device)
    q = rand(0, h, d, device=device, dtype=dtype, grad=False)
    out = fa.flash_attn_varlen_func(q, pages, pages, cu_q, cu_k, 0, 25, causal=True, block_table=table)
    assert out.shape == q.shape
