"""GPU check of flashmonoid.distributed.ring_attention over NCCL (run by tools/ring_gpu_run.sh under
torchrun): every rank builds the same whole-sequence inputs, runs the ring on its shard, and the
gathered out / dq / dk / dv are held to the FlashAttention rule against float64 attention on the
whole sequence; single-GPU flashmonoid.attention on the whole sequence is checked the same way and
the largest ring - single-GPU difference is recorded. Rank 0 writes JSON to argv[1]."""

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "python"))
import flashmonoid as fm  # noqa: E402
import flashmonoid.distributed as fmd  # noqa: E402
from torch_reference import attention as ref_attention  # noqa: E402

CASES = [
    dict(seqlen=2051, h=8, h_k=2, d=128, causal=True, layout="zigzag"),
    dict(seqlen=2048, h=8, h_k=8, d=64, causal=False, layout="contiguous"),
    dict(seqlen=1999, h=8, h_k=1, d=128, causal=False, layout="contiguous"),
    dict(seqlen=2048, h=4, h_k=2, d=128, causal=True, layout="zigzag", window=(300, -1), softcap=30.0),
]


def error_budget(ref, lowp, dtype):
    scale = max(ref.abs().max().item(), 1.0)
    unit = {torch.bfloat16: 2**-8, torch.float16: 2**-11}[dtype]
    return 2 * (lowp.double() - ref).abs().max().item() + 2 * unit * scale


def main():
    gpu = torch.cuda.is_available()  # without one (a smoke test of this script): gloo on the CPU
    dist.init_process_group("nccl" if gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda" if gpu else "cpu")
    seed = int(os.environ.get("FM_SEED", "1"))
    results, ok = [], True
    for i, c in enumerate(CASES):
        g = torch.Generator().manual_seed(seed * 100 + i)
        S, dtype = c["seqlen"], torch.bfloat16
        mk = lambda h: torch.randn(1, S, h, c["d"], generator=g).to(dev, dtype)  # noqa: E731
        q, k, v, dout = mk(c["h"]), mk(c["h_k"]), mk(c["h_k"]), mk(c["h"])
        opts = dict(causal=c["causal"], window=c.get("window", (-1, -1)), softcap=c.get("softcap", 0.0))
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        ref = ref_attention(*xs, **opts)
        ref_g = torch.autograd.grad(ref, xs, dout.double())
        ls = [x.clone().requires_grad_() for x in (q, k, v)]
        lowp = ref_attention(*ls, **opts, upcast=False)
        lowp_g = torch.autograd.grad(lowp, ls, dout)
        ss = [x.clone().requires_grad_() for x in (q, k, v)]
        single = fm.attention(*ss, **opts)
        single_g = torch.autograd.grad(single, ss, dout)
        parts = [fmd.shard(x, world, rank, layout=c["layout"]) for x in (q, k, v, dout)]
        lq, lk, lv = (t.clone().requires_grad_() for t in parts[:3])
        out = fmd.ring_attention(lq, lk, lv, causal=c["causal"], window=opts["window"], softcap=opts["softcap"],
                                 layout=c["layout"], seqlen_total=S)
        out.backward(parts[3])
        got = [fmd.gather(t.detach(), S, layout=c["layout"]) for t in (out, lq.grad, lk.grad, lv.grad)]
        rec = dict(c, world_size=world, device=torch.cuda.get_device_name() if gpu else "cpu")
        for name, x, r, lp, sg in zip(("out", "dq", "dk", "dv"), got, (ref,) + ref_g, (lowp,) + lowp_g,
                                      (single,) + single_g):
            r = r.double()
            err, budget = (x.double() - r).abs().max().item(), error_budget(r, lp, dtype)
            single_err = (sg.double() - r).abs().max().item()
            rec[name] = dict(error=err, budget=budget, single_gpu_error=single_err,
                             max_diff_vs_single_gpu=(x.double() - sg.double()).abs().max().item())
            ok &= err <= budget
        results.append(rec)
        if rank == 0:
            print(json.dumps(rec), flush=True)
    if rank == 0:
        json.dump(dict(passed=bool(ok), cases=results), open(sys.argv[1], "w"), indent=1)
        print("PASSED" if ok else "FAILED", flush=True)
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
