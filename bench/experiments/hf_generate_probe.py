#!/usr/bin/env python3
"""Where a transformers generate step's host time goes, sdpa against monoid (hf_bench's model and
batch): seconds per decoding step from two generate lengths, then cProfile of one generate each."""
import cProfile
import io
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, "bench")
import hf_bench  # noqa: E402
from flashmonoid import hf, sdpa  # noqa: E402


class Args:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    batch = 8
    prompt = int(sys.argv[2]) if len(sys.argv) > 2 else 2048


args = Args()
dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
model = hf_bench.model_for(args, dtype)
ids, mask = hf_bench.batch(args)


def gen(n):
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)


impls = ["sdpa", hf.NAME]
t = {(i, n): [] for i in impls for n in (1, 33)}
for r in range(4):
    for impl in impls if r % 2 else impls[::-1]:
        model.set_attn_implementation(impl)
        for n in (1, 33):
            dt = hf_bench.timed(lambda: gen(n), args.device)
            if r:
                t[(impl, n)].append(dt)
for impl in impls:
    pre, full = (statistics.median(t[(impl, n)]) for n in (1, 33))
    print(f"{impl:6s} prefill+1 {pre * 1e3:8.2f} ms   per step {(full - pre) / 32 * 1e3:7.3f} ms")
for impl in impls:
    model.set_attn_implementation(impl)
    sdpa.reset_stats()
    prof = cProfile.Profile()
    prof.enable()
    gen(33)
    if args.device == "cuda":
        torch.cuda.synchronize()
    prof.disable()
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("tottime").print_stats(30)
    st.sort_stats("cumulative").print_stats(60)
    print(f"===== {impl} (stats {sdpa.stats()})\n" + s.getvalue())
