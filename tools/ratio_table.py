#!/usr/bin/env python3
"""flashmonoid / cuDNN per cell from interleaved peer records (bench/peers.py with
FM_PEERS_INTERLEAVED=1): one table per pass, TFLOP/s as ours/cuDNN, then the geomean, the minimum
and the count of cells >= 1.0 over head dims 64, 128, 256 (issues 8 and 9's bars; other head dims,
e.g. 96 and 192, are listed with their own line). Usage: ratio_table.py RECORDS.json [...]"""
import json
import math
import sys

recs = [r for p in sys.argv[1:] for r in json.load(open(p)) if r.get("timing") == "interleaved"]
cells = {}
for r in recs:
    cells.setdefault((r["pass"], r["hdim"], r["causal"], r["seqlen_k"]), {})[r["impl"]] = r["tflops"]
for pass_ in ("fwd", "bwd"):
    keys = sorted(k for k in cells if k[0] == pass_ and len(cells[k]) == 2)
    if not keys:
        continue
    seqlens = sorted({k[3] for k in keys})
    print(f"| {pass_} | hdim | causal | " + " | ".join(f"{s // 1024}k" if s >= 1024 else str(s) for s in seqlens) + " |")
    ratios, others = [], []
    for d, c in sorted({(k[1], k[2]) for k in keys}):
        row = []
        for s in seqlens:
            v = cells.get((pass_, d, c, s))
            if not v or len(v) != 2:
                row.append("")
                continue
            (ratios if d in (64, 128, 256) else others).append(v["flashmonoid"] / v["torch_cudnn"])
            row.append(f"{v['flashmonoid']:.0f}/{v['torch_cudnn']:.0f}")
        print(f"| | {d} | {'yes' if c else 'no'} | " + " | ".join(row) + " |")
    for label, rs in ((pass_, ratios), (f"{pass_}, other head dims (no bar)", others)):
        if rs:
            g = math.exp(sum(map(math.log, rs)) / len(rs))
            print(f"{label}: geomean {g:.3f}, min {min(rs):.2f}, >=1.0: {sum(x >= 1.0 for x in rs)}/{len(rs)}")
    print()
