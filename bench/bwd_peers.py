#!/usr/bin/env python3
"""PyTorch's flash backward (SDPA FLASH_ATTENTION backend, FlashAttention-2) on the shapes of the
CUDA backward's timing test (tests/cuda/test_bwd_cuda.cu, DISABLED_Timing): bf16, 16k tokens,
hidden 2048, seqlen 4k and 16k, hdim 64/128/256, causal and not; timed as there (CUDA events,
3 warm-ups, median of 20), FLOPs 2.5 · 4·b·h·s²·d, halved when causal. One line per shape, in the
test's format, so that both sides of a device run read alike."""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def median_ms(fn, warmup=3, reps=20):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


for d in (64, 128, 256):
    for s in (4096, 16384):
        for causal in (False, True):
            b, h = 16384 // s, 2048 // d
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
                       for _ in range(3))
            g = torch.randn_like(q)
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                ms = median_ms(lambda: torch.autograd.grad(o, (q, k, v), g, retain_graph=True))
            flops = 2.5 * 4.0 * b * h * s * s * d / (2 if causal else 1)
            print(f"torch-flash bwd bf16 hdim {d} seqlen {s} batch {b} heads {h} causal {int(causal)}: "
                  f"{ms:.3f} ms, {flops / ms * 1e-9:.1f} TFLOP/s", flush=True)
            del q, k, v, g, o
