#!/usr/bin/env python3
"""Summarise a GPU benchmark JSON (the list of records tools/device_run.sh writes).

  summarize.py bench.json            one line per configuration: flashmonoid and each peer
  summarize.py bench.json --markdown  per (pass, hdim, causal): TFLOP/s at 16k and the range of
                                      flashmonoid / FlashAttention-2 over all seqlens; decoding
                                      bandwidth (per call and graph-replayed) as a share of the
                                      measured copy ceiling
"""
import collections
import json
import sys


def configs(recs):
    by = collections.defaultdict(dict)
    for r in recs:
        if r.get("pass") in ("fwd", "bwd"):
            # Decoding is timed per call ("events") and as CUDA-graph replays ("graph").
            by[(r["pass"], r["hdim"], r["causal"], r["batch"], r["seqlen_q"], r["seqlen_k"],
                r.get("timing", "events"))][r["impl"]] = r
    return by


def metric(row):
    return "tflops" if "tflops" in next(iter(row.values())) else "tbps"


def table(recs):
    by = configs(recs)
    print(f"{'pass':4} {'d':>3} {'c':1} {'b':>3} {'s_q':>6} {'s_k':>6} {'timing':6} | {'fm':>7} {'flash':>7} "
          f"{'cudnn':>7} {'effic':>7} | fm/flash")
    for k in sorted(by, key=lambda k: tuple(str(x) for x in k)):
        row, m = by[k], metric(by[k])
        g = lambda i: row[i][m] if i in row else float("nan")
        fm, fl = g("flashmonoid"), g("torch_flash")
        print(f"{k[0]:4} {k[1]:>3} {'y' if k[2] else 'n'} {k[3]:>3} {k[4]:>6} {k[5]:>6} {k[6]:6} | {fm:7.1f} {fl:7.1f} "
              f"{g('torch_cudnn'):7.1f} {g('torch_efficient'):7.1f} | {fm / fl if fl == fl and fl else float('nan'):.2f}  {m}")
    for r in recs:
        if r.get("pass") in ("copy", "fwd_memory"):
            print(json.dumps({k: v for k, v in r.items() if k != "device"}))


def markdown(recs):
    by = configs(recs)
    device = next((r["device"] for r in recs if "device" in r), "?")
    print(f"Device: {device}. bf16 TFLOP/s at seqlen 16k (16k tokens, hidden 2048); ratio ranges over "
          "seqlen 512..16k against cuDNN and FlashAttention-2 (PyTorch SDPA's cudnn and flash backends), "
          "same run. flashmonoid = the kernels a call gets by default (sm90 forward on Hopper); "
          "sm80 = the mma.sync forward forced.\n")
    print("| pass | hdim | causal | flashmonoid | sm80 | flash | cudnn | / cudnn | / flash |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    rng = lambda r: f"{min(r):.2f}–{max(r):.2f}" if r else ""
    g = lambda row, i: row[i]["tflops"] if i in row else float("nan")
    per_seqlen, geo = [], {}
    for p in ("fwd", "bwd"):
        for d in sorted({k[1] for k in by if k[0] == p}):
            for c in (False, True):
                ks = sorted((k for k in by if k[:3] == (p, d, c) and k[4] > 1 and "flashmonoid" in by[k]),
                            key=lambda k: k[4])
                if not ks:
                    continue
                vs_cudnn = [g(by[k], "flashmonoid") / g(by[k], "torch_cudnn") for k in ks if "torch_cudnn" in by[k]]
                vs_flash = [g(by[k], "flashmonoid") / g(by[k], "torch_flash") for k in ks if "torch_flash" in by[k]]
                geo.setdefault(p, []).extend(vs_cudnn)
                top = by[ks[-1]]
                print(f"| {p} | {d} | {'yes' if c else 'no'} | {g(top, 'flashmonoid'):.0f} | "
                      f"{g(top, 'flashmonoid_sm80'):.0f} | {g(top, 'torch_flash'):.0f} | {g(top, 'torch_cudnn'):.0f} | "
                      f"{rng(vs_cudnn)} | {rng(vs_flash)} |")
                if vs_cudnn:
                    per_seqlen.append(f"| {p} | {d} | {'yes' if c else 'no'} | " + " ".join(f"{x:.2f}" for x in vs_cudnn) + " |")
    print("\nflashmonoid / cuDNN per seqlen (512, 1k, 2k, 4k, 8k, 16k), same run:\n")
    print("| pass | hdim | causal | ratios |")
    print("| --- | --- | --- | --- |")
    print("\n".join(per_seqlen))
    for p, r in geo.items():
        prod = 1.0
        for x in r:
            prod *= x
        print(f"\n{p}: geometric mean of flashmonoid / cuDNN over {len(r)} configurations {prod ** (1 / len(r)):.3f}, "
              f"min {min(r):.3f}, configurations at >= 1.0: {sum(x >= 1.0 for x in r)}")
    copy = next((r["tbps"] for r in recs if r.get("pass") == "copy"), None)
    print("\n| decoding (s_q = 1) | timing | flashmonoid TB/s | flash | cudnn | flashmonoid / copy | host µs/call |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for k in sorted(k for k in by if k[4] == 1):
        row = by[k]
        g = lambda i: row[i]["tbps"] if i in row else float("nan")
        share = f"{g('flashmonoid') / copy:.0%}" if copy else "?"
        host = row.get("flashmonoid", {}).get("host_us")
        print(f"| b={k[3]}, s_k={k[5] // 1024}k | {k[6]} | {g('flashmonoid'):.2f} | {g('torch_flash'):.2f} | "
              f"{g('torch_cudnn'):.2f} | {share} | {'' if host is None else f'{host:.1f}'} |")
    if copy:
        print(f"\nCopy ceiling (device-to-device, bytes read + written): {copy:.2f} TB/s.")
    kvcache(recs, copy)


def kvcache(recs, copy):
    """Issue 10's KV-cache decoding records (pass "decode"): TB/s of K/V, its share of the copy
    ceiling, paged against contiguous (same append/rotary/s_q), and cuDNN on the plain read."""
    dec = [r for r in recs if r.get("pass") == "decode"]
    if not dec:
        return
    key = lambda r: (r["batch"], r["seqlen_k"], r["seqlen_q"], r["append"], r["rotary"])  # noqa: E731
    contiguous = {key(r): r["tbps"] for r in dec if r["impl"] == "flashmonoid" and r["page_size"] == 0}
    cudnn = {(r["batch"], r["seqlen_k"]): r["tbps"] for r in dec if r["impl"] == "torch_cudnn"}
    print("\n| KV cache (graph) | s_q | page | append+rotary | TB/s | / copy | / contiguous | cudnn TB/s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in sorted((r for r in dec if r["impl"] == "flashmonoid"),
                    key=lambda r: (r["batch"], r["seqlen_k"], r["seqlen_q"], r["page_size"], r["append"])):
        base = contiguous.get(key(r))
        print(f"| b={r['batch']}, s_k={r['seqlen_k'] // 1024}k | {r['seqlen_q']} | {r['page_size']} | "
              f"{'yes' if r['append'] else 'no'} | {r['tbps']:.2f} | {r['tbps'] / copy if copy else float('nan'):.0%} | "
              f"{r['tbps'] / base if base else float('nan'):.2f} | {cudnn.get((r['batch'], r['seqlen_k']), float('nan')):.2f} |")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    records = json.load(open(sys.argv[1]))
    (markdown if "--markdown" in sys.argv else table)(records)
