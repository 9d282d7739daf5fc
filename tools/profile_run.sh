#!/usr/bin/env bash
# Profiling call for a lent GPU: decoding timings (per call, graph-replayed, host time) with the
# peers, then Nsight Compute on flashmonoid's and FlashAttention-2's forward and backward kernels at 4k (16k tokens, hidden 2048, bf16).
# Uses a gpu bench binary built beforehand (FM_BIN; tools/device_run.sh builds everything instead).
set -uo pipefail
OUT=${OUT:-$PWD/device_out}
BIN=${FM_BIN:-build-prof/bench/gpu/flashmonoid-gpu-bench}
mkdir -p "$OUT"
step() { echo "== $* ($(date +%T))"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader

if [ "${FM_PROF_DECODE:-1}" != 0 ]; then
  step "decoding"
  timeout 120 "$BIN" "$OUT/decode.json" --decode-only 2>"$OUT/decode.log"
  FM_PEERS_DECODE_ONLY=1 FM_PEERS_NO_BWD=1 timeout 120 python3 bench/peers.py "$OUT/peers_decode.json" 2>>"$OUT/decode.log"
  python3 - "$OUT" <<'PY'
import json, os, sys
o = sys.argv[1]
recs = sum((json.load(open(os.path.join(o, f))) for f in ("decode.json", "peers_decode.json") if os.path.exists(os.path.join(o, f))), [])
json.dump(recs, open(os.path.join(o, "decode_all.json"), "w"), indent=1)
PY
  python3 bench/summarize.py "$OUT/decode_all.json" --markdown | tail -12
fi

if [ "${FM_PROF_NCU:-1}" != 0 ]; then
  step "ncu"
  SEC=(--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis
       --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section SchedulerStats
       --section Occupancy --section LaunchStats --section InstructionStats)
  NCU=(ncu --clock-control none "${SEC[@]}")
  S=${FM_PROF_SEQ:-4096}
  for d in ${FM_PROF_FWD_HDIMS:-128 256}; do
    timeout 120 "${NCU[@]}" -k regex:fwd_kernel_sm80 --launch-skip 2 --launch-count 1 "$BIN" --case $d 0 $S --no-bwd \
      >"$OUT/ncu_fm_fwd_$d.txt" 2>&1
    echo "fm fwd $d rc=$?"
  done
  for d in ${FM_PROF_BWD_HDIMS:-64 128 256}; do
    timeout 150 "${NCU[@]}" --section SourceCounters -k regex:bwd_main --launch-skip 2 --launch-count 1 "$BIN" --case $d 0 $S \
      >"$OUT/ncu_fm_bwd_$d.txt" 2>&1
    echo "fm bwd $d rc=$?"
  done
  for d in ${FM_PROF_PEER_HDIMS:-64 128 256}; do
    timeout 150 "${NCU[@]}" -k regex:"flash_fwd_kernel|flash_bwd_dq_dk_dv" --launch-skip 2 --launch-count 2 \
      python3 tools/profile_peer.py $d 0 $S >"$OUT/ncu_fa2_$d.txt" 2>&1
    echo "fa2 $d rc=$?"
  done
  grep -H -E "^  [a-z_]+.*\(|Duration|Compute \(SM\) Throughput|Registers Per|Issue Slots Busy|Shared Memory  *\[|Bank Conflicts" \
    "$OUT"/ncu_*.txt | head -80
fi
step "done"
