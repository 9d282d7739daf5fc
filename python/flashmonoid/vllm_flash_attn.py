"""Drop-in for vLLM's ``vllm.vllm_flash_attn`` (the flash-attn build vLLM's FlashAttention backend
imports): ``flash_attn_varlen_func`` with vLLM's argument order, defaults and returns, and
``get_scheduler_metadata``, ``is_fa_version_supported`` and ``fa_version_unsupported_reason``.

vLLM's backend makes every prefill, chunked-prefill and decoding step one
``flash_attn_varlen_func(q, k_cache, v_cache, max_seqlen_q, cu_seqlens_q, max_seqlen_k,
seqused_k=..., block_table=..., out=...)`` call over its paged cache (pages of 16 rows by default);
here that is one flashmonoid paged varlen call with seqused_k as the key counts, graph-capturable,
with no host read of a device tensor. To run a vLLM process on flashmonoid, make this module the one
vLLM imports before vLLM loads its attention backend::

    import sys
    import flashmonoid.vllm_flash_attn
    sys.modules["vllm.vllm_flash_attn"] = flashmonoid.vllm_flash_attn

It shares flashmonoid.flash_attn_interface's checks and behaviour (lse = -inf and out = 0 for a row
without a key; any page size; fp32 and head dims that are not multiples of 8 too), and differs from
vLLM's build in these ways:
  * fa_version 2 and 3 both run flashmonoid (the same kernels); each takes every option either of
    them takes here: ALiBi with 3, s_aux with 2.
  * s_aux (attention sinks, one logit per query head, as gpt-oss has): each row's softmax also counts
    exp(s_aux[h]) with a zero value. It is the monoid's merge with the state (max s_aux, sum 1,
    output 0): out * sigmoid(lse - s_aux), lse -> logaddexp(lse, s_aux), applied to the call's
    result (torch_ops.merge_sink: one elementwise pass over out; the kernels are unchanged), with
    gradients (q, k, v's and its own) in the cu_seqlens_k form.
  * Not supported; each raises flashmonoid.NotSupportedError (a NotImplementedError) naming the
    argument: FP8 (q_descale, k_descale, v_descale and float8 tensors), q_v, and cp_world_size > 1
    (decode context parallelism's interleaved shards).
  * scheduler_metadata and num_splits are accepted and unused (flashmonoid plans its splits inside
    the call); get_scheduler_metadata returns None. return_attn_probs is ignored, as in vLLM's build.
  * out: the result is computed, then copied into it.
"""

import torch

from . import _C, torch_ops
from . import flash_attn_interface as _fa2

DEFAULT_FA_VERSION = 2



def _refuse(name, what):
    raise _C.NotSupportedError(f"flashmonoid.vllm_flash_attn: {name}: not supported ({what})")


def _unsupported_reason(fa_version, device=None):
    if fa_version not in (2, 3, 4):  # the versions vLLM's build knows
        raise AssertionError(f"Unsupported FA version: {fa_version}")
    if fa_version == 4:
        return "flashmonoid stands in for fa_version 2 and 3 (flash-attn 4's CuTe interface is not mirrored)"
    if not _C.cuda_available():
        return "flashmonoid's CUDA backend is not built or sees no GPU of compute capability >= 8.0"
    if torch.cuda.get_device_capability(device)[0] < 8:
        return "flashmonoid's CUDA backend needs compute capability >= 8.0"
    return None


def is_fa_version_supported(fa_version, device=None):
    """True where flashmonoid's CUDA backend runs on the device (sm80 and later), for fa_version 2 or 3
    (4: False)."""
    return _unsupported_reason(fa_version, device) is None


def fa_version_unsupported_reason(fa_version, device=None):
    """None where is_fa_version_supported, else why not."""
    return _unsupported_reason(fa_version, device)


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
    has_softcap=False,
    num_splits=0,
    pack_gqa=None,
    sm_margin=0,
):
    """None: flashmonoid plans a call's splits inside the call, so there is nothing to compute ahead;
    flash_attn_varlen_func accepts the None back as scheduler_metadata."""
    return None


def flash_attn_varlen_func(
    q,
    k,
    v,
    max_seqlen_q,
    cu_seqlens_q,
    max_seqlen_k,
    cu_seqlens_k=None,
    seqused_k=None,
    q_v=None,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=None,
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
    return_softmax_lse=False,
    out=None,
    scheduler_metadata=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    num_splits=0,
    fa_version=DEFAULT_FA_VERSION,
    s_aux=None,
    cp_world_size=1,
    cp_rank=0,
    cp_tot_seqused_k=None,
):
    """q (total_q, nheads, headdim), cu_seqlens_q int32 (batch_size + 1). The keys, one of:
      * cu_seqlens_k int32 (batch_size + 1) with packed k, v (total_k, nheads_k, headdim) (a prefill
        without a cache);
      * seqused_k int32 (batch_size) with block_table int32 (batch_size, max_blocks) over pages k, v
        (num_blocks, block_size, nheads_k, headdim): sequence b's keys are its first seqused_k[b]
        rows through its pages, and its queries the last of them (vLLM's decoding and chunked prefill);
      * seqused_k without block_table: k, v batched (batch_size, seqlen_k, nheads_k, headdim).
    Causal and windows are aligned to the bottom right (each sequence's last query at its last key).
    Returns out (total_q, nheads, headdim), or with return_softmax_lse (out, softmax_lse float32
    (nheads, total_q)); out= is filled and returned."""
    if cu_seqlens_k is None and seqused_k is None:
        raise AssertionError("cu_seqlens_k or seqused_k must be provided")
    if cu_seqlens_k is not None and seqused_k is not None:
        raise AssertionError("cu_seqlens_k and seqused_k cannot be provided at the same time")
    if block_table is not None and seqused_k is None:
        raise AssertionError("seqused_k must be provided if block_table is provided")
    if fa_version not in (2, 3):
        raise ValueError(f"Unsupported FA version: {fa_version}")
    for name, value, what in (("q_v", q_v, "the extra query part of MLA decoding"), ("q_descale", q_descale, "FP8"),
                              ("k_descale", k_descale, "FP8"), ("v_descale", v_descale, "FP8")):
        if value is not None:
            _refuse(name, what + "; leave it None")
    if q.dtype in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)):
        _refuse("q", "float8 inputs (FP8); use fp16 or bf16")
    if cp_world_size != 1:
        _refuse("cp_world_size", "decode context parallelism's interleaved KV shards; leave it 1")
    window = (-1, -1) if window_size is None else tuple(window_size)
    _fa2._require(len(window) == 2, "window_size must be (left, right)")
    if s_aux is not None:
        torch_ops.check_sinks(s_aux, q.shape[1], "s_aux")
    if seqused_k is not None:  # forward only (pages)
        result, lse = _fa2._attn_varlen_paged(q, k, v, cu_seqlens_q, None, max_seqlen_q, max_seqlen_k, dropout_p,
                                              softmax_scale, causal, window, softcap, alibi_slopes, True, block_table,
                                              seqused_k=seqused_k)[:2]
        if s_aux is not None:
            result, lse = torch_ops.merge_sink(result, lse, s_aux)
    else:  # differentiable, the sinks too
        res = _fa2._attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                softmax_scale, causal, window, softcap, alibi_slopes, deterministic,
                                return_softmax_lse, s_dmask=False, sinks=s_aux)
        result, lse = res if return_softmax_lse else (res, None)
    if out is not None:
        _fa2._require(out.shape == result.shape and out.dtype == result.dtype,
                      "out must have the shape and dtype of q (total_q, num_heads, head_size)")
        out.copy_(result)
        result = out
    return (result, lse) if return_softmax_lse else result


__all__ = ["flash_attn_varlen_func", "get_scheduler_metadata", "is_fa_version_supported",
           "fa_version_unsupported_reason"]
