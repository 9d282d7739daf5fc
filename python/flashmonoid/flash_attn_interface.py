"""Drop-in for flash-attn 2.x's ``flash_attn.flash_attn_interface``: same functions, argument
names, defaults, layouts and return conventions, so that code written for flash-attn runs after
changing the import to ``from flashmonoid.flash_attn_interface import flash_attn_func``.

Behaviour that differs, on purpose:
  * A query row that sees no key (e.g. causal with seqlen_q > seqlen_k) has out = 0, as in
    flash-attn, but softmax_lse = -inf where flash-attn reports +inf. -inf is log(0), the true
    log-sum-exp of an empty row and the identity of flashmonoid.merge, so partial results combine
    exactly; code that tests ``lse == inf`` for empty rows must test ``isinf(lse)`` instead.
  * More inputs run: CPU tensors, float32 (and float64 through an exact torch implementation,
    for gradcheck), head dims that flash-attn pads to a multiple of 8. What this build cannot run
    raises flashmonoid.NotSupportedError (a NotImplementedError) naming the reason.
  * Dropout draws its Philox seed from torch's default CPU generator; the mask is flashmonoid's
    (detail/philox.hpp), not flash-attn's, so the same seed drops different elements.
  * return_attn_probs: S_dmask holds flash-attn's exp(score - row max), negated where dropped,
    with the whole row's max (flash-attn's test decodes it exactly when a row is one key block;
    here for any length); shape (batch, nheads, seqlen_q, seqlen_k) (flash-attn pads both lengths
    to multiples of 128 on CUDA), or for varlen (batch, nheads, max_seqlen_q, max_seqlen_k),
    zero-padded; vectorised torch on the inputs' device (_attn_probs.py). As upstream, it is an
    empty tensor when dropout_p == 0.
  * softmax_lse carries no gradient (upstream ignores it in backward too).
  * flash_attn_with_kvcache and flash_attn_varlen_func(block_table=...) take any page size
    (flash-attn: multiples of 256), any even rotary dim (flash-attn: multiples of 16), and leftpad
    with a paged cache.

Invalid input raises RuntimeError with flash-attn's message (torch's TORCH_CHECK raises
RuntimeError there), e.g. "query and key must have the same dtype".
"""

from typing import Optional, Union

import torch

from . import _C, _attn_probs, _backend, torch_ops

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _require(cond, message):
    if not cond:
        raise RuntimeError(message)


def _check_common(q, k, v, alibi_slopes, dropout_p, batch_size, num_heads):
    _require(q.dtype in _DTYPES, "FlashAttention only support fp16 and bf16 data type")
    _require(k.dtype == q.dtype, "query and key must have the same dtype")
    _require(v.dtype == q.dtype, "query and value must have the same dtype")
    _require(dropout_p < 1.0, "Expected p_dropout < 1.f to be true, but got false.")
    _require(batch_size > 0, "batch size must be positive")
    if alibi_slopes is not None:
        _require(alibi_slopes.dtype == torch.float32, "ALiBi slopes must have dtype fp32")
        _require(alibi_slopes.stride(-1) == 1, "ALiBi slopes tensor must have contiguous last dimension")
        _require(tuple(alibi_slopes.shape) in ((num_heads,), (batch_size, num_heads)),
                 "Expected alibi_slopes.sizes() == torch::IntArrayRef({num_heads}) || alibi_slopes.sizes() == "
                 "torch::IntArrayRef({batch_size, num_heads}) to be true, but got false.")


def _check_batched(q, k, v, alibi_slopes, dropout_p):
    _require(q.dim() == 4, "q must have shape (batch_size, seqlen_q, num_heads, head_size)")
    batch_size, _, num_heads, head_size = q.shape
    _require(k.dim() == 4 and v.dim() == 4, "k must have shape (batch_size, seqlen_k, num_heads_k, head_size)")
    _check_common(q, k, v, alibi_slopes, dropout_p, batch_size, num_heads)
    seqlen_k, num_heads_k = k.shape[1], k.shape[2]
    _require(num_heads % num_heads_k == 0, "Number of heads in key/value must divide number of heads in query")
    _require(tuple(k.shape) == (batch_size, seqlen_k, num_heads_k, head_size),
             "k must have shape (batch_size, seqlen_k, num_heads_k, head_size)")
    _require(tuple(v.shape) == (batch_size, seqlen_k, num_heads_k, head_size),
             "v must have shape (batch_size, seqlen_k, num_heads_k, head_size)")


def _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_p):
    _require(cu_seqlens_q.dtype == torch.int32, "cu_seqlens_q must have dtype int32")
    _require(cu_seqlens_k.dtype == torch.int32, "cu_seqlens_k must have dtype int32")
    _require(cu_seqlens_q.is_contiguous(), "cu_seqlens_q must be contiguous")
    _require(cu_seqlens_k.is_contiguous(), "cu_seqlens_k must be contiguous")
    _require(q.dim() == 3, "q must have shape (total_q, num_heads, head_size)")
    total_q, num_heads, head_size = q.shape
    batch_size = cu_seqlens_q.numel() - 1
    _require(k.dim() == 3 and v.dim() == 3, "k must have shape (total_k, num_heads_k, head_size)")
    _check_common(q, k, v, alibi_slopes, dropout_p, batch_size, num_heads)
    total_k, num_heads_k = k.shape[0], k.shape[1]
    _require(num_heads % num_heads_k == 0, "Number of heads in key/value must divide number of heads in query")
    _require(tuple(k.shape) == (total_k, num_heads_k, head_size),
             "k must have shape (total_k, num_heads_k, head_size)")
    _require(tuple(v.shape) == (total_k, num_heads_k, head_size),
             "v must have shape (total_k, num_heads_k, head_size)")
    _require(tuple(cu_seqlens_q.shape) == (batch_size + 1,), "cu_seqlens_q must have shape (batch_size + 1)")
    _require(tuple(cu_seqlens_k.shape) == (batch_size + 1,), "cu_seqlens_k must have shape (batch_size + 1)")


def _s_dmask(q, k, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p, rng, cu_q=None, cu_k=None,
             max_q=0, max_k=0):
    if dropout_p <= 0:
        return torch.empty((0,), dtype=q.dtype, device=q.device)
    o = dict(scale=softmax_scale, causal=causal, window_left=window_size[0], window_right=window_size[1],
             softcap=softcap, alibi=alibi_slopes, dropout_p=dropout_p, seed=int(rng[0]), offset=int(rng[1]))
    with torch.no_grad():
        return _attn_probs.s_dmask(q.detach(), k.detach(), o, cu_q, cu_k, max_q, max_k)


def _scale(q, softmax_scale):
    return q.shape[-1] ** (-0.5) if softmax_scale is None else softmax_scale


def _attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
          return_attn_probs, s_dmask=True, sinks=None):
    """out, or with return_attn_probs (out, lse, S_dmask); s_dmask=False: (out, lse) (flash-attn 3's
    return_attn_probs, which has no S_dmask to materialise). sinks: torch_ops.attention's."""
    _check_batched(q, k, v, alibi_slopes, dropout_p)
    softmax_scale = _scale(q, softmax_scale)
    rng = torch_ops.new_rng(dropout_p)
    out, lse = torch_ops.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, window=window_size,
                                   softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                                   deterministic=deterministic, rng=rng, sinks=sinks)
    if not return_attn_probs:
        return out
    if not s_dmask:
        return out, lse
    return out, lse, _s_dmask(q, k, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p, rng)


def _attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                 window_size, softcap, alibi_slopes, deterministic, return_attn_probs, seqused_q=None, seqused_k=None,
                 s_dmask=True, sinks=None):
    """seqused_q / seqused_k: flash_attn3_interface's used lengths, sinks: vllm_flash_attn's s_aux
    (torch_ops.attention_varlen's); s_dmask as in _attn."""
    _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_p)
    softmax_scale = _scale(q, softmax_scale)
    rng = torch_ops.new_rng(dropout_p)
    out, lse = torch_ops.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          causal=causal, softmax_scale=softmax_scale, window=window_size,
                                          softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                                          deterministic=deterministic, rng=rng, seqused_q=seqused_q,
                                          seqused_k=seqused_k, sinks=sinks)
    if not return_attn_probs:
        return out
    if not s_dmask:
        return out, lse
    return out, lse, _s_dmask(q, k, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p, rng,
                              cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)


def _attn_varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                       causal, window_size, softcap, alibi_slopes, return_attn_probs, block_table, seqused_k=None):
    """seqused_k (flash-attn 3's and vLLM's paged form): the key counts, cu_seqlens_k may be None.
    block_table None (with seqused_k): k, v are a batched cache (batch_size_cache, seqlen_k, ...),
    sequence b's keys the first seqused_k[b] rows of k[b], run as one page per sequence."""
    _require(q.dim() == 3, "q must have shape (total_q, num_heads, head_size)")
    _require(cu_seqlens_q.dtype == torch.int32, "cu_seqlens_q must have dtype int32")
    _require(cu_seqlens_k is None or cu_seqlens_k.dtype == torch.int32, "cu_seqlens_k must have dtype int32")
    batch_size = cu_seqlens_q.numel() - 1
    _check_common(q, k, v, alibi_slopes, dropout_p, batch_size, q.shape[1])
    if block_table is None:
        _require(seqused_k is not None, "block_table: needed unless seqused_k gives the key counts of a batched k")
        _require(k.dim() == 4 and tuple(v.shape) == tuple(k.shape),
                 "k must have shape (batch_size, seqlen_k, num_heads_k, head_size) without a block_table")
        _require(k.shape[0] >= batch_size, "k: fewer cache rows than sequences in cu_seqlens_q")
        block_table = torch.arange(batch_size, dtype=torch.int32, device=q.device)[:, None]
    _require(block_table.dtype == torch.int32, "block_table must have dtype torch.int32")
    _require(block_table.stride(-1) == 1, "block_table must have contiguous last dimension")
    _require(k.dim() == 4 and tuple(v.shape) == tuple(k.shape),
             "k must have shape (num_blocks, page_block_size, num_heads_k, head_size_og)")
    _require(dropout_p == 0.0, "flashmonoid: paged KV (block_table) is inference-only: dropout_p must be 0")
    out, lse = torch_ops.attention_varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                block_table, causal=causal, softmax_scale=_scale(q, softmax_scale),
                                                window=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                                seqused_k=seqused_k)
    if not return_attn_probs:
        return out
    return out, lse, torch.empty((0,), dtype=q.dtype, device=q.device)


def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """qkv (batch_size, seqlen, 3, nheads, headdim) -> out (batch_size, seqlen, nheads, headdim);
    with return_attn_probs, (out, softmax_lse (batch_size, nheads, seqlen), S_dmask)."""
    _require(qkv.dim() == 5 and qkv.shape[2] == 3, "qkv must have shape (batch_size, seqlen, 3, nheads, headdim)")
    q, k, v = qkv.unbind(dim=2)
    return _attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                 return_attn_probs)


def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """q (batch_size, seqlen_q, nheads, headdim), kv (batch_size, seqlen_k, 2, nheads_k, headdim)."""
    _require(kv.dim() == 5 and kv.shape[2] == 2, "kv must have shape (batch_size, seqlen_k, 2, nheads_k, headdim)")
    k, v = kv.unbind(dim=2)
    return _attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                 return_attn_probs)


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """q (batch_size, seqlen_q, nheads, headdim), k and v (batch_size, seqlen_k, nheads_k, headdim),
    nheads % nheads_k == 0. Masks are aligned to the bottom-right corner; query i sees keys
    [i + seqlen_k - seqlen_q - window_size[0], i + seqlen_k - seqlen_q + window_size[1]]."""
    return _attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                 return_attn_probs)


def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """qkv (total, 3, nheads, headdim), cu_seqlens int32 (batch_size + 1,); lse (nheads, total)."""
    _require(qkv.dim() == 4 and qkv.shape[1] == 3, "qkv must have shape (total, 3, nheads, headdim)")
    q, k, v = qkv.unbind(dim=1)
    return _attn_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale, causal,
                        window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """q (total_q, nheads, headdim), kv (total_k, 2, nheads_k, headdim)."""
    _require(kv.dim() == 4 and kv.shape[1] == 2, "kv must have shape (total_k, 2, nheads_k, headdim)")
    k, v = kv.unbind(dim=1)
    return _attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                        causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """q (total_q, nheads, headdim), k and v (total_k, nheads_k, headdim), cu_seqlens_q/k int32
    (batch_size + 1,). softmax_lse is (nheads, total_q). With block_table (batch_size,
    max_num_blocks_per_seq) int32, k and v are pages (num_blocks, page_block_size, nheads_k,
    headdim), any page_block_size >= 1, and sequence b's keys are its first
    cu_seqlens_k[b+1] - cu_seqlens_k[b] rows through its pages (forward only, no dropout)."""
    if block_table is not None:
        return _attn_varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs,
                                  block_table)
    return _attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                        causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def _check_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                   block_table, alibi_slopes):
    """flash-attn 2.8's mha_fwd_kvcache checks and messages, less its limits (page sizes that are
    multiples of 256, rotary dims that are multiples of 16, paged caches without leftpad). Every
    decoding step runs them, so each tensor's shape, dtype and strides are read once (0.1-0.2 us a
    read) and compared as tuples."""
    q_shape, dtype = q.shape, q.dtype
    _require(len(q_shape) == 4, "q must have shape (batch_size, seqlen_q, num_heads, head_size)")
    batch_size, seqlen_q, num_heads, head_size = q_shape
    _require(dtype in _DTYPES[:3], "FlashAttention only support fp16 and bf16 data type")
    _require(k_cache.dtype == dtype, "query and key must have the same dtype")
    _require(v_cache.dtype == dtype, "query and value must have the same dtype")
    _require(q.stride()[-1] == 1, "Input tensor must have contiguous last dimension")
    _require(batch_size > 0, "batch size must be positive")
    _require(head_size <= 256, "FlashAttention forward only supports head dimension at most 256")
    kc_shape, vc_shape = k_cache.shape, v_cache.shape
    _require(len(kc_shape) == 4, "kcache must have 4 dimensions")
    num_heads_k = kc_shape[2]
    _require(num_heads % num_heads_k == 0, "Number of heads in key/value must divide number of heads in query")
    if block_table is not None:
        _require(block_table.dtype == torch.int32, "block_table must have dtype torch.int32")
        _require(block_table.stride()[-1] == 1, "block_table must have contiguous last dimension")
        _require(cache_batch_idx is None, "Paged KVcache does not support cache_batch_idx")
        _require(kc_shape[3] == head_size,
                 "kcache must have shape (num_blocks, page_block_size, num_heads_k, head_size_og)")
        _require(vc_shape == kc_shape, "vcache must have shape (num_blocks, page_block_size, num_heads_k, head_size_og)")
        bt_shape = block_table.shape
        _require(len(bt_shape) == 2 and bt_shape[0] == batch_size,
                 "block_table must have shape (batch_size, max_num_blocks_per_seq)")
        seqlen_k = bt_shape[1] * kc_shape[1]
    else:
        seqlen_k = kc_shape[1]
        _require(kc_shape[3] == head_size, "kcache must have shape (batch_size_c, seqlen_k, num_heads_k, head_size_og)")
        _require(vc_shape == kc_shape, "vcache must have shape (batch_size_c, seqlen_k, num_heads_k, head_size_og)")
    if k is not None:
        _require(v is not None, "If key is supplied, value must also be passed in")
        _require(cache_seqlens is not None, "If key is supplied, seqlens_k must also be passed in")
        _require(k.dtype == dtype, "Key must have the same dtype as query")
        _require(v.dtype == dtype, "Value must have the same dtype as query")
        _require(k.stride()[-1] == 1, "Key tensor must have contiguous last dimension")
        _require(v.stride()[-1] == 1, "Value tensor must have contiguous last dimension")
        k_shape = k.shape
        _require(len(k_shape) == 4 and k_shape[0] == batch_size and k_shape[2:] == (num_heads_k, head_size),
                 "k must have shape (batch_size, seqlen_knew, num_heads_k, head_size_og)")
        _require(v.shape == k_shape, "v must have shape (batch_size, seqlen_knew, num_heads_k, head_size_og)")
        _require(k_shape[1] <= seqlen_k, "If key is supplied, it must have seqlen <= the seqlen of the KV cache")
    if isinstance(cache_seqlens, torch.Tensor):
        _require(cache_seqlens.dtype == torch.int32, "seqlens_k must have dtype int32")
        _require(cache_seqlens.shape == (batch_size,), "seqlens_k must have shape (batch_size)")
    if cache_leftpad is not None:
        _require(cache_leftpad.dtype == torch.int32, "leftpad_k must have dtype int32")
        _require(cache_leftpad.shape == (batch_size,), "leftpad_k must have shape (batch_size)")
    if cache_batch_idx is not None:
        _require(cache_batch_idx.dtype == torch.int32, "cache_batch_idx must have dtype int32")
    if rotary_cos is not None or rotary_sin is not None:
        _require(k is not None, "If rotary cos/sin are provided, new key / query must also be provided")
        _require(rotary_cos is not None and rotary_sin is not None, "rotary_cos and rotary_sin must be given together")
        cos_shape = rotary_cos.shape
        seqlen_ro, rotary_dim = cos_shape[0], cos_shape[1] * 2
        _require(rotary_dim <= head_size, "rotary_dim must be <= headdim")
        _require(seqlen_ro >= seqlen_k, "cos/sin seqlen must be at least the seqlen of KV cache")
        _require(len(cos_shape) == 2, "rotary_cos must have shape (seqlen_ro, rotary_dim / 2)")
        _require(rotary_sin.shape == cos_shape, "rotary_sin must have shape (seqlen_ro, rotary_dim / 2)")
        _require(rotary_cos.dtype == dtype, "rotary_cos must have the same dtype as query")
        _require(rotary_sin.dtype == dtype, "rotary_sin must have the same dtype as query")
    if alibi_slopes is not None:
        _check_common(q, k_cache, v_cache, alibi_slopes, 0.0, batch_size, num_heads)


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens: Optional[Union[(int, torch.Tensor)]] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    """Attention of q (batch_size, seqlen, nheads, headdim) over the KV cache, after writing k, v
    (batch_size, seqlen_new, nheads_k, headdim), if given, into the cache in place at
    cache_seqlens (k rotated when rotary_cos/sin are given). One call of
    flashmonoid::forward_kvcache (torch op flashmonoid::fwd_kvcache): cache_seqlens, cache_leftpad,
    cache_batch_idx and block_table stay on the device (no host synchronisation), so the call can
    be captured in a CUDA graph.

    k_cache, v_cache: (batch_size_cache, seqlen_cache, nheads_k, headdim), or with block_table
    (batch_size, max_num_blocks_per_seq) int32 the pages (num_blocks, page_block_size, nheads_k,
    headdim), any page_block_size >= 1. rotary_cos/sin (seqlen_ro, rotary_dim / 2): query i sits at
    cache_seqlens + i when causal or windowed, else at cache_seqlens. num_splits: 0 = heuristic.
    Returns out, and softmax_lse (batch_size, nheads, seqlen) with return_softmax_lse. No backward,
    as upstream. Under torch.use_deterministic_algorithms(True) the result repeats bit for bit run to
    run (otherwise split-KV decoding over a long contiguous cache may differ in the last bits)."""
    # The eager route: one call into _C checks what lets it skip torch's dispatcher (plain tensors,
    # none needing grad, contiguous; see _C.kvcache_eager_torch) and returns None where that fails.
    # Every rule of _check_kvcache it does not check itself (strides: the tensors are contiguous, the
    # caches' last dimension; seqlens with k; k with rotary; no ALiBi, whose padding rules differ) is
    # checked here first.
    if (alibi_slopes is None and (k is None or cache_seqlens is not None)
            and (k is not None or (rotary_cos is None and rotary_sin is None))
            and not torch.compiler.is_compiling()):
        # The library checks every other rule of _check_kvcache before it touches memory; when it
        # (or anything on the way) refuses the call, flash-attn's message for the input, if it has
        # one, is raised as before.
        try:
            if _backend.kvcache_eager():
                r = _C.kvcache_eager_torch(
                    q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                    block_table, softmax_scale, bool(causal), int(window_size[0]), int(window_size[1]), float(softcap),
                    bool(rotary_interleaved), int(num_splits), torch.is_grad_enabled(),
                    torch.are_deterministic_algorithms_enabled(), bool(return_softmax_lse), _backend._cpu_algorithm,
                    _backend._cpu_isa)
            elif _kvcache_fast(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                               cache_leftpad, block_table):
                # torch before 2.10 (no DLPack exchange table): the same checks and call in Python layers.
                seqlens, seqlen = (None, cache_seqlens) if isinstance(cache_seqlens, int) else (cache_seqlens, -1)
                r = torch_ops._fwd_kvcache_impl(
                    q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, seqlens, seqlen, cache_batch_idx, cache_leftpad,
                    block_table, None, _scale(q, softmax_scale), bool(causal), int(window_size[0]),
                    int(window_size[1]), float(softcap), bool(rotary_interleaved), int(num_splits))
            else:
                r = None
        except Exception:
            try:
                _check_kvcache_all(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                                   cache_leftpad, block_table, alibi_slopes)
            except (AssertionError, RuntimeError) as flash_attn_error:
                raise flash_attn_error from None
            raise
        if r is not None:
            return r if return_softmax_lse else r[0]
    _check_kvcache_all(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                       cache_leftpad, block_table, alibi_slopes)
    out, lse = torch_ops.attention_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos=rotary_cos, rotary_sin=rotary_sin, cache_seqlens=cache_seqlens,
        cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, block_table=block_table, causal=causal,
        softmax_scale=_scale(q, softmax_scale), window=window_size, softcap=softcap,
        rotary_interleaved=rotary_interleaved, alibi_slopes=alibi_slopes, num_splits=num_splits)
    return (out, lse) if return_softmax_lse else out


def _check_kvcache_all(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                       cache_leftpad, block_table, alibi_slopes):
    assert k_cache.stride()[-1] == 1, "k_cache must have contiguous last dimension"
    assert v_cache.stride()[-1] == 1, "v_cache must have contiguous last dimension"
    _check_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                   block_table, alibi_slopes)


def _kvcache_fast(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                  block_table):
    """Whether a call may take the eager route without _C.kvcache_eager_torch (torch before 2.10): the
    checks that function makes, in Python (q 4-D with a batch and a head dim <= 256 and a multiple of
    8, so nothing is padded; contiguous tensors, the caches with a contiguous last dimension; nothing
    differentiated). ~3 us."""
    shape = q.shape
    if len(shape) != 4 or shape[0] <= 0 or shape[3] > 256 or shape[3] % 8 != 0:
        return False
    seqlens = None if isinstance(cache_seqlens, int) else cache_seqlens
    if k_cache.stride()[-1] != 1 or v_cache.stride()[-1] != 1:
        return False
    return torch_ops._eager_contiguous((q, k, v, block_table),
                                       (k_cache, v_cache, rotary_cos, rotary_sin, seqlens, cache_batch_idx,
                                        cache_leftpad))


__all__ = [
    "flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache",
]
