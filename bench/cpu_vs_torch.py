#!/usr/bin/env python3
"""flashmonoid's CPU flash path against PyTorch's CPU SDPA (its flash kernel), side by side in one
process: for each shape the implementations run interleaved, in a rotating order, repeat after
repeat, so that a shared or throttling machine slows them alike; each time is the median.

    python3 bench/cpu_vs_torch.py [--threads 2] [--out bench/results/cpu_vs_torch_2t.json]

torch: used as it is when importable (e.g. on the GPU machine, which has no internet); otherwise
the script makes .venv-bench/ beside the repository root, installs torch from the package index
into it, and re-runs itself there. flashmonoid: built from this checkout (CPU only) into
build-bench/ and imported from there, so the numbers are this tree's; --installed uses an
importable flashmonoid instead.

Implementations: flashmonoid (the ISA the library picks: AVX-512 where the CPU has it, with bf16
inputs' products from bf16 pairs on AMX tiles where it has AMX-BF16, or with VDPBF16PS on AMD CPUs
with AVX512_BF16), flashmonoid_avx2 (Context cpu_isa =
avx2, the fallback), torch_cpu (SDPBackend.FLASH_ATTENTION). The environment variable
FLASHMONOID_CPU_ISA caps what flashmonoid picks for the whole process (avx512: AVX-512 without the
bf16 products, to compare them with the fp32 products on one machine); the JSON records it as
cpu_isa_env.
Passes: fwd (under no_grad), fwd_bwd (forward and backward through autograd, both libraries).
FLOPs: 4·b·h·s²·d for the forward, 2.5x that for the backward (fwd_bwd counts 3.5x), halved with
--causal (both libraries then mask; torch through is_causal).
Records: {impl, pass, dtype, threads, batch, nheads, hdim, seqlen, causal, ms, gflops, cpu}; each
flashmonoid record also carries max_abs_diff, its output's largest difference from torch's.
Not part of CI: it takes minutes.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/cpu_vs_torch_<threads>t.json)")
    ap.add_argument("--hdims", default="64,128")
    ap.add_argument("--seqlens", default="1024,4096,8192")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--nheads", type=int, default=8)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--passes", default="fwd,fwd_bwd")
    ap.add_argument("--bf16-passes", default="fwd", help="passes timed for bf16 (fp32 gets --passes)")
    ap.add_argument("--impls", default="flashmonoid,flashmonoid_avx2,torch_cpu")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--causal", action="store_true", help="causal masks in both libraries (FLOPs halved)")
    ap.add_argument("--installed", action="store_true", help="use an importable flashmonoid, build nothing")
    return ap.parse_args()


def ensure_torch():
    """Re-executes the script in .venv-bench with torch installed when torch is not importable."""
    try:
        import torch  # noqa: F401
        return
    except ImportError:
        pass
    venv = os.path.join(ROOT, ".venv-bench")
    py = os.path.join(venv, "bin", "python")
    # sys.prefix, not the executable's real path: a venv's python is often a link to the very
    # interpreter that created it.
    if os.path.realpath(sys.prefix) == os.path.realpath(venv):
        sys.exit("torch is not importable even in .venv-bench; see the pip output above")
    if not os.path.exists(py):
        subprocess.check_call([sys.executable, "-m", "venv", venv])
    subprocess.check_call([py, "-m", "pip", "install", "-q", "torch", "numpy", "nanobind", "scikit-build-core"])
    os.execv(py, [py] + sys.argv)


def import_flashmonoid(installed, threads):
    if not installed:
        build = os.path.join(ROOT, "build-bench")
        try:
            import nanobind  # noqa: F401
        except ImportError:
            subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "nanobind"])
        subprocess.check_call(["cmake", "-S", ROOT, "-B", build, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                               "-DFLASHMONOID_CUDA=OFF", "-DFLASHMONOID_PYTHON=ON", "-DFLASHMONOID_TESTS=OFF",
                               "-DFLASHMONOID_BENCH=OFF", f"-DPython_EXECUTABLE={sys.executable}"],
                              stdout=subprocess.DEVNULL)
        subprocess.check_call(["cmake", "--build", build, "-j", str(max(1, threads))])
        # The package as an install would lay it out: the Python sources beside the built _C.
        pkg = os.path.join(build, "pkg", "flashmonoid")
        os.makedirs(pkg, exist_ok=True)
        src = os.path.join(ROOT, "python", "flashmonoid")
        built = os.path.join(build, "python", "flashmonoid")
        for d, names in ((src, os.listdir(src)), (built, [n for n in os.listdir(built) if n.startswith("_C")])):
            for n in names:
                link = os.path.join(pkg, n)
                if not os.path.lexists(link):
                    os.symlink(os.path.join(d, n), link)
        sys.path.insert(0, os.path.dirname(pkg))
    import flashmonoid
    return flashmonoid


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return sorted(x for x in line.split(":", 1)[1].split() if x.startswith(("avx512", "amx")))
    except OSError:
        pass
    return []


def main():
    args = parse_args()
    # Both libraries' OpenMP runtimes read this at load; torch's is also set below.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    ensure_torch()
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fm = import_flashmonoid(args.installed, args.threads)
    torch.set_num_threads(args.threads)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    impls = args.impls.split(",")
    cpu = cpu_model()
    out = args.out or os.path.join(ROOT, "bench", "results", f"cpu_vs_torch_{args.threads}t.json")
    b, h = args.batch, args.nheads
    isa_env = os.environ.get("FLASHMONOID_CPU_ISA", "")
    print(f"{cpu}, {args.threads} threads, torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), "
          f"avx512 flags: {' '.join(cpu_flags()) or 'none'}, FLASHMONOID_CPU_ISA={isa_env or '(unset)'}", flush=True)

    def make_call(impl, pas, q, k, v, dout):
        """q, k, v (b, s, h, d): flashmonoid's layout; torch gets (b, h, s, d) contiguous copies."""
        if impl == "torch_cpu":
            q, k, v, dout = (x.transpose(1, 2).contiguous() for x in (q, k, v, dout))

            def attn(q, k, v):
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=args.causal)
        else:
            isa = "avx2" if impl == "flashmonoid_avx2" else "best"

            def attn(q, k, v):
                fm.set_cpu_isa(isa)
                try:
                    return fm.attention(q, k, v, causal=args.causal)
                finally:
                    fm.set_cpu_isa("best")
        if pas == "fwd":
            def call():
                with torch.no_grad():
                    return attn(q, k, v)
            return call
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]

        def call():
            for x in leaves:
                x.grad = None
            o = attn(*leaves)
            o.backward(dout)
            return o
        return call

    records = []
    for dtype_name in args.dtypes.split(","):
        passes = args.passes if dtype_name == "fp32" else args.bf16_passes
        for d in (int(x) for x in args.hdims.split(",")):
            for s in (int(x) for x in args.seqlens.split(",")):
                gen = torch.Generator().manual_seed(s * 1000 + d)
                q, k, v, dout = (torch.randn(b, s, h, d, generator=gen).to(dtypes[dtype_name]) for _ in range(4))
                for pas in passes.split(","):
                    calls = {impl: make_call(impl, pas, q, k, v, dout) for impl in impls}
                    outs = {impl: calls[impl]() for impl in impls}  # warm-up, and the outputs compared
                    times = {impl: [] for impl in impls}
                    for rep in range(args.repeats):
                        order = impls[rep % len(impls):] + impls[:rep % len(impls)]
                        for impl in order:
                            t0 = time.perf_counter()
                            calls[impl]()
                            times[impl].append((time.perf_counter() - t0) * 1e3)
                    flops = 4.0 * b * h * s * s * d * (3.5 if pas == "fwd_bwd" else 1.0) * (0.5 if args.causal else 1.0)
                    ref = outs.get("torch_cpu")
                    line = []
                    for impl in impls:
                        ms = statistics.median(times[impl])
                        rec = dict(impl=impl, pas=pas, dtype=dtype_name, threads=args.threads, batch=b, nheads=h,
                                   hdim=d, seqlen=s, causal=args.causal, ms=round(ms, 3), gflops=round(flops / ms / 1e6, 2), cpu=cpu)
                        rec["pass"] = rec.pop("pas")
                        if ref is not None and impl != "torch_cpu":
                            diff = (outs[impl].float() - ref.transpose(1, 2).float()).abs().max().item()
                            rec["max_abs_diff"] = float(f"{diff:.3g}")
                        records.append(rec)
                        line.append(f"{impl} {ms:9.2f} ms {rec['gflops']:7.1f} GFLOP/s")
                    ratio = ""
                    if "torch_cpu" in times and "flashmonoid" in times:
                        speed = statistics.median(times["torch_cpu"]) / statistics.median(times["flashmonoid"])
                        ratio = f"  flashmonoid/torch speed {speed:.2f}x"
                    print(f"{dtype_name} {pas:7s} d={d:3d} s={s:5d}{' causal' if args.causal else ''} | " + " | ".join(line) + ratio, flush=True)
                    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
                    with open(out, "w") as f:
                        json.dump({"cpu": cpu, "threads": args.threads, "torch": torch.__version__,
                                   "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
                                   "cpu_flags": cpu_flags(), "cpu_isa_env": isa_env, "repeats": args.repeats,
                                   "timing": "median of interleaved repeats after a warm-up, wall clock",
                                   "records": records}, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
