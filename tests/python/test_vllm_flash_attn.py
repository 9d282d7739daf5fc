"""flashmonoid.vllm_flash_attn: vLLM's flash_attn_varlen_func (argument order, defaults, returns)
as vLLM's FlashAttention backend calls it (paged KV with seqused_k, a prefill with cu_seqlens_k,
out=, attention sinks) against float64, the bits of the calls it runs, and what it refuses."""

import inspect

import pytest

torch = pytest.importorskip("torch")

from flashmonoid import flash_attn3_interface as fa3  # noqa: E402
from flashmonoid import flash_attn_interface as fa2  # noqa: E402
from flashmonoid import vllm_flash_attn as vfa  # noqa: E402

from conftest import require_supported  # noqa: E402
from test_flash_attn_interface import CONFIGS, HAS_CUDA, rand  # noqa: E402
from torch_reference import attention as ref_attention, lse as ref_lse  # noqa: E402

# vLLM's (vllm_flash_attn/flash_attn_interface.py of vllm-project/flash-attention) parameters and
# defaults, in order.
SIGNATURE = [
    ("q", None), ("k", None), ("v", None), ("max_seqlen_q", None), ("cu_seqlens_q", None), ("max_seqlen_k", None),
    ("cu_seqlens_k", None), ("seqused_k", None), ("q_v", None), ("dropout_p", 0.0), ("softmax_scale", None),
    ("causal", False), ("window_size", None), ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False),
    ("return_attn_probs", False), ("block_table", None), ("return_softmax_lse", False), ("out", None),
    ("scheduler_metadata", None), ("q_descale", None), ("k_descale", None), ("v_descale", None), ("num_splits", 0),
    ("fa_version", 2), ("s_aux", None), ("cp_world_size", 1), ("cp_rank", 0), ("cp_tot_seqused_k", None)]


def test_signature_matches_vllm():
    params = inspect.signature(vfa.flash_attn_varlen_func).parameters.values()
    assert [(p.name, None if p.default is inspect.Parameter.empty else p.default) for p in params] == SIGNATURE
    assert list(inspect.signature(vfa.get_scheduler_metadata).parameters)[:7] == [
        "batch_size", "max_seqlen_q", "max_seqlen_k", "num_heads_q", "num_heads_kv", "headdim", "cache_seqlens"]


def i32(x, device):
    return torch.tensor(x, dtype=torch.int32, device=device)


def paged_batch(device, dtype, lens_k, page, h_k=2, d=64, cap=48, seed=10):
    """Per-sequence K and V rows (cap rows each, NaN past each length: poison that must not be read)
    and the same rows in shuffled pages of `page` rows: (rows_k, rows_v, k_pages, v_pages, table)."""
    b = len(lens_k)
    rows = [rand(cap, h_k, d, device=device, dtype=dtype, seed=seed + e, grad=False) for e in range(2 * b)]
    for e in range(2 * b):
        rows[e][lens_k[e % b]:] = float("nan")
    per_seq = cap // page
    order = torch.randperm(b * per_seq, generator=torch.Generator().manual_seed(seed))
    table = order.view(b, per_seq).to(device=device, dtype=torch.int32)
    k_pages, v_pages = (torch.empty((b * per_seq, page, h_k, d), device=device, dtype=dtype) for _ in range(2))
    for e in range(b):
        k_pages[order[e * per_seq:(e + 1) * per_seq]] = rows[e].view(per_seq, page, h_k, d)
        v_pages[order[e * per_seq:(e + 1) * per_seq]] = rows[b + e].view(per_seq, page, h_k, d)
    return rows[:b], rows[b:], k_pages, v_pages, table


def check_sequences(out, lse, q, rows_k, rows_v, lens_q, lens_k, **kw):
    """Each sequence's out and lse by the FlashAttention rule against float64 over its own keys
    (its queries the last of them)."""
    floor = 1e-5 if q.dtype == torch.float32 else 0.0
    for e in range(len(lens_q)):
        rq = slice(sum(lens_q[:e]), sum(lens_q[:e + 1]))
        if rq.stop == rq.start:
            continue
        qs, ks, vs = q[rq][None], rows_k[e][:lens_k[e]][None], rows_v[e][:lens_k[e]][None]
        ref, low = (ref_attention(qs, ks, vs, upcast=u, **kw)[0] for u in (True, False))
        assert (out[rq].double() - ref).abs().max() <= 2 * (low.double() - ref).abs().max() + floor, e
        want, low = (ref_lse(qs, ks, upcast=u, **kw)[0].double() for u in (True, False))
        finite = torch.isfinite(want)
        assert torch.equal(finite, torch.isfinite(lse[:, rq])), e
        err = lambda x: (x.double() - want).masked_fill(~finite, 0).abs().max()  # noqa: E731
        assert err(lse[:, rq]) <= 2 * err(low) + floor, e


@pytest.mark.parametrize("device,dtype", CONFIGS)
@pytest.mark.parametrize("page", [16, 1])
def test_paged_steps_as_vllm_calls_them(device, dtype, page):
    """vLLM's one call per step over its pages: a prefill chunk, decodes, a speculative step of 4 and
    a sequence without queries, packed; seqused_k the key counts, block_table shuffled, GQA 4/2,
    causal; out= poisoned with NaN, filled and returned. Every sequence meets the rule against
    float64, and the bits are those of flash-attn 3's packed-query KV-cache call (the same op)."""
    lens_q, lens_k = [7, 1, 4, 0, 1], [30, 17, 9, 5, 48]
    h = 4
    rows_k, rows_v, k_pages, v_pages, table = paged_batch(device, dtype, lens_k, page)
    q = rand(sum(lens_q), h, 64, device=device, dtype=dtype, grad=False)
    require_supported(q[None], k_pages[:1], causal=True)
    cu_q = i32([sum(lens_q[:e]) for e in range(len(lens_q) + 1)], device)
    out = torch.full_like(q, float("nan"))
    r = vfa.flash_attn_varlen_func(q, k_pages, v_pages, max(lens_q), cu_q, max(lens_k), seqused_k=i32(lens_k, device),
                                   causal=True, block_table=table, return_softmax_lse=True, out=out,
                                   scheduler_metadata=vfa.get_scheduler_metadata(5, 7, 48, h, 2, 64, i32(lens_k, device)),
                                   num_splits=3, fa_version=3)
    assert r[0] is out and r[1].shape == (h, q.shape[0]) and r[1].dtype == torch.float32
    check_sequences(out, r[1], q, rows_k, rows_v, lens_q, lens_k, causal=True)
    want = fa3.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=i32(lens_k, device), page_table=table,
                                       cu_seqlens_q=cu_q, max_seqlen_q=max(lens_q), causal=True, return_softmax_lse=True)
    assert torch.equal(out, want[0]) and torch.equal(r[1], want[1])
    assert torch.equal(vfa.flash_attn_varlen_func(q, k_pages, v_pages, max(lens_q), cu_q, max(lens_k),
                                                  seqused_k=i32(lens_k, device), causal=True, block_table=table), out)


@pytest.mark.parametrize("device,dtype", CONFIGS)
def test_paged_options_alibi_window_softcap(device, dtype):
    """ALiBi (which vLLM's FA2 path passes), a sliding window as vLLM passes it ((w - 1, 0)) and
    softcap on the paged form, against float64; a batched k without block_table (one page per
    sequence) gives the same bits as its pages."""
    lens_q, lens_k = [5, 1, 3], [40, 12, 3]
    h = 4
    rows_k, rows_v, k_pages, v_pages, table = paged_batch(device, dtype, lens_k, 16, seed=20)
    q = rand(sum(lens_q), h, 64, device=device, dtype=dtype, grad=False)
    require_supported(q[None], k_pages[:1], causal=True, window=(7, 0), softcap=30.0)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], device=device)
    kw = dict(causal=True, window=(7, 0), softcap=30.0, alibi_slopes=slopes)
    cu_q = i32([0, 5, 6, 9], device)
    out, lse = vfa.flash_attn_varlen_func(q, k_pages, v_pages, 5, cu_q, 40, seqused_k=i32(lens_k, device), causal=True,
                                          window_size=[7, 0], softcap=30.0, alibi_slopes=slopes, block_table=table,
                                          return_softmax_lse=True)
    check_sequences(out, lse, q, rows_k, rows_v, lens_q, lens_k, **kw)
    batched_k, batched_v = torch.stack(rows_k), torch.stack(rows_v)  # (b, 48, h_k, d)
    out2, lse2 = vfa.flash_attn_varlen_func(q, batched_k, batched_v, 5, cu_q, 40, seqused_k=i32(lens_k, device),
                                            causal=True, window_size=[7, 0], softcap=30.0, alibi_slopes=slopes,
                                            return_softmax_lse=True)
    assert torch.equal(out2, out) and torch.equal(lse2, lse)


@pytest.mark.parametrize("device,dtype", CONFIGS)
def test_prefill_with_cu_seqlens_k_is_the_flash_attn_2_call(device, dtype):
    """cu_seqlens_k (vLLM's prefill without a cache, e.g. an encoder): flash-attn 2's varlen call bit
    for bit, out and lse; window_size None is no window."""
    q = rand(11, 4, 64, device=device, dtype=dtype, grad=False)
    k, v = (rand(14, 2, 64, device=device, dtype=dtype, seed=s, grad=False) for s in (1, 2))
    require_supported(q[None], k[None], causal=True)
    cu_q, cu_k = i32([0, 4, 11], device), i32([0, 6, 14], device)
    out, lse = vfa.flash_attn_varlen_func(q, k, v, 7, cu_q, 8, cu_seqlens_k=cu_k, causal=True, return_softmax_lse=True)
    want = fa2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 8, causal=True, return_attn_probs=True)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    assert torch.equal(vfa.flash_attn_varlen_func(q, k, v, 7, cu_q, 8, cu_seqlens_k=cu_k, causal=True), out)


@pytest.mark.parametrize("device,dtype", CONFIGS)
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "cu_seqlens_k"])
def test_attention_sinks(device, dtype, paged):
    """s_aux (gpt-oss's sinks, one score per query head with a zero value) against float64 with the
    sink as one more softmax column, a sliding window as gpt-oss's alternate layers; a sequence
    whose keys are all hidden gives out 0 and lse = its sink."""
    lens_q, lens_k = [6, 1, 2], [20, 9, 0]
    h = 4
    rows_k, rows_v, k_pages, v_pages, table = paged_batch(device, dtype, lens_k, 16, seed=30)
    q = rand(sum(lens_q), h, 64, device=device, dtype=dtype, grad=False)
    require_supported(q[None], k_pages[:1], causal=True, window=(5, 0))
    sinks = torch.tensor([2.5, -1.0, 0.0, 6.0], device=device)
    cu_q = i32([0, 6, 7, 9], device)
    if paged:
        keys = dict(seqused_k=i32(lens_k, device), block_table=table)
        k, v = k_pages, v_pages
    else:
        keys = dict(cu_seqlens_k=i32([0, 20, 29, 29], device))
        k, v = (torch.cat([r[:n] for r, n in zip(rows, lens_k)]) for rows in (rows_k, rows_v))
    out, lse = vfa.flash_attn_varlen_func(q, k, v, 6, cu_q, 20, causal=True, window_size=(5, 0), s_aux=sinks,
                                          return_softmax_lse=True, **keys)
    check_sequences(out, lse, q, rows_k, rows_v, lens_q, lens_k, causal=True, window=(5, 0), sinks=sinks)
    assert torch.equal(out[7:], torch.zeros_like(out[7:]))
    assert torch.equal(lse[:, 7:], sinks[:, None].expand(h, 2).float())
    plain = vfa.flash_attn_varlen_func(q, k, v, 6, cu_q, 20, causal=True, window_size=(5, 0), **keys)
    assert not torch.allclose(out[:7].float(), plain[:7].float())  # the sinks take weight


@pytest.mark.parametrize("device,dtype", CONFIGS)
def test_sinks_gradients(device, dtype):
    """The cu_seqlens_k form with s_aux is differentiable: q, k, v's and the sinks' gradients by the
    rule against float64's autograd through the sink column."""
    q = rand(5, 4, 64, device=device, dtype=dtype)
    k, v = (rand(9, 2, 64, device=device, dtype=dtype, seed=s) for s in (1, 2))
    require_supported(q[None], k[None], causal=True)
    sinks = torch.tensor([1.5, -0.5, 0.0, 3.0], device=device, requires_grad=True)
    out = vfa.flash_attn_varlen_func(q, k, v, 5, i32([0, 5], device), 9, cu_seqlens_k=i32([0, 9], device), causal=True,
                                     s_aux=sinks)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(device=device, dtype=dtype)
    grads = torch.autograd.grad(out, (q, k, v, sinks), dout)
    ref, low = (torch.autograd.grad(ref_attention(q[None], k[None], v[None], causal=True, upcast=u, sinks=sinks)[0],
                                    (q, k, v, sinks), dout.double() if u else dout) for u in (True, False))
    floor = 1e-5 if dtype == torch.float32 else 0.0
    for g, r, lo in zip(grads, ref, low):
        assert (g.double() - r.double()).abs().max() <= 2 * (lo.double() - r.double()).abs().max() + floor


def test_refusals_and_vllms_assertions():
    q = rand(4, 2, 64, grad=False)
    k = rand(1, 16, 2, 64, seed=1, grad=False)
    cu, used, table = i32([0, 4], "cpu"), i32([6], "cpu"), i32([[0]], "cpu")
    one = torch.ones(1)
    call = lambda **kw: vfa.flash_attn_varlen_func(q, k, k, 4, cu, 6, **kw)  # noqa: E731
    for name in ("q_v", "q_descale", "k_descale", "v_descale"):
        with pytest.raises(NotImplementedError, match=f"vllm_flash_attn: {name}: not supported"):
            call(seqused_k=used, block_table=table, **{name: one})
    with pytest.raises(NotImplementedError, match="cp_world_size: not supported"):
        call(seqused_k=used, block_table=table, cp_world_size=2)
    if hasattr(torch, "float8_e4m3fn"):
        with pytest.raises(NotImplementedError, match="q: not supported .float8"):
            vfa.flash_attn_varlen_func(q.to(torch.float8_e4m3fn), k, k, 4, cu, 6, seqused_k=used, block_table=table)
    with pytest.raises(AssertionError, match="cu_seqlens_k or seqused_k must be provided"):
        call()
    with pytest.raises(AssertionError, match="cannot be provided at the same time"):
        call(cu_seqlens_k=cu, seqused_k=used)
    with pytest.raises(AssertionError, match="seqused_k must be provided if block_table"):
        call(cu_seqlens_k=cu, block_table=table)
    with pytest.raises(ValueError, match="Unsupported FA version: 4"):
        call(seqused_k=used, block_table=table, fa_version=4)
    with pytest.raises(ValueError, match=r"s_aux: must be a float tensor of shape \(heads,\) = \(2,\)"):
        call(seqused_k=used, block_table=table, s_aux=torch.zeros(3))
    with pytest.raises(RuntimeError, match="out must have the shape and dtype of q"):
        call(seqused_k=used, block_table=table, out=torch.empty(4, 2, 32))
    with pytest.raises(RuntimeError, match="k must have shape .batch_size, seqlen_k"):
        vfa.flash_attn_varlen_func(q, k[0], k[0], 4, cu, 6, seqused_k=used)


def test_fa_version_support_follows_the_cuda_backend():
    for version in (2, 3):
        assert vfa.is_fa_version_supported(version) == HAS_CUDA
        reason = vfa.fa_version_unsupported_reason(version)
        assert (reason is None) == HAS_CUDA and (HAS_CUDA or "CUDA backend" in reason)
    # vLLM asks about flash-attn 4 on Blackwell: a reason, as its own build gives, not an error.
    assert not vfa.is_fa_version_supported(4) and "fa_version 2 and 3" in vfa.fa_version_unsupported_reason(4)
    with pytest.raises(AssertionError, match="Unsupported FA version: 5"):
        vfa.is_fa_version_supported(5)


def test_compiles_without_graph_breaks():
    """torch.compile(fullgraph=True) of the paged call with sinks: the eager bits."""
    lens_q, lens_k = [3, 1], [20, 7]
    _, _, k_pages, v_pages, table = paged_batch("cpu", torch.float32, lens_k, 16, seed=40)
    k_pages, v_pages = k_pages.nan_to_num(0.0), v_pages.nan_to_num(0.0)
    q = rand(4, 4, 64, grad=False)
    cu_q, used, sinks = i32([0, 3, 4], "cpu"), i32(lens_k, "cpu"), torch.tensor([1.0, 0.0, -2.0, 3.0])
    call = lambda q: vfa.flash_attn_varlen_func(q, k_pages, v_pages, 3, cu_q, 20, seqused_k=used,  # noqa: E731
                                                 causal=True, block_table=table, s_aux=sinks, return_softmax_lse=True)
    (out, lse), (out2, lse2) = torch.compile(call, fullgraph=True, backend="aot_eager")(q), call(q)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
