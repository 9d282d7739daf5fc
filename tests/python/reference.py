"""An independent float64 NumPy attention: the oracle of the Python tests (no torch needed).

Written from the definition in include/flashmonoid/options.hpp, separately from the package's own
float64 path, so that the two check each other.
"""

import numpy as np


def attention(q, k, v, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0, alibi_slopes=None,
              keep=None, dropout_p=0.0, sinks=None):
    """q (b, s_q, h, d), k, v (b, s_k, h_k, d) -> out float64 like q, lse (b, h, s_q).

    keep: optional boolean (b, h, s_q, s_k) dropout keep-mask. sinks (h,): one more score per head in
    every row's softmax, whose value is 0 (counted in lse)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    b, s_q, h, d = q.shape
    s_k, h_k = k.shape[1], k.shape[2]
    g = h // h_k
    k = np.repeat(k, g, axis=2)
    v = np.repeat(v, g, axis=2)
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    s = np.einsum("bihd,bjhd->bhij", q, k) * scale
    if softcap > 0:
        s = softcap * np.tanh(s / softcap)
    i = np.arange(s_q)[:, None]
    j = np.arange(s_k)[None, :]
    diag = s_k - s_q
    if alibi_slopes is not None:
        slopes = np.asarray(alibi_slopes, dtype=np.float64)
        slopes = np.broadcast_to(slopes, (b, h))[:, :, None, None]
        s = s - slopes * np.abs(i + diag - j)
    left, right = window
    if causal:
        right = 0
    visible = np.ones((s_q, s_k), dtype=bool)
    if right >= 0:
        visible &= j <= i + diag + right
    if left >= 0:
        visible &= j >= i + diag - left
    s = np.where(visible, s, -np.inf)
    if sinks is not None:
        column = np.broadcast_to(np.asarray(sinks, dtype=np.float64)[None, :, None, None], (b, h, s_q, 1))
        s = np.concatenate([s, column], axis=-1)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isneginf(m), 0.0, m)
    e = np.exp(s - m)
    denom = e.sum(axis=-1, keepdims=True)
    p = np.where(denom > 0, e / np.where(denom > 0, denom, 1.0), 0.0)
    with np.errstate(divide="ignore"):
        lse = (np.log(denom) + m)[..., 0]
    p = p[..., :s_k]  # the sinks' column, if any, has no value
    if keep is not None:
        p = p * keep / (1.0 - dropout_p)
    out = np.einsum("bhij,bjhd->bihd", p, v)
    return out, lse


def rel_err(x, ref):
    """max |x - ref| / max |ref|: one number for a whole tensor."""
    x = np.asarray(x, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    return float(np.abs(x - ref).max() / max(np.abs(ref).max(), 1e-30))
