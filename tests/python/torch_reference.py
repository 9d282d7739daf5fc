"""Plain torch attention for the torch tests: differentiable, any dtype, materialises the scores."""

import math

import torch


def attention(q, k, v, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0, alibi_slopes=None,
              upcast=True, sinks=None):
    """q (b, s_q, h, d), k, v (b, s_k, h_k, d). upcast: compute in float64; else in q's dtype
    (the "same math in the input dtype" of the FlashAttention accuracy rule). sinks (h,): one more
    score per head in every row's softmax (attention sinks), whose value is 0."""
    s, v = _scores(q, k, v, causal, softmax_scale, window, softcap, alibi_slopes, upcast, sinks)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)[..., :v.shape[1]]
    return torch.einsum("bhij,bjhd->bihd", p.to(v.dtype), v)


def lse(q, k, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0, alibi_slopes=None, upcast=True,
        sinks=None):
    """(b, h, s_q) log-sum-exp of each row's visible scaled scores (and its sink), as attention's."""
    s, _ = _scores(q, k, k, causal, softmax_scale, window, softcap, alibi_slopes, upcast, sinks)
    return torch.logsumexp(s, dim=-1)


def _scores(q, k, v, causal, softmax_scale, window, softcap, alibi_slopes, upcast, sinks):
    """(scores (b, h, s_q, s_k [+ 1 sink column]) with hidden keys at -inf, v with k's heads
    repeated)."""
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
    b, s_q, h, d = q.shape
    s_k, h_k = k.shape[1], k.shape[2]
    k = k.repeat_interleave(h // h_k, dim=2)
    v = v.repeat_interleave(h // h_k, dim=2)
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(s_q, device=q.device)[:, None]
    j = torch.arange(s_k, device=q.device)[None, :]
    diag = s_k - s_q
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(s.dtype).expand(b, h)[:, :, None, None]
        s = s - slopes * (i + diag - j).abs().to(s.dtype)
    left, right = window
    if causal:
        right = 0
    visible = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device)
    if right >= 0:
        visible &= j <= i + diag + right
    if left >= 0:
        visible &= j >= i + diag - left
    s = s.masked_fill(~visible, -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.to(s.dtype)[None, :, None, None].expand(b, h, s_q, 1)], dim=-1)
    return s, v


def rel_err(x, ref):
    return ((x.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


def assert_rule(out, same_math, ref):
    """The FlashAttention accuracy rule: out's error against the float64 ref at most twice that of
    the same math done in out's dtype (float32: plus 1e-6 of ref's size, both errors being rounding
    noise there)."""
    ref = ref.double()
    err = (out.double() - ref).abs().max().item()
    floor = 1e-6 * ref.abs().max().item() if out.dtype == torch.float32 else 0.0
    bound = 2 * (same_math.double() - ref).abs().max().item() + floor
    assert err <= bound, (err, bound)
