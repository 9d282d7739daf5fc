"""S_dmask of flash_attn's return_attn_probs=True, vectorised in torch on the inputs' device.

flash-attn's convention: per (batch, head, query, key) the softmax numerator before normalisation,
exp(score - row max), negated where dropout drops the element and 0 where masked. flash-attn's own
test decodes it as |S_dmask| · exp(row max - lse) per key block, which equals the probabilities
when the row is one block; here the row max is the whole row's, so that decoding is exact for any
length (and |S_dmask| / its row sum are the probabilities). The dropout mask is the library's
(detail/philox.hpp, through _philox.keep_mask_torch), so it names the elements the kernels drop.
Debugging output, as upstream: it materialises (b, h, s_q, s_k). Sequences are processed in
chunks of at most _CHUNK_ELEMS scores, bounding the fp32 / int64 temporaries; no per-row loop.
"""

import math

import torch

from . import _philox

_CHUNK_ELEMS = 1 << 25


def _rows(x, starts, length):
    """(b, length, h, d) rows of packed x (total, h, d) from starts, zero past the packed end."""
    idx = starts.long()[:, None] + torch.arange(length, device=x.device)[None, :]
    valid = idx < x.shape[0]
    return torch.where(valid[..., None, None], x[idx.clamp(max=max(x.shape[0] - 1, 0))], torch.zeros((), dtype=x.dtype,
                                                                                                      device=x.device))


def s_dmask(q, k, o, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0):
    """q (b, s_q, h, d), k (b, s_k, h_k, d) -> (b, h, s_q, s_k) of q's dtype; varlen: packed q, k with
    cu_seqlens -> (b, h, max_seqlen_q, max_seqlen_k), zero-padded. o: the options dict of
    torch_ops._math_options (scale, causal, windows, softcap, alibi, dropout_p, seed, offset)."""
    dev = q.device
    if cu_seqlens_q is None:
        b, s_q, h, _ = q.shape
        s_k = k.shape[1]
        len_q = torch.full((b,), s_q, device=dev)
        len_k = torch.full((b,), s_k, device=dev)
        row0 = torch.arange(b, device=dev) * s_q
        total_q = b * s_q
    else:
        b, s_q, s_k, h = cu_seqlens_q.numel() - 1, int(max_seqlen_q), int(max_seqlen_k), q.shape[1]
        len_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
        len_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long()
        row0 = cu_seqlens_q[:-1].long()
        total_q = q.shape[0]
        q, k = _rows(q, cu_seqlens_q[:-1], s_q), _rows(k, cu_seqlens_k[:-1], s_k)
    out = torch.empty((b, h, s_q, s_k), dtype=q.dtype, device=dev)
    if out.numel() == 0:  # no query or no key: nothing to compute (the row max below needs keys)
        return out
    per = max(1, _CHUNK_ELEMS // max(1, h * s_q * s_k))
    for b0 in range(0, b, per):
        c = slice(b0, min(b, b0 + per))
        out[c] = _chunk(q[c], k[c], len_q[c], len_k[c], row0[c], torch.arange(b0, c.stop, device=dev), total_q, o)
    return out


def _chunk(q, k, len_q, len_k, row0, batch, total_q, o):
    nb, s_q, h, _ = q.shape
    s_k, h_k = k.shape[1], k.shape[2]
    kk = k.float().repeat_interleave(h // h_k, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q.float(), kk) * o["scale"]
    if o["softcap"] > 0:
        s = o["softcap"] * torch.tanh(s / o["softcap"])
    i = torch.arange(s_q, device=q.device)[None, None, :, None]
    j = torch.arange(s_k, device=q.device)[None, None, None, :]
    diag = (len_k - len_q)[:, None, None, None]
    if o["alibi"] is not None:
        a = o["alibi"].float()
        slopes = (a[batch] if a.dim() == 2 else a[None, :].expand(nb, h))[:, :, None, None]
        s = s - slopes * (i + diag - j).abs().float()
    visible = (i < len_q[:, None, None, None]) & (j < len_k[:, None, None, None])
    left, right = o["window_left"], 0 if o["causal"] else o["window_right"]
    if right >= 0:
        visible &= j <= i + diag + right
    if left >= 0:
        visible &= j >= i + diag - left
    s = s.masked_fill(~visible, -math.inf)
    m = s.amax(dim=-1, keepdim=True)
    p = torch.where(visible, torch.exp(s - m), torch.zeros((), device=q.device))
    if o["dropout_p"] > 0:
        heads = torch.arange(h, device=q.device)
        row_ids = heads[None, :, None] * total_q + row0[:, None, None] + torch.arange(s_q, device=q.device)[None, None, :]
        keep = _philox.keep_mask_torch(o["seed"], o["offset"], o["dropout_p"], row_ids.reshape(-1), s_k)
        p = torch.where(keep.reshape(nb, h, s_q, s_k), p, -p)
    return p.to(q.dtype)
