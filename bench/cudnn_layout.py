"""cuDNN's decoding read (PyTorch SDPA, cudnn backend) over two cache layouts, beside
`flashmonoid-gpu-bench --kv-layout` (issue 10, bench/NOTES.md): K/V stored (b, h_k, s, d), SDPA's own
layout and the one bench/peers.py times, and stored (b, s, h_k, d), flash-attn's (the benchmark's
cache), passed to SDPA as the transposed view. Graph-replayed TB/s of K/V over the copy bandwidth,
GQA 32/8, hdim 128, bf16, s_q = 1, no append. Prints one line per shape and layout. b = 1 at 4k keys
(17 MB of K/V) stays in the 50 MB L2 across the graph's calls, as in gpu_bench: a latency-bound
call, not an HBM read."""
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peers import copy_tbps, graph_ms  # noqa: E402


def main():
    copy = copy_tbps()
    h, hk, d = 32, 8, 128
    print(f"{'b':<4} {'s_k':<7} {'variant':<24} {'TB/s':>8} {'x copy':>8}")
    for b, sk in ((1, 4096), (1, 32768), (8, 4096), (1, 131072), (8, 32768)):
        kv_bytes = 2 * b * hk * sk * d * 2
        q = torch.randn(b, h, 1, d, device="cuda", dtype=torch.bfloat16)
        for name, shape, to_bhsd in (("cudnn (b,h,s,d)", (b, hk, sk, d), lambda t: t),
                                     ("cudnn (b,s,h,d)", (b, sk, hk, d), lambda t: t.transpose(1, 2))):
            k = to_bhsd(torch.randn(*shape, device="cuda", dtype=torch.bfloat16))
            v = to_bhsd(torch.randn(*shape, device="cuda", dtype=torch.bfloat16))
            try:
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    ms = graph_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
            except RuntimeError as e:
                print(f"{b:<4} {sk:<7} {name:<24} failed: {str(e).splitlines()[0]}")
                continue
            tbps = kv_bytes / ms / 1e9
            print(f"{b:<4} {sk:<7} {name:<24} {tbps:8.3f} {tbps / copy:8.3f}")
            del k, v


if __name__ == "__main__":
    main()
