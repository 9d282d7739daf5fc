#!/usr/bin/env bash
# Where a kernel's warps wait, instruction by instruction: Nsight Compute's warp-state sampling on one
# launch of the kernels matching REGEX in `flashmonoid-gpu-bench --case HDIM CAUSAL SEQLEN`, printed as
# the SASS lines with the most samples (with their neighbours' share) and saved as CSV under $OUT.
# Usage: tools/ncu_source.sh BIN NAME REGEX "HDIM CAUSAL SEQLEN" [gpu_bench flags]
# A CASE that starts with "--" is passed as gpu_bench flags instead (e.g. "--kv-case 1 32768 0 1").
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BIN=$1 NAME=$2 REGEX=$3 CASE=$4; shift 4
timeout 240 ncu --clock-control none --section WarpStateStats --section SourceCounters --section SpeedOfLight \
  --import-source no -k regex:"$REGEX" --launch-skip 3 --launch-count 1 -o /tmp/ncu_$NAME -f \
  "$BIN" $([[ $CASE == --* ]] || echo --case) $CASE "$@" >/tmp/ncu_$NAME.log 2>&1 || { echo "ncu $NAME failed"; tail -5 /tmp/ncu_$NAME.log; exit 1; }
ncu -i /tmp/ncu_$NAME.ncu-rep --page details >"$OUT/ncu_$NAME.txt" 2>&1
ncu -i /tmp/ncu_$NAME.ncu-rep --page source --csv --print-source sass >/tmp/ncu_${NAME}_sass.csv 2>&1
gzip -c /tmp/ncu_${NAME}_sass.csv >"$OUT/ncu_${NAME}_sass.csv.gz"
grep -E "Duration|Compute \(SM\) Throughput|Issue Slots|No Eligible|Active Warps Per|Warp Cycles Per Issued" "$OUT/ncu_$NAME.txt" | head -8
python3 - /tmp/ncu_${NAME}_sass.csv "$NAME" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1], errors="replace")))
hdr_i = next((i for i, r in enumerate(rows) if any("Warp Stall Sampling (All" in c for c in r)), None)
if hdr_i is None:
    print("no sampling columns:", rows[:3]); sys.exit()
hdr = rows[hdr_i]
col = next(i for i, c in enumerate(hdr) if "Warp Stall Sampling (All" in c)
src = next((i for i, c in enumerate(hdr) if c.strip() == "Source"), 1)
body = [r for r in rows[hdr_i + 1:] if len(r) > col]
def num(x):
    try: return float(x.replace(",", ""))
    except ValueError: return 0.0
tot = sum(num(r[col]) for r in body) or 1
print(f"{sys.argv[2]}: {len(body)} SASS lines, {tot:.0f} samples; top 30 (share, line, SASS):")
top = sorted(range(len(body)), key=lambda i: -num(body[i][col]))[:30]
for i in sorted(top):
    print(f"  {100 * num(body[i][col]) / tot:5.1f}%  {i:5d}  {body[i][src][:110]}")
PY
