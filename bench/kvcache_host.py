"""Host time of one Python `flash_attn_with_kvcache` call (issue 10's bar: <= 15 us).

A decoding step as a serving engine makes it: bf16, 32 query heads over 8 KV heads, hdim 128,
s_q = 1, a 1-token append with rotary, device cache_seqlens, contiguous and paged (page 16)
caches. 1000 calls are queued back to back and the device is synchronised once at the end, so the
host clock measures what the Python call costs the CPU. The cache is short (512 keys) so that the
GPU's ~3 launches per call keep up and the launch queue never fills (a full queue would make the
host wait for the GPU and time the device instead); each record's sync_wait_us_runs (the wait in
that final sync) shows it: tens of us, a few calls' GPU work, at b = 1 on the H200.
Median of 5 such runs (FM_HOST_CALLS, FM_HOST_RUNS: other counts).

--breakdown: the same calls with the layers below each level replaced by a stub that returns at
once, innermost first, so that differences give each layer's own share: the C++ call (nanobind's
argument conversion, validation, launches), _backend (DLPack export, stream, workspace),
torch_ops' implementation (outputs, options), attention_kvcache (padding test, eager test),
_check_kvcache (flash-attn's checks), and the entry function itself. Stubbed runs launch nothing.
--peers (CUDA): the same host clock on calls that are not ours, for scale on the machine at hand:
PyTorch's SDPA over the same contiguous cache (no append, no rotary; its cuDNN and flash backends,
`torch_sdpa_*`) and one in-place add of a 1-element tensor (`torch_one_kernel`: one launch through
torch's dispatcher, the least any Python call that launches work costs there).
--device cpu: CPU tensors of tiny shapes (4/1 heads, hdim 8, 32 keys, float32; for the Python
layers, on a machine without a GPU: the "C++ call" row is then the CPU backend's compute; run with
OMP_NUM_THREADS=1, so that the backend's threads do not wait on a busy core).

Usage: python bench/kvcache_host.py OUT.json [--breakdown] [--peers] [--device cpu]
(run from outside the source tree, or with the installed package first on the path)."""
import argparse
import json
import os
import statistics
import sys
import time

import torch

from flashmonoid import _backend, _C, flash_attn_interface, torch_ops
from flashmonoid.flash_attn_interface import flash_attn_with_kvcache

CALLS, RUNS = int(os.environ.get("FM_HOST_CALLS", 1000)), int(os.environ.get("FM_HOST_RUNS", 5))


def make_call(b, page, dev, lse=False):
    h, hk, d, s_k, dt = (32, 8, 128, 512, torch.bfloat16) if dev == "cuda" else (4, 1, 8, 32, torch.float32)
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
                                       cache_seqlens=seqlens, block_table=table, causal=True,
                                       return_softmax_lse=lse)

    shape = dict(dtype=str(dt).replace("torch.", ""), hdim=d, batch=b, nheads=h, nheads_k=hk, seqlen_q=1,
                 seqlen_k=s_k, page_size=page)
    return call, shape


def sync(dev):
    if dev == "cuda":
        torch.cuda.synchronize()


def cpu_mhz():
    """The mean of /proc/cpuinfo's "cpu MHz" over the cores (None where there is none): the machine's
    clock state beside a run, to tell a slow machine from a slow call."""
    try:
        with open("/proc/cpuinfo") as f:
            mhz = [float(line.split(":")[1]) for line in f if line.startswith("cpu MHz")]
        return round(sum(mhz) / len(mhz)) if mhz else None
    except OSError:
        return None


def host_us(call, dev, runs=RUNS, waits=None, clocks=None):
    """Per-call host time of each run (us): CALLS calls queued back to back, one sync after. waits (a
    list) gets each run's wait in that sync (us): about one call's GPU time when the GPU kept up, the
    queue's worth of GPU work when the host ran ahead. clocks (a list) gets cpu_mhz() before each run."""
    for _ in range(50 if dev == "cuda" else 2000):  # the CPU backend's threads settle more slowly
        call()
    sync(dev)
    per_call = []
    for _ in range(runs):
        if clocks is not None:
            clocks.append(cpu_mhz())
        t0 = time.perf_counter()
        for _ in range(CALLS):
            call()
        t1 = time.perf_counter()  # host time: the calls were only queued
        sync(dev)
        per_call.append((t1 - t0) / CALLS * 1e6)
        if waits is not None:
            waits.append((time.perf_counter() - t1) * 1e6)
    return per_call


# (layer, module, attributes replaced by a stub, what the stub returns), innermost first. With torch
# >= 2.10 flash_attn_with_kvcache's eager route is one call, _C.kvcache_eager_torch (checks, outputs,
# stream, workspace and the library call; "C++ eager route"), and every other row reads ~0. Before
# it, the torch route entered _C through forward_kvcache_torch from torch_ops' implementation, others
# through forward_kvcache; _check_kvcache runs only when a call fails or cannot take the eager route.
def _out_lse(q, *args, **kwargs):
    return q, q


LAYERS = [
    ("C++ eager route", _C, ("kvcache_eager_torch",), _out_lse),
    ("C++ call", _C, ("forward_kvcache", "forward_kvcache_torch"), None),
    ("_backend", _backend, ("forward_kvcache",), None),
    ("torch_ops impl", torch_ops, ("_fwd_kvcache_impl",), _out_lse),
    ("attention_kvcache", torch_ops, ("attention_kvcache",), _out_lse),
    ("_check_kvcache", flash_attn_interface, ("_check_kvcache",), None),
]
STUBBED = [(m, name) for _, m, names, _ in LAYERS for name in names if hasattr(m, name)]


def breakdown(call, dev):
    """Host us per call with 0, 1, ... layers stubbed, runs interleaved; each layer's share is the
    difference to the next."""
    saved = [getattr(m, name) for m, name in STUBBED]
    runs = [[] for _ in range(len(LAYERS) + 1)]
    try:
        for _ in range(2 * RUNS):
            for n in range(len(LAYERS) + 1):
                for (m, name), real in zip(STUBBED, saved):
                    setattr(m, name, real)
                for _, m, names, ret in LAYERS[:n]:
                    for name in names:
                        if hasattr(m, name):
                            setattr(m, name, (lambda r: lambda *a, **k: r(*a) if r else None)(ret))
                runs[n] += host_us(call, dev, runs=1)
    finally:
        for (m, name), real in zip(STUBBED, saved):
            setattr(m, name, real)
    t = [min(r) for r in runs]  # noise only adds: the least of interleaved runs is the steadiest
    shares = {layer: round(t[i] - t[i + 1], 2) for i, (layer, *_) in enumerate(LAYERS)}
    shares["flash_attn_with_kvcache body"] = round(t[-1], 2)
    return {"host_us": round(t[0], 2), "layers_us": shares}


def peer_calls(dev):
    """(impl, call, shape, context) of the --peers rows: one decoding step's attention through SDPA
    (b = 1, the contiguous 512-key cache of make_call, laid out as SDPA wants it) and one tiny
    kernel. The calls are timed inside their context, entered once: sdpa_kernel's enter and exit
    cost ~8.5 us of host time themselves (torch 2.15, this project's CPU VM), which no serving loop
    pays per call."""
    import contextlib
    from torch.nn.attention import SDPBackend, sdpa_kernel
    h, hk, d, s_k, dt = 32, 8, 128, 512, torch.bfloat16
    q = torch.randn(1, h, 1, d, device=dev, dtype=dt)
    k = torch.randn(1, hk, s_k, d, device=dev, dtype=dt)
    v = torch.randn_like(k)
    shape = dict(dtype="bfloat16", hdim=d, batch=1, nheads=h, nheads_k=hk, seqlen_q=1, seqlen_k=s_k, page_size=0)
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
    yield "torch_sdpa_cudnn", sdpa, shape, sdpa_kernel(SDPBackend.CUDNN_ATTENTION)
    yield "torch_sdpa_flash", sdpa, shape, sdpa_kernel(SDPBackend.FLASH_ATTENTION)
    x = torch.zeros(1, device=dev)
    yield "torch_one_kernel", lambda: x.add_(1), dict(dtype="float32", batch=1), contextlib.nullcontext()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--breakdown", action="store_true")
    p.add_argument("--peers", action="store_true")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    a = p.parse_args()
    dev = a.device
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu (tiny shapes, float32)"
    out = []
    # The last row asks for the lse too (flash-attn's default does not: the eager route then keeps it
    # in its workspace instead of a tensor of its own).
    for b, page, lse in ((1, 0, False), (1, 16, False), (8, 0, False), (1, 0, True)):
        call, shape = make_call(b, page, dev, lse)
        waits, clocks = [], []
        per_call = host_us(call, dev, waits=waits, clocks=clocks)
        r = {"impl": "flashmonoid_python", "pass": "decode_host", **shape, "append": True, "rotary": True,
             "return_softmax_lse": lse, "calls": CALLS, "host_us": round(statistics.median(per_call), 2),
             "host_us_runs": [round(x, 2) for x in per_call], "sync_wait_us_runs": [round(x) for x in waits],
             "cpu_mhz_runs": clocks,
             "device": name, "torch": torch.__version__}
        if a.breakdown:
            r["breakdown"] = breakdown(call, dev)
        out.append(r)
        print(json.dumps(out[-1]), file=sys.stderr)
    for impl, call, shape, context in peer_calls(dev) if a.peers and dev == "cuda" else ():
        clocks = []
        try:
            with context:
                per_call = host_us(call, dev, clocks=clocks)
        except RuntimeError as e:  # a backend that does not take this shape here
            print(f"{impl}: {str(e).splitlines()[0]}", file=sys.stderr)
            continue
        out.append({"impl": impl, "pass": "decode_host", **shape, "append": False, "rotary": False, "calls": CALLS,
                    "host_us": round(statistics.median(per_call), 2), "host_us_runs": [round(x, 2) for x in per_call],
                    "cpu_mhz_runs": clocks, "device": name, "torch": torch.__version__})
        print(json.dumps(out[-1]), file=sys.stderr)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
