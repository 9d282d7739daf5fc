#!/usr/bin/env bash
# A/B of the CPU forward and backward through the public API on a device machine's CPU. Source trees
# (FM_BWD_VARIANTS, "name:dir ...", default "new:. ref:.ab/ref"; a reference is a `git archive` of a
# commit or a patched copy) each build the library alone (CPU backend) and
# bench/experiments/cpu-fwd-bwd-api.cpp against it; then FM_BWD_ROUNDS rounds (default 4), the trees
# in rotating order, time every shape of FM_BWD_SHAPES ("dtype:seqlen:hdim:causal|x", b = 1, h = 8)
# at each of FM_BWD_THREADS (default "16 8"), threads pinned. The table (stdout, $OUT/bwd_ab.txt)
# gives per shape and thread count each tree's median forward and backward ms and the median [min,
# max] of the per-round speeds of each tree over the last one. Raw lines in $OUT/bwd_ab_raw.txt.
set -uo pipefail
OUT=${OUT:-$PWD/bwd_ab_out}; mkdir -p "$OUT"
VARIANTS=${FM_BWD_VARIANTS:-"new:. ref:.ab/ref"}
SHAPES=${FM_BWD_SHAPES:-"bf16:1024:128:x bf16:4096:128:x bf16:1024:128:causal bf16:4096:128:causal bf16:2048:64:causal fp32:1024:128:x"}
THREADS=${FM_BWD_THREADS:-"16 8"}
harness=$PWD/bench/experiments/cpu-fwd-bwd-api.cpp
bld() {  # tree dir, name
  cmake -S "$1" -B "$1/build-ab" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHMONOID_CUDA=OFF -DFLASHMONOID_PYTHON=OFF \
    -DFLASHMONOID_TESTS=OFF -DFLASHMONOID_BENCH=OFF >"$OUT/b_$2.log" 2>&1 &&
    cmake --build "$1/build-ab" -j 6 --target flashmonoid >>"$OUT/b_$2.log" 2>&1 &&
    g++ -O2 -std=c++20 -I"$1/include" "$harness" "$1/build-ab/libflashmonoid.a" -fopenmp -o "$OUT/h_$2" \
      >>"$OUT/b_$2.log" 2>&1 || { echo "build $2 failed"; tail -20 "$OUT/b_$2.log"; }
}
t0=$(date +%s)
for vd in $VARIANTS; do bld "${vd#*:}" "${vd%%:*}" & done
wait
echo "builds $(($(date +%s) - t0)) s"
export OMP_PROC_BIND=${OMP_PROC_BIND:-spread} OMP_PLACES=${OMP_PLACES:-cores}
vs=($VARIANTS); n=${#vs[@]}
raw="$OUT/bwd_ab_raw.txt"; : >"$raw"
for r in $(seq "${FM_BWD_ROUNDS:-4}"); do
  for T in $THREADS; do
    for sh in $SHAPES; do
      IFS=: read -r dt s d c <<<"$sh"
      for i in $(seq 0 $((n - 1))); do
        v=${vs[$(((i + r) % n))]%%:*}
        line=$(OMP_NUM_THREADS=$T timeout 120 "$OUT/h_$v" "$s" "$d" "$T" 9 "$dt" "$c" 2>&1 | tail -1)
        echo "$v $r $T $sh $line" >>"$raw"
      done
    done
  done
done
echo "runs $(($(date +%s) - t0)) s"
python3 - "$raw" "$VARIANTS" <<'PY' | tee "$OUT/bwd_ab.txt"
import re, statistics as st, sys
raw, variants = sys.argv[1], [x.split(":")[0] for x in sys.argv[2].split()]
base = variants[-1]
t = {}  # (shape, threads, tree, round) -> (fwd ms, bwd ms)
for line in open(raw):
    parts = line.split()
    nums = re.findall(r"(fwd|bwd)[^0-9]*([0-9.]+)", line)
    if len(nums) < 2:
        print("unparsed:", line.strip()); continue
    d = dict(nums)
    t[(parts[3], int(parts[2]), parts[0], parts[1])] = (float(d["fwd"]), float(d["bwd"]))
keys = sorted({(k[0], k[1]) for k in t}, key=lambda k: (k[0], -k[1]))
others = [v for v in variants if v != base]
print("shape threads | " + " ".join(f"{v} fwd/bwd ms" for v in variants) + " | " +
      " | ".join(f"{v}/{base} bwd speed, fwd speed (median [min, max])" for v in others))
for sh, T in keys:
    cells = []
    for v in variants:
        xs = [x for (s2, T2, v2, r), x in t.items() if (s2, T2, v2) == (sh, T, v)]
        cells.append(f"{st.median(x[0] for x in xs):.2f}/{st.median(x[1] for x in xs):.2f}" if xs else "-")
    sp = []
    for v in others:
        def speeds(j):
            return [t[(sh, T, base, r)][j] / t[(sh, T, v, r)][j]
                    for (s2, T2, v2, r) in t if (s2, T2, v2) == (sh, T, v) and (sh, T, base, r) in t]
        b, f = speeds(1), speeds(0)
        sp.append(f"{st.median(b):.3f} [{min(b):.3f}, {max(b):.3f}], {st.median(f):.3f}" if b else "-")
    print(f"{sh} T{T} | " + " ".join(cells) + " | " + " | ".join(sp))
PY
