"""The SDPA override on a GPT-style model: same outputs and gradients, calls counted."""

import contextlib
import copy
import logging

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import flashmonoid as fm  # noqa: E402
from flashmonoid import _reference, sdpa  # noqa: E402

from torch_reference import assert_rule  # noqa: E402

HAS_CUDA = torch.cuda.is_available() and fm.cuda_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and a CUDA build"))]


class GPTBlock(torch.nn.Module):
    """nanoGPT-style block: F.scaled_dot_product_attention looked up at call time."""

    def __init__(self, dim=64, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.hd)
        self.proj = torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def forward(self, x, mask=None):
        b, s, c = x.shape
        h = self.ln1(x)
        q = self.q(h).view(b, s, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(h).view(b, s, 2, self.kv_heads, self.hd).permute(2, 0, 3, 1, 4)
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, c))
        return x + self.mlp(self.ln2(x))


class GPT(torch.nn.Module):
    def __init__(self, dim=64, layers=2):
        super().__init__()
        self.blocks = torch.nn.ModuleList(GPTBlock(dim) for _ in range(layers))

    def forward(self, x, mask=None):
        for blk in self.blocks:
            x = blk(x, mask)
        return x


def run(model, x, mask=None):
    model.zero_grad()
    out = model(x, mask)
    out.square().mean().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("masked", [False, True])
def test_gpt_same_outputs_and_gradients(device, masked, caplog):
    torch.manual_seed(0)
    # CPU: float32, head dim 16. GPU: the half-precision head dim 64 the CUDA kernels are built for.
    cuda = device == "cuda"
    dim, dtype = (256, torch.float16) if cuda else (64, torch.float32)
    model = GPT(dim).to(device=device, dtype=dtype)
    x = torch.randn(2, 24, dim, device=device, dtype=dtype)
    tol = dict(rtol=2e-2, atol=2e-2) if cuda else dict(rtol=1e-4, atol=1e-5)
    # A sliding window of 8 as a boolean mask: a band flashmonoid expresses as window (7, 0).
    mask = torch.ones(24, 24, dtype=torch.bool, device=device).tril().triu(-7) if masked else None
    ref_out, ref_grads = run(model, x, mask)
    sdpa.reset_stats()
    with caplog.at_level(logging.DEBUG, logger="flashmonoid.sdpa"), sdpa.override():
        assert sdpa.is_enabled()
        out, grads = run(model, x, mask)
    assert not sdpa.is_enabled()
    assert sdpa.stats() == {"routed": 2, "fallback": 0}
    assert sum("sdpa -> flashmonoid" in r.message for r in caplog.records) == 2
    torch.testing.assert_close(out, ref_out, **tol)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, **tol)


# More query rows (20) than the per-row route takes (sdpa._ROWS_MAX_S_Q), so that masks the band
# analysis refuses fall back to PyTorch.
N = 20


@pytest.mark.parametrize("kwargs,reason", [
    (dict(attn_mask=torch.zeros(N, N)), "float (additive) attn_mask"),
    # Every row keeps its diagonal key, so that no draw happens to be a band with padding rows.
    (dict(attn_mask=(torch.rand(N, N) > 0.5) | torch.eye(N, dtype=torch.bool)), "more than 16 query rows"),
    # Causal for batch entry 0, a window of 3 for entry 1: bands, but not of one window.
    (dict(attn_mask=torch.stack((torch.ones(N, N).tril(), torch.ones(N, N).tril().triu(-2)))[:, None].bool()),
     "one band each of one window"),
    (dict(attn_mask=torch.stack((torch.ones(N, N).tril(), torch.ones(N, N).tril().triu(-2)))[None].bool().expand(
        2, 2, N, N).repeat(1, 2, 1, 1)), "differs across heads"),
    (dict(dtype=torch.float64), "dtype"),
    (dict(attn_mask=torch.ones(N, 0, dtype=torch.bool), s_k=0), "no query or no key"),
    (dict(attn_mask=torch.ones(0, N, dtype=torch.bool), s_q=0), "no query or no key"),
])
def test_fallbacks_are_counted_logged_and_exact(kwargs, reason, caplog):
    kwargs = dict(kwargs)
    dtype = kwargs.pop("dtype", torch.float32)
    s_q, s_k = kwargs.pop("s_q", N), kwargs.pop("s_k", N)
    q = torch.randn(2, 4, s_q, 16, dtype=dtype)
    k, v = torch.randn(2, 4, s_k, 16, dtype=dtype), torch.randn(2, 4, s_k, 16, dtype=dtype)
    expected = F.scaled_dot_product_attention(q, k, v, **kwargs)
    sdpa.reset_stats()
    with caplog.at_level(logging.DEBUG, logger="flashmonoid.sdpa"), sdpa.override():
        out = F.scaled_dot_product_attention(q, k, v, **kwargs)
    assert sdpa.stats() == {"routed": 0, "fallback": 1}
    assert any(reason in r.message for r in caplog.records)
    torch.testing.assert_close(out, expected, equal_nan=True)


@contextlib.contextmanager
def math_in_input_dtype():
    """PyTorch's math backend computing in the inputs' dtype: by default (2.5+) it upcasts float16 and
    bfloat16 to float32, which is not the same math in the input dtype that the rule compares with."""
    allowed = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    try:
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            yield
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(allowed)


def routed_against_torch(q, k, v, **kwargs):
    """The override's output and gradients (of a fixed random dout where q requires grad) for a GQA
    call with SDPA's kwargs, with PyTorch's math backend's in q's dtype (the same math) and in
    float64, and the override's stats."""
    dout = torch.randn_like(q)
    runs = []
    for name in ("same math", "ours", "float64"):
        x = [t.detach().double().requires_grad_(t.requires_grad) for t in (q, k, v)] if name == "float64" else \
            (q, k, v)
        sdpa.reset_stats()
        with sdpa.override() if name == "ours" else math_in_input_dtype():
            out = F.scaled_dot_product_attention(*x, enable_gqa=True, **kwargs)
        if q.requires_grad:
            out.backward(dout.to(out.dtype))
        runs.append((out.detach(), [t.grad.clone() for t in x] if q.requires_grad else [], sdpa.stats()))
        for t in x:
            t.grad = None
    return runs


@pytest.mark.parametrize("s_q, s_k", [(5, 12), (12, 5), (7, 7)])
def test_is_causal_is_top_left_for_any_lengths(s_q, s_k):
    """SDPA's is_causal aligns to the top-left: with seq_q < seq_k the keys past seq_q are unseen
    (cut off), with seq_q > seq_k the rows past seq_k see every key. Outputs and gradients."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, s_q, 16, requires_grad=True)
    k, v = (torch.randn(2, 2, s_k, 16, requires_grad=True) for _ in range(2))
    (same, same_grads, _), (out, grads, stats), (ref, ref_grads, _) = routed_against_torch(q, k, v, is_causal=True)
    assert stats == {"routed": 1, "fallback": 0}
    assert_rule(out, same, ref)
    for g, s, r in zip(grads, same_grads, ref_grads):
        assert_rule(g, s, r)


def test_a_mask_is_analysed_once_until_it_changes(monkeypatch):
    """One mask object passed to every layer is read once; changed in place, it is read again (here it
    stops being a band, so the call runs per row, whose tables are remembered for the mask as well and
    rebuilt when it changes again); inference tensors (no version counter) are read every time."""
    calls, tables = [], []
    analyse, build = sdpa._band_of, sdpa._row_tables
    monkeypatch.setattr(sdpa, "_band_of", lambda *a: calls.append(1) or analyse(*a))
    monkeypatch.setattr(sdpa, "_row_tables", lambda *a: tables.append(1) or build(*a))
    q, k, v = torch.randn(2, 4, 8, 16), torch.randn(2, 4, 8, 16), torch.randn(2, 4, 8, 16)
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    sdpa.reset_stats()
    with sdpa.override():
        for _ in range(3):
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert len(calls) == 1 and not tables
        outs = []
        for i, j in ((0, 5), (3, 0)):
            mask[i, j] = not mask[i, j]  # not a band any more
            for _ in range(2):
                outs.append((F.scaled_dot_product_attention(q, k, v, attn_mask=mask), mask.clone()))
        assert len(calls) == 3 and len(tables) == 2
        with torch.inference_mode():
            frozen = torch.ones(8, 8, dtype=torch.bool).tril()
            for _ in range(2):
                F.scaled_dot_product_attention(q, k, v, attn_mask=frozen)
        assert len(calls) == 5
    assert sdpa.stats() == {"routed": 9, "fallback": 0}
    for out, m in outs:
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=m))


def mask_of(route, b, s_q, s_k):
    """The (b, s_q, s_k) mask the override runs for an analysis result (window, keys): a band over a
    slice of the keys for every entry, or per entry [no key | band over its keys | every key] rows."""
    window, keys = route
    mask = torch.zeros(b, s_q, s_k, dtype=torch.bool)
    if isinstance(keys, slice):
        mask[:, :, keys] = _reference.band(s_q, keys.stop - keys.start, False, *window, "cpu")
        return mask
    for e, (empty, band, k0, k1) in enumerate(zip(keys.empty, keys.band, keys.begin, keys.end)):
        mask[e, empty:empty + band, k0:k1] = _reference.band(band, k1 - k0, False, *window, "cpu")
        mask[e, empty + band:, k0:k1] = True
    return mask


def test_mask_analysis_accepts_a_mask_only_as_the_mask_it_runs():
    """Random masks as transformers makes them (bands of random windows over random key ranges, shared
    or per entry, with padding rows before or after), half of them with one element flipped: every
    mask the analysis accepts, rebuilt from its result, is the mask; most unflipped ones are accepted."""
    g = torch.Generator().manual_seed(0)
    pick = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    counts = {"accepted": 0, "refused": 0, "flipped accepted": 0}
    for _ in range(400):
        b, s_q, s_k = pick(1, 4), pick(1, 9), pick(1, 12)
        window = (pick(-1, 4), pick(-1, 2))
        entries = []
        for _ in range(b if pick(0, 1) else 1):
            k0 = pick(0, s_k - 1)
            k1 = pick(k0 + 1, s_k)
            empty = pick(0, s_q) * pick(0, 1)
            after = pick(0, s_q - empty) * pick(0, 1)
            entries.append((empty, s_q - empty - after, k0, k1))
        keys = sdpa._Entries(*map(list, zip(*(entries * b)[:b])))
        mask = mask_of((window, keys), b, s_q, s_k)[:len(entries)][:, None]
        flipped = bool(pick(0, 1))
        if flipped:
            mask[pick(0, len(entries) - 1), 0, pick(0, s_q - 1), pick(0, s_k - 1)] ^= True
        route = sdpa._band_of(mask, b, s_q, s_k)
        if isinstance(route, str):
            counts["refused"] += 1
            continue
        assert torch.equal(mask_of(route, b, s_q, s_k), mask[:, 0].expand(b, s_q, s_k)), (mask, route)
        counts["flipped accepted" if flipped else "accepted"] += 1
    assert counts["accepted"] > 120 and counts["refused"] > 120 and counts["flipped accepted"] > 5, counts


def test_enable_disable_and_scale():
    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
    expected = F.scaled_dot_product_attention(q, k, v, scale=0.3)
    sdpa.enable()
    try:
        sdpa.reset_stats()
        out = F.scaled_dot_product_attention(q, k, v, scale=0.3)
    finally:
        sdpa.disable()
    assert F.scaled_dot_product_attention is sdpa._original
    assert sdpa.stats()["routed"] == 1
    torch.testing.assert_close(out, expected)


def test_override_compiles_fullgraph():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT()
    x = torch.randn(2, 16, 64)
    expected = model(x)
    with sdpa.override():
        out = torch.compile(model, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("s_q, filled, window", [(1, 37, None), (3, 20, None), (1, 37, 8), (4, 1, None)])
def test_static_cache_masks_route_over_the_filled_keys(device, s_q, filled, window):
    """transformers' StaticCache masks: the same boolean mask for every batch entry, over a capacity
    of which the first `filled` keys are held; queries at filled .. filled + s_q - 1 (a decoding or
    speculative step), causal, optionally a sliding window. Routed with the unseen keys cut off;
    outputs and gradients as PyTorch's."""
    torch.manual_seed(0)
    cuda = device == "cuda"
    dtype, d = (torch.float16, 64) if cuda else (torch.float32, 16)
    b, h, h_k, capacity = 2, 4, 2, 64
    q = torch.randn(b, h, s_q, d, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(b, h_k, capacity, d, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    pos = filled + torch.arange(s_q, device=device)[:, None]
    j = torch.arange(capacity, device=device)[None, :]
    mask = (j <= pos) & ((j > pos - window) if window else True)
    mask = mask.expand(b, 1, s_q, capacity)  # transformers' shape: one row set per batch entry
    (same, same_grads, _), (out, grads, stats), (ref, ref_grads, _) = routed_against_torch(q, k, v, attn_mask=mask)
    assert stats == {"routed": 1, "fallback": 0}
    assert_rule(out, same, ref)
    for g, s, r in zip(grads, same_grads, ref_grads):
        assert_rule(g, s, r)


def padded_mask(b, s_q, s_k, pads, window=None, right=False):
    """transformers' mask of a padded batch (b, 1, s_q, s_k): entry e's first (or, right, last)
    pads[e] keys are padding; queries at the last s_q positions, causal, optionally a window."""
    i = (s_k - s_q + torch.arange(s_q))[:, None]
    j = torch.arange(s_k)[None, :]
    band = (j <= i) & ((j > i - window) if window else True)
    held = [(j < s_k - p) if right else (j >= p) for p in pads]
    return torch.stack([band & h for h in held])[:, None]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("s_q, s_k, pads, window, right", [
    (12, 12, [0, 3, 11], None, False),  # prefill, left padding: padding rows see no key
    (1, 20, [0, 5, 19], None, False),  # a decoding step over left-padded caches
    (4, 20, [2, 0, 7], None, False),  # transformers' GQA fold: the query heads sharing a KV head as rows
    (12, 12, [0, 4, 2], 5, False),  # a sliding window
    (1, 16, [0, 3, 5], None, True),  # right padding in a decoding step (bottom-right aligned all the same)
    (12, 12, [0, 3, 11], None, True),  # right padding in training: the padding rows see every held key
    (10, 10, [12, 0, 2], None, False),  # an entry all padding (more padding than rows: no key at all)
    (12, 12, [3], None, False),  # one entry: a mask every entry shares, with padding rows
    (12, 12, [3], None, True),
])
@pytest.mark.parametrize("grad", [False, True])
def test_padded_batches_route(device, s_q, s_k, pads, window, right, grad):
    """transformers' masks of padded batches: inference (a KV-cache call over each entry's keys, or
    varlen calls) and training (varlen calls: gradients, padding rows after the band in a call of
    their own) against PyTorch's math backend, which gives rows without keys 0 as flashmonoid does."""
    torch.manual_seed(0)
    cuda = device == "cuda"
    dtype, d = (torch.float16, 64) if cuda else (torch.float32, 16)
    b, h, h_k = len(pads), 4, 2
    q = torch.randn(b, h, s_q, d, device=device, dtype=dtype, requires_grad=grad)
    k, v = (torch.randn(b, h_k, s_k, d, device=device, dtype=dtype, requires_grad=grad) for _ in range(2))
    mask = padded_mask(b, s_q, s_k, pads, window, right).to(device)
    if s_q == 4 and not window:  # the fold: every row of an entry sees the same keys
        mask = mask[:, :, -1:].expand(b, 1, s_q, s_k)
    (same, same_grads, _), (out, grads, stats), (ref, ref_grads, _) = routed_against_torch(q, k, v, attn_mask=mask)
    assert stats == {"routed": 1, "fallback": 0}
    empty = ~mask.any(dim=-1)[:, :, :, None].expand(b, h, s_q, d)
    assert bool((out[empty] == 0).all()), "a row without keys is not 0"
    assert_rule(out, same, ref)
    for g, s, r in zip(grads, same_grads, ref_grads):
        assert_rule(g, s, r)


def packed_mask(lengths, window=None):
    """transformers' mask of packed sequences (b, 1, s, s): entry e's rows are sequences of
    lengths[e], each causal over its own rows (optionally a sliding window)."""
    masks = []
    for entry in lengths:
        seq = torch.repeat_interleave(torch.arange(len(entry)), torch.tensor(entry))
        i, j = torch.arange(len(seq))[:, None], torch.arange(len(seq))[None]
        masks.append((seq[:, None] == seq[None]) & (j <= i) & ((j > i - window) if window else True))
    return torch.stack(masks)[:, None]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lengths, window", [
    ([[7, 9, 4]], None),  # one packed entry (a padding-free batch, as transformers' packed position_ids give)
    ([[7, 9, 4], [20], [1, 1, 18]], None),  # entries packed differently, one not packed, sequences of 1 row
    ([[7, 9, 4], [3, 17]], 5),  # a sliding window inside each sequence
    ([[12, 2, 6]], 3),
])
@pytest.mark.parametrize("grad", [False, True])
def test_packed_sequences_route_as_one_varlen_call(device, lengths, window, grad):
    """Packed sequences' block-diagonal causal masks run as one varlen call over the batch's rows in
    place (each sequence its own keys), with gradients: against PyTorch's math backend."""
    torch.manual_seed(0)
    cuda = device == "cuda"
    dtype, d = (torch.float16, 64) if cuda else (torch.float32, 16)
    b, s, h, h_k = len(lengths), sum(lengths[0]), 4, 2
    q = torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=grad)
    k, v = (torch.randn(b, h_k, s, d, device=device, dtype=dtype, requires_grad=grad) for _ in range(2))
    mask = packed_mask(lengths, window).to(device)
    (same, same_grads, _), (out, grads, stats), (ref, ref_grads, _) = routed_against_torch(q, k, v, attn_mask=mask)
    assert stats == {"routed": 1, "fallback": 0}
    assert_rule(out, same, ref)
    for g, s_, r in zip(grads, same_grads, ref_grads):
        assert_rule(g, s_, r)


def test_packed_analysis_refuses_what_is_not_packing():
    """Masks that look like packing but are not (a sequence that sees an earlier one's rows, a row
    that does not see itself) fall back to PyTorch."""
    base = packed_mask([[7, 9, 4]])
    leak = base.clone()
    leak[0, 0, 10, 3] = True  # row 10 (second sequence) sees row 3 (the first)
    hole = base.clone()
    hole[0, 0, 12, 12] = False  # a row that does not see itself: no band either
    q, k, v = torch.randn(1, 4, 20, 16), torch.randn(1, 2, 20, 16), torch.randn(1, 2, 20, 16)
    for mask in (leak, hole):
        sdpa.reset_stats()
        with sdpa.override():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        assert sdpa.stats() == {"routed": 0, "fallback": 1}  # 20 rows: not the per-row route's either
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_transformers_generate_routes_every_call(device, padded, cache):
    """transformers' greedy generate (a small random Llama, GQA 8/2) under the override: every
    attention call routed, with and without left padding, dynamic and static caches; the same
    tokens as without it."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cuda = device == "cuda"
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, head_dim=64 if cuda else 32,
                                      attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config).eval().to(device, torch.bfloat16 if cuda else torch.float32)
    ids = torch.randint(1, 256, (3, 21), device=device)  # 0 is the pad token
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    if padded:
        mask = torch.ones_like(ids)
        mask[1, :4], mask[2, :15] = 0, 0
        kw["attention_mask"] = mask
    if cache == "static":
        # On a GPU generate compiles the decoding step for a static cache; under torch.compile a
        # boolean mask's values cannot be read, so those calls run PyTorch's SDPA (not counted).
        kw.update(cache_implementation="static", disable_compile=True)
    with torch.no_grad():
        expected = model.generate(ids, **kw)
        sdpa.reset_stats()
        with sdpa.override():
            out = model.generate(ids, **kw)
    assert sdpa.stats() == {"routed": 2 * 6, "fallback": 0}
    if not cuda:  # bf16 greedy tokens may part at a near tie; the CPU runs float32
        assert torch.equal(out, expected)


@pytest.mark.parametrize("side", ["right", "left"])
def test_transformers_training_step_on_a_padded_batch(side):
    """A training step of a small transformers Llama on a padded batch (labels -100 on padding): every
    attention call routed (varlen calls with gradients), the loss and every gradient within the
    FlashAttention rule of the model in float64 (PyTorch's SDPA in float32 as the same math)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(1, 256, (3, 24))
    mask = torch.ones_like(ids)
    pads = (slice(-5, None), slice(-17, None)) if side == "right" else (slice(None, 5), slice(None, 17))
    mask[1, pads[0]], mask[2, pads[1]] = 0, 0
    labels = ids.masked_fill(mask == 0, -100)
    runs = []
    for m, routed in ((model, False), (model, True), (copy.deepcopy(model).double(), False)):
        m.zero_grad()
        sdpa.reset_stats()
        with sdpa.override() if routed else contextlib.nullcontext():
            loss = m(ids, attention_mask=mask, labels=labels).loss
            loss.backward()
        runs.append((loss.detach(), [p.grad.clone() for p in m.parameters()], sdpa.stats()))
    (same_loss, same_grads, _), (loss, grads, stats), (ref_loss, ref_grads, _) = runs
    assert stats == {"routed": 2, "fallback": 0}
    assert_rule(loss, same_loss, ref_loss)
    for g, same, r in zip(grads, same_grads, ref_grads):
        assert_rule(g, same, r)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("s_q", [1, 3, 16])
@pytest.mark.parametrize("layout", ["heads", "rows"])
@pytest.mark.parametrize("compiled", [False, True])
def test_any_mask_over_few_rows_runs_per_row(device, s_q, layout, compiled):
    """Masks the band analysis refuses (random holes, right-padded prompts in a decoding step), or any
    mask under torch.compile, over at most 16 query rows: each row attends to exactly its mask row's
    keys (pages of one key row, K / V in place; contiguous (b, h_k, s, d) caches and (b, s, h_k, d)
    ones seen through transpose); rows without keys give 0. Against PyTorch's math backend and float64
    by the FlashAttention rule; compiled, with fresh masks each call and no recompilation."""
    torch.manual_seed(0)
    cuda = device == "cuda"
    dtype, d = (torch.float16, 64) if cuda else (torch.float32, 16)
    b, h, h_k = 3, 8, 2
    s_k = 3000 if cuda else 77  # on a GPU long enough for split-KV (and its workspace)
    q = torch.randn(b, h, s_q, d, device=device, dtype=dtype)
    shape = (b, h_k, s_k, d) if layout == "heads" else (b, s_k, h_k, d)
    k, v = (torch.randn(shape, device=device, dtype=dtype) for _ in range(2))
    if layout == "rows":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    call = lambda m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)  # noqa: E731
    if compiled:
        torch._dynamo.reset()
        # On a GPU as transformers compiles decoding steps: CUDA graph trees, which allocate from their own
        # pool while warming up.
        call = torch.compile(call, fullgraph=True, dynamic=False, mode="reduce-overhead" if cuda else None)
        frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    masks = [torch.rand(b, 1, s_q, s_k, device=device) > 0.6 for _ in range(2)]
    masks[0][1, :, 0] = False  # a row without keys
    # A decoding step of a right-padded prompt: entry e's prompt holds keys [0, 20 + e), then padding,
    # then the 17 tokens generated since.
    held = torch.arange(s_k, device=device)
    masks.append(((held < 20 + torch.arange(b, device=device)[:, None]) | (held >= s_k - 17))[:, None, None]
                 .expand(b, 1, s_q, s_k).contiguous())  # the other masks' strides: no recompilation
    for mask in masks:
        sdpa.reset_stats()
        with sdpa.override(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = call(mask)
        names = [e.name for e in prof.events()]
        # Calls under torch.compile are not counted; the compiled graph holds the KV-cache op instead.
        assert sdpa.stats() == ({"routed": 0, "fallback": 0} if compiled else {"routed": 1, "fallback": 0})
        assert "flashmonoid::fwd_kvcache" in names or not compiled
        assert not [n for n in names if "scaled_dot_product" in n]
        with math_in_input_dtype():
            same = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=True)
        empty = ~mask.any(dim=-1)[:, :, :, None].expand(b, h, s_q, d)
        assert bool((out[empty] == 0).all()), "a row without keys is not 0"
        assert_rule(out[~empty], same[~empty], ref[~empty])
    if compiled:
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames + 1  # compiled once


def test_random_calls_route_or_fall_back_never_crash():
    """Random SDPA calls (GQA or not; K / V head-major, (b, s, h, d) seen through transpose, or with a
    strided head dim; no mask, is_causal, random masks, bands, padding, 2-d, 3-d and per-head masks;
    1-24 query rows): the override never raises where PyTorch does not, and its result is PyTorch's
    by the FlashAttention rule (rows without keys 0)."""
    g = torch.Generator().manual_seed(0)
    pick = lambda *xs: xs[int(torch.randint(len(xs), (1,), generator=g))]  # noqa: E731
    routed = 0
    for _ in range(300):
        b, h_k = pick(1, 2, 3), pick(1, 2)
        h, s_q, s_k, d = h_k * pick(1, 2, 4), pick(1, 2, 5, 16, 17, 24), pick(1, 3, 8, 40), pick(8, 16)
        q = torch.randn(b, h, s_q, d, generator=g)
        layout = pick("heads", "rows", "strided")
        shape = {"heads": (b, h_k, s_k, d), "rows": (b, s_k, h_k, d), "strided": (b, h_k, s_k, 2 * d)}[layout]
        k, v = (torch.randn(shape, generator=g) for _ in range(2))
        if layout == "rows":
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        elif layout == "strided":
            k, v = k[..., ::2], v[..., ::2]
        kind = pick("none", "causal", "random", "band", "padding", "2d", "3d", "per head")
        kw = dict(enable_gqa=h != h_k, scale=pick(None, 0.3))
        i, j = torch.arange(s_q)[:, None] + (s_k - s_q), torch.arange(s_k)[None]
        if kind == "causal":
            kw["is_causal"] = True
        elif kind == "random":
            kw["attn_mask"] = torch.rand(b, 1, s_q, s_k, generator=g) > 0.4
        elif kind == "band":
            kw["attn_mask"] = (j <= i) & (j > i - int(torch.randint(1, 7, (1,), generator=g)))
        elif kind == "padding":
            pads = torch.randint(0, s_k + 1, (b, 1), generator=g)
            kw["attn_mask"] = (j >= pads)[:, None, None].expand(b, 1, s_q, s_k)
        elif kind != "none":
            mask_shape = {"2d": (s_q, s_k), "3d": (1, s_q, s_k), "per head": (b, h, s_q, s_k)}[kind]
            kw["attn_mask"] = torch.rand(mask_shape, generator=g) > 0.3
        with math_in_input_dtype():
            same = F.scaled_dot_product_attention(q, k, v, **kw)
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), **kw)
        sdpa.reset_stats()
        with sdpa.override():
            out = F.scaled_dot_product_attention(q, k, v, **kw)
        routed += sdpa.stats()["routed"]
        empty = torch.isnan(ref) | (ref == 0).all(dim=-1, keepdim=True)  # rows without keys
        assert bool((out[empty] == 0).all()) or sdpa.stats()["fallback"], (kind, layout)
        if bool((~empty).any()):
            assert_rule(out[~empty], same[~empty], ref[~empty])
    assert routed > 150


def _masked_attention(q, k, v, mask, sinks, scale=None):
    """Plain torch attention with a boolean mask and sinks (one more softmax column of score
    sinks[h], value 0) in q's dtype; (b, h, s_q, d) tensors, K/V heads repeated for GQA."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    s = s.masked_fill(~mask, float("-inf"))
    column = sinks.to(s.dtype)[None, :, None, None].expand(*s.shape[:3], 1)
    p = torch.softmax(torch.cat([s, column], dim=-1), dim=-1)[..., :-1]
    return p @ v


@pytest.mark.parametrize("route", ["band", "padded inference", "padded training", "per-row heads", "per-row rows",
                                   "packed"])
def test_sinks_on_every_route(route):
    """sdpa.routed with sinks on each route (the one-band call, a padded batch's KV-cache call and its
    varlen calls, the per-row pages in both K/V layouts, packed sequences): out (and, where the route
    trains, the gradients of q, k, v and the sinks) by the rule against the masked formula with the
    sinks' column in float32 and float64."""
    torch.manual_seed(0)
    b, h, h_k, d = 3, 4, 2, 16
    s_q, s_k = (3, 40) if route.startswith("per-row") else (12, 12)
    grad = route in ("band", "padded training", "packed")
    q = torch.randn(b, h, s_q, d, requires_grad=grad)
    if route == "per-row rows":
        k, v = (torch.randn(b, s_k, h_k, d).transpose(1, 2).requires_grad_(grad) for _ in range(2))
    else:
        k, v = (torch.randn(b, h_k, s_k, d, requires_grad=grad) for _ in range(2))
    sinks = torch.tensor([1.0, -0.5, 2.5, 0.0], requires_grad=grad)
    causal = torch.ones(s_q, s_k, dtype=torch.bool).tril()
    mask = {"band": None, "padded inference": padded_mask(b, s_q, s_k, [0, 3, 11]),
            "padded training": padded_mask(b, s_q, s_k, [0, 3, 11], right=True),
            "packed": packed_mask([[7, 5], [3, 9], [12]])}.get(route, torch.rand(b, 1, s_q, s_k) > 0.6)
    sdpa.reset_stats()
    out = sdpa.routed(q, k, v, mask, 0.0, mask is None, None, True, 0.0, sinks)
    assert sdpa.stats() == {"routed": 1, "fallback": 0}
    full = (causal if mask is None else mask).expand(b, 1, s_q, s_k)
    same = _masked_attention(q, k, v, full, sinks)
    ref = _masked_attention(*(x.double() for x in (q, k, v)), full, sinks.double())
    assert_rule(out, same, ref)
    if grad:
        dout = torch.randn_like(out)
        inputs = (q, k, v, sinks)
        for g, s_, r in zip(*(torch.autograd.grad(x, inputs, dout.to(x.dtype)) for x in (out, same, ref))):
            assert_rule(g, s_, r)
