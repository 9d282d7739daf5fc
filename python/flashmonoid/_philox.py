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


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox-4x32-10 on broadcastable uint64 arrays holding 32-bit values; returns 4 words."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) for c in (c0, c1, c2, c3))
    k0, k1 = np.uint64(k0), np.uint64(k1)
    for _ in range(_ROUNDS):
        p0 = _M0 * c0
        p1 = _M1 * c2
        hi0, lo0 = p0 >> np.uint64(32), p0 & _MASK32
        hi1, lo1 = p1 >> np.uint64(32), p1 & _MASK32
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + _W0) & _MASK32
        k1 = (k1 + _W1) & _MASK32
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
    words = philox4x32_10(cols // np.uint64(4), rows, offset & 0xFFFFFFFF, (offset >> 32) & 0xFFFFFFFF,
                          seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF)
    lane = (cols % np.uint64(4)).astype(np.int64)
    r = np.choose(np.broadcast_to(lane, np.broadcast_shapes(lane.shape, words[0].shape)), words)
    return r >= np.uint64(threshold(p))
