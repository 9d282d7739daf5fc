"""Attention written out in torch, in the dtype of its inputs (float64 in practice).

It backs the float64 case of the torch ops (the C++ API takes fp32/fp16/bf16), so that
torch.autograd.gradcheck can check the registered autograd formula in float64: gradcheck then
compares this backward against finite differences of this forward. The C++ kernels themselves are
checked against an independent float64 reference in tests/python. It materialises the
(h, s_q, s_k) scores one sequence at a time: for small inputs only.

Semantics are those of include/flashmonoid/options.hpp and detail/mask.hpp: bottom-right aligned
causal/window masks, softcap, ALiBi, the Philox dropout mask of detail/philox.hpp, and a row with
no visible key gives out = 0 and lse = -inf.
"""

import math

import torch

from . import _philox


def key_ranges(diagonal, s_k, window_left, window_right):
    """[first, stop) of the keys a query sees, for each query's bottom-right diagonal key position
    (diagonal: a tensor, i + s_k - s_q for query i) among s_k keys (an int or a tensor that
    broadcasts), within [diagonal - window_left, diagonal + window_right] (-1: no bound on that
    side); first == stop where it sees none."""
    first = (diagonal - window_left).clamp(min=0) if window_left >= 0 else torch.zeros_like(diagonal)
    stop = torch.minimum(diagonal + window_right + 1, torch.as_tensor(s_k)) if window_right >= 0 else \
        torch.zeros_like(diagonal) + s_k
    return first, torch.maximum(stop, first)


def band(s_q, s_k, causal, window_left, window_right, device):
    """(s_q, s_k) bool: True where query i sees key j."""
    first, stop = key_ranges(torch.arange(s_q, device=device) + (s_k - s_q), s_k, window_left,
                             0 if causal else window_right)
    j = torch.arange(s_k, device=device)
    return (j >= first[:, None]) & (j < stop[:, None])


class _Seq:
    """Where one sequence sits in the batch: for ALiBi's batch index and dropout's row ids."""

    def __init__(self, b, row0, total_q):
        self.b, self.row0, self.total_q = b, row0, total_q


def _probabilities(q, k, seq, o):
    """P (h, s_q, s_k), lse (h, s_q), tanh of the capped scores (or None) and the dropout factor.

    q (s_q, h, d), k (s_k, h_k, d). The dropout factor is keep / (1 - p), or None without dropout.
    """
    s_q, h, _ = q.shape
    s_k, h_k, _ = k.shape
    kk = k.repeat_interleave(h // h_k, dim=1)
    s = torch.einsum("ihd,jhd->hij", q, kk) * o["scale"]
    t = None
    if o["softcap"] > 0:
        t = torch.tanh(s / o["softcap"])
        s = o["softcap"] * t
    i = torch.arange(s_q, device=q.device)[:, None]
    j = torch.arange(s_k, device=q.device)[None, :]
    if o["alibi"] is not None:
        slopes = o["alibi"][seq.b] if o["alibi"].dim() == 2 else o["alibi"]
        s = s - slopes.to(s.dtype)[:, None, None] * (i + (s_k - s_q) - j).abs().to(s.dtype)
    visible = band(s_q, s_k, o["causal"], o["window_left"], o["window_right"], q.device)
    s = s.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    empty = torch.isneginf(lse)[..., None]
    p = torch.where(empty, torch.zeros((), dtype=s.dtype, device=s.device), torch.exp(s - lse[..., None]))
    drop = None
    if o["dropout_p"] > 0:
        heads = torch.arange(h)[:, None]
        rows = (heads * seq.total_q + seq.row0 + torch.arange(s_q)[None, :]).reshape(-1).numpy()
        keep = _philox.keep_mask(o["seed"], o["offset"], o["dropout_p"], rows, s_k).reshape(h, s_q, s_k)
        drop = torch.from_numpy(keep).to(device=q.device, dtype=s.dtype) / (1.0 - o["dropout_p"])
    return p, lse, t, drop


def _forward_seq(q, k, v, seq, o):
    p, lse, _, drop = _probabilities(q, k, seq, o)
    vv = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    pd = p if drop is None else p * drop
    return torch.einsum("hij,jhd->ihd", pd, vv), lse.float()


def _backward_seq(dout, q, k, v, out, seq, o):
    h, h_k = q.shape[1], k.shape[1]
    g = h // h_k
    p, _, t, drop = _probabilities(q, k, seq, o)
    kk = k.repeat_interleave(g, dim=1)
    vv = v.repeat_interleave(g, dim=1)
    pd = p if drop is None else p * drop
    dv = torch.einsum("hij,ihd->jhd", pd, dout)
    dp = torch.einsum("ihd,jhd->hij", dout, vv)
    if drop is not None:
        dp = dp * drop
    # D_i = dO_i . O_i = sum_j P_ij dP_ij, also with dropout (O already holds the kept, rescaled P).
    d = (dout * out).sum(-1).transpose(0, 1)
    ds = p * (dp - d[..., None])
    if t is not None:
        ds = ds * (1 - t * t)
    ds = ds * o["scale"]
    dq = torch.einsum("hij,jhd->ihd", ds, kk)
    dk = torch.einsum("hij,ihd->jhd", ds, q)
    s_k, d_k = k.shape[0], k.shape[2]
    return dq, dk.reshape(s_k, h_k, g, d_k).sum(2), dv.reshape(s_k, h_k, g, v.shape[2]).sum(2)


def forward(q, k, v, o):
    """q (b, s_q, h, d) -> out like q, lse float32 (b, h, s_q)."""
    b, s_q = q.shape[:2]
    outs, lses = zip(*(_forward_seq(q[i], k[i], v[i], _Seq(i, i * s_q, b * s_q), o) for i in range(b)))
    return torch.stack(outs), torch.stack(lses)


def backward(dout, q, k, v, out, o):
    b, s_q = q.shape[:2]
    grads = [_backward_seq(dout[i], q[i], k[i], v[i], out[i], _Seq(i, i * s_q, b * s_q), o) for i in range(b)]
    return tuple(torch.stack(x) for x in zip(*grads))


def _segments(cu_seqlens_q, cu_seqlens_k, seqused_q=None, seqused_k=None):
    """(b, q0, q1, k0, k1) per sequence: its rows, the first seqused of its slot where given (clamped)."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()

    def stop(c, used, b):
        return c[b + 1] if used is None else c[b] + min(max(used[b], 0), c[b + 1] - c[b])

    uq, uk = (None if u is None else u.tolist() for u in (seqused_q, seqused_k))
    return [(b, cq[b], stop(cq, uq, b), ck[b], stop(ck, uk, b)) for b in range(len(cq) - 1)]


def forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, o, seqused_q=None, seqused_k=None):
    """q (total_q, h, d) -> out like q, lse float32 (h, total_q); rows outside every sequence 0 and -inf."""
    out = torch.zeros_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=torch.float32, device=q.device)
    for b, q0, q1, k0, k1 in _segments(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
        out[q0:q1], lse[:, q0:q1] = _forward_seq(q[q0:q1], k[k0:k1], v[k0:k1], _Seq(b, q0, q.shape[0]), o)
    return out, lse


def backward_varlen(dout, q, k, v, out, cu_seqlens_q, cu_seqlens_k, o, seqused_q=None, seqused_k=None):
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for b, q0, q1, k0, k1 in _segments(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = _backward_seq(
            dout[q0:q1], q[q0:q1], k[k0:k1], v[k0:k1], out[q0:q1], _Seq(b, q0, q.shape[0]), o)
    return dq, dk, dv
