#!/usr/bin/env python3
"""Chart of the GPU training kernels against PyTorch's cuDNN SDPA from committed results, no GPU needed:

    python3 bench/plot_gpu.py [results dir]      # default bench/results; needs matplotlib

train_gpu_<device>.png from cuda_<device>_interleaved.json (bench/peers.py with FM_PEERS_INTERLEAVED=1:
flashmonoid and cuDNN alternated in one process, bf16, 16k tokens per call, hidden 2048): our TFLOP/s
over cuDNN's for the forward and the backward, causal and not, per (hdim, seqlen); the panel titles
give the geometric means.
"""
import json
import math
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from charts import grouped_bars, reference_line  # noqa: E402

PASSES = [("fwd", "forward"), ("bwd", "backward")]


def ratios(path):
    """{(pass, causal, hdim, seqlen): ours TFLOP/s / cuDNN's} and the device's name."""
    rows = json.load(open(path))
    tf = {(r["impl"], r["pass"], r["causal"], r["hdim"], r["seqlen_q"]): r["tflops"] for r in rows}
    out = {k[1:]: t / tf[("torch_cudnn",) + k[1:]] for k, t in tf.items()
           if k[0] == "flashmonoid" and ("torch_cudnn",) + k[1:] in tf}
    return out, rows[0]["device"]


def chart(path, out):
    val, device = ratios(path)
    fig, axes = plt.subplots(len(PASSES), 1, figsize=(13, 4.2 * len(PASSES)), sharey=True, squeeze=False)
    for ax, (pas, name) in zip(axes[:, 0], PASSES):
        shapes = sorted({k[2:] for k in val if k[0] == pas})
        ys = [v for k, v in val.items() if k[0] == pas]
        gmean = math.exp(sum(math.log(v) for v in ys) / len(ys))
        grouped_bars(ax, [f"d {d}\n{s // 1024}k" if s >= 1024 else f"d {d}\n{s}" for d, s in shapes],
                     [(label, [val.get((pas, causal) + sh, 0.0) for sh in shapes])
                      for label, causal in (("not causal", False), ("causal", True))])
        reference_line(ax, 1.0, "cuDNN")
        ax.set_ylabel("our TFLOP/s / cuDNN's")
        ax.set_title(f"{name}: geometric mean {gmean:.3f}x over {len(ys)} shapes, {sum(v >= 1 for v in ys)} at or "
                     "above cuDNN", fontsize=10)
        ax.legend(fontsize=8, ncol=2, loc="upper left")
    axes[0, 0].set_ylim(0, max(val.values()) * 1.15)
    fig.suptitle(f"Training kernels on the {device} against PyTorch's SDPA (cuDNN), bf16, 16k tokens per call, "
                 f"hidden 2048, alternated in one process ({os.path.basename(path)})", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    results = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "results")
    for dev in ("h100", "h200"):
        src = os.path.join(results, f"cuda_{dev}_interleaved.json")
        if os.path.exists(src):
            chart(src, os.path.join(results, f"train_gpu_{dev}.png"))
