"""Route torch.nn.functional.scaled_dot_product_attention to flashmonoid where it can run the call.

    with flashmonoid.sdpa.override():        # or flashmonoid.sdpa.enable() ... disable()
        y = model(x)
    flashmonoid.sdpa.stats()                   # {"routed": n, "fallback": m}

Routed: 4-d (batch, heads, seq, head_dim) float32/float16/bfloat16 tensors on a device this build
supports, key and value with the same head dim as the query, with is_causal, scale, dropout_p,
enable_gqa, and attn_mask either None or a boolean mask, the same for every head, whose rows in
each batch entry are a bottom-right band (causal or sliding window) of one window over that
entry's keys, with padding rows before it that see no key (left padding) or after it that see every
key of the entry (right padding), as transformers masks padded batches. A mask that is one band
with every row seeing a key, the same for every batch entry, runs as one call with the keys no row
sees at either end cut off as views (a static KV cache's unfilled capacity, as transformers'
StaticCache masks it); any other such mask as one KV-cache call over each entry's key range in
place (inference with all rows aligned to the end of the keys), else as varlen calls over the
gathered rows (gradients, dropout, right padding). A mask of packed sequences (each entry's rows
consecutive sequences, each causal, optionally windowed, over its own rows: a padding-free batch, as
transformers masks packed position_ids) runs as one varlen call over the batch's rows in place
(gradients, dropout). Any other boolean mask the same for every head,
and under torch.compile (where a mask's values cannot be read on the host) any such mask at all,
runs per row when the call has at most 16 query rows and needs no gradient or dropout (decoding
and speculative steps): one KV-cache call over pages of one key row of K and V in place, each row's
block table listing exactly the keys its mask row holds (built on the device; compiled graphs and
CUDA graphs hold it). Rows that see no key give 0, as PyTorch's math backend does since 2.5.
Everything else (float masks, masks of other shapes, nested tensors, float64, ...) falls back to
PyTorch.

SDPA aligns is_causal to the top-left corner and flashmonoid to the bottom-right. A top-left
causal mask is the bottom-right window (-1, seq_q - seq_k) when seq_q >= seq_k; with seq_q < seq_k
no row sees a key past seq_q, so the keys are cut to the first seq_q (a view) and the call is
causal. With dropout_p > 0 the two draw different (equally distributed) masks.

Only callers that look the function up at call time (``F.scaled_dot_product_attention(...)``) are
routed; a module that did ``from torch.nn.functional import scaled_dot_product_attention`` before
enable() keeps PyTorch's. Each decision is logged at DEBUG level on the logger "flashmonoid.sdpa"
(outside torch.compile tracing).
"""

import contextlib
import dataclasses
import logging
import weakref

import numpy as np
import torch
import torch.nn.functional as F

from . import _C, _reference, flash_attn_interface, torch_ops

log = logging.getLogger(__name__)

_original = F.scaled_dot_product_attention
_counts = {"routed": 0, "fallback": 0}
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def stats():
    """Calls routed to flashmonoid and calls left to PyTorch since the last reset_stats()."""
    return dict(_counts)


def reset_stats():
    _counts["routed"] = _counts["fallback"] = 0


def _row_ranges(m, s_k):
    """(first, stop) int64 NumPy arrays of m's shape less its last dim (s_k keys, broadcast): each row
    of the boolean mask m sees keys [first, stop) (both 0 when it sees none); a string when some row's
    keys are not one range. The only read of the mask's values: a few
    reductions where it lives and one transfer (one device sync for a CUDA mask), so the rest of the
    analysis costs O(rows), not O(rows x keys)."""
    if m.device.type == "cpu":  # NumPy on a view of the mask: ~0.2 us an operation on small masks, torch ~2-3 us
        u = m.expand(*m.shape[:-1], s_k).numpy()
        count, first, last = np.count_nonzero(u, axis=-1), u.argmax(axis=-1), u[..., ::-1].argmax(axis=-1)
    else:
        u = m.expand(*m.shape[:-1], s_k).to(torch.uint8)
        # A float32 sum counts exactly below 2^24 keys and runs faster than an integer one.
        count = u.sum(dim=-1, dtype=torch.float32 if s_k < 1 << 24 else torch.int64).long()
        count, first, last = torch.stack((count, u.argmax(dim=-1), u.flip(-1).argmax(dim=-1))).cpu().numpy()
    none = count == 0
    first, stop = np.where(none, 0, first), np.where(none, 0, s_k - last)
    if ((stop - first) != count).any():
        return "the mask is not a causal or sliding-window band (a row's keys are not one range)"
    return first, stop


def _same_ranges(first, stop, want_first, want_stop):
    """Whether rows seeing [first, stop) see exactly [want_first, want_stop) (empty when stop == first)."""
    n, want_n = stop - first, want_stop - want_first
    return bool(((n == want_n) & ((first == want_first) | (n == 0))).all())


def _band_window(first, stop, s_k):
    """(window_left, window_right) when the rows that see keys [first, stop) (1-d int64 tensors, one per
    query) are the bottom-right band of that window over s_k keys, else why not."""
    s_q = first.shape[0]
    diagonal = torch.arange(s_q) + (s_k - s_q)
    sees = stop > first
    if not bool(sees.any()):
        return "the mask hides every key"
    right, left = int((stop - 1 - diagonal)[sees].max()), int((diagonal - first)[sees].max())
    if right < 0 or left < 0:
        return "the band does not contain the diagonal"
    # A side that cuts off no key is no window (-1): plain causal stays the kernels' causal path.
    window = (-1 if left >= s_k - 1 else left, -1 if right >= s_q - 1 else right)
    if not _same_ranges(first, stop, *_reference.key_ranges(diagonal, s_k, *window)):
        return "the mask is not a causal or sliding-window band"
    return window


@dataclasses.dataclass(eq=False)
class _Entries:
    """A mask that differs across batch entries, per entry: rows [0, empty) see no key (left
    padding), the next `band` rows are a bottom-right band over keys [begin, end), and every row after
    them sees exactly those keys (right padding's rows). Remembered with its mask (_band_of_cached),
    so the device tensors each route needs are built once per mask, not once per layer."""
    empty: list
    band: list
    begin: list
    end: list
    _memo: dict = dataclasses.field(default_factory=dict, repr=False)

    def aligned(self, s_q, window):
        """Whether all s_q rows of each entry are the band over its keys as a KV-cache call aligns them
        (queries at the end of the keys): no row past the band, and the empty rows exactly those the
        window leaves without a key."""
        right = window[1]
        return all(e + n == s_q and e == (max(0, s_q - (k1 - k0) - right) if right >= 0 else 0)
                   for e, n, k0, k1 in zip(self.empty, self.band, self.begin, self.end))

    def key_ranges(self, device):
        """(begin, end) int32 tensors on device: the KV-cache call's cache_leftpad and cache_seqlens."""
        key = ("key_ranges", device)
        if key not in self._memo:
            self._memo[key] = tuple(torch.tensor(x, dtype=torch.int32, device=device) for x in (self.begin, self.end))
        return self._memo[key]

    def varlen_calls(self, device, s_q, s_k, window):
        """The varlen calls of _per_entry_varlen, in place over the padded batch's (b·s_q) query and
        (b·s_k) key rows: (window, cu_q, used_q, cu_k, used_k, max_q, max_k) each. Entry e's slot
        starts at its call's first row (cu, int32, b + 1) and its used rows are that call's rows of it
        (seqused); the keys are the entry's [begin, end) in every call."""
        key = ("varlen", device, s_q, s_k, window)
        if key in self._memo:
            return self._memo[key]
        b = len(self.end)
        n_k = [max(0, k1 - k0) for k0, k1 in zip(self.begin, self.end)]
        first = list(self.empty)  # the band's rows start after the rows without a key
        band = [n if k else 0 for n, k in zip(self.band, n_k)]
        after = [s_q - e - n if k else 0 for e, n, k in zip(self.empty, self.band, n_k)]
        groups = [(window, first, band), ((-1, -1), [e + n for e, n in zip(self.empty, self.band)], after)] \
            if window != (-1, -1) else [(window, first, [n + a for n, a in zip(band, after)])]
        i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
        cu_k = i32([e * s_k + k0 for e, k0 in enumerate(self.begin)] + [b * s_k])
        used_k = i32(n_k)
        calls = []
        for w, start, used in groups:
            if any(used):
                calls.append((w, i32([e * s_q + r for e, r in enumerate(start)] + [b * s_q]), i32(used), cu_k, used_k,
                               max(used), max(n_k)))
        self._memo[key] = calls
        return calls


@dataclasses.dataclass(eq=False)
class _Packed:
    """A mask of packed sequences (padding-free batches): each batch entry's s rows are consecutive
    sequences, each a causal band over its own rows (keys = queries, s_q = s_k), of one left window.
    starts: each sequence's first row in the (b * s) flattened rows, then b * s. Remembered with its
    mask, as _Entries."""
    starts: list
    _memo: dict = dataclasses.field(default_factory=dict, repr=False)

    def cu_seqlens(self, device):
        """(cu_seqlens int32 on device, the longest sequence): one varlen call's, queries and keys alike."""
        key = ("cu", device)
        if key not in self._memo:
            lengths = [b - a for a, b in zip(self.starts, self.starts[1:])]
            self._memo[key] = (torch.tensor(self.starts, dtype=torch.int32, device=device), max(lengths))
        return self._memo[key]


def _packed_of(first, stop):
    """(window, _Packed) when the rows that see keys [first, stop) ((b, s) int64 tensors, s_q = s_k)
    are packed sequences (see _Packed), else None. A sequence starts at each row whose first key is
    itself; every row then sees from its sequence's start (or its window's) to itself."""
    b, s = first.shape
    rows = torch.arange(s)[None]
    starts = first == rows
    if not bool(starts[:, 0].all()) or int(starts.sum()) <= b:  # no second sequence in any entry: not packing
        return None
    start_of = torch.cummax(torch.where(starts, rows, 0), dim=-1).values  # each row's sequence start
    stop_want = (rows + 1).expand(b, s)
    for left in (-1, int((rows - first).max())):
        first_want = start_of if left < 0 else torch.maximum(start_of, rows - left)
        if _same_ranges(first, stop, first_want, stop_want):
            flat = (torch.arange(b)[:, None] * s + rows)[starts].tolist()
            return (left, 0), _Packed(flat + [b * s])
    return None


def _entries_of(first, stop):
    """(window, _Entries) of rows that see keys [first, stop) ((b, s_q) int64 tensors) when
    the batch entries differ (see _Entries), or a string saying why they are not such."""
    b, s_q = first.shape
    rows = torch.arange(s_q)[None]
    sees = stop > first
    empty = (~sees).int().cumprod(dim=-1).sum(dim=-1)  # leading rows without a key
    held = sees.any(dim=-1)
    begin = torch.where(held, first.masked_fill(~sees, torch.iinfo(first.dtype).max).amin(dim=-1), 0)
    end = stop.amax(dim=-1)  # 0 for an entry without keys
    every = sees & (first == begin[:, None]) & (stop == end[:, None])  # rows that see every held key
    last = every.int().argmax(dim=-1)  # the band's last row: its first that sees every key ...
    tail = every.any(dim=-1) & (every | (rows < last[:, None])).all(dim=-1)  # ... when all after do too
    band = torch.where(tail, last + 1 - empty, s_q - empty)
    entries = _Entries(*torch.stack((empty, band, begin, end)).tolist())
    # The window: the band of the entry with the most rows and keys; every entry must be it.
    e = max(range(b), key=lambda e: entries.band[e] * (entries.end[e] - entries.begin[e]))
    r0, r1, k0 = entries.empty[e], entries.empty[e] + entries.band[e], entries.begin[e]
    window = _band_window(first[e, r0:r1] - k0, stop[e, r0:r1] - k0, entries.end[e] - k0)
    if isinstance(window, str):
        return window + " (in a batch entry)"
    # The rows these entries and the window make, [no key | band | every key] per entry, must be the mask's.
    empty, band, begin, end = (x[:, None] for x in (empty, band, begin, end))
    in_band, after = (rows >= empty) & (rows < empty + band), rows >= empty + band
    band_first, band_stop = _reference.key_ranges((rows - empty) + (end - begin - band), end - begin, *window)
    want_first = torch.where(in_band, begin + band_first, torch.where(after, begin, 0))
    want_stop = torch.where(in_band, begin + band_stop, torch.where(after, end, 0))
    if not _same_ranges(first, stop, want_first, want_stop):
        return "the batch entries are not one band each of one window with padding rows before or after"
    return window, entries


def _mask_4d(mask):
    """The mask as SDPA broadcasts it against (b, h, s_q, s_k): leading dims of 1 added (a 3-d mask's
    first dim is the heads')."""
    m = mask
    while m.dim() < 4:
        m = m[None]
    return m


def _band_of(mask, b, s_q, s_k):
    """(window, keys) for a boolean mask the same for every head: keys a slice when the mask is one
    band for every batch entry in which every row sees a key, else _Entries when each entry's rows
    are a bottom-right band of one window over its own keys with padding rows before (no key) or
    after (every key); a string saying why not otherwise. Reads the mask's values once (_row_ranges)."""
    m = _mask_4d(mask)
    m = m[:1] if m.shape[0] > 1 and m.stride(0) == 0 else m  # broadcast dims: read once
    m = m[:, :1] if m.shape[1] > 1 and m.stride(1) == 0 else m
    ranges = _row_ranges(m, s_k)
    if isinstance(ranges, str):
        return ranges
    ranges = np.stack(ranges)  # (2, b or 1, h or 1, s_q or 1); NumPy: these arrays hold one entry per row
    if not (ranges == ranges[:, :, :1]).all():
        return "the mask differs across heads"
    ranges = ranges[:, :, 0]
    if ranges.shape[1] > 1 and (ranges == ranges[:, :1]).all():
        ranges = ranges[:, :1]
    if s_q == 1 and ranges.shape[1] > 1:  # a decoding step of a padded batch: each entry's row sees one range
        first, stop = ranges[:, :, 0].tolist()
        sees = [int(k1 > k0) for k0, k1 in zip(first, stop)]
        if not any(sees):
            return "the mask hides every key (in a batch entry)"
        return (-1, -1), _Entries([1 - x for x in sees], sees, first, stop)
    first, stop = torch.from_numpy(ranges).expand(2, ranges.shape[1], s_q)
    if first.shape[0] == 1 and bool((stop > first).all()):  # one band for every entry, every row seeing a key
        begin, end = int(first.min()), int(stop.max())
        window = _band_window(first[0] - begin, stop[0] - begin, end - begin)
        if not isinstance(window, str):  # one call over a slice of the keys
            return window, slice(begin, end)
    # Padding rows, or entries that differ: each entry's rows and keys; or packed sequences.
    entries = _entries_of(first.expand(b, s_q), stop.expand(b, s_q))
    if isinstance(entries, str) and s_q == s_k:
        return _packed_of(first.expand(b, s_q), stop.expand(b, s_q)) or entries
    return entries


# Per kind of result, (a weak reference to the last mask, its version and shapes with the call's
# arguments, the result): one tuple, replaced whole, so threads never see one call's reference with
# another's result.
_last_per_mask = {}


def _per_mask(kind, mask, args, compute):
    """compute(), remembered for the last mask object (per kind) while torch's version counter says it
    is unchanged (a write that bypasses it, through .data or another library's view of the memory, is
    not seen): a model passes one mask to every layer of a forward, so its reads (and a CUDA mask's
    device syncs) happen once per forward, not once per layer (a decoding step's analysis costs about
    what its attention does). Inference tensors (no version counter) and traced calls compute anew."""
    if torch.compiler.is_compiling() or mask.is_inference():
        return compute()
    key = (mask._version, tuple(mask.shape), mask.stride(), mask.storage_offset(), args)
    last = _last_per_mask.get(kind)
    if last is not None and last[0]() is mask and last[1] == key:
        return last[2]
    result = compute()
    _last_per_mask[kind] = (weakref.ref(mask), key, result)
    return result


def _band_of_cached(mask, b, s_q, s_k):
    """_band_of, remembered per mask (_per_mask)."""
    return _per_mask("band", mask, (b, s_q, s_k), lambda: _band_of(mask, b, s_q, s_k))


_support_cache = {}


@torch.compiler.assume_constant_result
def _supports(device, dtype, h, h_k, d, window, dropout_p, softcap):
    """The library's supports() for one (device, dtype, heads, head dim, options) combination.

    Asked with one-row tensors, since the answer does not depend on sequence lengths, and cached;
    plain arguments let torch.compile fold it to a constant instead of tracing the extension."""
    key = (device, dtype, h, h_k, d, window, dropout_p, softcap)
    if key not in _support_cache:
        dt = getattr(torch, dtype)
        q = torch.empty(1, 1, h, d, dtype=dt, device=device)
        k = torch.empty(1, 1, h_k, d, dtype=dt, device=device)
        opts = _C.Options(window_left=window[0], window_right=window[1], dropout_p=dropout_p, softcap=softcap)
        _support_cache[key] = tuple(_C.supports(q, k, opts))
    return _support_cache[key]


def _plan(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap):
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
        if s_q == 0 or key.shape[2] == 0:
            return None, "a mask over no query or no key"
        # Under torch.compile a mask's values are data: only the per-row route, which never reads them on
        # the host, can take it.
        band = ("a boolean attn_mask under torch.compile (its values are data)" if torch.compiler.is_compiling()
                else _band_of_cached(attn_mask, b, s_q, key.shape[2]))
        if isinstance(band, str):
            refusal = _rows_refusal(query, key, value, attn_mask, dropout_p)
            if refusal:
                return None, f"{band}; {refusal}"
            band = (-1, -1), _ROWS
        window, keys = band
    elif is_causal:  # top-left: row i sees keys j <= i, so no row sees a key past seq_q
        keys = slice(0, min(s_q, key.shape[2]))
        window = (-1, s_q - keys.stop)
    for w in {window, (-1, -1)} if isinstance(keys, _Entries) else {window}:
        ok, reason = _supports(str(query.device), str(query.dtype).removeprefix("torch."), h, h_k, d, w,
                               float(dropout_p), float(softcap))
        if not ok:
            return None, reason
    return (window, keys), ""


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """torch.nn.functional.scaled_dot_product_attention, run by flashmonoid where it can."""
    out = routed(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if out is None:
        return _original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                         scale=scale, enable_gqa=enable_gqa)
    return out


def routed(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
           softcap=0.0, sinks=None):
    """flashmonoid's result for an SDPA call (with SDPA's arguments and semantics, plus flash-attn's
    softcap and attention sinks (h,), torch_ops.attention's), or None where it does not run the call
    (the reason is logged); counted in stats(). Every route takes sinks: the kernels' (out, lse)
    merged with them (torch_ops.merge_sink; with gradients on the training routes)."""
    route, reason = _plan(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap)
    compiling = torch.compiler.is_compiling()
    if route is None:
        if not compiling:
            _counts["fallback"] += 1
            log.debug("sdpa -> torch: %s", reason)
        return None
    window, keys = route
    if not compiling:
        _counts["routed"] += 1
        log.debug("sdpa -> flashmonoid: q %s, k %s, keys %s, %s, window %s, dropout_p %s, softcap %s",
                  tuple(query.shape), tuple(key.shape), keys, query.dtype, window, dropout_p, softcap)
    deterministic = torch.are_deterministic_algorithms_enabled()
    if keys is _ROWS:
        return _per_row_pages(query, key, value, attn_mask, scale, softcap, sinks)
    if isinstance(keys, _Packed):
        return _per_sequence_varlen(query, key, value, window, keys, scale, softcap, dropout_p, deterministic, sinks)
    if isinstance(keys, _Entries):
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        # The KV-cache call reads K and V in place: their rows' last dimension must be contiguous.
        if (dropout_p == 0.0 and not grad and keys.aligned(query.shape[2], window) and key.stride(-1) == 1
                and value.stride(-1) == 1):
            return _per_entry_kvcache(query, key, value, window, keys, scale, softcap, sinks)
        return _per_entry_varlen(query, key, value, window, keys, scale, softcap, dropout_p, deterministic, sinks)
    key, value = key[:, :, keys], value[:, :, keys]
    # (b, h, s, d) -> (b, s, h, d): views, the head dim stays contiguous.
    # torch.use_deterministic_algorithms(True): bit-identical results run to run (Options::deterministic).
    out, _ = torch_ops.attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                 softmax_scale=scale, window=window, softcap=softcap, dropout_p=dropout_p,
                                 deterministic=deterministic, sinks=sinks)
    return out.transpose(1, 2)


def _per_entry_kvcache(query, key, value, window, entries, scale, softcap, sinks=None):
    """Inference over each entry's keys in place: one KV-cache call (cache_leftpad, cache_seqlens = each
    entry's key range), every query row of an entry aligned to the end of its keys."""
    begin, end = entries.key_ranges(query.device)
    # flash_attn_with_kvcache: its eager route (one C++ call) takes the head-major (b, s, h_k, d) views.
    out = flash_attn_interface.flash_attn_with_kvcache(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), cache_seqlens=end, cache_leftpad=begin,
        softmax_scale=scale, window_size=window, softcap=softcap, return_softmax_lse=sinks is not None)
    if sinks is not None:  # (out (b, s, h, d), lse (b, h, s))
        out = torch_ops.merge_sink(*out, sinks)[0]
    return out.transpose(1, 2)


# Query rows per call up to which a mask the band analysis cannot use (or, under torch.compile, read) runs
# per row (_per_row_pages): a decoding step's rows, speculative ones included. Each row reads its keys
# once per KV head, so longer calls would multiply the K/V reads.
_ROWS_MAX_S_Q = 16
_ROWS = "rows"  # _plan's keys for _per_row_pages


def _rows_refusal(query, key, value, mask, dropout_p):
    """Why _per_row_pages cannot run this masked call, or "" when it can: at most _ROWS_MAX_S_Q query rows,
    inference only (no dropout, nothing needing grad: a KV-cache call), the mask the same for every
    head (broadcast over them), K and V contiguous (b, h_k, s_k, d) or views of contiguous
    (b, s_k, h_k, d) tensors (as pages of one key row, without copies)."""
    if query.shape[2] > _ROWS_MAX_S_Q:
        return f"more than {_ROWS_MAX_S_Q} query rows"
    if dropout_p != 0.0 or (torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))):
        return "dropout or gradients"
    m = _mask_4d(mask)
    if m.shape[1] > 1 and m.stride(1) != 0:
        return "the mask is not broadcast over heads"
    layout = _row_layout(key)
    if layout is None or layout != _row_layout(value):
        return "key and value are not both contiguous (b, h, s, d) or (b, s, h, d) memory"
    return ""


def _row_layout(t):
    """"heads" for a contiguous (b, h_k, s_k, d) tensor, "rows" for a (b, s_k, h_k, d) one seen through
    transpose(1, 2), else None ("rows" when both, as with one KV head)."""
    return "rows" if t.transpose(1, 2).is_contiguous() else "heads" if t.is_contiguous() else None


def _row_tables(mask, b, s_q, s_k, h_k, layout):
    """(cache_seqlens, block_table) int32 of _per_row_pages from the boolean mask (SDPA-broadcastable to
    (b, 1, s_q, s_k)), built where the mask lives without reading it on the host: a row's keys in
    order at the front of its table, their count its seqlens."""
    m = _mask_4d(mask)
    m = m.expand(b, m.shape[1], s_q, s_k)[:, 0]
    seqlens = m.sum(dim=-1, dtype=torch.int32)  # (b, s_q)
    held = m.cumsum(dim=-1)  # keys held up to and including each key
    keys = torch.arange(s_k, device=m.device).expand(b, s_q, s_k)
    # A stable partition: held keys in order first, then the others (past the row's count, never read).
    place = torch.where(m, held - 1, seqlens[..., None] + keys - held)
    order = torch.empty_like(keys).scatter_(-1, place, keys)
    if layout == "rows":  # page = key row (all heads) of entry e: e * s_k + key
        table = order + (torch.arange(b, device=m.device) * s_k)[:, None, None]
        return seqlens.view(b * s_q), table.to(torch.int32).view(b * s_q, s_k)
    # "heads": page = one head's key row: (e * h_k + head) * s_k + key; a call entry per (e, head, row).
    base = (torch.arange(b * h_k, device=m.device) * s_k).view(b, h_k, 1, 1)
    table = order[:, None] + base
    return seqlens[:, None].expand(b, h_k, s_q).reshape(-1), table.to(torch.int32).view(b * h_k * s_q, s_k)


def _row_tables_cached(mask, *args):
    """_row_tables, remembered per mask (_per_mask)."""
    return _per_mask("rows", mask, args, lambda: _row_tables(mask, *args))


def _per_row_pages(query, key, value, mask, scale, softcap, sinks=None):
    """Any boolean mask the same for every head, over a few query rows: each query row attends to
    exactly the keys its mask row holds, in one KV-cache call whose pages are single key rows of K and
    V in place; a row's block table lists its keys, cache_seqlens counts them (_row_tables). Nothing
    is read on the host, so torch.compile and CUDA graphs can hold the call. A row without keys gives 0."""
    b, h, s_q, d = query.shape
    h_k, s_k = key.shape[1], key.shape[2]
    layout = _row_layout(key)
    seqlens, table = _row_tables_cached(mask, b, s_q, s_k, h_k, layout)
    if layout == "rows":  # entries (b, row) of 1 query row and h heads; pages (b * s_k, 1, h_k, d)
        q = query.transpose(1, 2).reshape(b * s_q, 1, h, d)
        k, v = (t.transpose(1, 2).view(b * s_k, 1, h_k, d) for t in (key, value))
    else:  # entries (b, KV head, row) of 1 query row and that head's h / h_k query heads; pages (b * h_k * s_k, 1, 1, d)
        q = query.reshape(b, h_k, h // h_k, s_q, d).transpose(2, 3).reshape(b * h_k * s_q, 1, h // h_k, d)
        k, v = (t.view(b * h_k * s_k, 1, 1, d) for t in (key, value))
    out = flash_attn_interface.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, block_table=table,
                                                       softmax_scale=scale, softcap=softcap,
                                                       return_softmax_lse=sinks is not None)
    out, lse = out if sinks is not None else (out, None)
    if layout == "rows":
        out = out.view(b, s_q, h, d)
        lse = None if lse is None else lse.view(b, s_q, h).transpose(1, 2)
    else:  # back to (b, s_q, h, d) and lse (b, h, s_q): a sink belongs to a query head
        out = out.view(b, h_k, s_q, h // h_k, d).permute(0, 2, 1, 3, 4).reshape(b, s_q, h, d)
        lse = None if lse is None else lse.view(b, h_k, s_q, h // h_k).transpose(2, 3).reshape(b, h, s_q)
    if sinks is not None:
        out = torch_ops.merge_sink(out, lse, sinks)[0]
    return out.transpose(1, 2)


def _rows(x):
    """(b, h, s, d) -> the packed (b * s, h, d) rows of a varlen call: a view of transformers' (b, s, h, d)
    projections, which reach attention transposed."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])


def _per_entry_varlen(query, key, value, window, entries, scale, softcap, dropout_p, deterministic, sinks=None):
    """Each entry's rows as varlen calls (with backward and dropout) over the padded batch in place
    (used lengths, _Entries.varlen_calls): its band rows with the window, the rows after the band (which
    see every key of the entry) without one; rows without keys stay 0. No gather or scatter: each call
    leaves 0 in the rows it does not own, so the output is their sum."""
    b, h, s_q, d = query.shape
    s_k = key.shape[2]
    q, k, v = (_rows(x) for x in (query, key, value))
    out = None
    for w, cu_q, used_q, cu_k, used_k, max_q, max_k in entries.varlen_calls(query.device, s_q, s_k, window):
        o, _ = torch_ops.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, window=w,
                                          softcap=softcap, dropout_p=dropout_p, deterministic=deterministic,
                                          seqused_q=used_q, seqused_k=used_k, sinks=sinks)
        out = o if out is None else out + o
    if out is None:
        out = q.new_zeros(b * s_q, h, d)
    return out.view(b, s_q, h, d).transpose(1, 2)


def _per_sequence_varlen(query, key, value, window, packed, scale, softcap, dropout_p, deterministic, sinks=None):
    """Packed sequences (a padding-free batch) as one varlen call over the (b * s) rows in place, each
    sequence its own queries and keys."""
    b, h, s, d = query.shape
    cu, longest = packed.cu_seqlens(query.device)
    q, k, v = (_rows(x) for x in (query, key, value))
    out, _ = torch_ops.attention_varlen(q, k, v, cu, cu, longest, longest, softmax_scale=scale, window=window,
                                        softcap=softcap, dropout_p=dropout_p, deterministic=deterministic, sinks=sinks)
    return out.view(b, s, h, d).transpose(1, 2)


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
