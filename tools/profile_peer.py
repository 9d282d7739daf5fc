#!/usr/bin/env python3
"""One training shape of PyTorch's flash backend (FlashAttention-2), forward + backward three times,
for a profiler: profile_peer.py HDIM CAUSAL SEQLEN (batch·seqlen = 16k tokens, hidden 2048, bf16, as
bench/gpu/gpu_bench.cu --case)."""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

d, causal, s = int(sys.argv[1]), bool(int(sys.argv[2])), int(sys.argv[3])
b, h = 16384 // s, 2048 // d
q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
           for _ in range(3))
g = torch.randn_like(q)
with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
    for _ in range(3):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        o.backward(g)
torch.cuda.synchronize()
