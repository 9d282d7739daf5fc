#!/usr/bin/env python3
"""Probe (issue 10 follow-up): hf_bench measured monoid's eager training step 0.78x of sdpa when
generate with a static cache (compiled decoding step, CUDA graph trees) ran before it in the same
process, 0.98-0.99x in a process of its own. Times monoid's training step before and after a
compiled static-cache generate (with sdpa, then with monoid), with flashmonoid.sdpa.stats() and
torch.profiler tables of one step in each state.

    python3 bench/experiments/hf_compile_then_train_probe.py OUT_DIR
"""
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import hf_bench as hb  # noqa: E402
from flashmonoid import sdpa  # noqa: E402

out = sys.argv[1] if len(sys.argv) > 1 else "."
os.makedirs(out, exist_ok=True)
args = SimpleNamespace(device="cuda", layers=8, batch=8, prompt=2048, new=64)
model = hb.model_for(args, torch.bfloat16)
ids, mask = hb.batch(args)
right = mask.flip(-1)
labels = ids.masked_fill(right == 0, -100)


def train():
    model.zero_grad(set_to_none=True)
    model(ids, attention_mask=right, labels=labels).loss.backward()


def gen_static():
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=args.new, min_new_tokens=args.new,
                       do_sample=False, pad_token_id=0, cache_implementation="static")


def measure(tag, impl="monoid", n=7):
    model.set_attn_implementation(impl)
    train()
    torch.cuda.synchronize()
    sdpa.reset_stats()
    ts, hosts = [], []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        train()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
        hosts.append(t1 - t0)
    print(f"{tag:40s} {impl:7s} step {statistics.median(ts) * 1e3:7.2f} ms  host {statistics.median(hosts) * 1e3:7.2f} ms"
          f"  stats {sdpa.stats()}", flush=True)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        train()
        torch.cuda.synchronize()
    t = prof.key_averages()
    with open(os.path.join(out, f"{tag.replace(' ', '_')}_{impl}.txt"), "w") as f:
        f.write(t.table(sort_by="self_cuda_time_total", row_limit=25) + "\n")
        f.write(t.table(sort_by="cpu_time_total", row_limit=40) + "\n")


measure("fresh", "monoid")
measure("fresh", "sdpa")
model.set_attn_implementation("sdpa")
gen_static(); gen_static()
measure("after sdpa static generate", "monoid")
model.set_attn_implementation("monoid")
gen_static(); gen_static()
measure("after monoid static generate", "monoid")
measure("after monoid static generate", "sdpa")
torch._dynamo.reset()
measure("after dynamo reset", "monoid")
