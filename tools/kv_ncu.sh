#!/usr/bin/env bash
# Per-kernel durations (ncu, --clock-control none) of forward_kvcache's append, forward and combine on
# a few decoding shapes (`flashmonoid-gpu-bench --kv-case B S_K PAGE S_Q`, append + rotary), next to
# each shape's graph-replayed TB/s. Run from the repo root on a GPU machine; logs under $OUT.
set -uo pipefail
(cmake -S . -B build-device -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 && ninja -C build-device flashmonoid-gpu-bench) >$OUT/build.log 2>&1 || { tail -20 $OUT/build.log; exit 1; }
B=build-device/bench/gpu/flashmonoid-gpu-bench
for c in "1 32768 0 1" "1 32768 0 4" "8 4096 0 1" "8 4096 0 4" "8 4096 16 1"; do
  echo "== $c: $($B --kv-case $c)"
  ncu --clock-control none --metrics gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active,dram__bytes_read.sum -k regex:. --launch-skip 30 --launch-count 6 $B --kv-case $c > $OUT/ncu_${c// /_}.txt 2>&1
  python3 - $OUT/ncu_${c// /_}.txt <<'PY'
import re, sys
name = None
for line in open(sys.argv[1]):
    m = re.match(r"\s+(\S+?)(\(|<)", line)
    if line.startswith("  ") and ("kernel" in line) and "Section" not in line and "(" in line and not line.strip().startswith(("gpu__", "sm__", "dram__")):
        name = line.strip().split("(")[0].split("<")[0][-40:]
    for k in ("gpu__time_duration.sum", "dram__bytes_read.sum", "sm__warps_active"):
        if k in line:
            f = line.split()
            print(f"  {name:40s} {k:28s} {f[-2]} {f[-1]}")
PY
done
