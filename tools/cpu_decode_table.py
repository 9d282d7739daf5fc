#!/usr/bin/env python3
"""The tables of tools/cpu_decode_device_run.sh from its output folder (bench/results/cpu_decode_*.txt).

    python3 tools/cpu_decode_table.py OUT

Per thread count: each shape's decode-cpu-bench times (the tiled mainloop, the decoding one on
(b, s, h_k, d) K/V and on head-major K/V) beside torch's CPU SDPA on head-major tensors and on views
of (b, s, h_k, d) ones, and torch's time over ours on the same memory. Then, where the folder has
an A/B (ab_<new|ref>[_hm]_t<threads>_<round>.txt), each shape's median (min-max) over the rounds."""
import collections
import glob
import os
import re
import statistics
import sys

out = sys.argv[1]
SHAPE = r"(b=\S+ s_k=\S+ h=\S+ h_k=\S+ d=\S+ \S+ s_q=\d+)"


def times(path, field):
    """shape -> us of `field` (tiled / decode / torch) in one output file."""
    got = {}
    if os.path.exists(path):
        for line in open(path):
            m = re.match(SHAPE + r".*\| " + field + r" ([0-9.]+) us", line)
            if m:
                got[m.group(1)] = float(m.group(2))
    return got


def ratio(a, b):
    return f"{a / b:.2f}" if a and b else "-"


for t in (16, 2):
    tiled, dec = times(f"{out}/table_t{t}.txt", "tiled"), times(f"{out}/table_t{t}.txt", "decode")
    if not dec:
        continue
    hm = times(f"{out}/table_hm_t{t}.txt", "decode")
    th, tb = times(f"{out}/torch_t{t}.txt", "torch"), times(f"{out}/torchbshd_t{t}.txt", "torch")
    print(f"threads {t}: shape | tiled us | decode us | decode head-major us | torch us | torch bshd us | "
          "torch/decode head-major | torch bshd/decode | tiled/decode")
    for s in dec:
        print(f"{s:<48} {tiled.get(s, 0):10.1f} {dec[s]:10.1f} {hm.get(s, 0):10.1f} {th.get(s, 0):10.1f} "
              f"{tb.get(s, 0):10.1f}   {ratio(th.get(s), hm.get(s)):>5}   {ratio(tb.get(s), dec[s]):>5}   "
              f"{ratio(tiled.get(s), dec[s]):>5}")

ab = collections.defaultdict(dict)  # (threads, shape, new|ref) -> {round: us}
for path in glob.glob(f"{out}/ab_*_t*_*.txt"):
    m = re.match(r"ab_(new|ref)(_hm)?_t(\d+)_(\d+)\.txt", os.path.basename(path))
    if m:
        for s, us in times(path, "decode").items():
            ab[(int(m.group(3)), s + (" head-major" if m.group(2) else ""), m.group(1))][int(m.group(4))] = us
for t in sorted({k[0] for k in ab}, reverse=True):
    shapes = sorted({k[1] for k in ab if k[0] == t})
    print(f"A/B threads {t}: shape | new median (min-max) | ref median (min-max) | ref/new of the medians | "
          "median of the rounds' ref/new | each round's ref/new")
    for s in shapes:
        cell = {v: ab.get((t, s, v), {}) for v in ("new", "ref")}
        if not all(cell.values()):
            continue
        med = {v: statistics.median(x.values()) for v, x in cell.items()}
        rounds = sorted(set(cell["new"]) & set(cell["ref"]))
        per = [cell["ref"][r] / cell["new"][r] for r in rounds]
        print(f"{s:<60} " + " ".join(f"{med[v]:9.1f} ({min(cell[v].values()):.0f}-{max(cell[v].values()):.0f})"
                                     for v in ("new", "ref")) +
              f"   {med['ref'] / med['new']:.2f}   {statistics.median(per):.2f}   " + " ".join(f"{x:.2f}" for x in per))
