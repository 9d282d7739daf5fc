#!/usr/bin/env python3
"""One training step of a Llama model through Hugging Face transformers, per attention
implementation, in one process (issue 9's bar: pass "train_step", ms per impl).

The model: transformers.LlamaForCausalLM from a LlamaConfig built here, random init (no download):
hidden 2048, 16 query heads of hdim 128 over --kv-heads KV heads, intermediate 5632, --layers
layers, vocab 32000, bf16 weights (--dtype fp32 is the CPU default: PyTorch's CPU bf16 GEMMs
without AVX512-BF16 take minutes, 122 s for one 128x32000 by 32000x2048 product on a 2-core EPYC).
A step is forward with labels (the mean cross-entropy HF computes), backward, optimizer.step() and
zero_grad: AdamW (fused on CUDA; its moments in the weights' dtype) unless --optimizer says sgd or
none.

Implementations (each on its own copy of the same initial weights, fed the same batches):
  torch_sdpa               attn_implementation "sdpa", PyTorch's own backend choice (recorded)
  torch_flash              "sdpa" under sdpa_kernel(SDPBackend.FLASH_ATTENTION)
  torch_cudnn              "sdpa" under sdpa_kernel(SDPBackend.CUDNN_ATTENTION)
  flashmonoid              "sdpa" under flashmonoid.sdpa.override(): HF calls
                           F.scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=True)
                           when the model gets no attention_mask (no padding), which the override
                           routes; an explicit causal mask would be routed too, after reading it
  flashmonoid_flash_attn   flashmonoid.flash_attn_interface.flash_attn_func registered with HF's
                           AttentionInterface (transformers >= 4.48): the flash-attn layout without
                           SDPA; "flash_attention_2" itself would need the flash_attn package
Routed SDPA calls are counted with flashmonoid.sdpa.stats(); one per layer per step is expected.

Timing: the implementations take turns step by step (a rotating order), so that clock or thermal
drift hits them alike: 3 warm-up steps each (the first, on the initial weights, gives loss0, which
must agree between implementations within bf16 tolerance), then --steps timed steps each, a CUDA
event pair around each step with the device synchronised before and after; the median is reported.
Token ids are fresh random ids in [1, vocab) every step (the same for every implementation).
--budget: the whole run's seconds; the timed steps per impl are cut to fit (never under 3).

Output: a JSON list of records {impl, pass: "train_step", dtype, batch, seqlen, nheads, nheads_k,
hdim, layers, ms, tokens_per_s, loss0, routed, fallback, optimizer, sdpa_backend, max_mem_gb,
steps, device, torch, transformers} at the path given first; a table on stdout. Exit status 1 when
a loss0 disagrees or flashmonoid routed fewer calls than expected.

    python3 bench/train_step.py OUT.json [--kv-heads 4] [--layers 8] [--batch 2] [--seqlen 4096]
    python3 bench/train_step.py OUT.json --device cpu --layers 1 --seqlen 128 --batch 1 --steps 2
"""
import argparse
import contextlib
import copy
import json
import platform
import statistics
import sys
import time

import torch
import transformers
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import LlamaConfig, LlamaForCausalLM

IMPLS = ("torch_sdpa", "torch_flash", "torch_cudnn", "flashmonoid", "flashmonoid_flash_attn")
CUDA_ONLY = {"torch_flash", "torch_cudnn"}
LOSS_RTOL = 5e-3  # loss0 ~ ln(32000) = 10.4 at init; bf16's step is 2^-8 = 0.4% relative


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="JSON output path")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--impls", default=",".join(IMPLS), help="comma-separated subset of " + ",".join(IMPLS))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=16, help="4 for GQA (16 query heads)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--steps", type=int, default=10, help="timed steps per impl (median)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per impl; the first gives loss0")
    p.add_argument("--dtype", choices=("bf16", "fp32"), help="default: bf16 on CUDA, fp32 on the CPU")
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd", "none"))
    p.add_argument("--budget", type=float, default=120.0, help="seconds for the whole run, imports included")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.dtype is None:
        args.dtype = "bf16" if args.device == "cuda" else "fp32"
    args.torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    return args


def build_model(args, dev):
    config = LlamaConfig(hidden_size=2048, num_attention_heads=16, num_key_value_heads=args.kv_heads,
                         head_dim=128, intermediate_size=5632, num_hidden_layers=args.layers,
                         vocab_size=32000, max_position_embeddings=max(args.seqlen, 4096), use_cache=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(args.torch_dtype)
    try:
        with torch.device(dev):  # initialised in place: no 0.5 G-parameter init on the host
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    return model.to(device=dev, dtype=args.torch_dtype).train()


def register_flash_attn():
    """Registers flashmonoid's flash_attn_func as HF attention "flashmonoid_flash_attn"."""
    from transformers import AttentionInterface
    from flashmonoid.flash_attn_interface import flash_attn_func

    def forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        # No mask function is registered under this name, so HF passes none (no padding here);
        # the attention is the model's causal one. HF hands (b, h, s, d) and wants (b, s, h, d) back.
        if attention_mask is not None:
            raise ValueError("flashmonoid_flash_attn takes no attention mask (unpadded causal only)")
        out = flash_attn_func(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                              dropout_p=dropout, softmax_scale=scaling, causal=True)
        return out, None

    AttentionInterface.register("flashmonoid_flash_attn", forward)


def impl_context(name):
    """A fresh context manager that runs a step the way the implementation `name` wants."""
    if name == "torch_flash":
        return sdpa_kernel(SDPBackend.FLASH_ATTENTION)
    if name == "torch_cudnn":
        return sdpa_kernel(SDPBackend.CUDNN_ATTENTION)
    if name == "flashmonoid":
        import flashmonoid.sdpa
        return flashmonoid.sdpa.override()
    return contextlib.nullcontext()


def sdpa_choice(args, dev):
    """The backend PyTorch's SDPA picks for this model's attention call (private API; None if absent)."""
    try:
        q = torch.empty(args.batch, 16, args.seqlen, 128, device=dev, dtype=args.torch_dtype)
        k = torch.empty(args.batch, args.kv_heads, args.seqlen, 128, device=dev, dtype=args.torch_dtype)
        choice = torch._fused_sdp_choice(q, k, k, None, 0.0, True, enable_gqa=args.kv_heads != 16)
        return SDPBackend(choice).name.lower()
    except Exception:
        return None


class Runner:
    """One implementation's model copy, optimizer and step times."""

    def __init__(self, name, base, args):
        self.name, self.args = name, args
        self.model = copy.deepcopy(base)
        if name == "flashmonoid_flash_attn":
            self.model.config._attn_implementation = name
        params = self.model.parameters()
        if args.optimizer == "adamw":
            self.opt = torch.optim.AdamW(params, lr=1e-4, fused=args.device == "cuda")
        elif args.optimizer == "sgd":
            self.opt = torch.optim.SGD(params, lr=1e-4)
        else:
            self.opt = None
        self.times, self.loss0, self.steps_run = [], None, 0

    def step(self, ids):
        with impl_context(self.name):
            loss = self.model(input_ids=ids, labels=ids).loss
            loss.backward()
        if self.opt is not None:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        else:
            self.model.zero_grad(set_to_none=True)
        self.steps_run += 1
        return loss

    def timed_step(self, ids):
        """Runs one step; returns its milliseconds (CUDA events, or the host clock on the CPU)."""
        cuda = self.args.device == "cuda"
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        loss = self.step(ids)
        if cuda:
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end)
        else:
            ms = (time.perf_counter() - t0) * 1e3
        return ms, loss


def main():
    t_start = time.perf_counter()
    args = parse_args()
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device (use --device cpu for a smoke test)")
    names = [n for n in args.impls.split(",") if n]
    for n in names:
        if n not in IMPLS:
            sys.exit(f"unknown impl {n!r}; known: {', '.join(IMPLS)}")
    if dev != "cuda":
        for n in [n for n in names if n in CUDA_ONLY]:
            print(f"skip {n}: needs CUDA")
            names.remove(n)
    if any(n.startswith("flashmonoid") for n in names):
        try:
            import flashmonoid.sdpa
        except ImportError as e:
            print(f"skip flashmonoid impls: {e}")
            names = [n for n in names if not n.startswith("flashmonoid")]
    if "flashmonoid_flash_attn" in names:
        try:
            register_flash_attn()
        except ImportError as e:  # transformers without AttentionInterface (< 4.48)
            print(f"skip flashmonoid_flash_attn: {e}")
            names.remove("flashmonoid_flash_attn")

    base = build_model(args, dev)
    n_params = sum(p.numel() for p in base.parameters())
    device_name = torch.cuda.get_device_name(0) if dev == "cuda" else (platform.processor() or "cpu")
    print(f"Llama {args.layers} layers, {n_params / 1e6:.0f} M params, heads 16/{args.kv_heads}, hdim 128, "
          f"batch {args.batch} x seqlen {args.seqlen}, {args.dtype}, optimizer {args.optimizer}, {device_name}, "
          f"torch {torch.__version__}, transformers {transformers.__version__}")
    runners = [Runner(n, base, args) for n in names]
    del base
    gen = torch.Generator(device=dev).manual_seed(args.seed + 1)

    def fresh_ids():
        return torch.randint(1, 32000, (args.batch, args.seqlen), device=dev, generator=gen)

    def rotated(rnd):
        k = rnd % len(runners) if runners else 0
        return runners[k:] + runners[:k]

    if any(r.name == "flashmonoid" for r in runners):
        flashmonoid.sdpa.reset_stats()  # only its steps run under the override
    failed = []
    for rnd in range(args.warmup):
        ids = fresh_ids()
        for r in rotated(rnd):
            try:
                ms, loss = r.timed_step(ids)
            except (RuntimeError, ValueError) as e:  # e.g. no cuDNN kernel for this shape
                print(f"skip {r.name}: {str(e).splitlines()[0][:200]}")
                failed.append(r)
                continue
            r.last_ms = ms
            if rnd == 0:
                r.loss0 = loss.item()
        for r in failed:
            runners.remove(r)
        failed.clear()
        if dev == "cuda":
            torch.cuda.empty_cache()

    # Timed rounds: as many as fit the budget, at least 3 (or --steps if fewer).
    round_s = sum(r.last_ms for r in runners) / 1e3
    left = args.budget - (time.perf_counter() - t_start)
    rounds = min(args.steps, max(min(3, args.steps), int(left / max(round_s, 1e-6))))
    if rounds < args.steps:
        print(f"budget: {rounds} timed steps per impl instead of {args.steps}")
    for rnd in range(rounds):
        ids = fresh_ids()
        for r in rotated(rnd):
            ms, _ = r.timed_step(ids)
            r.times.append(ms)

    records, ok = [], True
    ref = runners[0].loss0 if runners else None
    backends = {"torch_sdpa": sdpa_choice(args, dev), "torch_flash": "flash_attention",
                "torch_cudnn": "cudnn_attention"}
    tokens = args.batch * args.seqlen
    for r in runners:
        ms = statistics.median(r.times)
        rec = dict(impl=r.name, **{"pass": "train_step"}, dtype=args.dtype, batch=args.batch, seqlen=args.seqlen,
                   nheads=16, nheads_k=args.kv_heads, hdim=128, layers=args.layers, ms=round(ms, 3),
                   tokens_per_s=round(tokens / ms * 1e3), loss0=r.loss0, routed=None, fallback=None,
                   optimizer=args.optimizer, sdpa_backend=backends.get(r.name),
                   max_mem_gb=None, steps=len(r.times), device=device_name, torch=torch.__version__,
                   transformers=transformers.__version__)
        if r.name == "flashmonoid":
            routed = flashmonoid.sdpa.stats()
            rec["routed"], rec["fallback"] = routed["routed"], routed["fallback"]
            if routed["routed"] != args.layers * r.steps_run or routed["fallback"]:
                print(f"flashmonoid: {routed['routed']} SDPA calls routed, {routed['fallback']} fell back; "
                      f"expected {args.layers * r.steps_run} routed ({args.layers} layers x {r.steps_run} steps)")
                ok = False
        if abs(r.loss0 - ref) > LOSS_RTOL * abs(ref):
            print(f"{r.name}: loss0 {r.loss0:.5f} disagrees with {runners[0].name}'s {ref:.5f}")
            ok = False
        records.append(rec)
    if dev == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**30
        for rec in records:  # all copies live at once: the peak is the run's, not one impl's
            rec["max_mem_gb"] = round(peak, 2)

    with open(args.out, "w") as f:
        json.dump(records, f, indent=1)
    print("speed: the first impl's ms / this impl's ms; routed: SDPA calls routed / made")
    print(f"{'impl':24} {'ms':>9} {'tokens/s':>10} {'loss0':>9} {'speed':>8}  routed  backend")
    for rec in records:
        routed_s = "" if rec["routed"] is None else f"{rec['routed']}/{rec['routed'] + rec['fallback']}"
        print(f"{rec['impl']:24} {rec['ms']:9.2f} {rec['tokens_per_s']:10d} {rec['loss0']:9.5f} "
              f"{records[0]['ms'] / rec['ms']:7.3f}x  {routed_s:6}  {rec['sdpa_backend'] or ''}")
    print(f"{len(records)} impls, {time.perf_counter() - t_start:.0f} s, peak memory "
          f"{records[0]['max_mem_gb'] if records else None} GB; wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
