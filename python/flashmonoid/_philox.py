"""The dropout keep-mask of include/flashmonoid/detail/philox.hpp, in NumPy.

The C++ backends draw it inside their kernels; Python needs the same mask in three places that
never touch those kernels: the float64 path of the torch ops (gradcheck), the S_dmask that
flash_attn's return_attn_probs hands back, and the tests that check CPU and GPU drop exactly the
elements this function names. Products are formed in uint64, where two 32-bit factors never
overflow, so the high and low words come out exact.
"""

import numpy as np

_MASK32 = np.uint64(0xFFFFFFFF)
_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)  # multipliers
_W0, _W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)  # Weyl key increments
_ROUNDS = 10


def philox4x32_10(c0, c1, c2, c3, k0, k1, word=np.uint64):
    """Philox-4x32-10 on broadcastable arrays holding 32-bit values; returns 4 words. word wraps
    the constants: np.uint64 for NumPy uint64 arrays, int for torch int64 tensors (whose products
    wrap modulo 2^64, so the shifted and masked words are exact as in uint64)."""
    mask, shift = word(0xFFFFFFFF), word(32)
    m0, m1, w0, w1 = word(0xD2511F53), word(0xCD9E8D57), word(0x9E3779B9), word(0xBB67AE85)
    k0, k1 = word(k0), word(k1)
    for _ in range(_ROUNDS):
        p0 = m0 * c0
        p1 = m1 * c2
        hi0, lo0 = (p0 >> shift) & mask, p0 & mask
        hi1, lo1 = (p1 >> shift) & mask, p1 & mask
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + w0) & mask
        k1 = (k1 + w1) & mask
    return c0, c1, c2, c3


def threshold(p):
    """min(floor(p * 2^32), 2^32 - 1) with p rounded to float32, as Options::dropout_p is a float."""
    t = float(np.float32(p)) * 4294967296.0
    return 0xFFFFFFFF if t >= 4294967295.0 else int(t)


def keep_mask(seed, offset, p, row_ids, num_cols):
    """Boolean (len(row_ids), num_cols): True where the element survives dropout with probability p.

    row_ids are head * total_q + global query row (see params.hpp: dropout_row_id); columns are
    key indices within the sequence.
    """
    seed, offset = int(seed), int(offset)
    rows = (np.asarray(row_ids, dtype=np.uint64) & _MASK32)[:, None]
    cols = np.arange(num_cols, dtype=np.uint64)[None, :]
    words = philox4x32_10(cols // np.uint64(4), rows, np.uint64(offset & 0xFFFFFFFF),
                          np.uint64((offset >> 32) & 0xFFFFFFFF), seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF)
    lane = (cols % np.uint64(4)).astype(np.int64)
    r = np.choose(np.broadcast_to(lane, np.broadcast_shapes(lane.shape, words[0].shape)), words)
    return r >= np.uint64(threshold(p))


def keep_mask_torch(seed, offset, p, row_ids, num_cols):
    """keep_mask on the device of row_ids (an int64 torch tensor), vectorised: one Philox call per
    4 columns, int64 arithmetic."""
    import torch

    seed, offset = int(seed), int(offset)
    rows = (row_ids & 0xFFFFFFFF)[:, None]
    groups = torch.arange((num_cols + 3) // 4, dtype=torch.int64, device=row_ids.device)[None, :]
    words = philox4x32_10(groups, rows, offset & 0xFFFFFFFF, (offset >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF,
                          (seed >> 32) & 0xFFFFFFFF, word=int)
    r = torch.stack(torch.broadcast_tensors(*words), dim=-1).reshape(rows.shape[0], -1)[:, :num_cols]
    return r >= threshold(p)
