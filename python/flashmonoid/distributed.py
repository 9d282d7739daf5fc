"""Context parallelism: ring attention over torch.distributed.

The sequence is sharded over the ranks of a process group (Q, K and V alike). K/V shards travel
around the ring with batched point-to-point ops (``dist.batch_isend_irecv``; NCCL on GPUs, gloo on
CPUs), the next exchange overlapping the current block's attention; each rank folds its partial
(out, lse) results with flashmonoid's merge, the online-softmax monoid. The schedule (which chunk
pairs each step computes, with which mask, which it skips) is the C++ one (src/dist/ring_schedule,
through ``_C.ring_schedule``), so this path and the C++/NCCL path (include/flashmonoid/ring.hpp)
compute the same tasks in the same order. Backward: dQ stays local; dK/dV sum in float32 (float64
for float64 inputs) and travel with their shard, one exchange behind it.

Layouts (``layout=``), with chunk i of n covering tokens [floor(i*S/n), floor((i+1)*S/n)), no
padding, any S >= n:

- ``"zigzag"``: 2P chunks, rank r holds chunks r and 2P-1-r (the default with ``causal=True``:
  every rank then does the same causal work at every step);
- ``"contiguous"``: P chunks, rank r holds chunk r (the default otherwise).

``shard`` / ``unshard`` / ``gather`` move between the whole sequence and a rank's shard; they take
the layout explicitly, and it must be the one ring_attention runs with.

    # torchrun --nproc-per-node 2 train.py
    dist.init_process_group("nccl")
    q, k, v = (fmd.shard(x, world, rank, layout="zigzag") for x in (q_full, k_full, v_full))
    out = fmd.ring_attention(q, k, v, causal=True)          # differentiable in q, k, v
    out_full = fmd.gather(out, q_full.shape[1], layout="zigzag")

torch.compile: the local attention and merge are flashmonoid's custom ops (fake kernels
registered; a step of local work compiles with fullgraph=True), but ``ring_attention`` is an
autograd.Function around point-to-point communication, which dynamo does not trace. It is marked
``torch.compiler.disable``: a model calling it compiles with one graph break at the call (the code
before and after it compiles; measured with torch 2.15 on CPU/gloo: 2 graphs, 1 break, forward and
backward equal to eager).
"""

import functools
import math
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from . import _C
from . import _backend
from . import torch_ops as _ops

__all__ = ["ring_attention", "shard", "unshard", "gather", "shard_ranges", "default_layout"]


def default_layout(causal: bool, window: Tuple[int, int] = (-1, -1)) -> str:
    """The layout ring_attention assumes when none is given (as the C++ ring: zigzag for causal)."""
    return "zigzag" if causal or window[1] == 0 else "contiguous"


@functools.lru_cache(maxsize=256)
def _schedule(world_size, seqlen_total, layout, window_left, window_right, rank):
    return _C.ring_schedule(world_size, seqlen_total, layout, window_left, window_right, rank)


def _segments(seqlen_total, world_size, layout):
    return _schedule(world_size, seqlen_total, layout, -1, -1, 0)[0]


def shard_ranges(seqlen_total: int, world_size: int, rank: int, layout: str) -> List[Tuple[int, int]]:
    """Token ranges [begin, end) of the whole sequence that rank holds, in its local order."""
    return [(g, g + n) for g, _, n in _segments(seqlen_total, world_size, layout)[rank]]


def shard(x: Tensor, world_size: int, rank: int, *, layout: str, dim: int = 1) -> Tensor:
    """Rank's shard of a whole-sequence tensor (sequence along ``dim``). The layout has no default
    here: it must be the one ring_attention runs with (its default is ``default_layout(causal)``)."""
    return torch.cat([x.narrow(dim, b, e - b) for b, e in shard_ranges(x.shape[dim], world_size, rank, layout)], dim)


def unshard(shards: Sequence[Tensor], *, layout: str, dim: int = 1) -> Tensor:
    """The whole sequence from every rank's shard (in rank order)."""
    seqlen = sum(s.shape[dim] for s in shards)
    segs = _segments(seqlen, len(shards), layout)
    shape = list(shards[0].shape)
    shape[dim] = seqlen
    out = shards[0].new_empty(shape)
    for piece, rank_segs in zip(shards, segs):
        for g, local, n in rank_segs:
            out.narrow(dim, g, n).copy_(piece.narrow(dim, local, n))
    return out


def gather(x: Tensor, seqlen_total: int, *, layout: str, group=None, dim: int = 1) -> Tensor:
    """All-gather of every rank's shard into the whole sequence, on every rank (not differentiable)."""
    world = dist.get_world_size(group)
    segs = _segments(seqlen_total, world, layout)
    lens = [sum(n for _, _, n in s) for s in segs]
    longest = max(lens)
    padded = x
    if x.shape[dim] < longest:  # all_gather needs equal sizes; shards differ by at most 2 rows
        pad_shape = list(x.shape)
        pad_shape[dim] = longest - x.shape[dim]
        padded = torch.cat([x, x.new_zeros(pad_shape)], dim)
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return unshard([p.narrow(dim, 0, n) for p, n in zip(parts, lens)], layout=layout, dim=dim)


# ---------------------------------------------------------------------------------------------
# The ring


class _Ring:
    """One call's ring: the group, this rank's schedule and the options of every local call."""

    def __init__(self, q, k, group, seqlen_total, layout, causal, softmax_scale, window, softcap, deterministic):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        n = q.shape[1]
        self.seqlen = n * self.world if seqlen_total is None else int(seqlen_total)
        self.layout = layout or default_layout(causal, window)
        wl, wr = int(window[0]), 0 if causal else int(window[1])
        self.segments, self.steps, self.home_shift = _schedule(self.world, self.seqlen, self.layout, wl, wr, self.rank)
        self.lens = [sum(s[2] for s in segs) for segs in self.segments]
        if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"flashmonoid: q: ring_attention runs float32, float16 and bfloat16, got {q.dtype} (the "
                             "ops' float64 path recomputes each block's softmax alone and cannot use the global lse)")
        for name, t in (("q", q), ("k", k)):
            if t.dim() != 4:
                raise ValueError(f"flashmonoid: {name}: expected (b, s_local, heads, d), got {t.dim()} dimensions")
            if t.shape[1] != self.lens[self.rank]:
                raise ValueError(
                    f"flashmonoid: {name}: has {t.shape[1]} rows but rank {self.rank}'s shard of {self.seqlen} tokens "
                    f"in the {self.layout} layout over {self.world} ranks holds {self.lens[self.rank]} (pass "
                    f"seqlen_total= when the shards are not all equal)")
        self.scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
        self.softcap = float(softcap)
        self.deterministic = bool(deterministic)
    def peer(self, offset):
        r = (self.rank + offset) % self.world
        return dist.get_global_rank(self.group, r) if self.group is not None else r

    def exchange(self, send: Tensor, recv_rows: int, shift: int = 1):
        """Starts sending `send` (a packed (2, b, n, h_k, d) shard) to rank + shift and receiving
        rank - shift's, of recv_rows rows; returns (requests, receive buffer)."""
        shape = list(send.shape)
        shape[2] = recv_rows
        recv = send.new_empty(shape)
        ops = [dist.P2POp(dist.isend, send, self.peer(shift), self.group),
               dist.P2POp(dist.irecv, recv, self.peer(-shift), self.group)]
        return dist.batch_isend_irecv(ops), recv

    def source_rows(self, step):
        return self.lens[(self.rank - step) % self.world]

    def fwd(self, q, k, v, wl, wr, exchanging=False):
        """While an exchange is in flight (exchanging) an eager call runs the forward kernels
        non-persistent, so that NCCL's kernels get SMs as blocks retire (Context::persistent_kernels;
        a traced call keeps the default)."""
        if _ops._eager(q, k, v):
            with _backend.persistent_kernels(not exchanging):
                return _ops._fwd_impl(q, k, v, self.scale, False, wl, wr, self.softcap, None, 0.0, None, False)
        return _ops.fwd(q, k, v, self.scale, False, wl, wr, self.softcap, None, 0.0, None, False)

    def bwd(self, dout, q, k, v, out, lse, wl, wr, exchanging=False):
        """As fwd: an eager call beside an exchange in flight runs the (sm90, persistent) backward
        kernels one block per work item."""
        args = (dout, q, k, v, out, lse, self.scale, False, wl, wr, self.softcap, None, 0.0, None,
                self.deterministic)
        if _ops._eager(q, k, v):
            with _backend.persistent_kernels(not exchanging):
                return _ops._bwd_impl(*args)
        return _ops.bwd(*args)


def _wait(reqs):
    for r in reqs:
        r.wait()


def _acc_dtype(t):
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _ring_forward(ring: _Ring, q, k, v):
    n = q.shape[1]
    kv = torch.stack([k, v])  # (2, b, n, h_k, d): one message per exchange
    acc_out = acc_lse = None
    for t, (src, layers) in enumerate(ring.steps):
        pending = ring.exchange(kv, ring.source_rows(t + 1)) if t + 1 < len(ring.steps) else None
        for layer in layers:
            if len(layer) == 1 and layer[0][0] == 0 and layer[0][1] == n:
                q0, q1, k0, k1, wl, wr = layer[0]
                step_out, step_lse = ring.fwd(q, kv[0][:, k0:k1], kv[1][:, k0:k1], wl, wr, pending is not None)
            else:  # rows no task covers keep lse = -inf, the identity of merge
                step_out = torch.zeros_like(q)
                step_lse = torch.full((q.shape[0], q.shape[2], n), -math.inf, dtype=torch.float32, device=q.device)
                for q0, q1, k0, k1, wl, wr in layer:
                    o, lse = ring.fwd(q[:, q0:q1], kv[0][:, k0:k1], kv[1][:, k0:k1], wl, wr, pending is not None)
                    step_out[:, q0:q1] = o
                    step_lse[..., q0:q1] = lse
            if acc_out is None:
                acc_out, acc_lse = step_out.to(_acc_dtype(q)), step_lse
            else:
                acc_out, acc_lse = _ops.merge([acc_out, step_out], [acc_lse, step_lse])
        if pending is not None:
            _wait(pending[0])
            kv = pending[1]
    if acc_out is None:  # no key visible to any local row
        return torch.zeros_like(q), torch.full((q.shape[0], q.shape[2], n), -math.inf, device=q.device)
    return acc_out.to(q.dtype), acc_lse


def _ring_backward(ring: _Ring, dout, q, k, v, out, lse):
    n = q.shape[1]
    acc = _acc_dtype(q)
    kv = torch.stack([k, v])
    dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)  # gradient sums of the shard in kv
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dkv_pending = None
    for t, (src, layers) in enumerate(ring.steps):
        last = t + 1 == len(ring.steps)
        kv_pending = None if last else ring.exchange(kv, ring.source_rows(t + 1))
        for layer in layers:
            for q0, q1, k0, k1, wl, wr in layer:
                g_q, g_k, g_v = ring.bwd(dout[:, q0:q1], q[:, q0:q1], kv[0][:, k0:k1], kv[1][:, k0:k1],
                                         out[:, q0:q1], lse[..., q0:q1].contiguous(), wl, wr,
                                         exchanging=kv_pending is not None or dkv_pending is not None)
                dq[:, q0:q1] += g_q
                if dkv_pending is not None:  # earlier ranks' sums are needed from the first accumulation on
                    _wait(dkv_pending[0])
                    dkv, dkv_pending = dkv_pending[1], None
                dkv[0][:, k0:k1] += g_k
                dkv[1][:, k0:k1] += g_v
        if dkv_pending is not None:
            _wait(dkv_pending[0])
            dkv, dkv_pending = dkv_pending[1], None
        # On to the next rank, or after the last step home (shift 1 after a full ring).
        shift = ring.home_shift if last else 1
        if shift:
            dkv_pending = ring.exchange(dkv, n if last else ring.source_rows(t + 1), shift)
        if kv_pending is not None:
            _wait(kv_pending[0])
            kv = kv_pending[1]
    if dkv_pending is not None:  # after the last step this rank's own shard's sums come home
        _wait(dkv_pending[0])
        dkv = dkv_pending[1]
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring):
        out, lse = _ring_forward(ring, q, k, v)
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(ctx.ring, dout.contiguous(), q, k, v, out, lse)
        return dq, dk, dv, None


@torch.compiler.disable  # point-to-point communication is not traceable: one clean graph break here
def ring_attention(q: Tensor, k: Tensor, v: Tensor, group=None, causal: bool = False,
                   softmax_scale: Optional[float] = None, window: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                   *, layout: Optional[str] = None, seqlen_total: Optional[int] = None, deterministic: bool = False,
                   return_lse: bool = False):
    """Attention over a sequence sharded across the ranks of ``group`` (default: the world).

    q (b, s_local, h, d), k, v (b, s_local, h_k, d): this rank's shard in ``layout`` (default
    ``default_layout(causal, window)``: zigzag for causal). The result is this rank's rows of
    attention over the whole sequence with the given mask (``causal``, ``window``, as
    flashmonoid.attention on the whole sequence), differentiable in q, k and v. ``seqlen_total``
    defaults to s_local * world_size; pass it when the length does not divide evenly. Returns out,
    or (out, lse) with ``return_lse``. Collective: every rank calls it with the same arguments.
    """
    ring = _Ring(q, k, group, seqlen_total, layout, causal, softmax_scale, window, softcap, deterministic)
    out, lse = _RingAttention.apply(q, k, v, ring)
    return (out, lse) if return_lse else out
