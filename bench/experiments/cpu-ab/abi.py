#!/usr/bin/env python3
"""abi.py d s calls BUILD_A BUILD_B ... (run from the folder holding the BUILDs; build.sh makes them): the binaries as servers, called alternately one call at a time
(rotating order); per binary the median ms, and per binary the median of its paired ratios to A."""
import os, statistics, subprocess, sys
d, s, calls = sys.argv[1:4]
bins = sys.argv[4:]
env = dict(os.environ, SERVE="1", OMP_WAIT_POLICY="PASSIVE")
ps = [subprocess.Popen([f"./{b}/h", d, s, "1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
      for b in bins]
for p in ps:  # warm-up call each
    p.stdin.write("x\n"); p.stdin.flush(); p.stdout.readline()
t = {b: [] for b in bins}
for i in range(int(calls)):
    order = list(range(len(bins)))
    order = order[i % len(bins):] + order[:i % len(bins)]
    for j in order:
        ps[j].stdin.write("x\n"); ps[j].stdin.flush()
        t[bins[j]].append(float(ps[j].stdout.readline()))
for p in ps:
    p.stdin.close(); p.wait()
a = bins[0]
for b in bins:
    r = [y / x for x, y in zip(t[a], t[b])]
    print(f"d={d} s={s} {b}: median {statistics.median(t[b]):.3f} ms, min {min(t[b]):.3f}, paired ratio to {a}: median {statistics.median(r):.4f}")
