#!/usr/bin/env python3
"""Chart of the CPU training passes against torch's CPU SDPA from committed results, no GPU needed:

    python3 bench/plot_cpu.py [results dir]      # default bench/results; needs matplotlib

cpu_train_xeon.png from cpu_vs_torch_{16,8}t_xeon_s35{,_causal}.json (bench/cpu_vs_torch.py on the
H200 machine's Xeon, ours and torch interleaved in one process): torch's time over ours for the
forward and the forward + backward, causal and not, per (dtype, hdim, seqlen), b = 1, h = 8, one
panel per thread count.
"""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from charts import grouped_bars, reference_line  # noqa: E402

SOURCES = {16: "cpu_vs_torch_16t_xeon_s35", 8: "cpu_vs_torch_8t_xeon_s35"}
SERIES = [  # label, pass, causal
    ("forward", "fwd", False),
    ("forward, causal", "fwd", True),
    ("forward + backward", "fwd_bwd", False),
    ("forward + backward, causal", "fwd_bwd", True),
]


def speedups(results, stem):
    """{(pass, causal, dtype, hdim, seqlen): torch ms / ours ms} over the plain and causal files."""
    out, cpu = {}, None
    for causal, suffix in ((False, ""), (True, "_causal")):
        path = os.path.join(results, stem + suffix + ".json")
        if not os.path.exists(path):
            continue
        data = json.load(open(path))
        cpu = data["cpu"]
        ms = {(r["impl"], r["pass"], r["dtype"], r["hdim"], r["seqlen"]): r["ms"] for r in data["records"]}
        for (impl, pas, dtype, d, s), t in ms.items():
            torch_ms = ms.get(("torch_cpu", pas, dtype, d, s))
            if impl == "flashmonoid" and torch_ms:
                out[(pas, causal, dtype, d, s)] = torch_ms / t
    return out, cpu


def chart(results, out):
    panels = {t: speedups(results, stem) for t, stem in SOURCES.items()}
    panels = {t: p for t, p in panels.items() if p[0]}
    if not panels:
        return
    fig, axes = plt.subplots(len(panels), 1, figsize=(13, 4 * len(panels)), sharey=True, squeeze=False)
    for ax, (threads, (val, cpu)) in zip(axes[:, 0], sorted(panels.items(), reverse=True)):
        shapes = sorted({k[2:] for k in val}, key=lambda k: (k[0] != "bf16", k[1], k[2]))
        grouped_bars(ax, [f"{dt} d {d}\n{s // 1024}k" for dt, d, s in shapes],
                     [(label, [val.get((pas, causal) + sh, 0.0) for sh in shapes]) for label, pas, causal in SERIES])
        reference_line(ax, 1.0)
        ax.set_ylabel("torch's time / ours")
        ax.set_title(f"{threads} threads, {cpu}", fontsize=10)
        ax.legend(fontsize=8, ncol=4, loc="upper left")
    ymax = max(v for _, (val, _) in panels.items() for v in val.values())
    axes[0, 0].set_ylim(0, ymax * 1.15)
    fig.suptitle("CPU attention against torch's CPU SDPA (flash), b = 1, h = 8, one process, interleaved "
                 "(bench/cpu_vs_torch.py)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    results = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "results")
    chart(results, os.path.join(results, "cpu_train_xeon.png"))
