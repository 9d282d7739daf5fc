"""transformers' attention on flashmonoid: ``attn_implementation="monoid"``.

    import flashmonoid.hf
    flashmonoid.hf.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="monoid")
    # or, on a loaded model: model.set_attn_implementation("monoid")

(Not "flashmonoid": transformers takes any implementation name containing "flash" for a flash-attn
kernel to import.)

The attention function takes the calls transformers makes for its SDPA path (the same boolean masks,
from its sdpa mask function, or none with is_causal) and runs them through flashmonoid.sdpa's routing
(causal and sliding-window bands, static caches, padded batches, packed sequences, gradients), with
these differences from `attn_implementation="sdpa"`:
  * the key / value heads are passed as they are (GQA without transformers' repeat_kv copies);
  * the attention logit softcap of models such as Gemma 2, which SDPA lacks, runs in the kernels;
  * so do the attention sinks of models such as gpt-oss (`s_aux`), on every route;
  * a padding-free batch described by flash-attn's kwargs (cu_seq_lens_q / _k, max_length_q / _k)
    runs as transformers' flash_attention_2 runs it, one varlen call over its sequences, where the
    mask (if any) is no more than a causal or sliding-window band over the whole row (SDPA would let
    the sequences see each other).
Under torch.compile (the decoding step generate compiles for a static cache) a mask's values cannot
be read, and decoding calls run per row (sdpa's route for at most 16 query rows, which reads nothing
on the host). A call the routing cannot take (a compiled prefill's mask, a float mask, a right-padded
sliding-window training mask, ...) runs as attn_implementation="sdpa" would, or with a softcap or
sinks in plain torch with the eager formula (a fully masked row averages its values, as
transformers' eager attention does; sinks as one more softmax column, as gpt-oss's eager
attention). flashmonoid.sdpa.stats() counts both, outside torch.compile.
"""

import torch

from . import sdpa, torch_ops

NAME = "monoid"


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      softcap=None, **kwargs):
    """transformers' attention interface: query (b, h, s_q, d), key / value (b, h_k, s_k, d) ->
    ((b, s_q, h, d), None)."""
    s_q = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(s_q > 1 and attention_mask is None and causal)  # as transformers' sdpa path decides
    softcap = float(softcap or 0.0)
    sinks = kwargs.pop("s_aux", None)  # gpt-oss's attention sinks (h,)
    packed = [kwargs.get(n) for n in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")]
    window = _flash_kwargs_window(module, query, key, attention_mask, kwargs.get("sliding_window")) \
        if all(x is not None for x in packed) else None
    if window is not None:
        out = _flash_kwargs_varlen(query, key, value, packed, window, dropout, scaling, softcap, sinks)
        return out.transpose(1, 2).contiguous(), None
    out = sdpa.routed(query, key, value, attention_mask, dropout, causal, scaling, True, softcap, sinks)
    if out is None and softcap == 0.0 and sinks is None:  # what attn_implementation="sdpa" runs
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if out is None:
        out = _eager(query, key, value, attention_mask, dropout, causal, scaling, softcap, sinks)
    return out.transpose(1, 2).contiguous(), None


def _flash_kwargs_window(module, query, key, mask, sliding_window):
    """The window of a padding-free row's sequences when flash-attn's kwargs may describe them, as
    transformers' flash_attention_2 takes them: one batch entry, and no mask (causal as the module is,
    a sliding window of sliding_window keys when given) or one transformers made without seeing the
    packing, a causal or sliding-window band over the whole row (its window). None otherwise (a mask
    with padding: the mask rules, as flash_attention_2 unpads by it)."""
    if query.shape[0] != 1:
        return None
    if mask is None:
        return (sliding_window - 1 if sliding_window else -1, 0 if getattr(module, "is_causal", True) else -1)
    if mask.dtype != torch.bool or torch.compiler.is_compiling():
        return None
    band = sdpa._band_of_cached(mask, 1, query.shape[2], key.shape[2])
    return band[0] if not isinstance(band, str) and band[1] == slice(0, key.shape[2]) else None


def _flash_kwargs_varlen(query, key, value, packed, window, dropout, scale, softcap, sinks):
    """A padding-free batch described by flash-attn's kwargs (cu_seq_lens_q / _k, max_length_q / _k, as
    DataCollatorWithFlattening(return_flash_attn_kwargs=True) gives), as transformers' flash_attention_2
    runs it: one varlen call over the row's sequences with the window of _flash_kwargs_window."""
    cu_q, cu_k, max_q, max_k = packed
    b, h, s_q, d = query.shape
    q, k, v = (sdpa._rows(x) for x in (query, key, value))
    out, _ = torch_ops.attention_varlen(q, k, v, cu_q.int(), cu_k.int(), int(max_q), int(max_k), softmax_scale=scale,
                                        window=window, softcap=softcap, dropout_p=dropout, sinks=sinks,
                                        deterministic=torch.are_deterministic_algorithms_enabled())
    return out.view(b, s_q, h, d).transpose(1, 2)


def _eager(query, key, value, mask, dropout, is_causal, scale, softcap, sinks=None):
    """The attention formula in torch: scores, softcap, mask (a boolean mask's hidden scores set to the
    dtype's minimum, as transformers' eager masks are), the sinks as one more column, float32
    softmax (the sinks' column dropped after it), dropout, values."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = (query @ key.transpose(-1, -2)) * (query.shape[-1] ** -0.5 if scale is None else scale)
    if softcap > 0.0:
        scores = torch.tanh(scores / softcap) * softcap
    if is_causal:  # top-left, as SDPA's is_causal
        mask = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool, device=query.device).tril()
    if mask is not None:
        scores = (scores.masked_fill(~mask, torch.finfo(scores.dtype).min) if mask.dtype == torch.bool
                  else scores + mask)
    if sinks is not None:
        column = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
        scores = torch.cat([scores, column], dim=-1)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)[..., :key.shape[2]].to(query.dtype)
    probs = torch.nn.functional.dropout(probs, p=dropout, training=dropout > 0.0)
    return probs @ value


def register(name=NAME):
    """Registers the attention function and transformers' sdpa mask function under `name` (transformers
    4.53 or later: AttentionInterface and AttentionMaskInterface)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)


__all__ = ["NAME", "attention_forward", "register"]
