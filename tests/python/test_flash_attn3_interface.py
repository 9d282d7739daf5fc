"""flashmonoid.flash_attn3_interface: flash-attn 3's names, defaults and return conventions over the
ops of the flash-attn 2 module (their bits), and its own pieces (packed GQA heads, used lengths,
combine, page_table) against float64 or the other entry points; what it refuses."""

import inspect

import pytest

torch = pytest.importorskip("torch")

from flashmonoid import flash_attn3_interface as fa3  # noqa: E402
from flashmonoid import flash_attn_interface as fa2  # noqa: E402

from conftest import require_supported  # noqa: E402
from test_flash_attn_interface import CONFIGS, HAS_CUDA, check_rule, rand  # noqa: E402
from torch_reference import attention as ref_attention, lse as ref_lse  # noqa: E402

# flash-attn 3's (hopper/flash_attn_interface.py) parameters and defaults, in order; sinks, last, is
# SGLang's build's (sgl-kernel), which its gpt-oss path passes.
_D = (-1, -1)
SIGNATURES = {
    "flash_attn_qkvpacked_func": [
        ("qkv", None), ("softmax_scale", None), ("causal", False), ("q_descale", None), ("k_descale", None),
        ("v_descale", None), ("window_size", _D), ("attention_chunk", 0), ("softcap", 0.0), ("deterministic", False),
        ("num_heads_q", None), ("sm_margin", 0), ("return_attn_probs", False)],
    "flash_attn_func": [
        ("q", None), ("k", None), ("v", None), ("softmax_scale", None), ("causal", False), ("qv", None),
        ("q_descale", None), ("k_descale", None), ("v_descale", None), ("window_size", _D), ("attention_chunk", 0),
        ("softcap", 0.0), ("num_splits", 1), ("pack_gqa", None), ("deterministic", False), ("sm_margin", 0),
        ("return_attn_probs", False), ("sinks", None)],
    "flash_attn_varlen_func": [
        ("q", None), ("k", None), ("v", None), ("cu_seqlens_q", None), ("cu_seqlens_k", None),
        ("max_seqlen_q", None), ("max_seqlen_k", None), ("seqused_q", None), ("seqused_k", None),
        ("softmax_scale", None), ("causal", False), ("qv", None), ("q_descale", None), ("k_descale", None),
        ("v_descale", None), ("window_size", _D), ("attention_chunk", 0), ("softcap", 0.0), ("num_splits", 1),
        ("pack_gqa", None), ("deterministic", False), ("sm_margin", 0), ("return_attn_probs", False),
        ("sinks", None)],
    "flash_attn_combine": [("out_partial", None), ("lse_partial", None), ("out", None), ("out_dtype", None)],
    "flash_attn_with_kvcache": [
        ("q", None), ("k_cache", None), ("v_cache", None), ("k", None), ("v", None), ("qv", None),
        ("rotary_cos", None), ("rotary_sin", None), ("cache_seqlens", None), ("cache_batch_idx", None),
        ("cache_leftpad", None), ("page_table", None), ("cu_seqlens_q", None), ("cu_seqlens_k_new", None),
        ("max_seqlen_q", None), ("rotary_seqlens", None), ("q_descale", None), ("k_descale", None),
        ("v_descale", None), ("softmax_scale", None), ("causal", False), ("window_size", _D),
        ("attention_chunk", 0), ("softcap", 0.0), ("rotary_interleaved", True), ("scheduler_metadata", None),
        ("num_splits", 0), ("pack_gqa", None), ("sm_margin", 0), ("return_softmax_lse", False), ("sinks", None)],
    "get_scheduler_metadata": [
        ("batch_size", None), ("max_seqlen_q", None), ("max_seqlen_k", None), ("num_heads_q", None),
        ("num_heads_kv", None), ("headdim", None), ("cache_seqlens", None), ("qkv_dtype", torch.bfloat16),
        ("headdim_v", None), ("cu_seqlens_q", None), ("cu_seqlens_k_new", None), ("cache_leftpad", None),
        ("page_size", None), ("max_seqlen_k_new", 0), ("causal", False), ("window_size", _D),
        ("attention_chunk", 0), ("has_softcap", False), ("num_splits", 0), ("pack_gqa", None), ("sm_margin", 0)],
}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signatures_match_flash_attn_3(name):
    params = inspect.signature(getattr(fa3, name)).parameters.values()
    assert [(p.name, None if p.default is inspect.Parameter.empty else p.default) for p in params] == SIGNATURES[name]


OPTIONS = [dict(causal=False), dict(causal=True), dict(causal=True, window_size=(9, 0)),
           dict(window_size=(5, 3), softcap=20.0)]


@pytest.mark.parametrize("device,dtype", CONFIGS)
@pytest.mark.parametrize("opts", OPTIONS, ids=["full", "causal", "causal-window", "window-softcap"])
def test_flash_attn_func_is_the_flash_attn_2_call(device, dtype, opts):
    """The same op as flash-attn 2's function: out, lse and gradients bit for bit; the tuning knobs
    change nothing; out alone, or (out, lse) with return_attn_probs; the FlashAttention rule."""
    q, k, v = (rand(2, 33, 4, 64, device=device, dtype=dtype), rand(2, 47, 2, 64, device=device, dtype=dtype, seed=1),
               rand(2, 47, 2, 64, device=device, dtype=dtype, seed=2))
    require_supported(q, k, causal=opts.get("causal", False))
    out, lse = fa3.flash_attn_func(q, k, v, return_attn_probs=True, num_splits=3, pack_gqa=True, sm_margin=4,
                                   **opts)
    out2, lse2, _ = fa2.flash_attn_func(q, k, v, return_attn_probs=True, **opts)
    assert torch.equal(out, out2) and torch.equal(lse, lse2) and lse.shape == (2, 4, 33)
    assert torch.equal(fa3.flash_attn_func(q, k, v, **opts), out)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for g, g2 in zip(grads, torch.autograd.grad(out2, (q, k, v), dout)):
        assert torch.equal(g, g2)
    kw = dict(causal=opts.get("causal", False), window=opts.get("window_size", (-1, -1)),
              softcap=opts.get("softcap", 0.0))
    check_rule(out, grads, q, k, v, dout, **kw)


@pytest.mark.parametrize("device,dtype", CONFIGS)
def test_qkvpacked_5d_and_gqa_4d(device, dtype):
    """(b, s, 3, h, d) unbound, and (b, s, h_q + 2 h_k, d) split with num_heads_q: the unpacked call's
    bits, gradients into the packed tensor at the same places."""
    qkv5 = rand(2, 29, 3, 4, 64, device=device, dtype=dtype)
    require_supported(qkv5[:, :, 0], qkv5[:, :, 1], causal=True)
    qkv4 = rand(2, 29, 4 + 2 * 2, 64, device=device, dtype=dtype, seed=3)
    for qkv, pieces, kw in ((qkv5, lambda t: t.unbind(dim=2), {}),
                            (qkv4, lambda t: t.split([4, 2, 2], dim=2), dict(num_heads_q=4))):
        out, lse = fa3.flash_attn_qkvpacked_func(qkv, causal=True, return_attn_probs=True, **kw)
        flat = qkv.detach().clone().requires_grad_()
        q, k, v = pieces(flat)
        ref, ref_lse = fa3.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
        dout = torch.randn_like(out)
        (g,) = torch.autograd.grad(out, qkv, dout)
        (g_ref,) = torch.autograd.grad(ref, flat, dout)
        assert g.shape == qkv.shape and torch.equal(g, g_ref)
    with pytest.raises(RuntimeError, match="num_heads_q"):
        fa3.flash_attn_qkvpacked_func(qkv4)
    with pytest.raises(RuntimeError, match="num_heads_q"):
        fa3.flash_attn_qkvpacked_func(qkv4, num_heads_q=3)


@pytest.mark.parametrize("device,dtype", CONFIGS)
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_used_lengths_run_a_padded_batch_in_place(device, dtype, causal):
    """Slots of 20 query and 24 key rows, used 20 / 7 / 0 and 24 / 11 / 5: each sequence's used rows
    meet the FlashAttention rule against float64 on that sequence alone; the rest: out 0, lse -inf,
    gradient 0."""
    b, s_q, s_k, h, h_k, d = 3, 20, 24, 4, 2, 64
    used_q, used_k = [20, 7, 0], [24, 11, 5]
    q = rand(b * s_q, h, d, device=device, dtype=dtype)
    k, v = (rand(b * s_k, h_k, d, device=device, dtype=dtype, seed=s) for s in (1, 2))
    require_supported(q[None], k[None], causal=causal)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    cu_q, cu_k = i32([i * s_q for i in range(b + 1)]), i32([i * s_k for i in range(b + 1)])
    out, lse = fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(used_q), max(used_k), seqused_q=i32(used_q),
                                          seqused_k=i32(used_k), causal=causal, return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (h, b * s_q)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    for e in range(b):
        rq, rk = slice(e * s_q, e * s_q + used_q[e]), slice(e * s_k, e * s_k + used_k[e])
        pad_q, pad_k = slice(e * s_q + used_q[e], (e + 1) * s_q), slice(e * s_k + used_k[e], (e + 1) * s_k)
        assert torch.all(out[pad_q] == 0) and torch.all(lse[:, pad_q] == float("-inf"))
        assert torch.all(dq[pad_q] == 0) and torch.all(dk[pad_k] == 0) and torch.all(dv[pad_k] == 0)
        if used_q[e] == 0:
            continue
        seq = [x.detach()[r][None].requires_grad_() for x, r in ((q, rq), (k, rk), (v, rk))]
        check_rule(out[rq][None], (dq[rq][None], dk[rk][None], dv[rk][None]), *seq, dout[rq][None], causal=causal)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not HAS_CUDA, reason="needs a CUDA GPU and a CUDA build"))])
def test_combine_merges_splits(device):
    """Three key splits' (out, lse) in flash-attn 3's layouts, one split seeing no key (lse -inf, its
    out poisoned with NaN): the whole attention within float32 rounding of float64; out_dtype and a
    caller's out; lse (b, s, h), a view of (b, h, s) as upstream."""
    b, s_q, h, d = 2, 5, 3, 32
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(b, s_q, h, d, generator=g, dtype=torch.float64),
               torch.randn(b, 30, h, d, generator=g, dtype=torch.float64),
               torch.randn(b, 30, h, d, generator=g, dtype=torch.float64))
    whole = ref_attention(q, k, v, upcast=True)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * d ** -0.5
    parts_o, parts_l = [], []
    for ks in (slice(0, 12), slice(12, 12), slice(12, 30)):  # the middle split has no key
        s = scores[..., ks]
        lse = torch.logsumexp(s, dim=-1) if s.shape[-1] else torch.full(s.shape[:-1], float("-inf"), dtype=s.dtype)
        o = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), v[:, ks]) if s.shape[-1] else \
            torch.full((b, s_q, h, d), float("nan"), dtype=s.dtype)
        parts_o.append(o)
        parts_l.append(lse.transpose(1, 2))  # (b, s, h)
    out_partial = torch.stack(parts_o).float().to(device)
    lse_partial = torch.stack(parts_l).float().to(device)
    out, lse = fa3.flash_attn_combine(out_partial, lse_partial)
    assert out.dtype == torch.float32 and out.shape == (b, s_q, h, d) and lse.shape == (b, s_q, h)
    assert lse.transpose(1, 2).is_contiguous()
    assert (out.double().cpu() - whole).abs().max() <= 1e-5 * whole.abs().max()
    want_lse = torch.logsumexp(scores, dim=-1).transpose(1, 2)
    assert (lse.double().cpu() - want_lse).abs().max() <= 1e-5 * want_lse.abs().max()
    bf16, _ = fa3.flash_attn_combine(out_partial, lse_partial, out_dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, out.to(torch.bfloat16))
    mine = torch.full((b, s_q, h, d), float("nan"), dtype=torch.float16, device=device)
    got, _ = fa3.flash_attn_combine(out_partial, lse_partial, out=mine)
    assert got is mine and torch.equal(mine, out.half())
    with pytest.raises(RuntimeError, match="fp32"):
        fa3.flash_attn_combine(out_partial.half(), lse_partial)
    with pytest.raises(RuntimeError, match="lse_partial must have shape"):
        fa3.flash_attn_combine(out_partial, lse_partial[:, :, :, :2])


@pytest.mark.parametrize("device,dtype", CONFIGS)
def test_kvcache_page_table_is_the_block_table(device, dtype):
    """Pages of 16 rows in a shuffled table, a 3-token append with rotary: the flash-attn 2 call's
    output, lse and written pages bit for bit; with return_softmax_lse flash-attn 3's 4-tuple."""
    b, h, h_k, d, page, pages_per_seq = 2, 4, 2, 64, 16, 4
    q = rand(b, 3, h, d, device=device, dtype=dtype, grad=False)
    k_new, v_new = (rand(b, 3, h_k, d, device=device, dtype=dtype, seed=s, grad=False) for s in (1, 2))
    k_pages, v_pages = (rand(b * pages_per_seq, page, h_k, d, device=device, dtype=dtype, seed=s, grad=False)
                        for s in (3, 4))
    require_supported(q, k_pages, causal=True)
    table = torch.randperm(b * pages_per_seq, generator=torch.Generator().manual_seed(5)).view(b, pages_per_seq)
    table = table.to(device=device, dtype=torch.int32)
    seqlens = torch.tensor([30, 15], dtype=torch.int32, device=device)  # both appends cross a page boundary
    angle = torch.rand(64, 16, generator=torch.Generator().manual_seed(6)) * 6.0
    cos, sin = angle.cos().to(device=device, dtype=dtype), angle.sin().to(device=device, dtype=dtype)
    caches2 = (k_pages.clone(), v_pages.clone())
    r3 = fa3.flash_attn_with_kvcache(q, k_pages, v_pages, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                     cache_seqlens=seqlens, page_table=table, causal=True, return_softmax_lse=True)
    r2 = fa2.flash_attn_with_kvcache(q, *caches2, k_new, v_new, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens,
                                     block_table=table, causal=True, return_softmax_lse=True)
    assert len(r3) == 4 and r3[2].numel() == 0 and r3[3].numel() == 0
    assert torch.equal(r3[0], r2[0]) and torch.equal(r3[1], r2[1])
    assert torch.equal(k_pages, caches2[0]) and torch.equal(v_pages, caches2[1])
    meta = fa3.get_scheduler_metadata(b, 3, 64, h, h_k, d, seqlens, page_size=page, causal=True)
    assert meta is None
    out = fa3.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=seqlens + 3, page_table=table, causal=True,
                                      scheduler_metadata=meta)
    assert torch.equal(out, fa2.flash_attn_with_kvcache(q, *caches2, cache_seqlens=seqlens + 3, block_table=table,
                                                        causal=True))


@pytest.mark.parametrize("device,dtype", CONFIGS)
@pytest.mark.parametrize("page", [1, 16, 0], ids=["page1", "page16", "contiguous"])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["", "sinks"])
def test_kvcache_packed_queries_as_sglang_calls_it(device, dtype, page, with_sinks):
    """SGLang's flash-attn 3 backend: packed queries (cu_seqlens_q, max_seqlen_q) whose keys are
    already the last rows of each sequence's cache_seqlens, shuffled pages of 1 or 16 rows (or a
    contiguous cache), causal, cu_seqlens_k_new passed without new keys, and (its gpt-oss path) sinks:
    each sequence meets the FlashAttention rule against float64 over its keys; lse (nheads, total_q)."""
    h, h_k, d, cap = 4, 2, 64, 48
    lens_q, lens_k = [5, 1, 0, 9], [12, 7, 3, 9]  # extend, decode, nothing new, a whole prefill
    b = len(lens_q)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    q = rand(sum(lens_q), h, d, device=device, dtype=dtype, grad=False)
    rows = [rand(cap, h_k, d, device=device, dtype=dtype, seed=10 + e, grad=False) for e in range(2 * b)]
    for e in range(2 * b):  # the cache past each sequence's length: poison that must not be read
        rows[e][lens_k[e % b]:] = float("nan")
    if page:
        per_seq = cap // page
        order = torch.randperm(b * per_seq, generator=torch.Generator().manual_seed(3))
        table = order.view(b, per_seq).to(device=device, dtype=torch.int32)
        k_cache, v_cache = (torch.empty((b * per_seq, page, h_k, d), device=device, dtype=dtype) for _ in range(2))
        for e in range(b):  # sequence e's rows through its pages
            k_cache[order[e * per_seq:(e + 1) * per_seq]] = rows[e].view(per_seq, page, h_k, d)
            v_cache[order[e * per_seq:(e + 1) * per_seq]] = rows[b + e].view(per_seq, page, h_k, d)
    else:
        table = None
        k_cache, v_cache = torch.stack(rows[:b]), torch.stack(rows[b:])
    require_supported(q[None], k_cache[:1], causal=True)
    cu_q = i32([sum(lens_q[:e]) for e in range(b + 1)])
    cu_k = i32([sum(lens_k[:e]) for e in range(b + 1)])
    sinks = torch.tensor([1.0, -2.0, 0.5, 3.0], device=device) if with_sinks else None
    out, lse, *rest = fa3.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=i32(lens_k), page_table=table,
                                                  cu_seqlens_q=cu_q, cu_seqlens_k_new=cu_k, max_seqlen_q=max(lens_q),
                                                  causal=True, return_softmax_lse=True, sinks=sinks)
    assert out.shape == q.shape and lse.shape == (h, q.shape[0]) and [r.numel() for r in rest] == [0, 0]
    for e in range(b):
        rq = slice(sum(lens_q[:e]), sum(lens_q[:e + 1]))
        if rq.stop == rq.start:
            continue
        seq = (q[rq][None], rows[e][:lens_k[e]][None], rows[b + e][:lens_k[e]][None])
        low, ref = (ref_attention(*seq, causal=True, upcast=u, sinks=sinks) for u in (False, True))
        floor = 1e-5 if dtype == torch.float32 else 0.0
        assert (out[rq].double() - ref[0]).abs().max() <= 2 * (low[0].double() - ref[0]).abs().max() + floor
        # lse by the same rule: the log-sum-exp of each query's visible scores in float64, against
        # the same math in the input dtype.
        want, low = (ref_lse(*seq[:2], causal=True, upcast=u, sinks=sinks)[0].double() for u in (True, False))
        assert (lse[:, rq].double() - want).abs().max() <= 2 * (low - want).abs().max() + floor


@pytest.mark.parametrize("device,dtype", CONFIGS)
def test_sinks_in_the_batched_and_kvcache_calls(device, dtype):
    """sinks (SGLang's build's argument) in flash_attn_func (out, lse and the gradients of q, k, v and
    the sinks) and in the KV-cache call over a contiguous cache with cache_seqlens (out and lse), by
    the rule against float64 with the sink as one more softmax column."""
    h, d = 4, 64
    q, k, v = (rand(2, 5, h, d, device=device, dtype=dtype), rand(2, 9, 2, d, device=device, dtype=dtype, seed=1),
               rand(2, 9, 2, d, device=device, dtype=dtype, seed=2))
    require_supported(q, k, causal=True)
    sinks = torch.tensor([0.5, 2.0, -1.0, 1.5], device=device, requires_grad=True)
    floor = 1e-5 if dtype == torch.float32 else 0.0

    def rule(x, ref, low):  # the FlashAttention rule against float64 (ref) and the input dtype's math (low)
        return (x.double() - ref.double()).abs().max() <= 2 * (low.double() - ref.double()).abs().max() + floor

    out, lse = fa3.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, sinks=sinks)
    ref, low = (ref_attention(q, k, v, causal=True, upcast=u, sinks=sinks) for u in (True, False))
    assert rule(out, ref, low)
    assert rule(lse, *(ref_lse(q, k, causal=True, upcast=u, sinks=sinks) for u in (True, False)))
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(device=device, dtype=dtype)
    for g, r, lo in zip(*(torch.autograd.grad(x, (q, k, v, sinks), dout.to(x.dtype)) for x in (out, ref, low))):
        assert rule(g, r, lo)
    lens = [9, 6]  # the second sequence's cache holds 6 of its 9 rows; NaN past them must not be read
    k_cache, v_cache = k.detach().clone(), v.detach().clone()
    k_cache[1, 6:], v_cache[1, 6:] = float("nan"), float("nan")
    out, lse, *_ = fa3.flash_attn_with_kvcache(q.detach(), k_cache, v_cache, causal=True, sinks=sinks.detach(),
                                               cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=device),
                                               return_softmax_lse=True)
    for e, n in enumerate(lens):
        seq = (q[e:e + 1].detach(), k[e:e + 1, :n].detach(), v[e:e + 1, :n].detach())
        assert rule(out[e], *(ref_attention(*seq, causal=True, upcast=u, sinks=sinks.detach())[0] for u in (True, False)))
        assert rule(lse[e], *(ref_lse(*seq[:2], causal=True, upcast=u, sinks=sinks.detach())[0] for u in (True, False)))


def test_return_attn_probs_materialises_no_s_dmask(monkeypatch):
    """flash-attn 3's return_attn_probs asks for lse only: flash-attn 2's S_dmask (an O(s_q * s_k)
    tensor) is not built, in the batched and varlen calls."""
    def refuse(*args, **kwargs):
        raise AssertionError("S_dmask built")
    monkeypatch.setattr(fa2, "_s_dmask", refuse)
    q, k = rand(1, 5, 2, 64, grad=False), rand(1, 7, 2, 64, seed=1, grad=False)
    cu_q, cu_k = torch.tensor([0, 5], dtype=torch.int32), torch.tensor([0, 7], dtype=torch.int32)
    assert len(fa3.flash_attn_func(q, k, k, return_attn_probs=True)) == 2
    assert len(fa3.flash_attn_varlen_func(q[0], k[0], k[0], cu_q, cu_k, 5, 7, return_attn_probs=True)) == 2


def test_refused_arguments_name_themselves():
    q = rand(1, 4, 2, 64, grad=False)
    k, v = rand(1, 6, 2, 64, seed=1, grad=False), rand(1, 6, 2, 64, seed=2, grad=False)
    one = torch.ones(1)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    calls = {
        "qv": lambda: fa3.flash_attn_func(q, k, v, qv=q),
        "q_descale": lambda: fa3.flash_attn_func(q, k, v, q_descale=one),
        "v_descale": lambda: fa3.flash_attn_qkvpacked_func(torch.stack((q, q, q), dim=2), v_descale=one),
        "attention_chunk": lambda: fa3.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 4, 4, attention_chunk=2),
        "cu_seqlens_k_new": lambda: fa3.flash_attn_with_kvcache(q, k, v, k=k[:, :1], v=v[:, :1], cache_seqlens=2,
                                                                cu_seqlens_k_new=cu),
        "rotary_seqlens": lambda: fa3.flash_attn_with_kvcache(q, k, v, rotary_seqlens=cu),
    }
    for name, call in calls.items():
        with pytest.raises(NotImplementedError, match=f"flash_attn3_interface: {name}: not supported"):
            call()
    for name in ("k", "rotary_cos", "cache_leftpad"):  # packed queries attend over keys already in the cache
        extra = dict(k=k[:, :1], v=v[:, :1]) if name == "k" else {name: cu}
        with pytest.raises(NotImplementedError, match=f"{name}: not supported with cu_seqlens_q"):
            fa3.flash_attn_with_kvcache(q[0], k, v, cu_seqlens_q=cu, max_seqlen_q=4, **extra)
    with pytest.raises(RuntimeError, match="max_seqlen_q must be provided"):
        fa3.flash_attn_with_kvcache(q[0], k, v, cu_seqlens_q=cu)
    with pytest.raises(ValueError, match=r"sinks: must be a float tensor of shape \(heads,\) = \(2,\)"):
        fa3.flash_attn_with_kvcache(q, k, v, cache_seqlens=6, sinks=torch.zeros(3))
    if hasattr(torch, "float8_e4m3fn"):
        with pytest.raises(NotImplementedError, match="float8"):
            fa3.flash_attn_func(q.to(torch.float8_e4m3fn), k, v)
    with pytest.raises(RuntimeError, match="needs cu_seqlens_q and cu_seqlens_k"):
        fa3.flash_attn_varlen_func(q[0], k[0], v[0], None, cu, 4, 6, seqused_q=torch.tensor([4], dtype=torch.int32))


def test_compiles_without_graph_breaks():
    """torch.compile(fullgraph=True) over the training call (with its backward), the packed-query
    KV-cache form and combine: the eager bits."""
    q, k, v = rand(2, 9, 4, 64), rand(2, 12, 2, 64, seed=1), rand(2, 12, 2, 64, seed=2)
    call = lambda q, k, v: fa3.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)  # noqa: E731
    (out, lse), (out2, lse2) = torch.compile(call, fullgraph=True, backend="aot_eager")(q, k, v), call(q, k, v)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    for g, g2 in zip(grads, torch.autograd.grad(out2.sum(), (q, k, v))):
        assert torch.equal(g, g2)
    qp = rand(7, 4, 64, grad=False)
    kc, vc = rand(3, 16, 2, 64, seed=1, grad=False), rand(3, 16, 2, 64, seed=2, grad=False)
    cu, lens = torch.tensor([0, 3, 4, 7], dtype=torch.int32), torch.tensor([5, 9, 16], dtype=torch.int32)
    packed = lambda qp, kc, vc, cu, lens: fa3.flash_attn_with_kvcache(  # noqa: E731
        qp, kc, vc, cache_seqlens=lens, cu_seqlens_q=cu, max_seqlen_q=3, causal=True)
    assert torch.equal(torch.compile(packed, fullgraph=True, backend="aot_eager")(qp, kc, vc, cu, lens),
                       packed(qp, kc, vc, cu, lens))
    parts, lses = rand(3, 2, 5, 4, 32, grad=False), rand(3, 2, 5, 4, seed=1, grad=False)
    got = torch.compile(fa3.flash_attn_combine, fullgraph=True, backend="aot_eager")(parts, lses)
    for x, y in zip(got, fa3.flash_attn_combine(parts, lses)):
        assert torch.equal(x, y)
