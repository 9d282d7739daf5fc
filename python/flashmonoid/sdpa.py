"""Route torch.nn.functional.scaled_dot_product_attention to flashmonoid where it can run the call.

    with flashmonoid.sdpa.override():        # or flashmonoid.sdpa.enable() ... disable()
        y = model(x)
    flashmonoid.sdpa.stats()                   # {"routed": n, "fallback": m}

Routed: 4-d (batch, heads, seq, head_dim) float32/float16/bfloat16 tensors on a device this build
supports, key and value with the same head dim as the query, with is_causal, scale, dropout_p,
enable_gqa, and attn_mask either None or a boolean mask that is a band (causal or sliding window,
the same for every batch entry and head) in which every query sees at least one key; keys no query
sees at either end (a static KV cache's unfilled capacity, as transformers' StaticCache masks it)
are cut off as views. A mask that differs across batch entries routes where each entry's rows are
a bottom-right band of the same window over its own keys (left padding, as transformers pads
batches for generation), without dropout or gradients: a KV-cache call with each entry's key range, where rows
that see no key (padding) give 0, as PyTorch's math backend does since 2.5. Everything else (float
masks, masks of other shapes, nested tensors, float64, ...) falls back to PyTorch.

SDPA aligns is_causal to the top-left corner and flashmonoid to the bottom-right. A top-left
causal mask is the bottom-right window (-1, seq_q - seq_k) when seq_q >= seq_k; is_causal with
seq_q < seq_k falls back. With dropout_p > 0 the two draw different (equally distributed) masks.

Only callers that look the function up at call time (``F.scaled_dot_product_attention(...)``) are
routed; a module that did ``from torch.nn.functional import scaled_dot_product_attention`` before
enable() keeps PyTorch's. Each decision is logged at DEBUG level on the logger "flashmonoid.sdpa"
(outside torch.compile tracing).
"""

import contextlib
import logging

import torch
import torch.nn.functional as F

from . import _C, torch_ops

log = logging.getLogger(__name__)

_original = F.scaled_dot_product_attention
_counts = {"routed": 0, "fallback": 0}
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def stats():
    """Calls routed to flashmonoid and calls left to PyTorch since the last reset_stats()."""
    return dict(_counts)


def reset_stats():
    _counts["routed"] = _counts["fallback"] = 0


def _band(m, s_q, s_k):
    """(window_left, window_right, key_begin, key_end) when the (s_q, s_k) boolean mask m is a
    bottom-right band over keys [key_begin, key_end) (the keys no row sees at either end cut off: a
    static KV cache's unfilled capacity, a batch entry's padding), else a string saying why not."""
    seen = m.any(dim=0).nonzero()
    if len(seen) == 0:
        return "the mask hides every key"
    begin, end = int(seen[0]), int(seen[-1]) + 1
    m, s_k = m[:, begin:end], end - begin
    i = torch.arange(s_q, device=m.device)[:, None]
    j = torch.arange(s_k, device=m.device)[None, :]
    offset = j - (i + (s_k - s_q))  # key position relative to the bottom-right diagonal
    right, left = int(offset[m].max()), int((-offset)[m].max())
    if right < 0 or left < 0:
        return "the band does not contain the diagonal"
    if not torch.equal((offset <= right) & (offset >= -left), m):
        return "the mask is not a causal or sliding-window band"
    # A side that cuts off no key is no window (-1): plain causal stays the kernels' causal path.
    return (-1 if left >= s_k - 1 else left, -1 if right >= s_q - 1 else right, begin, end)


def _band_of(mask, b, s_q, s_k):
    """(window, keys) for a boolean mask the same for every head: keys a slice when the mask is one
    band for every batch entry, else (key_begin, key_end) int32 tensors (b) when each entry's rows are
    a bottom-right band of the same window over its own keys (left padding); a string saying why not
    otherwise. Reads the mask's values (a device sync for CUDA masks)."""
    m = mask
    while m.dim() < 4:  # SDPA broadcasts masks to (b, h, s_q, s_k)
        m = m[None]
    if m.shape[1] != 1 and not torch.equal(m, m[:, :1].expand_as(m)):
        return "the mask differs across heads"
    m = m[:, 0]
    if m.shape[0] != 1 and torch.equal(m, m[:1].expand_as(m)):
        m = m[:1]
    if m.shape[0] == 1:
        m = m[0].expand(s_q, s_k)
        if not bool(m.any(dim=-1).all()):
            return "a query row sees no key (SDPA gives NaN there, flashmonoid 0)"
        band = _band(m, s_q, s_k)
        return band if isinstance(band, str) else (band[:2], slice(*band[2:]))
    bands = [_band(e.expand(s_q, s_k), s_q, s_k) for e in m.expand(b, s_q, s_k)]
    reason = next((x for x in bands if isinstance(x, str)), None)
    if reason is not None:
        return reason + " (in a batch entry)"
    if len({x[:2] for x in bands}) != 1:
        return "the batch entries' bands differ in window"
    begin, end = (torch.tensor([x[i] for x in bands], dtype=torch.int32, device=mask.device) for i in (2, 3))
    return bands[0][:2], (begin, end)


_support_cache = {}


@torch.compiler.assume_constant_result
def _supports(device, dtype, h, h_k, d, window, dropout_p):
    """The library's supports() for one (device, dtype, heads, head dim, options) combination.

    Asked with one-row tensors, since the answer does not depend on sequence lengths, and cached;
    plain arguments let torch.compile fold it to a constant instead of tracing the extension."""
    key = (device, dtype, h, h_k, d, window, dropout_p)
    if key not in _support_cache:
        dt = getattr(torch, dtype)
        q = torch.empty(1, 1, h, d, dtype=dt, device=device)
        k = torch.empty(1, 1, h_k, d, dtype=dt, device=device)
        opts = _C.Options(window_left=window[0], window_right=window[1], dropout_p=dropout_p)
        _support_cache[key] = tuple(_C.supports(q, k, opts))
    return _support_cache[key]


def _plan(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """((window, keys), reason): the window and the slice of keys to route with, or None and why the
    call falls back."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.is_nested or t.dim() != 4:
            return None, f"{name} is not a 4-d dense tensor"
        if t.dtype not in _SUPPORTED_DTYPES:
            return None, f"dtype {t.dtype} is not routed"
    if not (query.dtype == key.dtype == value.dtype and query.device == key.device == value.device):
        return None, "query, key and value differ in dtype or device"
    b, h, s_q, d = query.shape
    if key.shape[0] != b or value.shape[:3] != key.shape[:3] or key.shape[3] != d or value.shape[3] != d:
        return None, "shapes are not (b, h, s, d) with one head dim"
    h_k = key.shape[1]
    if h_k != h and not (enable_gqa and h % h_k == 0):
        return None, "key heads differ from query heads without enable_gqa"
    if not 0.0 <= dropout_p < 1.0:
        return None, "dropout_p is outside [0, 1)"
    window, keys = (-1, -1), slice(None)
    if attn_mask is not None:
        if is_causal:
            return None, "attn_mask together with is_causal"
        if attn_mask.dtype != torch.bool:
            return None, "a float (additive) attn_mask"
        if torch.compiler.is_compiling():
            return None, "a boolean attn_mask under torch.compile (its values are data)"
        band = _band_of(attn_mask, b, s_q, key.shape[2])
        if isinstance(band, str):
            return None, band
        window, keys = band
        if not isinstance(keys, slice):  # per-entry key ranges run as a KV-cache call: no dropout or gradient
            if dropout_p > 0.0:
                return None, "dropout with a mask that differs across batch entries"
            if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
                return None, "a gradient through a mask that differs across batch entries"
    elif is_causal:
        if s_q < key.shape[2]:
            return None, "is_causal with seq_q < seq_k (top-left alignment)"
        window = (-1, s_q - key.shape[2])
    ok, reason = _supports(str(query.device), str(query.dtype).removeprefix("torch."), h, h_k, d, window,
                           float(dropout_p))
    if not ok:
        return None, reason
    return (window, keys), ""


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """torch.nn.functional.scaled_dot_product_attention, run by flashmonoid where it can."""
    route, reason = _plan(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    compiling = torch.compiler.is_compiling()
    if route is None:
        if not compiling:
            _counts["fallback"] += 1
            log.debug("sdpa -> torch: %s", reason)
        return _original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                         scale=scale, enable_gqa=enable_gqa)
    window, keys = route
    if not compiling:
        _counts["routed"] += 1
        log.debug("sdpa -> flashmonoid: q %s, k %s, keys %s, %s, window %s, dropout_p %s", tuple(query.shape),
                  tuple(key.shape), keys, query.dtype, window, dropout_p)
    # (b, h, s, d) -> (b, s, h, d): views, the head dim stays contiguous.
    if not isinstance(keys, slice):  # each batch entry's keys [begin, end): the KV-cache forward's leftpad, seqlens
        out, _ = torch_ops.attention_kvcache(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                             cache_seqlens=keys[1], cache_leftpad=keys[0], softmax_scale=scale,
                                             window=window)
        return out.transpose(1, 2)
    key, value = key[:, :, keys], value[:, :, keys]
    # torch.use_deterministic_algorithms(True): bit-identical results run to run (Options::deterministic).
    out, _ = torch_ops.attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                 softmax_scale=scale, window=window, dropout_p=dropout_p,
                                 deterministic=torch.are_deterministic_algorithms_enabled())
    return out.transpose(1, 2)


def enable():
    """Route F.scaled_dot_product_attention through flashmonoid until disable()."""
    F.scaled_dot_product_attention = scaled_dot_product_attention


def disable():
    F.scaled_dot_product_attention = _original


def is_enabled():
    return F.scaled_dot_product_attention is scaled_dot_product_attention


@contextlib.contextmanager
def override():
    """Context manager form of enable()/disable(); restores the previous state on exit."""
    was = is_enabled()
    enable()
    try:
        yield
    finally:
        if not was:
            disable()
