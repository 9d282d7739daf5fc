#!/usr/bin/env python3
"""Page-1 KV-cache calls against contiguous and page-16 ones on the CPU (the per-row route's two layouts)."""
import timeit, torch
from flashmonoid import flash_attn_interface as fa
torch.set_num_threads(2)
def t(f, n):
    f(); return min(timeit.repeat(f, number=n, repeat=3))/n*1e6
for b, s_k, h, h_k, d, dt in ((8, 2048, 16, 4, 64, torch.float32), (1, 8192, 32, 8, 128, torch.float32), (4, 4096, 32, 8, 128, torch.bfloat16)):
    q = torch.randn(b, 1, h, d, dtype=dt); k = torch.randn(b, s_k, h_k, d, dtype=dt); v = torch.randn(b, s_k, h_k, d, dtype=dt)
    seq = torch.full((b,), s_k, dtype=torch.int32)
    c = t(lambda: fa.flash_attn_with_kvcache(q, k, v, cache_seqlens=seq), 20)
    table = (torch.arange(b)[:, None] * s_k + torch.arange(s_k)).int()
    kp, vp = k.view(b * s_k, 1, h_k, d), v.view(b * s_k, 1, h_k, d)
    r = t(lambda: fa.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=seq, block_table=table), 20)
    t16 = (torch.arange(b)[:, None] * (s_k // 16) + torch.arange(s_k // 16)).int()
    k16, v16 = k.view(b * s_k // 16, 16, h_k, d), v.view(b * s_k // 16, 16, h_k, d)
    p16 = t(lambda: fa.flash_attn_with_kvcache(q, k16, v16, cache_seqlens=seq, block_table=t16), 20)
    kh, vh = (x.transpose(1, 2).contiguous() for x in (k, v))
    qh = q.view(b, 1, h_k, h // h_k, d).transpose(1, 2).reshape(b * h_k, 1, h // h_k, d)
    th = (torch.arange(b * h_k)[:, None] * s_k + torch.arange(s_k)).int()
    hh = t(lambda: fa.flash_attn_with_kvcache(qh, kh.view(-1, 1, 1, d), vh.view(-1, 1, 1, d), cache_seqlens=seq.repeat_interleave(h_k), block_table=th), 20)
    print(f"b {b} s_k {s_k} h {h}/{h_k} d {d} {dt}: contiguous {c:.0f} us, page-16 {p16:.0f}, page-1 rows {r:.0f} ({r/c:.2f}x), page-1 heads {hh:.0f} ({hh/c:.2f}x)")
