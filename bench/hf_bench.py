#!/usr/bin/env python3
"""transformers' attention implementations against attn_implementation="monoid" (flashmonoid.hf) on
one model, same weights, alternated rounds: greedy `generate` of a padded batch (prefill and
decoding steps) with a dynamic cache and with a static one (whose decoding step transformers compiles
on a GPU, CUDA graphs included; round 0, not timed, compiles), a training step (forward + backward) of
a right-padded batch, and one of the same sequences padding-free (packed in one row).

    python3 bench/hf_bench.py [out.json] [--device cuda|cpu] [--layers 8] [--batch 8] [--prompt 512]
                              [--new 64] [--rounds 3] [--threads N] [--profile DIR] [--tasks a,b]
                              [--processes one|each]

A random Llama (GQA 16/4, head dim 64, hidden 1024) in bf16 on CUDA, float32 on the CPU. Prints
median seconds per call and the ratio sdpa / monoid; writes the records as JSON. --profile DIR
also writes, per implementation and task, torch.profiler's table of one more call (by self device
time, then by host time) under DIR.
"""

import argparse
import json
import statistics
import time

import torch
import transformers

from flashmonoid import hf

hf.register()


def model_for(args, dtype):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                                      num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=4,
                                      head_dim=64, max_position_embeddings=8192)
    return transformers.LlamaForCausalLM(config).to(args.device, dtype)


def batch(args):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 32000, (args.batch, args.prompt), generator=g)
    mask = torch.ones_like(ids)
    for i in range(args.batch):  # lengths from a half to all of the prompt
        mask[i, :int(torch.randint(0, args.prompt // 2 + 1, (1,), generator=g))] = 0
    return ids.to(args.device), mask.to(args.device)


def timed(fn, device):
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def profile(args, model, impls, tasks):
    import os

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    os.makedirs(args.profile, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    device_key = "self_cuda_time_total" if args.device == "cuda" else "self_cpu_time_total"
    for impl in impls:
        model.set_attn_implementation(impl)
        for task, fn in tasks.items():
            with torch_profile(activities=activities) as prof:
                timed(fn, args.device)
            table = prof.key_averages()
            with open(os.path.join(args.profile, f"{task}_{impl}.txt"), "w") as f:
                f.write(table.table(sort_by=device_key, row_limit=30) + "\n")
                f.write(table.table(sort_by="cpu_time_total", row_limit=40) + "\n")


def each_task_in_own_process(args):
    import os
    import subprocess
    import sys
    import tempfile

    records = []
    for task in args.tasks.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "records.json")
            cmd = [sys.executable, os.path.abspath(__file__), out, "--device", args.device, "--layers", str(args.layers),
                   "--batch", str(args.batch), "--prompt", str(args.prompt), "--new", str(args.new),
                   "--rounds", str(args.rounds), "--threads", str(args.threads), "--tasks", task]
            if args.profile:
                cmd += ["--profile", args.profile]
            subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
            for r in json.load(open(out)):
                records.append(dict(r, process="own"))
    report(args, records)


def report(args, records):
    """The table of medians (sdpa / monoid per task) and the JSON records."""
    by = {(r["task"], r["impl"]): r for r in records}
    r0 = records[0]
    print(f"{r0['device']}, torch.{r0['dtype']}, Llama {args.layers} layers GQA 16/4 d 64, batch {args.batch} x "
          f"{args.prompt} (padded), {args.new} new tokens; medians of {args.rounds} alternated rounds, s"
          + (", each task in its own process" if r0.get("process") == "own" else ""))
    for task in dict.fromkeys(r["task"] for r in records):
        s, m = by[(task, "sdpa")]["seconds"], by[(task, hf.NAME)]["seconds"]
        print(f"{task:15s}  sdpa {s:8.3f}  monoid {m:8.3f}  sdpa/monoid {s / m:5.2f}")
    if args.out:
        json.dump(records, open(args.out, "w"), indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--profile", default=None)
    ap.add_argument("--tasks", default="generate,generate_static,train_step,train_step_packed",
                    help="comma-separated tasks to time")
    ap.add_argument("--processes", choices=("one", "each"), default="one",
                    help="each: every task in a process of its own, the records merged (a compiled generate "
                         "through monoid left our eager calls' host time ~13 ms a training step higher in the "
                         "same process on the H200; bench/NOTES.md)")
    args = ap.parse_args()
    if args.processes == "each":
        return each_task_in_own_process(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = model_for(args, dtype)
    ids, mask = batch(args)
    right = mask.flip(-1)  # training batches are padded on the right
    labels = ids.masked_fill(right == 0, -100)

    def generate():
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=args.new, min_new_tokens=args.new,
                           do_sample=False, pad_token_id=0)

    def generate_static():  # a static cache: on a GPU transformers compiles the decoding step (CUDA graphs)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=args.new, min_new_tokens=args.new,
                           do_sample=False, pad_token_id=0, cache_implementation="static")

    def train_step():
        model.zero_grad(set_to_none=True)
        model(ids, attention_mask=right, labels=labels).loss.backward()

    # The same sequences padding-free: packed into one row, position_ids restarting at each (as
    # DataCollatorWithFlattening gives), no cache, so transformers masks them block-diagonally.
    held = [ids[i][mask[i].bool()] for i in range(args.batch)]
    packed_ids = torch.cat(held)[None]
    packed_pos = torch.cat([torch.arange(len(x), device=args.device) for x in held])[None]
    packed_labels = packed_ids.masked_fill(packed_pos == 0, -100)  # no prediction across a boundary

    def train_step_packed():
        model.zero_grad(set_to_none=True)
        model(packed_ids, position_ids=packed_pos, labels=packed_labels, use_cache=False).loss.backward()

    impls = ["sdpa", hf.NAME]
    tasks = {"generate": generate, "generate_static": generate_static, "train_step": train_step,
             "train_step_packed": train_step_packed}
    tasks = {t: tasks[t] for t in args.tasks.split(",")}
    times = {(task, impl): [] for task in tasks for impl in impls}
    for r in range(args.rounds + 1):  # round 0 warms up
        for impl in (impls if r % 2 else impls[::-1]):
            model.set_attn_implementation(impl)
            for task, fn in tasks.items():
                t = timed(fn, args.device)
                if r:
                    times[(task, impl)].append(t)
    if args.profile:
        profile(args, model, impls, tasks)
    records = []
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    for (task, impl), ts in times.items():
        records.append({"impl": impl, "task": task, "device": name, "dtype": str(dtype).removeprefix("torch."),
                        "layers": args.layers, "batch": args.batch, "prompt": args.prompt, "new_tokens": args.new,
                        "threads": torch.get_num_threads(), "seconds": statistics.median(ts), "rounds": ts,
                        "torch": torch.__version__, "transformers": transformers.__version__})
    report(args, [dict(r, process="shared") for r in records])


if __name__ == "__main__":
    main()
