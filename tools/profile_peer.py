#!/usr/bin/env python3
"""One training shape of a PyTorch SDPA backend, run three times, for a profiler:
profile_peer.py HDIM CAUSAL SEQLEN [flash|cudnn] [fwd|fwd_bwd] (batch·seqlen = 16k tokens, hidden 2048,
bf16, as bench/gpu/gpu_bench.cu --case; default FlashAttention-2's forward + backward)."""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

d, causal, s = int(sys.argv[1]), bool(int(sys.argv[2])), int(sys.argv[3])
backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[sys.argv[4] if len(sys.argv) > 4 else "flash"]
backward = (sys.argv[5] if len(sys.argv) > 5 else "fwd_bwd") == "fwd_bwd"
b, h = 16384 // s, 2048 // d
q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_(backward)
           for _ in range(3))
g = torch.randn_like(q)
with sdpa_kernel(backend):
    for _ in range(3):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        if backward:
            o.backward(g)
torch.cuda.synchronize()
