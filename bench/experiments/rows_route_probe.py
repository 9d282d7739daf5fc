#!/usr/bin/env python3
"""The per-row route (pages of one key row) against the band analysis' KV-cache route on a decoding
step's masks: (1) host time of a step of L layers' attention calls (a fresh left-padded mask per step,
as generate makes one per forward), (2) device time of one call over long caches, page-1 rows against
the contiguous call. CUDA events / perf_counter, medians."""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import peers  # noqa: E402

from flashmonoid import flash_attn_interface as fa
from flashmonoid import hf, sdpa

dev = "cuda"
torch.manual_seed(0)


class M(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 4


def step_host(route, b=8, h=16, h_k=4, d=64, s_k=2112, layers=8, steps=200):
    q = torch.randn(b, h, 1, d, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(b, h_k, s_k, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
    pads = torch.randint(0, 1024, (b,), device=dev)
    base = torch.arange(s_k, device=dev)[None] >= pads[:, None]
    masks = [base[:, None, None].clone() for _ in range(steps)]
    real = sdpa._band_of_cached
    if route == "rows":
        sdpa._band_of_cached = lambda *a: "forced"
    m = M()
    try:
        for it in range(2):
            torch.cuda.synchronize()
            t = time.perf_counter()
            for mask in masks:
                for _ in range(layers):
                    if route == "sdpa":
                        from transformers.integrations.sdpa_attention import sdpa_attention_forward
                        sdpa_attention_forward(m, q, k, v, mask)
                    else:
                        hf.attention_forward(m, q, k, v, mask)
            torch.cuda.synchronize()
            dt = (time.perf_counter() - t) / steps
    finally:
        sdpa._band_of_cached = real
    return dt


def device_time(fn):
    fn()
    return peers.event_ms(fn) * 1e3


def kernels(b, s_k, h=32, h_k=8, d=128):
    q = torch.randn(b, 1, h, d, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(b, s_k, h_k, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
    seq = torch.full((b,), s_k, dtype=torch.int32, device=dev)
    contiguous = device_time(lambda: fa.flash_attn_with_kvcache(q, k, v, cache_seqlens=seq))
    # The per-row route's "rows" layout: pages of one key row with every KV head.
    table = (torch.arange(b, device=dev)[:, None] * s_k + torch.arange(s_k, device=dev)).int()
    kp, vp = k.view(b * s_k, 1, h_k, d), v.view(b * s_k, 1, h_k, d)
    rows = device_time(lambda: fa.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=seq, block_table=table))
    # The "heads" layout: head-major caches, a call entry per (entry, KV head).
    kh, vh = (t.transpose(1, 2).contiguous() for t in (k, v))
    qh = q.view(b, 1, h_k, h // h_k, d).transpose(1, 2).reshape(b * h_k, 1, h // h_k, d)
    table_h = (torch.arange(b * h_k, device=dev)[:, None] * s_k + torch.arange(s_k, device=dev)).int()
    seq_h = seq.repeat_interleave(h_k)
    heads = device_time(lambda: fa.flash_attn_with_kvcache(qh, kh.view(-1, 1, 1, d), vh.view(-1, 1, 1, d),
                                                           cache_seqlens=seq_h, block_table=table_h))
    mb = 2 * b * s_k * h_k * d * 2 / 1e6
    return mb, contiguous, rows, heads


if "--kernels" not in sys.argv:
    print("host time of one decoding step's attention (8 layers, b 8, 2112 keys, bf16), us:")
    for r in ("sdpa", "bands", "rows", "sdpa", "bands", "rows"):
        print(f"  {r:6s} {step_host(r) * 1e6:8.1f}")
print("device time of one call (GQA 32/8, d 128, bf16), us: MB, contiguous, page-1 rows, page-1 heads")
for b, s_k in ((1, 4096), (8, 4096), (1, 32768), (8, 32768), (32, 32768)):
    mb, c, r, hh = kernels(b, s_k)
    print(f"  b {b:2d} s_k {s_k:6d} {mb:7.1f} MB  {c:8.1f} {r:8.1f} {hh:8.1f}   rows/contig {r / c:5.2f} heads/contig {hh / c:5.2f}")
