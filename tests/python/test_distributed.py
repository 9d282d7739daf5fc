"""flashmonoid.distributed: ring attention over torch.distributed, on CPU processes with gloo.

Four processes run ring_attention over the world and over subgroups of 2 and 3 ranks; the
gathered out and the gradients of q, k, v equal attention on the whole sequence under the
FlashAttention rule: float32 within 1e-5 of the float64 reference, bfloat16 within twice the
error of the same math in bfloat16 plus two rounding units. Skipped without torch. The schedule
binding and the shard helpers are tested in one process.
"""

import math
import os
import tempfile

import pytest

import flashmonoid._C as _C

CASES = [
    dict(causal=True, layout="zigzag"),
    dict(causal=False, layout="contiguous"),
    dict(causal=True, layout="contiguous", window=(6, -1)),
    dict(causal=False, layout="zigzag", window=(5, 3), softcap=2.0, softmax_scale=0.4),
    dict(causal=True, layout="contiguous", window=(3, -1)),  # the ring stops after 2 steps at P = 4
]


def test_schedule_binding_covers_the_sequence_and_names_bad_arguments():
    for world, seqlen, layout in [(2, 9, "zigzag"), (3, 10, "contiguous"), (4, 33, "zigzag")]:
        segments, steps, home = _C.ring_schedule(world, seqlen, layout, -1, 0, world - 1)
        assert home == 1  # causal without a window: a full ring
        covered = sorted((g, g + n) for segs in segments for g, _, n in segs)
        assert covered[0][0] == 0 and covered[-1][1] == seqlen
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
        assert [src for src, _ in steps] == [(world - 1 - t) % world for t in range(world)]
    # A causal window of 150 over shards of 100: three steps, then dK/dV go 6 ranks on (2 back).
    _, steps, home = _C.ring_schedule(8, 800, "contiguous", 150, 0, 0)
    assert (len(steps), home) == (3, 6)
    with pytest.raises(ValueError, match="seqlen_total"):
        _C.ring_schedule(4, 7, "zigzag", -1, 0, 0)
    with pytest.raises(ValueError, match="layout"):
        _C.ring_schedule(2, 8, "striped", -1, 0, 0)


def _case_inputs(seed, seqlen, dtype, torch):
    g = torch.Generator().manual_seed(seed)
    b, h, h_k, d = 2, 4, 2, 16
    q = torch.randn(b, seqlen, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, seqlen, h_k, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, seqlen, h_k, d, generator=g, dtype=torch.float64)
    dout = torch.randn(b, seqlen, h, d, generator=g, dtype=torch.float64)
    return [x.to(dtype) for x in (q, k, v, dout)]


def _check(name, got, ref, lowp, dtype, torch):
    scale = max(ref.abs().max().item(), 1.0)
    err = (got.double() - ref).abs().max().item()
    if dtype == torch.float32:
        budget = 1e-5 * scale
    else:  # twice the same-math-in-bf16 error, plus two rounding units at the output's magnitude
        budget = 2 * (lowp.double() - ref).abs().max().item() + 2 * 2**-8 * scale
    assert err <= budget, f"{name}: max error {err} > {budget}"


def _worker(rank, world, init_file, seed):
    import torch
    import torch.distributed as dist

    import flashmonoid.distributed as fmd
    from torch_reference import attention as ref_attention

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    groups = {p: dist.new_group(list(range(p))) for p in (2, 3)}
    groups[world] = None  # the default group
    f32, bf16 = torch.float32, torch.bfloat16
    # (ranks, case, dtype): every case and P, both dtypes, in few runs (CI has 2 cores).
    RUNS = [(4, 0, f32), (4, 1, bf16), (4, 2, f32), (4, 4, f32), (2, 2, bf16), (2, 3, f32), (3, 0, bf16), (3, 3, f32),
            (3, 4, bf16)]
    try:
        for p, i, dtype in RUNS:
            group = groups[p]
            if rank >= p:
                continue
            case = dict(CASES[i])
            layout = case.pop("layout")
            seqlen = 4 * p + 3 + i  # odd lengths: chunks differ by a row
            q, k, v, dout = _case_inputs(seed + 7 * i + p, seqlen, dtype, torch)
            xs = [x.detach().requires_grad_() for x in (q, k, v)]
            ref = ref_attention(*xs, **case)
            ref_grads = torch.autograd.grad(ref, xs, dout.double())
            lxs = [x.detach().requires_grad_() for x in (q, k, v)]
            lowp = ref_attention(*lxs, **case, upcast=False)
            lowp_grads = torch.autograd.grad(lowp, lxs, dout)
            parts = [fmd.shard(x, p, rank, layout=layout) for x in (q, k, v, dout)]
            lq, lk, lv = (t.clone().requires_grad_() for t in parts[:3])
            out = fmd.ring_attention(lq, lk, lv, group, causal=case.get("causal", False),
                                     window=case.get("window", (-1, -1)), softcap=case.get("softcap", 0.0),
                                     softmax_scale=case.get("softmax_scale"), layout=layout, seqlen_total=seqlen)
            out.backward(parts[3])
            got = [fmd.gather(t.detach(), seqlen, group=group, layout=layout) for t in (out, lq.grad, lk.grad, lv.grad)]
            for name, x, r, lp in zip(("out", "dq", "dk", "dv"), got, (ref,) + ref_grads, (lowp,) + lowp_grads):
                _check(f"{name} {case} {layout} {dtype} P{p}", x, r.double(), lp, dtype, torch)
    finally:
        dist.destroy_process_group()


def test_ring_attention_gloo_matches_whole_sequence():
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    with tempfile.TemporaryDirectory() as tmp:
        seed = int(torch.randint(0, 2**31, ()).item())  # fresh inputs each run
        mp.spawn(_worker, args=(4, os.path.join(tmp, "init"), seed), nprocs=4, join=True)


def test_ring_attention_one_process_errors_and_compile():
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    import flashmonoid.distributed as fmd

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'init')}", rank=0, world_size=1)
        try:
            x = torch.randn(1, 8, 2, 16, dtype=torch.float64)
            with pytest.raises(ValueError, match="q: ring_attention runs float32"):
                fmd.ring_attention(x, x, x)
            y = torch.randn(1, 8, 2, 16)
            with pytest.raises(ValueError, match="seqlen_total="):
                fmd.ring_attention(y, y, y, seqlen_total=9)

            # Under torch.compile the ring is one graph break; forward and backward equal eager.
            def model(x, w):
                q = (x @ w).view(1, 8, 2, 16)
                return (fmd.ring_attention(q, q, q, causal=True) * 2).sum()

            x, w = torch.randn(8, 32), torch.randn(32, 32, requires_grad=True)
            explained = torch._dynamo.explain(model)(x, w)
            assert (explained.graph_count, explained.graph_break_count) == (2, 1)
            eager = model(x, w)
            (g_eager,) = torch.autograd.grad(eager, w)
            compiled = torch.compile(model, backend="eager")(x, w)
            (g_compiled,) = torch.autograd.grad(compiled, w)
            assert torch.equal(eager, compiled) and torch.equal(g_eager, g_compiled)
        finally:
            dist.destroy_process_group()


def test_shard_unshard_round_trip_and_ranges():
    torch = pytest.importorskip("torch")
    import flashmonoid.distributed as fmd

    x = torch.arange(2 * 23 * 3).reshape(2, 23, 3)
    for world, layout in [(2, "zigzag"), (4, "zigzag"), (3, "contiguous")]:
        shards = [fmd.shard(x, world, r, layout=layout) for r in range(world)]
        assert sum(s.shape[1] for s in shards) == 23
        assert torch.equal(fmd.unshard(shards, layout=layout), x)
    assert fmd.shard_ranges(8, 2, 0, "zigzag") == [(0, 2), (6, 8)]
    assert fmd.shard_ranges(8, 2, 1, "zigzag") == [(2, 4), (4, 6)]
    assert fmd.default_layout(True) == "zigzag" and fmd.default_layout(False) == "contiguous"


def test_local_compute_compiles_without_graph_breaks():
    """The per-step local work (the fwd op on a shard, the merge op) traces with fullgraph=True."""
    torch = pytest.importorskip("torch")
    from flashmonoid import torch_ops

    def step(q, k, v, acc_out, acc_lse):
        o, lse = torch_ops.fwd(q, k, v, 0.25, False, -1, 0, 0.0, None, 0.0, None, False)
        return torch_ops.merge([acc_out, o], [acc_lse, lse])

    q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
    acc_out, acc_lse = torch.zeros(1, 8, 2, 16), torch.full((1, 2, 8), -math.inf)
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    o, lse = compiled(q, k, v, acc_out, acc_lse)
    ref_o, ref_lse = step(q, k, v, acc_out, acc_lse)
    assert torch.equal(o, ref_o) and torch.equal(lse, ref_lse)
