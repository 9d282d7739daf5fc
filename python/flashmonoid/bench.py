"""python -m flashmonoid.bench: flashmonoid next to PyTorch's SDPA backends and standard attention.

Runs on the current device (CUDA when a GPU and a CUDA build are there, else the CPU), forward and
forward+backward, over sequence lengths, head dims and causal; writes benchmark_results.json and
the plots memory_comparison.png, speedup_chart.png and scaling.png into --out.

Methods: flashmonoid; SDPA with one backend forced (flash, cudnn, efficient, math), each skipped
where PyTorch cannot run it on this device; "standard": softmax(QKᵀ)V written out in torch, which
materialises the (b, h, s, s) scores. TFLOP/s use one formula: 4·b·h·s_q·s_k·d for the forward,
halved when causal, and 2.5× that for the backward. Peak memory is the high-water mark of the
allocator above what the inputs already hold: torch.cuda's on GPUs, the profiler's CPU memory
events on the CPU, which see torch's allocations only: for flashmonoid its outputs, gradients and
lse, not the CPU kernels' own buffers (packed fp32 copies of K and V, O(N·d), and per-thread
tiles), so CPU memory numbers for flashmonoid are a lower bound; the GPU ones are complete.
"""

import argparse
import json
import math
import os
import platform
import sys
import statistics
import time

import torch
import torch.nn.functional as F

import flashmonoid as fm

try:
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # torch < 2.3
    SDPBackend = sdpa_kernel = None


def progress(items, desc):
    """tqdm when installed, else a one-line counter on stderr."""
    try:
        from tqdm import tqdm

        yield from tqdm(items, desc=desc)
        return
    except ImportError:
        pass
    n = len(items)
    for i, item in enumerate(items):
        sys.stderr.write(f"\r{desc}: {i}/{n}")
        sys.stderr.flush()
        yield item
    sys.stderr.write(f"\r{desc}: {n}/{n}\n")


def flops(b, h, s_q, s_k, d, causal, mode):
    f = 4.0 * b * h * s_q * s_k * d * (0.5 if causal else 1.0)
    return f if mode == "fwd" else f * 3.5  # forward + backward = (1 + 2.5) forward


def standard(q, k, v, causal):
    """Materialised attention in (b, s, h, d): the baseline every flash method is compared to."""
    s = torch.einsum("bihd,bjhd->bhij", q, k) * q.shape[-1] ** -0.5
    if causal:
        n_q, n_k = s.shape[-2:]
        s = s.masked_fill(torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(n_k - n_q).logical_not(),
                          -math.inf)
    return torch.einsum("bhij,bjhd->bihd", torch.softmax(s, dim=-1), v)


def methods(device):
    def fm_call(q, k, v, causal):
        return fm.attention(q, k, v, causal=causal)

    def sdpa(backend):
        def call(q, k, v, causal):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                      is_causal=causal).transpose(1, 2)
        return call

    out = {"flashmonoid": fm_call}
    if sdpa_kernel is not None:
        for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                              ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
                              ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION),
                              ("sdpa_math", SDPBackend.MATH)):
            out[name] = sdpa(backend)
    out["standard"] = standard
    return out


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_it(fn, device, warmup, reps, budget_s):
    """Median seconds per call after warm-up: CUDA events around each call on a GPU (no host
    synchronisation inside the timed region), the host clock on the CPU."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    start = time.perf_counter()
    for _ in range(reps):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s:
            break
    return statistics.median(times)


def peak_memory(fn, device):
    """Bytes allocated at the high-water mark of fn above the memory held before it."""
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        sync(device)
        return torch.cuda.max_memory_allocated(device) - base
    from torch.profiler import ProfilerActivity, profile

    # Each op's self allocation net of its own frees, and the frees outside ops ("[memory]"),
    # replayed in time order.
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    peak = cur = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        cur += e.self_cpu_memory_usage
        peak = max(peak, cur)
    return peak


def run_case(name, call, b, h, s, d, causal, dtype, device, args):
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, generator=g).to(device=device, dtype=dtype).requires_grad_()
               for _ in range(3))
    dout = torch.randn(b, s, h, d, generator=g).to(device=device, dtype=dtype)

    def fwd():
        with torch.no_grad():
            return call(q, k, v, causal)

    def fwd_bwd():
        out = call(q, k, v, causal)
        torch.autograd.grad(out, (q, k, v), dout)

    result = {"method": name, "batch": b, "heads": h, "seqlen": s, "head_dim": d, "causal": causal,
              "dtype": str(dtype).removeprefix("torch.")}
    try:
        for mode, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
            t = time_it(fn, device, args.warmup, args.reps, args.budget)
            result[f"{mode}_ms"] = t * 1e3
            result[f"{mode}_tflops"] = flops(b, h, s, s, d, causal, mode) / t / 1e12
            result[f"{mode}_peak_bytes"] = peak_memory(fn, device)
        result["ok"] = True
    except (RuntimeError, NotImplementedError, ValueError) as e:
        result["ok"] = False
        result["error"] = str(e).splitlines()[0][:200]
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} threads"


def plot(results, meta, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r["ok"]]
    d0 = meta["head_dims"][0]
    names = [m for m in meta["methods"] if any(r["method"] == m for r in ok)]
    colors = {m: plt.cm.tab10(i) for i, m in enumerate(meta["methods"])}
    # Distinct markers and dashes so that methods with equal values stay visible on top of each other.
    styles = {m: dict(marker="osD^vP"[i % 6], linestyle=["-", "--", "-.", ":"][i % 4], markersize=7 - i % 3)
              for i, m in enumerate(meta["methods"])}
    title = f"{meta['device']} · {meta['dtype']} · head dim {d0}"

    def series(method, causal, key, d=d0):
        rs = sorted((r for r in ok if r["method"] == method and r["causal"] == causal and r["head_dim"] == d),
                    key=lambda r: r["seqlen"])
        return [r["seqlen"] for r in rs], [r[key] for r in rs]

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, mode in zip(axes, ("fwd", "fwd_bwd")):
        for m in names:
            x, y = series(m, False, f"{mode}_peak_bytes")
            ax.plot(x, [max(v, 1) / 2**20 for v in y], label=m, color=colors[m], **styles[m])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length")
        ax.set_title({"fwd": "forward", "fwd_bwd": "forward + backward"}[mode])
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("peak memory above inputs (MiB, log)")
    axes[1].legend()
    fig.suptitle(f"Peak memory vs sequence length, non-causal, batch·seqlen = {meta['tokens']} tokens — {title}")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "memory_comparison.png"), dpi=110)
    plt.close(fig)

    peers = [m for m in names if m != "flashmonoid"]
    causals = sorted({r["causal"] for r in ok})  # only the panels that were measured
    fig, axes = plt.subplots(2, len(causals), figsize=(max(6.5 * len(causals), 9), 8), sharey="row", squeeze=False)
    for row, mode in enumerate(("fwd", "fwd_bwd")):
        for col, causal in enumerate(causals):
            ax = axes[row][col]
            fx, fy = series("flashmonoid", causal, f"{mode}_ms")
            width = 0.8 / max(len(peers), 1)
            for i, m in enumerate(peers):
                px, py = series(m, causal, f"{mode}_ms")
                pt = dict(zip(px, py))
                xs = [j for j, s in enumerate(fx) if s in pt]
                ys = [pt[fx[j]] / fy[j] for j in xs]
                ax.bar([j + (i - (len(peers) - 1) / 2) * width for j in xs], ys, width, label=f"vs {m}",
                       color=colors[m])
            ax.axhline(1.0, color="black", lw=0.8)
            ax.set_yscale("log")
            ax.set_xticks(range(len(fx)), [str(s) for s in fx])
            ax.set_title(f"{'forward' if mode == 'fwd' else 'forward + backward'}, "
                         f"{'causal' if causal else 'non-causal'}")
            ax.set_xlabel("sequence length")
            ax.grid(True, axis="y", which="both", alpha=0.3)
        axes[row][0].set_ylabel("speedup of flashmonoid (×, log)")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(f"flashmonoid speedup over each method (>1: flashmonoid faster)\n{title}")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "speedup_chart.png"), dpi=110)
    plt.close(fig)

    # Time per sequence (the batch shrinks as seqlen grows), so that exact attention's N²·d work
    # shows as slope 2.
    for r in ok:
        r["fwd_bwd_ms_per_seq"] = r["fwd_bwd_ms"] / r["batch"]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for m in names:
        x, y = series(m, False, "fwd_bwd_ms_per_seq")
        ax.plot(x, y, label=m, color=colors[m], **styles[m])
    x, y = series("flashmonoid", False, "fwd_bwd_ms_per_seq")
    if x:
        xs = [x[0], x[-1]]
        ax.plot(xs, [y[0] * (s / x[0]) ** 2 for s in xs], "k--", lw=1, label="∝ N² (slope 2)")
        ax.plot(xs, [y[0] * (s / x[0]) for s in xs], "k:", lw=1, label="∝ N·d (slope 1)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("forward + backward time per sequence (ms)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"Time per sequence vs sequence length, non-causal\n{title}\n"
                 "exact attention does N²·d work; slopes anchored at flashmonoid's first point", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "scaling.png"), dpi=110)
    plt.close(fig)


def main(argv=None):
    cuda = torch.cuda.is_available() and fm.cuda_available()
    p = argparse.ArgumentParser(prog="python -m flashmonoid.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlens", type=int, nargs="+",
                   default=[512, 1024, 2048, 4096, 8192, 16384] if cuda else [128, 256, 512, 1024])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128] if cuda else [64])
    p.add_argument("--causal", choices=["both", "on", "off"], default="both")
    p.add_argument("--tokens", type=int, default=16384 if cuda else 1024,
                   help="batch = max(1, tokens // seqlen): keeps the work per point comparable")
    p.add_argument("--model-dim", type=int, default=2048 if cuda else 256, help="heads = model_dim // head_dim")
    p.add_argument("--dtype", default="float16" if cuda else "float32")
    p.add_argument("--methods", nargs="+", help="subset of the methods to run")
    p.add_argument("--warmup", type=int, default=3 if cuda else 1)
    p.add_argument("--reps", type=int, default=20 if cuda else 10)
    p.add_argument("--budget", type=float, default=2.0, help="seconds of timing per point at most")
    p.add_argument("--out", default=".", help="folder for the JSON and the plots")
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)

    device = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, args.dtype)
    table = methods(device)
    names = [m for m in table if not args.methods or m in args.methods]
    causals = {"both": [False, True], "on": [True], "off": [False]}[args.causal]
    cases = [(m, s, d, c) for d in args.head_dims for c in causals for s in args.seqlens for m in names]
    results = []
    for m, s, d, c in progress(cases, "bench"):
        b, h = max(1, args.tokens // s), max(1, args.model_dim // d)
        results.append(run_case(m, table[m], b, h, s, d, c, dtype, device, args))

    meta = {"device": device_name(device), "device_type": device.type, "dtype": args.dtype,
            "torch": torch.__version__, "flashmonoid": fm.__version__,
            "cpu_algorithm": fm.get_cpu_algorithm(), "threads": torch.get_num_threads(),
            "methods": names, "seqlens": args.seqlens, "head_dims": args.head_dims, "tokens": args.tokens,
            "model_dim": args.model_dim, "statistic": "median over repeats", "reps": args.reps,
            "tflops_formula": "fwd 4*b*h*s_q*s_k*d (x0.5 causal); bwd 2.5x fwd; fwd_bwd = 3.5x fwd"}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "benchmark_results.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    print(f"{meta['device']}, {args.dtype}")
    print(f"{'method':16s} {'seq':>6s} {'d':>4s} {'causal':>6s} {'fwd ms':>9s} {'fwd+bwd ms':>11s} "
          f"{'TFLOP/s':>8s} {'peak MiB':>9s}")
    for r in results:
        if r["ok"]:
            print(f"{r['method']:16s} {r['seqlen']:6d} {r['head_dim']:4d} {str(r['causal']):>6s} "
                  f"{r['fwd_ms']:9.3f} {r['fwd_bwd_ms']:11.3f} {r['fwd_bwd_tflops']:8.3f} "
                  f"{r['fwd_bwd_peak_bytes'] / 2**20:9.2f}")
        else:
            print(f"{r['method']:16s} {r['seqlen']:6d} {r['head_dim']:4d} {str(r['causal']):>6s} "
                  f"unavailable: {r['error']}")
    if not args.no_plots:
        plot(results, meta, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
