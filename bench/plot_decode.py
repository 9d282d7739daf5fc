#!/usr/bin/env python3
"""Charts of decoding (issue 10) from committed results, no GPU needed:

    python3 bench/plot_decode.py [results dir]      # default bench/results; needs matplotlib

- decode_gpu_<device>.png from cuda_<device>_kvcache.json (tools/kvcache_device_run.sh): K/V bytes
  read per second as a fraction of the device's copy bandwidth, graph-replayed, per (batch, s_k):
  ours with a 1-token append and rotary (contiguous, pages of 16, s_q 4) beside cuDNN's SDPA on a
  contiguous cache without an append; the bars' 0.9 and 0.85 lines.
- decode_cpu_xeon.png from cpu_decode_xeon.txt (tools/cpu_decode_device_run.sh): torch's CPU SDPA
  time over ours on the same memory, head-major and (b, s, h_k, d) K/V, 16 and 2 threads.
"""
import json
import os
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from charts import grouped_bars, reference_line  # noqa: E402


def gpu_chart(path, out):
    rows = json.load(open(path))
    copy = next(r["tbps"] for r in rows if r.get("pass") == "copy")
    device = next(r["device"] for r in rows if r.get("pass") == "copy")
    series = [  # label, impl, page_size, seqlen_q, append
        ("ours, append + rotary", "flashmonoid", 0, 1, True),
        ("ours, pages of 16", "flashmonoid", 16, 1, True),
        ("ours, s_q 4", "flashmonoid", 0, 4, True),
        ("cuDNN, no append", "torch_cudnn", 0, 1, False),
        ("cuDNN, s_q 4", "torch_cudnn", 0, 4, False),
    ]
    val = {(r["impl"], r.get("page_size", 0), r["seqlen_q"], r.get("append", False), r["batch"], r["seqlen_k"]):
           r["tbps"] / copy for r in rows if r.get("pass") == "decode"}
    shapes = sorted({(k[4], k[5]) for k in val})
    fig, ax = plt.subplots(figsize=(13, 4.8))
    # bf16 K and V of 8 KV heads, hdim 128
    grouped_bars(ax, [f"b {b}\n{s // 1024}k\n{2 * b * s * 8 * 128 * 2 / 1e6:.0f} MB" for b, s in shapes],
                 [(label, [val.get((impl, page, sq, app, b, s), 0.0) for b, s in shapes])
                  for label, impl, page, sq, app in series])
    for y, text in ((0.9, "bar 0.9"), (0.85, "bar 0.85 (s_q 4)")):
        reference_line(ax, y, text)
    ax.set_ylabel(f"K/V bytes / time, x copy ({copy:.2f} TB/s)")
    ax.set_title(f"Decoding on the {device}: bf16, GQA 32/8, hdim 128, graph-replayed ({os.path.basename(path)})",
                 fontsize=10)
    ax.set_ylim(0, 1.3)
    ax.legend(fontsize=8, ncol=5, loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(out)


def cpu_chart(path, out):
    tables, threads = {}, None
    for line in open(path):
        m = re.match(r"threads (\d+): shape", line)
        if m:
            threads = int(m.group(1))
            tables[threads] = []
            continue
        if line.startswith("A/B"):
            threads = None
        m = re.match(r"(b=\d+ s_k=\d+ h=\d+ h_k=\d+ d=\d+ \w+ s_q=\d+)\s+([\d.\s]+)$", line)
        if threads and m:
            # tiled, decode, decode head-major, torch, torch bshd us, then their ratios
            _, dec, dec_hm, torch_hm, torch_bshd = (float(x) for x in m.group(2).split()[:5])
            if "s_k=5 " not in m.group(1):  # the 1-us smoke shape
                tables[threads].append((m.group(1), torch_hm / dec_hm, torch_bshd / dec))
    fig, axes = plt.subplots(1, len(tables), figsize=(13, 7), sharey=True)
    for ax, (t, rows) in zip(axes, sorted(tables.items(), reverse=True)):
        ys = range(len(rows))
        ax.barh([y + 0.2 for y in ys], [r[1] for r in rows], 0.4, label="head-major K/V (torch's layout)")
        ax.barh([y - 0.2 for y in ys], [r[2] for r in rows], 0.4, label="(b, s, h_k, d) K/V (flash-attn's)")
        ax.axvline(1.0, color="gray", linestyle="--", linewidth=0.8)
        ax.set_yticks(list(ys), [r[0].replace(" h=32", "").replace(" d=128", "") for r in rows], fontsize=7)
        ax.set_xlabel("torch's time / ours (same memory)")
        ax.set_title(f"{t} threads", fontsize=10)
    axes[0].invert_yaxis()  # the table's order, top down (the axes share y)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=2, fontsize=8)
    fig.suptitle("CPU decoding against torch's CPU SDPA, Intel Xeon of the H200 machine "
                 f"({os.path.basename(path)})", fontsize=10)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    results = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "results")
    for dev in ("h100", "h200"):
        src = os.path.join(results, f"cuda_{dev}_kvcache.json")
        if os.path.exists(src):
            gpu_chart(src, os.path.join(results, f"decode_gpu_{dev}.png"))
    src = os.path.join(results, "cpu_decode_xeon.txt")
    if os.path.exists(src):
        cpu_chart(src, os.path.join(results, "decode_cpu_xeon.png"))
