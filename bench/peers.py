#!/usr/bin/env python3
"""PyTorch SDPA peers (flash = FlashAttention-2, cudnn, efficient) on the shapes of
bench/gpu/gpu_bench.cu, timed the same way (CUDA events, 3 warm-ups, median of 15; training shapes
as queues of calls behind a sleep kernel, so no side's host time is timed; forwards under
no_grad, the flash backward through its aten op, so that autograd's host work is not timed, as
flashmonoid's C++ calls have none; cudnn's and efficient's backward through autograd), written as a
JSON list of records {impl, pass, dtype, hdim, causal, batch, nheads, nheads_k, seqlen_q, seqlen_k,
ms, tflops | tbps, device}; the KV-cache decoding records add page_size, append, rotary, timing and
copy_tbps. Usage: peers.py OUT.json
Environment (to fit a short device lease): FM_PEERS_NO_BWD=1 times the forward only;
FM_PEERS_IMPLS=torch_flash,torch_cudnn keeps those backends only; FM_PEERS_DECODE_ONLY=1 skips
the training shapes; cuDNN on issue 10's KV-cache decoding shapes unless FM_PEERS_KVCACHE=0 (main).
Decoding is timed twice: per call (events) and as CUDA-graph replays (graph).
FM_PEERS_FLEX=1 adds FlexAttention (torch.compile'd flex_attention, impl torch_flex) on the training
shapes at the seqlens of FM_PEERS_FLEX_SEQLENS (default 1024,4096,16384: every shape compiles its own
kernels, and the whole grid does not fit a device call); FM_PEERS_FLEX=only runs nothing else.
FM_PEERS_INTERLEAVED=1 instead times flashmonoid (the Python package, which must be importable) and
cuDNN on the training shapes in one process, alternated: per shape, ROUNDS rounds of CALLS calls of
each timed together behind a sleep kernel (the host's share untimed), the order reversed every round,
the median round; records carry timing "interleaved". Separate
processes put the two minutes apart, and cuDNN's own number moved by up to 9% between such runs.
FM_PEERS_EXTRA_HDIMS (default 96,192; "" for none) adds those head dims to the interleaved run,
forward only (the sm90 forward's own buckets; the bars are over 64, 128, 256)."""
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

WARMUP, REPS = 3, 15
BACKENDS = {"torch_flash": SDPBackend.FLASH_ATTENTION, "torch_cudnn": SDPBackend.CUDNN_ATTENTION,
            "torch_efficient": SDPBackend.EFFICIENT_ATTENTION}
if os.environ.get("FM_PEERS_IMPLS"):
    BACKENDS = {k: v for k, v in BACKENDS.items() if k in os.environ["FM_PEERS_IMPLS"].split(",")}
WITH_BWD = os.environ.get("FM_PEERS_NO_BWD", "0") == "0"
DEVICE = torch.cuda.get_device_name(0)


def event_ms(fn):
    """Median over REPS of fn() timed with CUDA events (no host synchronisation in the region)."""
    times = []
    for _ in range(REPS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def median_ms(fn):
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    return event_ms(fn)


# Length of queued_ms's sleep in cycles; doubled whenever the host's enqueueing outlasts it.
_SLEEP = {"cycles": 1_000_000, "ms_per_cycle": 0.0}


def queued_ms(fn, calls):
    """One sample: `calls` calls queued behind a sleep kernel between two events, per call, so the
    host's time per call (Python, autograd, launches) is not timed. That holds only while the sleep
    outlasts the host's enqueueing of the calls: a backward through autograd costs the host ~0.1-0.2
    ms per call, more than a 512-token shape's device time, and with a fixed 0.5 ms sleep two
    interleaved runs of the same kernels read hdim 128 causal 512 at 148 and 176 TFLOP/s. So the
    sample is retaken with a doubled sleep whenever the enqueueing took over 80% of it."""
    if not _SLEEP["ms_per_cycle"]:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        torch.cuda._sleep(10_000_000)
        b.record()
        b.synchronize()
        _SLEEP["ms_per_cycle"] = a.elapsed_time(b) / 10_000_000
    while True:
        torch.cuda.synchronize()
        torch.cuda._sleep(_SLEEP["cycles"])
        start = time.perf_counter()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        host_ms = (time.perf_counter() - start) * 1e3
        b.synchronize()
        if host_ms < 0.8 * _SLEEP["cycles"] * _SLEEP["ms_per_cycle"]:
            return a.elapsed_time(b) / calls
        _SLEEP["cycles"] *= 2


def device_ms(fn, calls=4):
    """Device time per call of a training shape: median of REPS queued_ms samples (gpu_bench.cu's
    device_ms)."""
    for _ in range(WARMUP):
        fn()
    return sorted(queued_ms(fn, calls) for _ in range(REPS))[REPS // 2]


GRAPH_CALLS = 20


def graph_ms(fn):
    """Device time per call without the host's share: GRAPH_CALLS calls captured into one CUDA graph,
    replays timed with events (median), divided by the call count (as gpu_bench.cu's graph_ms)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(WARMUP):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(GRAPH_CALLS):
            fn()
    g.replay()
    torch.cuda.synchronize()
    return event_ms(g.replay) / GRAPH_CALLS


def flash_backward_direct(q, k, v, g, causal):
    """The flash backend's backward kernels called through their aten op, without autograd's host
    bookkeeping (flashmonoid's timed backward is one C++ call too); None where the op's signature
    differs from what this expects."""
    try:
        q, k, v = q.detach(), k.detach(), v.detach()
        r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False)
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset = r[:8]
        call = lambda: torch.ops.aten._scaled_dot_product_flash_attention_backward(  # noqa: E731
            g, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset)
        call()
        return call
    except (RuntimeError, TypeError) as e:
        print(f"direct flash backward unavailable ({str(e).splitlines()[0]}); timing through autograd",
              file=sys.stderr)
        return None


def rec(impl, pass_, d, causal, b, h, hk, sq, sk, ms, metric, value):
    return {"impl": impl, "pass": pass_, "dtype": "bf16", "hdim": d, "causal": causal, "batch": b, "nheads": h,
            "nheads_k": hk, "seqlen_q": sq, "seqlen_k": sk, "ms": ms, metric: value, "device": DEVICE}


def train(out):
    for d in (64, 128, 256):
        for causal in (False, True):
            for s in (512, 1024, 2048, 4096, 8192, 16384):
                b, h = 16384 // s, 2048 // d
                # (b, s, h, d) storage as flashmonoid's, viewed (b, h, s, d) for SDPA.
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
                           for _ in range(3))
                g = torch.randn_like(q)
                flops = 4.0 * b * h * s * s * d / (2 if causal else 1)
                for impl, be in BACKENDS.items():
                    bwd_timing = "autograd"
                    try:
                        with sdpa_kernel(be):
                            # The forward under no_grad: with inputs that require grad, autograd's
                            # host bookkeeping adds ~35 us per call (0.25 -> 0.29 ms at s = 512, hdim
                            # 128, measured), which flashmonoid's C++ call does not pay.
                            with torch.no_grad():
                                fwd = device_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
                            if WITH_BWD:
                                direct = flash_backward_direct(q, k, v, g, causal) if impl == "torch_flash" else None
                                if direct is not None:
                                    bwd, bwd_timing = device_ms(direct), "direct"
                                else:
                                    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                                    bwd = device_ms(lambda: torch.autograd.grad(o, (q, k, v), g, retain_graph=True))
                    except RuntimeError as e:
                        print(f"{impl} d{d} s{s} causal={causal}: {str(e).splitlines()[0]}", file=sys.stderr)
                        continue
                    out.append(rec(impl, "fwd", d, causal, b, h, h, s, s, fwd, "tflops", flops / fwd / 1e9))
                    if WITH_BWD:
                        out.append(rec(impl, "bwd", d, causal, b, h, h, s, s, bwd, "tflops", 2.5 * flops / bwd / 1e9))
                        out[-1]["bwd_timing"] = bwd_timing
                    print(json.dumps(out[-1]), file=sys.stderr)
                del q, k, v, g


def flex(out):
    """FlexAttention peer: flex_attention under torch.compile (Triton kernels, one compilation per shape
    and mask), causal through a block mask, timed as the SDPA backends (forward under no_grad, backward
    through autograd)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    # Every (shape, mask, grad mode) is a recompilation; past dynamo's default limit (8) flex_attention
    # silently runs its unfused eager form (H100: 7-25 TFLOP/s, and out of memory at 16k).
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 1024)
    compiled = torch.compile(flex_attention, dynamic=False)
    seqlens = [int(x) for x in os.environ.get("FM_PEERS_FLEX_SEQLENS", "1024,4096,16384").split(",")]
    for d in (64, 128, 256):
        for causal in (False, True):
            for s in seqlens:
                b, h = 16384 // s, 2048 // d
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
                           for _ in range(3))
                g = torch.randn_like(q)
                flops = 4.0 * b * h * s * s * d / (2 if causal else 1)
                try:
                    mask = (create_block_mask(lambda b_, h_, qi, ki: qi >= ki, None, None, s, s, device="cuda")
                            if causal else None)
                    with torch.no_grad():
                        fwd = device_ms(lambda: compiled(q, k, v, block_mask=mask))
                    if WITH_BWD:
                        o = compiled(q, k, v, block_mask=mask)
                        bwd = device_ms(lambda: torch.autograd.grad(o, (q, k, v), g, retain_graph=True))
                except Exception as e:  # Triton's shared-memory limits, compile failures: no record
                    print(f"torch_flex d{d} s{s} causal={causal}: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
                          file=sys.stderr)
                    continue
                out.append(rec("torch_flex", "fwd", d, causal, b, h, h, s, s, fwd, "tflops", flops / fwd / 1e9))
                print(json.dumps(out[-1]), file=sys.stderr)
                if WITH_BWD:
                    out.append(rec("torch_flex", "bwd", d, causal, b, h, h, s, s, bwd, "tflops", 2.5 * flops / bwd / 1e9))
                    out[-1]["bwd_timing"] = "autograd"
                    print(json.dumps(out[-1]), file=sys.stderr)
                del q, k, v, g


ROUNDS, CALLS = 7, 5


def interleaved(out):
    import flashmonoid as fm
    extra = [int(x) for x in os.environ.get("FM_PEERS_EXTRA_HDIMS", "96,192").split(",") if x]
    for d in sorted((64, 128, 256, *extra)):
        passes = ("fwd",) if d in extra else ("fwd", "bwd")
        for causal in (False, True):
            for s in (512, 1024, 2048, 4096, 8192, 16384):
                b, h = 16384 // s, 2048 // d
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
                           for _ in range(3))
                g = torch.randn_like(q)
                flops = 4.0 * b * h * s * s * d / (2 if causal else 1)

                def fm_fwd():
                    return fm.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal)

                def cudnn_fwd():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                calls = {}
                for impl, fwd in (("flashmonoid", fm_fwd), ("torch_cudnn", cudnn_fwd)):
                    o = fwd().transpose(1, 2) if impl == "flashmonoid" else fwd()

                    def run_fwd(fwd=fwd):
                        with torch.no_grad():
                            fwd()

                    def run_bwd(o=o):
                        torch.autograd.grad(o, (q, k, v), g, retain_graph=True)
                    calls[impl] = {"fwd": run_fwd, "bwd": run_bwd}
                for pass_ in passes:
                    times = {impl: [] for impl in calls}
                    for impl in calls:
                        for _ in range(WARMUP):
                            calls[impl][pass_]()
                    order = list(calls)
                    for _ in range(ROUNDS):
                        for impl in order:
                            times[impl].append(queued_ms(calls[impl][pass_], CALLS))
                        order.reverse()
                    for impl, t in times.items():
                        ms = sorted(t)[len(t) // 2]
                        f = flops * (2.5 if pass_ == "bwd" else 1.0)
                        out.append(rec(impl, pass_, d, causal, b, h, h, s, s, ms, "tflops", f / ms / 1e9))
                        out[-1]["timing"] = "interleaved"
                        print(json.dumps(out[-1]), file=sys.stderr)
                del q, k, v, g, calls
    print(f"queued_ms: sleep of {_SLEEP['cycles']} cycles", file=sys.stderr)


def decode(out):
    h, hk, d = 32, 8, 128
    for b in (1, 8):
        for sk in (32768, 131072):
            q = torch.randn(b, h, 1, d, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(b, hk, sk, d, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            kv_bytes = 2 * k.numel() * k.element_size()
            for impl, be in BACKENDS.items():
                call = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
                for timing, timer in (("events", median_ms), ("graph", graph_ms)):
                    try:
                        with sdpa_kernel(be):
                            ms = timer(call)
                    except RuntimeError as e:
                        print(f"{impl} decode {timing} b{b} sk{sk}: {str(e).splitlines()[0]}", file=sys.stderr)
                        break
                    out.append(rec(impl, "fwd", d, False, b, h, hk, 1, sk, ms, "tbps", kv_bytes / ms / 1e9))
                    out[-1]["timing"] = timing
                    print(json.dumps(out[-1]), file=sys.stderr)
            del q, k, v


COPY_BYTES = 2**30  # far past the L2 (50 MB on the H100)


def copy_tbps():
    """The device's copy bandwidth as gpu_bench.cu's bench_copy measures it: one device-to-device
    copy of COPY_BYTES random bf16, bytes read + written over the median time (median_ms)."""
    src = torch.randn(COPY_BYTES // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return 2 * COPY_BYTES / median_ms(lambda: dst.copy_(src)) / 1e9


def kvcache_decode(out):
    """Issue 10's decoding shapes for the cuDNN peer: SDPA over a contiguous cache, no append, no
    rotary (what it can do), graph-replayed; records as gpu_bench's pass "decode", the same (b, s_k)
    and the skip rule of bench_kvcache_all, s_q = 1 and 4, each with this process's copy_tbps
    (measured once, before the shapes). s_q = 4 runs non-causal: SDPA's causal mask is top-left
    aligned (gpu_bench's is bottom-right); the K/V bytes read are the same."""
    copy = copy_tbps()
    print(f"device copy: {copy:.3f} TB/s", file=sys.stderr)
    h, hk, d = 32, 8, 128
    for b in (1, 8, 32, 64):
        for sk in (4096, 32768, 131072):
            kv_bytes = 2 * b * hk * sk * d * 2
            if kv_bytes > 60 * 2**30:
                continue
            k = torch.randn(b, hk, sk, d, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            for sq in (1, 4):
                q = torch.randn(b, h, sq, d, device="cuda", dtype=torch.bfloat16)
                call = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
                try:
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        ms = graph_ms(call)
                except RuntimeError as e:
                    print(f"torch_cudnn kvcache decode b{b} sk{sk} sq{sq}: {str(e).splitlines()[0]}", file=sys.stderr)
                    continue
                out.append(rec("torch_cudnn", "decode", d, False, b, h, hk, sq, sk, ms, "tbps", kv_bytes / ms / 1e9))
                out[-1].update(page_size=0, append=False, rotary=False, timing="graph", copy_tbps=copy)
                print(json.dumps(out[-1]), file=sys.stderr)
                del q
            del k, v


def memory(out):
    b, h, d, s = 1, 16, 64, 65536
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for impl, be in BACKENDS.items():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        try:
            with sdpa_kernel(be):
                o = F.scaled_dot_product_attention(q, k, v)
            torch.cuda.synchronize()
        except RuntimeError as e:
            print(f"{impl} memory: {str(e).splitlines()[0]}", file=sys.stderr)
            continue
        out.append({"impl": impl, "pass": "fwd_memory", "dtype": "bf16", "hdim": d, "batch": b, "nheads": h,
                    "seqlen_q": s, "seqlen_k": s, "extra_bytes": torch.cuda.max_memory_allocated() - base,
                    "device": DEVICE})
        del o


def main():
    """FM_PEERS_KVCACHE: 1 (default) adds the KV-cache decoding shapes, 0 leaves them out, "only"
    runs nothing else (a KV-cache run next to gpu_bench --kvcache-only)."""
    out = []
    if os.environ.get("FM_PEERS_INTERLEAVED", "0") == "1":
        interleaved(out)
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)
        return
    if os.environ.get("FM_PEERS_FLEX", "0") == "only":
        flex(out)
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)
        return
    kv = os.environ.get("FM_PEERS_KVCACHE", "1")
    if kv != "only":
        if os.environ.get("FM_PEERS_DECODE_ONLY", "0") == "0":
            train(out)
        decode(out)
        if os.environ.get("FM_PEERS_FLEX", "0") == "1":
            flex(out)
    if kv != "0":
        kvcache_decode(out)
    if kv != "only":
        memory(out)
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
