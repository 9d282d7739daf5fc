"""Host time of one Python `flash_attn_with_kvcache` call (issue 10's bar: <= 15 us).

A decoding step as a serving engine makes it: bf16, 32 query heads over 8 KV heads, hdim 128,
s_q = 1, a 1-token append with rotary, device cache_seqlens, contiguous and paged (page 16)
caches. 1000 calls are queued back to back and the device is synchronised once at the end, so the
host clock measures what the Python call costs the CPU. The cache is short (512 keys) so that the
GPU's ~3 launches per call keep up and the launch queue never fills (a full queue would make the
host wait for the GPU and time the device instead).
Median of 5 such runs. Usage: python bench/kvcache_host.py OUT.json
(run from outside the source tree, or with the installed package first on the path)."""
import json
import statistics
import sys
import time

import torch

from flashmonoid.flash_attn_interface import flash_attn_with_kvcache

CALLS, RUNS = 1000, 5


def case(b, page):
    h, hk, d, s_k = 32, 8, 128, 512
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(b, 1, h, d, device=dev, dtype=dt)
    k_new = torch.randn(b, 1, hk, d, device=dev, dtype=dt)
    v_new = torch.randn_like(k_new)
    cos = torch.randn(s_k, d // 2, device=dev, dtype=dt)
    sin = torch.randn_like(cos)
    seqlens = torch.full((b,), s_k - 1, device=dev, dtype=torch.int32)
    table = None
    if page:
        pages = b * s_k // page
        k_cache = torch.randn(pages, page, hk, d, device=dev, dtype=dt)
        table = torch.randperm(pages, device=dev, dtype=torch.int32).view(b, s_k // page)
    else:
        k_cache = torch.randn(b, s_k, hk, d, device=dev, dtype=dt)
    v_cache = torch.randn_like(k_cache)

    def call():
        # cache_seqlens stays the same: each call rewrites the same row (the timing needs no growth).
        return flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                       cache_seqlens=seqlens, block_table=table, causal=True)

    for _ in range(50):
        call()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(RUNS):
        t0 = time.perf_counter()
        for _ in range(CALLS):
            call()
        t1 = time.perf_counter()  # host time: the calls were only queued
        torch.cuda.synchronize()
        per_call.append((t1 - t0) / CALLS * 1e6)
    return {"impl": "flashmonoid_python", "pass": "decode_host", "dtype": "bf16", "hdim": d, "batch": b,
            "nheads": h, "nheads_k": hk, "seqlen_q": 1, "seqlen_k": s_k, "page_size": page, "append": True,
            "rotary": True, "calls": CALLS, "host_us": round(statistics.median(per_call), 2),
            "host_us_runs": [round(x, 2) for x in per_call], "device": torch.cuda.get_device_name()}


def main():
    out = []
    for b, page in ((1, 0), (1, 16), (8, 0)):
        out.append(case(b, page))
        print(json.dumps(out[-1]), file=sys.stderr)
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
