#!/usr/bin/env bash
# Memory and tensor-pipe profile of the forward kernels, flashmonoid's sm90 kernel next to cuDNN's
# (PyTorch SDPA), at the training shapes of FM_CASES ("hdim causal seqlen;...", 16k tokens, hidden 2048,
# bf16): duration, DRAM bytes, L2 hit rate, tensor-pipe activity, per kernel (one launch after warm-up).
# Then, with FM_SOURCE=1, where flashmonoid's warps wait (tools/ncu_source.sh) for each case.
# FM_PASS=bwd profiles the backward's main kernels instead (ours: bwd_kernel_sm90; cuDNN's: the first
# kernel whose name reads like a backward one).
# Usage: FM_BIN=build/bench/gpu/flashmonoid-gpu-bench tools/profile_short.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BIN=${FM_BIN:-build/bench/gpu/flashmonoid-gpu-bench}
M=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,lts__t_bytes.sum
M=$M,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active,sm__throughput.avg.pct_of_peak_sustained_elapsed
NCU=(timeout 120 ncu --clock-control none --metrics $M --launch-skip 2 --launch-count 1 --csv)
IFS=';' read -ra cases <<<"${FM_CASES:-128 0 512;64 1 512;256 0 512;128 0 4096}"
for c in "${cases[@]}"; do
  read -r d causal s <<<"$c"
  tag="${d}_${causal}_${s}"
  if [ "${FM_PASS:-fwd}" = bwd ]; then
    "${NCU[@]}" -k regex:bwd_kernel_sm90 "$BIN" --case $c >"$OUT/m_fm_$tag.csv" 2>&1
    "${NCU[@]}" -k regex:'dgrad|bprop|bwd|backward|Backward' python3 tools/profile_peer.py $c cudnn fwd_bwd \
      >"$OUT/m_cudnn_$tag.csv" 2>&1
  else
    "${NCU[@]}" -k regex:fwd_kernel_sm90 "$BIN" --case $c --no-bwd >"$OUT/m_fm_$tag.csv" 2>&1
    "${NCU[@]}" -k regex:'sdpa|fprop|fmha|flash' python3 tools/profile_peer.py $c cudnn fwd \
      >"$OUT/m_cudnn_$tag.csv" 2>&1
  fi
  for who in fm cudnn; do
    python3 - "$OUT/m_${who}_$tag.csv" "$who $c" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1], errors="replace")))
rows = rows[next((i for i, r in enumerate(rows) if "Kernel Name" in r), len(rows)):]
if len(rows) < 2:
    print(sys.argv[2], "no rows:", open(sys.argv[1], errors="replace").read()[-400:]); sys.exit()
h = rows[0]; ki, mi, vi = h.index("Kernel Name"), h.index("Metric Name"), h.index("Metric Value")
vals = {r[mi]: r[vi] for r in rows[1:]}
name = rows[1][ki][:60]
def g(k, div=1.0):
    try: return float(vals[k].replace(",", "")) / div
    except (KeyError, ValueError): return float("nan")
t = g("gpu__time_duration.sum", 1e3)
rd, wr, l2 = g("dram__bytes_read.sum", 1e6), g("dram__bytes_write.sum", 1e6), g("lts__t_bytes.sum", 1e6)
print(f"{sys.argv[2]:>18}: {t:7.1f} us  DRAM rd {rd:6.0f} MB wr {wr:5.0f} MB ({(rd + wr) / t:4.2f} TB/s)  "
      f"L2 {l2:6.0f} MB hit {g('lts__t_sector_hit_rate.pct'):4.1f}%  tensor {g('sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active'):4.1f}%  "
      f"SM {g('sm__throughput.avg.pct_of_peak_sustained_elapsed'):4.1f}%  [{name}]")
PY
  done
done
if [ -n "${FM_SOURCE:-}" ]; then
  for c in "${cases[@]}"; do
    tools/ncu_source.sh "$BIN" "fwd_${c// /_}" fwd_kernel_sm90 "$c" --no-bwd 2>&1 | head -45
  done
fi
