#!/usr/bin/env python3
"""torch's CPU scaled_dot_product_attention at the decoding shapes of decode-cpu-bench
(bench/decode_cpu.cpp): median microseconds per call and minor page faults per call, on THREADS
threads (default 2, as decode-cpu-bench's --threads).

    python3 bench/decode_cpu_torch.py [repeats]        # the default shapes
    SHAPES="1,4096,32,8,128,fp32,8 ..." python3 bench/decode_cpu_torch.py 5

A shape is b,s_k,h,h_k,d,dtype,s_q; q (b, h, s_q, d), k and v (b, h_k, s_k, d), not causal,
enable_gqa=True, under no_grad; calls per timing as decode-cpu-bench's (about 2e8 bytes of K/V).
LAYOUT=bshd: k and v are views of (b, s_k, h_k, d) tensors, the KV cache's layout in
flash_attn_with_kvcache and ours (what a caller of SDPA with such a cache passes); default head-major.
Run it alternately with decode-cpu-bench (CPU_DECODE_NOTES.md: three rounds each).
"""
import os
import resource
import statistics
import sys
import time

import torch

torch.set_num_threads(int(os.environ.get("THREADS", "2")))
shapes = []
for dt in ("fp32", "bf16"):
    for sq in (1, 4):
        for b, sk in ((1, 512), (1, 4096), (1, 32768), (8, 4096)):
            shapes.append((b, sk, 32, 8, 128, dt, sq))
        shapes.append((1, 4096, 32, 32, 128, dt, sq))
        shapes.append((1, 4096, 32, 8, 64, dt, sq))
shapes.append((1, 5, 4, 1, 64, "fp32", 1))
if os.environ.get("SHAPES"):
    shapes = [tuple(int(x) if x.isdigit() else x for x in s.split(",")) for s in os.environ["SHAPES"].split()]
repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 9
g = torch.Generator().manual_seed(0)
for b, sk, h, hk, d, dt, sq in shapes:
    t = torch.float32 if dt == "fp32" else torch.bfloat16
    q = torch.randn(b, h, sq, d, generator=g).to(t)
    if os.environ.get("LAYOUT") == "bshd":
        k = torch.randn(b, sk, hk, d, generator=g).to(t).transpose(1, 2)
        v = torch.randn(b, sk, hk, d, generator=g).to(t).transpose(1, 2)
    else:
        k = torch.randn(b, hk, sk, d, generator=g).to(t)
        v = torch.randn(b, hk, sk, d, generator=g).to(t)
    f = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    work = b * sk * hk * d * (4 if dt == "fp32" else 2) * 2
    calls = max(1, min(2000, int(2e8 / work)))
    with torch.no_grad():
        f()
        ts, faults = [], 0.0
        for _ in range(repeats):
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            for _ in range(calls):
                f()
            ts.append((time.perf_counter() - t0) / calls * 1e6)
            faults += (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / calls
    print(f"b={b} s_k={sk} h={h} h_k={hk} d={d} {dt} s_q={sq} | torch {statistics.median(ts):.1f} us "
          f"({faults / repeats:.1f} faults)", flush=True)
