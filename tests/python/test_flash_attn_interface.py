"""flashmonoid.flash_attn_interface against float64 references, with flash-attn's conventions."""

import inspect
import itertools

import pytest

torch = pytest.importorskip("torch")

import flashmonoid as fm  # noqa: E402
from flashmonoid import flash_attn_interface as fa  # noqa: E402

from conftest import require_supported  # noqa: E402
from torch_reference import attention as ref_attention, rel_err  # noqa: E402

HAS_CUDA = torch.cuda.is_available() and fm.cuda_available()
# (device, dtype): fp32 on the CPU; the half types on the GPU, where the FlashAttention rule applies.
CONFIGS = [("cpu", torch.float32)] + [
    pytest.param("cuda", dt, marks=pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and a CUDA build"))
    for dt in (torch.float16, torch.bfloat16)]


def rand(*shape, device="cpu", dtype=torch.float32, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
    return x.requires_grad_() if grad else x


def check_rule(out, grads, q, k, v, dout, **kw):
    check_rule_of(lambda upcast: ref_attention(q, k, v, upcast=upcast, **kw), out, grads, (q, k, v), dout)


def check_rule_of(reference, out, grads, inputs, dout):
    """FlashAttention's rule: error against float64 (reference(upcast=True)) <= 2x that of the same
    math in the input dtype (reference(upcast=False)), for out and the gradients of inputs (plus a
    floor for fp32, where both errors are near rounding)."""
    ref, low = reference(True), reference(False)
    ref_g = torch.autograd.grad(ref, inputs, dout.double())
    low_g = torch.autograd.grad(low, inputs, dout)
    floor = 1e-5 if out.dtype == torch.float32 else 0.0
    assert (out.double() - ref).abs().max() <= 2 * (low.double() - ref).abs().max() + floor
    for g, r, lg in zip(grads, ref_g, low_g):
        assert (g.double() - r).abs().max() <= 2 * (lg.double() - r).abs().max() + 10 * floor


SIGNATURES = {
    "flash_attn_func": "(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), "
                       "softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False)",
    "flash_attn_qkvpacked_func": "(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), "
                                 "softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False)",
    "flash_attn_kvpacked_func": "(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), "
                                "softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False)",
    "flash_attn_varlen_func": "(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, "
                              "softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, "
                              "alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None)",
    "flash_attn_varlen_qkvpacked_func": "(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, "
                                        "causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, "
                                        "deterministic=False, return_attn_probs=False)",
    "flash_attn_varlen_kvpacked_func": "(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, "
                                       "dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), "
                                       "softcap=0.0, alibi_slopes=None, deterministic=False, "
                                       "return_attn_probs=False)",
}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signatures_match_flash_attn_2(name):
    assert str(inspect.signature(getattr(fa, name))) == SIGNATURES[name]


def test_kvcache_signature():
    params = list(inspect.signature(fa.flash_attn_with_kvcache).parameters)
    assert params == ["q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens",
                      "cache_batch_idx", "cache_leftpad", "block_table", "softmax_scale", "causal", "window_size",
                      "softcap", "rotary_interleaved", "alibi_slopes", "num_splits", "return_softmax_lse"]


@pytest.mark.parametrize("device,dtype", CONFIGS)
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_func(device, dtype, causal):
    q, k, v = rand(2, 33, 4, 64, device=device, dtype=dtype), rand(2, 47, 2, 64, device=device, dtype=dtype, seed=1), \
        rand(2, 47, 2, 64, device=device, dtype=dtype, seed=2)
    require_supported(q, k, causal=causal)
    out, lse, s_dmask = fa.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (2, 4, 33) and lse.dtype == torch.float32
    assert s_dmask.numel() == 0  # as upstream: only with dropout
    dout = torch.randn_like(out)
    check_rule(out, torch.autograd.grad(out, (q, k, v), dout), q, k, v, dout, causal=causal)


# Calls with no query row or no key row, here and below through every entry point and option (on
# the GPU a workspace query once divided by zero rows): an empty output, or out = 0 with lse = -inf
# where a row has no key, zero gradients for inputs nothing reads. No batch entry is flash-attn's
# error, as there (the C++ API runs it).
def grads_are_zero(out, inputs):
    """out.sum()'s gradients: the shapes of the inputs, all zero (nothing reads them, or no row has a key)."""
    grads = torch.autograd.grad(out.sum(), inputs)
    for x, g in zip(inputs, grads):
        assert g.shape == x.shape and torch.all(g == 0)


@pytest.mark.parametrize("device,dtype", CONFIGS)
@pytest.mark.parametrize("s_q,s_k", [(0, 47), (33, 0), (0, 0)])
def test_empty_queries_or_keys(device, dtype, s_q, s_k):
    """No query: an empty output, dK = dV = 0. No key: out = 0, lse = -inf, dQ = 0. Through autograd,
    whose gradient of a sum is an expanded (stride 0) tensor, empty or not."""
    q, k, v = rand(2, s_q, 4, 64, device=device, dtype=dtype), rand(2, s_k, 2, 64, device=device, dtype=dtype, seed=1), \
        rand(2, s_k, 2, 64, device=device, dtype=dtype, seed=2)
    out, lse, _ = fa.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (2, 4, s_q)
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))  # vacuous when s_q = 0
    grads_are_zero(out, (q, k, v))


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
def test_varlen_without_rows(device, dtype, lens_q, lens_k):
    cu = lambda lens: torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)  # noqa: E731
    q = rand(sum(lens_q), 4, 64, device=device, dtype=dtype)
    k, v = (rand(sum(lens_k), 2, 64, device=device, dtype=dtype, seed=s) for s in (1, 2))
    out, lse, _ = fa.flash_attn_varlen_func(q, k, v, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k),
                                            causal=True, return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (4, sum(lens_q))
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))  # vacuous without query rows
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
    assert out.shape == q.shape and torch.all(out == 0) and torch.all(lse == float("-inf"))

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


@pytest.mark.parametrize("device,dtype", CONFIGS)
def test_packed_variants(device, dtype):
    qkv = rand(2, 24, 3, 4, 64, device=device, dtype=dtype)
    require_supported(qkv[:, :, 0], qkv[:, :, 1], causal=True, window=(5, 0))
    out = fa.flash_attn_qkvpacked_func(qkv, causal=True, window_size=(5, 0))
    dout = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, (qkv,), dout)
    q, k, v = (x.detach().requires_grad_() for x in qkv.unbind(2))
    ref = fa.flash_attn_func(q, k, v, causal=True, window_size=(5, 0))
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(dqkv, torch.stack(torch.autograd.grad(ref, (q, k, v), dout), dim=2))

    q = rand(2, 10, 4, 64, device=device, dtype=dtype)
    kv = rand(2, 24, 2, 2, 64, device=device, dtype=dtype, seed=3)
    out = fa.flash_attn_kvpacked_func(q, kv, softcap=5.0)
    k, v = kv.unbind(2)
    torch.testing.assert_close(out, fa.flash_attn_func(q, k, v, softcap=5.0))


@pytest.mark.parametrize("device,dtype", CONFIGS)
def test_varlen_variants(device, dtype):
    lens = [5, 12, 1]
    cu = torch.tensor([0, 5, 17, 18], dtype=torch.int32, device=device)
    q, k, v = (rand(18, 4, 64, device=device, dtype=dtype, seed=s) for s in range(3))
    require_supported(q[None], k[None], causal=True)
    out, lse, _ = fa.flash_attn_varlen_func(q, k, v, cu, cu, 12, 12, causal=True, return_attn_probs=True)
    assert lse.shape == (4, 18)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for b in range(3):
        s = slice(int(cu[b]), int(cu[b + 1]))
        qb, kb, vb = (x.detach()[None, s].requires_grad_() for x in (q, k, v))
        ob = fa.flash_attn_func(qb, kb, vb, causal=True)
        gb = torch.autograd.grad(ob, (qb, kb, vb), dout[None, s])
        torch.testing.assert_close(out[s], ob[0])
        for g, r in zip(grads, gb):
            torch.testing.assert_close(g[s], r[0])
    qkv = torch.stack([q, k, v], dim=1)
    torch.testing.assert_close(fa.flash_attn_varlen_qkvpacked_func(qkv, cu, 12, causal=True), out)
    kv = torch.stack([k, v], dim=1)
    torch.testing.assert_close(fa.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 12, 12, causal=True), out)


def varlen_reference(q, k, v, cu_q, cu_k, upcast, **kw):
    """ref_attention per sequence of packed q (total_q, h, d) and k, v (total_k, h_k, d)."""
    return torch.cat([ref_attention(q[None, cu_q[i]:cu_q[i + 1]], k[None, cu_k[i]:cu_k[i + 1]],
                                    v[None, cu_k[i]:cu_k[i + 1]], upcast=upcast, **kw)[0]
                      for i in range(len(cu_q) - 1)])


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and a CUDA build")
@pytest.mark.parametrize("d", [59, 111])
def test_head_dims_not_a_multiple_of_8_varlen_and_packed(d):
    # Every function of the interface at a head dim flash-attn pads internally, against float64.
    dev, dt = "cuda", torch.bfloat16 if d == 59 else torch.float16

    def check(out, inputs, reference):
        dout = torch.randn_like(out)
        check_rule_of(reference, out, torch.autograd.grad(out, inputs, dout), inputs, dout)

    lens_k, cu_q, cu_k = [3, 20, 9], [0, 3, 4, 10], [0, 3, 23, 32]
    cu_q_t, cu_k_t = (torch.tensor(c, dtype=torch.int32, device=dev) for c in (cu_q, cu_k))
    q, k, v = rand(10, 4, d, device=dev, dtype=dt), rand(32, 2, d, device=dev, dtype=dt, seed=1), \
        rand(32, 2, d, device=dev, dtype=dt, seed=2)
    out = fa.flash_attn_varlen_func(q, k, v, cu_q_t, cu_k_t, 6, 20, causal=True)
    assert out.shape == q.shape
    check(out, (q, k, v), lambda upcast: varlen_reference(q, k, v, cu_q, cu_k, upcast, causal=True))

    # Paged (page 16, shuffled, unused rows NaN): forward only.
    page, g = 16, torch.Generator().manual_seed(3)
    max_pages = -(-max(lens_k) // page)
    perm = torch.randperm(3 * max_pages + 1, generator=g)[: 3 * max_pages]
    table = perm.to(device=dev, dtype=torch.int32).reshape(3, max_pages)
    kp = torch.full((3 * max_pages + 1, page, 2, d), float("nan"), dtype=dt, device=dev)
    vp = kp.clone()
    for i in range(3):
        rows = torch.arange(lens_k[i], device=dev)
        kp[table[i].long()[rows // page], rows % page] = k.detach()[cu_k[i]:cu_k[i + 1]]
        vp[table[i].long()[rows // page], rows % page] = v.detach()[cu_k[i]:cu_k[i + 1]]
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    paged = fa.flash_attn_varlen_func(qd, kp, vp, cu_q_t, cu_k_t, 6, 20, causal=True, block_table=table)
    ref = varlen_reference(qd, kd, vd, cu_q, cu_k, True, causal=True)
    low = varlen_reference(qd, kd, vd, cu_q, cu_k, False, causal=True)
    assert (paged.double() - ref).abs().max() <= 2 * (low.double() - ref).abs().max()

    # Packed: qkv (b, s, 3, h, d), kv (b, s_k, 2, h_k, d), and their varlen forms.
    qkv = rand(2, 24, 3, 4, d, device=dev, dtype=dt, seed=4)
    check(fa.flash_attn_qkvpacked_func(qkv, causal=True), (qkv,),
          lambda upcast: ref_attention(*qkv.unbind(2), causal=True, upcast=upcast))
    qb, kv = rand(2, 10, 4, d, device=dev, dtype=dt, seed=5), rand(2, 24, 2, 2, d, device=dev, dtype=dt, seed=6)
    check(fa.flash_attn_kvpacked_func(qb, kv, softcap=5.0), (qb, kv),
          lambda upcast: ref_attention(qb, *kv.unbind(2), softcap=5.0, upcast=upcast))
    qkv = rand(10, 3, 4, d, device=dev, dtype=dt, seed=7)
    check(fa.flash_attn_varlen_qkvpacked_func(qkv, cu_q_t, 6, causal=True), (qkv,),
          lambda upcast: varlen_reference(*qkv.unbind(1), cu_q, cu_q, upcast, causal=True))
    kv = rand(32, 2, 2, d, device=dev, dtype=dt, seed=8)
    check(fa.flash_attn_varlen_kvpacked_func(q, kv, cu_q_t, cu_k_t, 6, 20, causal=True), (q, kv),
          lambda upcast: varlen_reference(q, *kv.unbind(1), cu_q, cu_k, upcast, causal=True))


def test_dropout_attn_probs_encode_the_mask():
    torch.manual_seed(0)
    q, k, v = rand(1, 8, 2, 16), rand(1, 8, 2, 16, seed=1), rand(1, 8, 2, 16, seed=2)
    out, lse, s_dmask = fa.flash_attn_func(q, k, v, dropout_p=0.4, return_attn_probs=True)
    assert s_dmask.shape == (1, 2, 8, 8)
    dropped = s_dmask < 0
    assert 0.2 < dropped.float().mean() < 0.6
    # flash-attn's convention: exp(score - row max), so each row's largest |entry| is 1 and
    # |S_dmask| · exp(row max - lse) are the probabilities.
    a = s_dmask.abs()
    assert torch.allclose(a.amax(-1), torch.ones(1, 2, 8))
    scores = torch.einsum("bihd,bjhd->bhij", q.detach(), k.detach()) * 16 ** -0.5
    probs = a * torch.exp(scores.amax(-1, keepdim=True) - lse[..., None])
    torch.testing.assert_close(probs, torch.softmax(scores, -1))
    # out = (kept probabilities / (1 - p)) v, with the probabilities S_dmask reports.
    expected = torch.einsum("bhij,bjhd->bihd", torch.where(s_dmask > 0, probs, 0) / 0.6, v.detach())
    assert rel_err(out, expected) <= 1e-5


@pytest.mark.parametrize("device", ["cpu"] + [
    pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and a CUDA build"))])
def test_attn_probs_match_the_kernels_dropout_and_varlen(device):
    # The same elements are dropped in S_dmask as in the kernel's output (a dropped key changes out):
    # out equals the decoded kept probabilities times v, batched and varlen.
    dtype = torch.float32 if device == "cpu" else torch.float16
    lens = [5, 12, 1]
    cu = torch.tensor([0, 5, 17, 18], dtype=torch.int32, device=device)
    q, k, v = (rand(18, 2, 32, device=device, dtype=dtype, seed=s).detach() for s in range(3))
    out, lse, s_dmask = fa.flash_attn_varlen_func(q, k, v, cu, cu, 12, 12, dropout_p=0.3, causal=True,
                                                  return_attn_probs=True)
    assert s_dmask.shape == (3, 2, 12, 12)
    for b, n in enumerate(lens):
        a = s_dmask[b, :, :n, :n].abs().double()
        probs = a / a.sum(-1, keepdim=True)
        kept = torch.where(s_dmask[b, :, :n, :n] > 0, probs, 0) / 0.7
        expected = torch.einsum("hij,jhd->ihd", kept, v[cu[b]:cu[b] + n].double())
        assert (out[cu[b]:cu[b] + n].double() - expected).abs().max() < (1e-5 if device == "cpu" else 5e-3)
        assert torch.all(s_dmask[b, :, n:] == 0) and torch.all(s_dmask[b, :, :, n:] == 0)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and a CUDA build")
def test_attn_probs_are_fast():
    # Upstream's dropout race test calls this 250 times at b = 60, h = 4, s = 1024, d = 128.
    import time

    q, k, v = (torch.randn(60, 1024, 4, 128, device="cuda", dtype=torch.float16) for _ in range(3))
    fa.flash_attn_func(q, k, v, dropout_p=0.17, return_attn_probs=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(3):
        fa.flash_attn_func(q, k, v, dropout_p=0.17, return_attn_probs=True)
    torch.cuda.synchronize()
    assert (time.perf_counter() - start) / 3 < 0.2


def test_fully_masked_rows_give_zero_and_minus_inf_lse():
    q, k, v = rand(1, 6, 2, 16), rand(1, 3, 2, 16), rand(1, 3, 2, 16)
    out, lse, _ = fa.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.all(out[:, :3] == 0) and torch.all(torch.isneginf(lse[:, :, :3]))


def test_kvcache_appends_in_place_and_attends():
    torch.manual_seed(0)
    b, cap, h, h_k, d = 3, 16, 4, 2, 32
    k_cache, v_cache = torch.randn(b, cap, h_k, d), torch.randn(b, cap, h_k, d)
    q = torch.randn(b, 2, h, d)
    k_new, v_new = torch.randn(b, 2, h_k, d), torch.randn(b, 2, h_k, d)
    seqlens = torch.tensor([3, 9, 0], dtype=torch.int32)
    kc0, vc0 = k_cache.clone(), v_cache.clone()
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=True,
                                          return_softmax_lse=True)
    assert lse.shape == (b, h, 2)
    for i, n in enumerate(seqlens.tolist()):
        torch.testing.assert_close(k_cache[i, n:n + 2], k_new[i])
        keys = torch.cat([kc0[i, :n], k_new[i]])[None]
        vals = torch.cat([vc0[i, :n], v_new[i]])[None]
        torch.testing.assert_close(out[i:i + 1], ref_attention(q[i:i + 1], keys, vals, causal=True).float())


def test_kvcache_batch_idx_and_int_seqlens():
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(4, 8, 2, 16), torch.randn(4, 8, 2, 16)
    q = torch.randn(2, 1, 2, 16)
    idx = torch.tensor([3, 1], dtype=torch.int32)
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=5, cache_batch_idx=idx)
    for i, r in enumerate(idx.tolist()):
        torch.testing.assert_close(out[i:i + 1], ref_attention(q[i:i + 1], k_cache[r:r + 1, :5],
                                                               v_cache[r:r + 1, :5]).float())


def _q(*shape, dtype=torch.float16):
    return torch.zeros(*shape, dtype=dtype)


# Every invalid input flash-attn rejects, with flash-attn's message.
INVALID = [
    ("q int", lambda: fa.flash_attn_func(_q(1, 4, 2, 8, dtype=torch.int32), _q(1, 4, 2, 8), _q(1, 4, 2, 8)),
     "FlashAttention only support fp16 and bf16 data type"),
    ("k dtype", lambda: fa.flash_attn_func(_q(1, 4, 2, 8), _q(1, 4, 2, 8, dtype=torch.bfloat16), _q(1, 4, 2, 8)),
     "query and key must have the same dtype"),
    ("v dtype", lambda: fa.flash_attn_func(_q(1, 4, 2, 8), _q(1, 4, 2, 8), _q(1, 4, 2, 8, dtype=torch.bfloat16)),
     "query and value must have the same dtype"),
    ("batch 0", lambda: fa.flash_attn_func(_q(0, 4, 2, 8), _q(0, 4, 2, 8), _q(0, 4, 2, 8)),
     "batch size must be positive"),
    ("heads", lambda: fa.flash_attn_func(_q(1, 4, 3, 8), _q(1, 4, 2, 8), _q(1, 4, 2, 8)),
     "Number of heads in key/value must divide number of heads in query"),
    ("k shape", lambda: fa.flash_attn_func(_q(1, 4, 2, 8), _q(2, 4, 2, 8), _q(1, 4, 2, 8)),
     "k must have shape (batch_size, seqlen_k, num_heads_k, head_size)"),
    ("v shape", lambda: fa.flash_attn_func(_q(1, 4, 2, 8), _q(1, 4, 2, 8), _q(1, 5, 2, 8)),
     "v must have shape (batch_size, seqlen_k, num_heads_k, head_size)"),
    ("q 3d", lambda: fa.flash_attn_func(_q(4, 2, 8), _q(1, 4, 2, 8), _q(1, 4, 2, 8)),
     "q must have shape (batch_size, seqlen_q, num_heads, head_size)"),
    ("dropout", lambda: fa.flash_attn_func(_q(1, 4, 2, 8), _q(1, 4, 2, 8), _q(1, 4, 2, 8), dropout_p=1.0),
     "Expected p_dropout < 1.f to be true, but got false."),
    ("alibi dtype", lambda: fa.flash_attn_func(_q(1, 4, 2, 8), _q(1, 4, 2, 8), _q(1, 4, 2, 8),
                                               alibi_slopes=torch.ones(2, dtype=torch.float16)),
     "ALiBi slopes must have dtype fp32"),
    ("alibi stride", lambda: fa.flash_attn_func(_q(1, 4, 2, 8), _q(1, 4, 2, 8), _q(1, 4, 2, 8),
                                                alibi_slopes=torch.ones(2, 1).t()[:, :1].expand(1, 2)),
     "ALiBi slopes tensor must have contiguous last dimension"),
    ("alibi shape", lambda: fa.flash_attn_func(_q(1, 4, 2, 8), _q(1, 4, 2, 8), _q(1, 4, 2, 8),
                                               alibi_slopes=torch.ones(3)),
     "Expected alibi_slopes.sizes() == torch::IntArrayRef({num_heads})"),
    ("cu dtype", lambda: fa.flash_attn_varlen_func(_q(4, 2, 8), _q(4, 2, 8), _q(4, 2, 8), torch.tensor([0, 4]),
                                                   torch.tensor([0, 4], dtype=torch.int32), 4, 4),
     "cu_seqlens_q must have dtype int32"),
    ("cu_k dtype", lambda: fa.flash_attn_varlen_func(_q(4, 2, 8), _q(4, 2, 8), _q(4, 2, 8),
                                                     torch.tensor([0, 4], dtype=torch.int32), torch.tensor([0, 4]),
                                                     4, 4),
     "cu_seqlens_k must have dtype int32"),
    ("cu contiguous", lambda: fa.flash_attn_varlen_func(
        _q(4, 2, 8), _q(4, 2, 8), _q(4, 2, 8), torch.tensor([0, 9, 4, 9], dtype=torch.int32)[::2],
        torch.tensor([0, 4], dtype=torch.int32), 4, 4), "cu_seqlens_q must be contiguous"),
    ("cu_k shape", lambda: fa.flash_attn_varlen_func(_q(4, 2, 8), _q(4, 2, 8), _q(4, 2, 8),
                                                     torch.tensor([0, 4], dtype=torch.int32),
                                                     torch.tensor([0, 2, 4], dtype=torch.int32), 4, 4),
     "cu_seqlens_k must have shape (batch_size + 1)"),
    ("varlen k shape", lambda: fa.flash_attn_varlen_func(_q(4, 2, 8), _q(4, 2, 4), _q(4, 2, 8),
                                                         torch.tensor([0, 4], dtype=torch.int32),
                                                         torch.tensor([0, 4], dtype=torch.int32), 4, 4),
     "k must have shape (total_k, num_heads_k, head_size)"),
    ("kvcache v missing", lambda: fa.flash_attn_with_kvcache(_q(1, 1, 2, 8), _q(1, 4, 2, 8), _q(1, 4, 2, 8),
                                                             k=_q(1, 1, 2, 8), cache_seqlens=1),
     "If key is supplied, value must also be passed in"),
    ("kvcache seqlens missing", lambda: fa.flash_attn_with_kvcache(_q(1, 1, 2, 8), _q(1, 4, 2, 8), _q(1, 4, 2, 8),
                                                                   k=_q(1, 1, 2, 8), v=_q(1, 1, 2, 8)),
     "If key is supplied, seqlens_k must also be passed in"),
    ("kvcache seqlens dtype", lambda: fa.flash_attn_with_kvcache(_q(1, 1, 2, 8), _q(1, 4, 2, 8), _q(1, 4, 2, 8),
                                                                 cache_seqlens=torch.tensor([1])),
     "seqlens_k must have dtype int32"),
    ("kvcache key dtype", lambda: fa.flash_attn_with_kvcache(_q(1, 1, 2, 8), _q(1, 4, 2, 8), _q(1, 4, 2, 8),
                                                             k=_q(1, 1, 2, 8, dtype=torch.bfloat16),
                                                             v=_q(1, 1, 2, 8), cache_seqlens=1),
     "Key must have the same dtype as query"),
]


@pytest.mark.parametrize("call,message", [(c, m) for _, c, m in INVALID], ids=[n for n, _, _ in INVALID])
def test_invalid_input_messages(call, message):
    with pytest.raises(RuntimeError) as info:
        call()
    assert str(info.value).startswith(message)


def test_kvcache_strided_cache_asserts():
    kc = torch.zeros(1, 4, 2, 8).transpose(-1, -2).contiguous().transpose(-1, -2)
    with pytest.raises(AssertionError, match="k_cache must have contiguous last dimension"):
        fa.flash_attn_with_kvcache(_q(1, 1, 2, 8, dtype=torch.float32), kc, kc)
