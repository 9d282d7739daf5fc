#!/usr/bin/env python3
"""Probe (issue 10 follow-up): hf_bench measured monoid's eager training step 0.78x of sdpa when
generate with a static cache (compiled decoding step, CUDA graph trees) ran before it in the same
process, 0.98-0.99x in a process of its own. Times monoid's training step before and after a
compiled static-cache generate (with sdpa, then with monoid), with flashmonoid.sdpa.stats() and
torch.profiler tables of one step and cProfile of three in each state, the garbage collector's
collections and seconds during the timed steps, and the same after gc.freeze().

    python3 bench/experiments/hf_compile_then_train_probe.py OUT_DIR
"""
import gc
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
small = os.environ.get("FM_PROBE_SMALL") == "1"  # a CPU smoke test of the script
args = SimpleNamespace(device="cpu" if small else "cuda", layers=2 if small else 8, batch=2 if small else 8,
                       prompt=32 if small else 2048, new=4 if small else 64)
model = hb.model_for(args, torch.float32 if small else torch.bfloat16)
ids, mask = hb.batch(args)
right = mask.flip(-1)
labels = ids.masked_fill(right == 0, -100)


def train():
    model.zero_grad(set_to_none=True)
    model(ids, attention_mask=right, labels=labels).loss.backward()


def sync():
    if args.device == "cuda":
        torch.cuda.synchronize()


def gen_static():
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=args.new, min_new_tokens=args.new,
                       do_sample=False, pad_token_id=0, cache_implementation="static")


_gc = {"n": [0, 0, 0], "s": 0.0, "t0": 0.0}


def _gc_callback(phase, info):  # collections per generation and their seconds, during measure()
    if phase == "start":
        _gc["t0"] = time.perf_counter()
    else:
        _gc["n"][info["generation"]] += 1
        _gc["s"] += time.perf_counter() - _gc["t0"]


gc.callbacks.append(_gc_callback)


def measure(tag, impl="monoid", n=7):
    model.set_attn_implementation(impl)
    train()
    sync()
    sdpa.reset_stats()
    ts, hosts = [], []
    _gc["n"], _gc["s"] = [0, 0, 0], 0.0
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        train()
        t1 = time.perf_counter()
        sync()
        ts.append(time.perf_counter() - t0)
        hosts.append(t1 - t0)
    print(f"{tag:40s} {impl:7s} step {statistics.median(ts) * 1e3:7.2f} ms  host {statistics.median(hosts) * 1e3:7.2f} ms"
          f"  stats {sdpa.stats()}  gc {_gc['n']} {_gc['s'] / n * 1e3:.2f} ms/step  objects {len(gc.get_objects())}",
          flush=True)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU] + ([] if small else [ProfilerActivity.CUDA])) as prof:
        train()
        sync()
    t = prof.key_averages()
    import cProfile
    import io
    import pstats
    import re
    py = cProfile.Profile()  # the Python side of 3 steps: where host time outside torch's ops goes
    py.enable()
    for _ in range(3):
        train()
    sync()
    py.disable()
    text = io.StringIO()
    pstats.Stats(py, stream=text).sort_stats("tottime").print_stats(30)
    pstats.Stats(py, stream=text).sort_stats("cumulative").print_stats(40)
    with open(os.path.join(out, re.sub(r"[^A-Za-z0-9]+", "_", tag) + f"_{impl}.txt"), "w") as f:
        f.write(t.table(sort_by="self_cpu_time_total" if small else "self_cuda_time_total", row_limit=25) + "\n")
        f.write(t.table(sort_by="cpu_time_total", row_limit=40) + "\n")
        f.write(text.getvalue())


measure("fresh", "monoid")
measure("fresh", "sdpa")
model.set_attn_implementation("sdpa")
gen_static(); gen_static()
measure("after sdpa static generate", "monoid")
model.set_attn_implementation("monoid")
gen_static(); gen_static()
measure("after monoid static generate", "monoid")
measure("after monoid static generate", "sdpa")
gc.collect()
gc.freeze()  # every object now alive out of the collector's generations
measure("after gc.freeze()", "monoid")
measure("after gc.freeze()", "sdpa")
