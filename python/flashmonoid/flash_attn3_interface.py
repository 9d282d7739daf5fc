"""Drop-in for flash-attn 3's ``flash_attn_interface`` (its Hopper package): the same functions,
argument names, defaults, layouts and return conventions, so that code written for it runs after
changing the import to ``from flashmonoid import flash_attn3_interface as flash_attn_interface``.
It runs wherever flashmonoid does (CUDA sm80+, with the Hopper kernels on H100/H200, and the CPU).

It shares flashmonoid.flash_attn_interface's (flash-attn 2's) checks, messages and behaviour (lse =
-inf for a row without a key, more dtypes and head dims, see that module), and differs from
flash-attn 3 in these ways:
  * Not supported; each raises flashmonoid.NotSupportedError (a NotImplementedError) naming the
    argument: FP8 (q_descale, k_descale, v_descale and float8 tensors), qv, attention_chunk > 0, and
    in flash_attn_with_kvcache rotary_seqlens, cu_seqlens_k_new with new keys, and new keys, rotary,
    cache_batch_idx or cache_leftpad together with packed queries (cu_seqlens_q).
  * num_splits, pack_gqa and sm_margin of the training functions are flash-attn 3's tuning knobs;
    flashmonoid plans its own grid, so they are accepted and change nothing.
    flash_attn_with_kvcache passes num_splits on (0: the heuristic, else forced).
  * scheduler_metadata is accepted and unused: flashmonoid plans splits inside the call (which is
    graph-capturable as is), and get_scheduler_metadata returns None.
  * flash_attn_with_kvcache(..., return_softmax_lse=True) returns (out, softmax_lse, out_accum,
    softmax_lse_accum) as flash-attn 3 does; the last two are empty tensors (flashmonoid keeps its
    split partials in its workspace).
  * flash_attn_combine merges any number of splits with flashmonoid.merge (the monoid's merge; a
    split with lse = -inf contributes nothing), on any device flashmonoid runs on.
  * flash_attn_func, flash_attn_varlen_func and flash_attn_with_kvcache take a last argument sinks
    (nheads,), attention sinks, as SGLang's build (sgl-kernel) does for gpt-oss: the result merged with
    a key of score sinks[h] and value 0 (differentiable in the first two).
"""

import torch

from . import _C, torch_ops
from . import flash_attn_interface as _fa2

# What each refused argument is in flash-attn 3.
_FEATURES = {
    "qv": "the extra query part of MLA decoding", "q_descale": "FP8 scaling", "k_descale": "FP8 scaling",
    "v_descale": "FP8 scaling", "attention_chunk": "chunked local attention",
    "cu_seqlens_k_new": "varlen new keys",
    "rotary_seqlens": "rotary positions apart from cache_seqlens",
}


def _refuse(name, value, unset=None):
    if value is not unset:
        raise _C.NotSupportedError(f"flashmonoid.flash_attn3_interface: {name}: not supported (flash-attn 3's "
                                   f"{_FEATURES[name]}); leave it {unset!r}")


def _refuse_fp8_qv_chunk(q, qv, q_descale, k_descale, v_descale, attention_chunk):
    if q.dtype in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)):
        raise _C.NotSupportedError("flashmonoid.flash_attn3_interface: q: float8 inputs (flash-attn 3's FP8) are "
                                   "not supported; use fp16 or bf16")
    for name, value in (("qv", qv), ("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        _refuse(name, value)
    if attention_chunk:
        _refuse("attention_chunk", attention_chunk, 0)


def _attn(q, k, v, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs, sinks=None):
    """The flash-attn 2 module's call without dropout or ALiBi; with return_attn_probs (out, lse), as
    flash-attn 3 (no S_dmask)."""
    return _fa2._attn(q, k, v, 0.0, softmax_scale, causal, window_size, softcap, None, deterministic,
                      return_attn_probs, s_dmask=False, sinks=sinks)


def flash_attn_qkvpacked_func(
    qkv,
    softmax_scale=None,
    causal=False,
    q_descale=None, k_descale=None, v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    deterministic=False,
    num_heads_q=None,
    sm_margin=0,
    return_attn_probs=False,
):
    """qkv (batch_size, seqlen, 3, nheads, headdim), or (batch_size, seqlen, num_heads_q + 2 *
    nheads_k, headdim) with num_heads_q (GQA: q's heads, then k's, then v's). Returns out, and with
    return_attn_probs (out, softmax_lse (batch_size, nheads, seqlen))."""
    _refuse_fp8_qv_chunk(qkv, None, q_descale, k_descale, v_descale, attention_chunk)
    if qkv.dim() == 5:
        _fa2._require(qkv.shape[-3] == 3, "qkv must have shape (batch_size, seqlen, 3, nheads, headdim)")
        q, k, v = qkv.unbind(dim=-3)
    else:
        _fa2._require(qkv.dim() == 4 and num_heads_q is not None,
                      "qkv must have shape (batch_size, seqlen, 3, nheads, headdim), or (batch_size, seqlen, "
                      "num_heads_q + 2 * nheads_k, headdim) with num_heads_q given")
        num_heads_k = (qkv.shape[2] - num_heads_q) // 2
        _fa2._require(num_heads_q > 0 and num_heads_k > 0 and num_heads_q + 2 * num_heads_k == qkv.shape[2],
                      f"qkv: {qkv.shape[2]} heads are not num_heads_q ({num_heads_q}) + 2 * nheads_k")
        q, k, v = qkv.split([num_heads_q, num_heads_k, num_heads_k], dim=-2)
    return _attn(q, k, v, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs)


def flash_attn_func(
    q,
    k,
    v,
    softmax_scale=None,
    causal=False,
    qv=None,
    q_descale=None, k_descale=None, v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    sm_margin=0,
    return_attn_probs=False,
    sinks=None,
):
    """q (batch_size, seqlen_q, nheads, headdim), k and v (batch_size, seqlen_k, nheads_k, headdim),
    nheads % nheads_k == 0; masks aligned to the bottom-right corner. Returns out, and with
    return_attn_probs (out, softmax_lse (batch_size, nheads, seqlen_q)). sinks (nheads,): attention
    sinks (SGLang's build's argument; differentiable)."""
    _refuse_fp8_qv_chunk(q, qv, q_descale, k_descale, v_descale, attention_chunk)
    return _attn(q, k, v, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs, sinks)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    seqused_q=None,
    seqused_k=None,
    softmax_scale=None,
    causal=False,
    qv=None,
    q_descale=None, k_descale=None, v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    sm_margin=0,
    return_attn_probs=False,
    sinks=None,
):
    """q (total_q, nheads, headdim), k and v (total_k, nheads_k, headdim), cu_seqlens_q/k int32
    (batch_size + 1,). seqused_q / seqused_k int32 (batch_size,): sequence b is the first seqused
    rows of its cu_seqlens slot (a padded batch runs in place); the other rows get out 0, lse -inf
    and gradient 0. Returns out, and with return_attn_probs (out, softmax_lse (nheads, total_q)).
    sinks: as flash_attn_func's."""
    _refuse_fp8_qv_chunk(q, qv, q_descale, k_descale, v_descale, attention_chunk)
    _fa2._require(cu_seqlens_q is not None and cu_seqlens_k is not None,
                  "flashmonoid.flash_attn3_interface: flash_attn_varlen_func needs cu_seqlens_q and cu_seqlens_k "
                  "(a batched q or k runs through flash_attn_func)")
    return _fa2._attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0, softmax_scale,
                             causal, window_size, softcap, None, deterministic, return_attn_probs, seqused_q, seqused_k,
                             s_dmask=False, sinks=sinks)


def flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None):
    """(out, softmax_lse) of attention over the union of num_splits disjoint key sets, from each
    split's result: out_partial (num_splits, batch_size, seqlen, nheads, headdim) and lse_partial
    (num_splits, batch_size, seqlen, nheads), both float32. out (batch_size, seqlen, nheads,
    headdim) of out_dtype (default float32; or written into `out`), softmax_lse float32 (batch_size,
    seqlen, nheads), a view of a (batch_size, nheads, seqlen) tensor as in flash-attn 3."""
    _fa2._require(out_partial.dtype == torch.float32 and lse_partial.dtype == torch.float32,
                  "Attention combine function only support fp32 data type")
    _fa2._require(out_partial.dim() == 5, "out_partial must have shape (num_splits, batch_size, seqlen, num_heads, "
                                          "head_size)")
    num_splits, batch_size, seqlen, num_heads, _ = out_partial.shape
    _fa2._require(tuple(lse_partial.shape) == (num_splits, batch_size, seqlen, num_heads),
                  "lse_partial must have shape (num_splits, batch_size, seqlen, num_heads)")
    _fa2._require(num_splits > 0, "out_partial: needs at least one split")
    out_dtype = out_dtype if out_dtype is not None else (out.dtype if out is not None else torch.float32)
    _fa2._require(out_dtype in (torch.float32, torch.bfloat16, torch.float16), "Output type must be FP32, FP16 or BF16")
    if out is not None:
        _fa2._require(out.dtype == out_dtype and out.shape == out_partial.shape[1:],
                      "out must have shape (batch_size, seqlen, num_heads, head_size) and dtype out_dtype")
    merged, lse = torch_ops.merge(list(out_partial.unbind(0)), [x.transpose(1, 2) for x in lse_partial.unbind(0)])
    if out is None:
        out = merged.to(out_dtype)
    else:
        out.copy_(merged)
    return out, lse.transpose(1, 2)


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    qv=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    page_table=None,
    cu_seqlens_q=None,
    cu_seqlens_k_new=None,
    max_seqlen_q=None,
    rotary_seqlens=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    rotary_interleaved=True,
    scheduler_metadata=None,
    num_splits=0,
    pack_gqa=None,
    sm_margin=0,
    return_softmax_lse=False,
    sinks=None,
):
    """flashmonoid.flash_attn_interface.flash_attn_with_kvcache with flash-attn 3's names: the pages'
    block table is page_table (any page size). k, v are written into the caches in place at
    cache_seqlens, then q attends over the cache. Returns out, or with return_softmax_lse (out,
    softmax_lse, empty, empty).

    With cu_seqlens_q (b + 1) int32 and max_seqlen_q, q is packed (total_q, nheads, headdim) and
    sequence b's queries, the last of its cache_seqlens[b] keys among them (a prefill or extend step
    whose keys are already in the cache, as SGLang's flash-attn 3 backend calls it), attend over
    those keys, causal aligned to their end; softmax_lse is then (nheads, total_q). This runs as one
    paged varlen call with cache_seqlens as its seqused_k (flashmonoid::forward_varlen with a block
    table; a contiguous cache is one page per sequence), with no host read of a device tensor, so it
    can be captured in a CUDA graph. No new k, v or rotary in this form;
    cu_seqlens_k_new describes new keys and is unused without them.

    sinks (nheads,): attention sinks (SGLang's build's argument, which its gpt-oss path passes), merged
    into the result (torch_ops.merge_sink); forward only, as the call is."""
    _refuse_fp8_qv_chunk(q, qv, q_descale, k_descale, v_descale, attention_chunk)
    _refuse("rotary_seqlens", rotary_seqlens)
    if k is not None:
        _refuse("cu_seqlens_k_new", cu_seqlens_k_new)
    empty = torch.empty((0,), dtype=torch.float32, device=q.device)
    if cu_seqlens_q is not None:
        out, lse = _kvcache_varlen_q(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                                     cache_leftpad, page_table, cu_seqlens_q, max_seqlen_q, softmax_scale, causal,
                                     window_size, softcap)
    else:  # the lse only when asked for (else the call keeps it in its workspace)
        need_lse = return_softmax_lse or sinks is not None
        r = _fa2.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                         cache_batch_idx, cache_leftpad, page_table, softmax_scale, causal,
                                         window_size, softcap, rotary_interleaved, None, num_splits, need_lse)
        out, lse = r if need_lse else (r, None)
    if sinks is not None:  # merge_sink checks them (torch_ops.check_sinks)
        out, lse = torch_ops.merge_sink(out, lse, sinks)
    return (out, lse, empty, empty) if return_softmax_lse else out


def _kvcache_varlen_q(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                      cache_leftpad, page_table, cu_seqlens_q, max_seqlen_q, softmax_scale, causal, window_size,
                      softcap):
    """flash_attn_with_kvcache's packed-q form as a paged varlen call: (out, lse (nheads, total_q))."""
    _fa2._require(max_seqlen_q is not None, "max_seqlen_q must be provided if cu_seqlens_q is provided")
    for name, value in (("k", k), ("v", v), ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin),
                        ("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if value is not None:
            raise _C.NotSupportedError(f"flashmonoid.flash_attn3_interface: {name}: not supported with cu_seqlens_q "
                                       "(packed queries attend over keys already in the cache); leave it None")
    assert k_cache.stride(-1) == 1, "k_cache must have contiguous last dimension"
    assert v_cache.stride(-1) == 1, "v_cache must have contiguous last dimension"
    _fa2._require(k_cache.dim() == 4, "k_cache must have shape (num_blocks, page_block_size, num_heads_k, head_size) "
                                     "or (batch_size_cache, seqlen_cache, num_heads_k, head_size)")
    batch_size = cu_seqlens_q.shape[0] - 1
    # A contiguous cache (no page_table): sequence b's keys are the first rows of k_cache[b].
    capacity = (1 if page_table is None else page_table.shape[-1]) * k_cache.shape[1]
    if cache_seqlens is None or isinstance(cache_seqlens, int):
        fill = capacity if cache_seqlens is None else cache_seqlens
        cache_seqlens = torch.full((batch_size,), fill, dtype=torch.int32, device=q.device)
    _fa2._require(cache_seqlens.dtype == torch.int32, "cache_seqlens must have dtype int32")
    _fa2._require(tuple(cache_seqlens.shape) == (batch_size,), "cache_seqlens must have shape (batch_size)")
    # cache_seqlens are the key counts as they are (seqused_k of a paged varlen call; no cu_seqlens_k;
    # a contiguous cache runs as one page per sequence).
    out, lse, _ = _fa2._attn_varlen_paged(q, k_cache, v_cache, cu_seqlens_q, None, max_seqlen_q, capacity, 0.0,
                                          softmax_scale, causal, window_size, softcap, None, True, page_table,
                                          seqused_k=cache_seqlens)
    return out, lse


def get_scheduler_metadata(
    batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim,
    cache_seqlens,
    qkv_dtype=torch.bfloat16,
    headdim_v=None,
    cu_seqlens_q=None,
    cu_seqlens_k_new=None,
    cache_leftpad=None,
    page_size=None,
    max_seqlen_k_new=0,
    causal=False,
    window_size=(-1, -1),
    attention_chunk=0,
    has_softcap=False,
    num_splits=0,
    pack_gqa=None,
    sm_margin=0,
):
    """None: flashmonoid plans a call's splits inside the call (graph-capturable, no host read of
    cache_seqlens), so there is no metadata to compute ahead; flash_attn_with_kvcache accepts the
    None back as scheduler_metadata."""
    return None


__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func", "flash_attn_combine",
           "flash_attn_with_kvcache", "get_scheduler_metadata"]
