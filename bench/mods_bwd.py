#!/usr/bin/env python3
"""Backward with score modifiers (softcap, ALiBi, dropout) on the H100: the sm90 kernels against
the forced sm80 ones (FLASHMONOID_CUDA_PATH=sm80), through flashmonoid.flash_attn_interface.
PyTorch's SDPA backends take none of these modifiers, so there is no vendor peer here.

bf16, 16k tokens, hidden 2048 (batch = 16384 / seqlen, heads = 2048 / hdim), causal. The backward
alone is timed: one forward with grad, then torch.autograd.grad(out, (q, k, v), dout) with
retain_graph, CUDA events around each call, 3 warm-ups, the median of --reps. FLOPs = 2.5 · 4 · b ·
h · s² · d / 2 (causal). Fresh random inputs per configuration.

    python3 bench/mods_bwd.py OUT.json [--reps 10]
Output: JSON records {impl, pass: "bwd", mod, dtype, hdim, seqlen, batch, nheads, causal, ms,
tflops, device}; a table on stdout.
"""
import argparse
import json
import os
import statistics

import torch

import flashmonoid.flash_attn_interface as fai

MODS = {
    "softcap": dict(softcap=30.0),
    "alibi": dict(alibi=True),
    "dropout": dict(dropout_p=0.1),
}


def time_bwd(q, k, v, reps, **kw):
    alibi = kw.pop("alibi", False)
    if alibi:
        kw["alibi_slopes"] = torch.rand(q.shape[2], device=q.device, dtype=torch.float32) * 0.1
    out = fai.flash_attn_func(q, k, v, causal=True, **kw)
    dout = torch.randn_like(out)
    times = []
    for i in range(3 + reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    device = torch.cuda.get_device_name()
    records = []
    for hdim in (128, 256):
        for seqlen in (4096, 16384):
            batch, heads = 16384 // seqlen, 2048 // hdim
            flops = 2.5 * 4 * batch * heads * seqlen * seqlen * hdim / 2
            for mod, kw in MODS.items():
                gen = torch.Generator(device="cuda").manual_seed(hdim * 100003 + seqlen)
                shape = (batch, seqlen, heads, hdim)
                q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
                           for _ in range(3))
                for impl, path in (("flashmonoid", None), ("flashmonoid_sm80", "sm80")):
                    if path:
                        os.environ["FLASHMONOID_CUDA_PATH"] = path
                    else:
                        os.environ.pop("FLASHMONOID_CUDA_PATH", None)
                    ms = time_bwd(q, k, v, args.reps, **dict(kw))
                    records.append(dict(impl=impl, mod=mod, dtype="bf16", hdim=hdim, seqlen=seqlen, batch=batch,
                                        nheads=heads, causal=True, ms=ms, tflops=flops / ms / 1e9, device=device,
                                        **{"pass": "bwd"}))
                    print(f"{impl:18s} {mod:8s} hdim {hdim} s {seqlen:5d}: {ms:8.3f} ms {flops / ms / 1e9:6.1f} TFLOP/s",
                          flush=True)
    os.environ.pop("FLASHMONOID_CUDA_PATH", None)
    with open(args.out, "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
