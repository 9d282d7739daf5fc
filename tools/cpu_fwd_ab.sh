#!/usr/bin/env bash
# A/B of the CPU forward on a device machine's CPU: source trees (FM_FWD_VARIANTS, "name:dir ...",
# default "new:. ref:.ab/ref"; a reference is a `git archive` of a commit or a patched copy), each
# timed through its own bench/cpu_vs_torch.py (ours and torch's CPU SDPA interleaved in one process,
# FM_FWD_REPEATS repeats, default 21) and its flashmonoid-bench --causal (bf16, hdim 128, ours alone),
# the trees rotated FM_FWD_ROUNDS times (default 6) at FM_FWD_THREADS (default 16) on
# FM_FWD_HDIMS x FM_FWD_SEQLENS (default 64,128 x 1024,2048,4096; causal at FM_FWD_CSEQLENS,
# default 1024,4096), bf16 and fp32, b = 1, h = 8. The table (stdout, $OUT/summary.txt) gives per
# shape each tree's median time, the median of per-round speeds over the last tree, and each tree's
# median torch/ours: on these VMs one library's time moves 1.5-2x between minutes, so the ratio to
# torch timed in the same process is the steadier of the two comparisons (bench/NOTES.md,
# 2026-11-29). OpenMP threads pinned. The per-round JSON in $OUT/j.tgz.
set -uo pipefail
OUT=${OUT:-$PWD/fwd_ab_out}; mkdir -p "$OUT/j"
PY=$(python3 -c 'import sys; print(sys.executable)')
VARIANTS=${FM_FWD_VARIANTS:-"new:. ref:.ab/ref"}
# The Python module as bench/cpu_vs_torch.py builds it (its own cmake call is then a no-op), and
# flashmonoid-bench in a folder of its own (that call configures without it).
bld() {
  cmake -S "$1" -B "$1/build-bench" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHMONOID_CUDA=OFF -DFLASHMONOID_PYTHON=ON \
    -DFLASHMONOID_TESTS=OFF -DFLASHMONOID_BENCH=OFF -DPython_EXECUTABLE="$PY" >"$OUT/b_$2.log" 2>&1 &&
    cmake --build "$1/build-bench" -j 3 >>"$OUT/b_$2.log" 2>&1 || { echo "build $2 failed"; tail -30 "$OUT/b_$2.log"; }
  cmake -S "$1" -B "$1/build-fb" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHMONOID_CUDA=OFF -DFLASHMONOID_TESTS=OFF \
    -DFLASHMONOID_BENCH=ON >"$OUT/bb_$2.log" 2>&1 &&
    cmake --build "$1/build-fb" -j 3 --target flashmonoid-bench >>"$OUT/bb_$2.log" 2>&1 ||
    { echo "build fb $2 failed"; tail -30 "$OUT/bb_$2.log"; }
}
t0=$(date +%s)
for vd in $VARIANTS; do bld "${vd#*:}" "${vd%%:*}" & done
wait
echo "builds $(($(date +%s) - t0)) s"
export OMP_PROC_BIND=${OMP_PROC_BIND:-spread} OMP_PLACES=${OMP_PLACES:-cores}
vs=($VARIANTS); n=${#vs[@]}
for r in $(seq "${FM_FWD_ROUNDS:-6}"); do
  for i in $(seq 0 $((n - 1))); do
    vd=${vs[$(((i + r) % n))]}; v=${vd%%:*}; root=${vd#*:}
    for T in ${FM_FWD_THREADS:-16}; do
      f="$OUT/j/${v}_t${T}_r$r"
      timeout 200 python3 "$root/bench/cpu_vs_torch.py" --threads "$T" --impls flashmonoid,torch_cpu --dtypes bf16,fp32 \
        --passes fwd --hdims "${FM_FWD_HDIMS:-64,128}" --seqlens "${FM_FWD_SEQLENS:-1024,2048,4096}" \
        --repeats "${FM_FWD_REPEATS:-21}" --out "$f.json" >"$f.log" 2>&1 || echo "run $v $T $r failed: $(tail -3 "$f.log")"
      OMP_NUM_THREADS=$T timeout 100 "$root/build-fb/bench/flashmonoid-bench" --device cpu --dtype bf16 --hdim 128 \
        --heads 8 --seqlens "${FM_FWD_CSEQLENS:-1024,4096}" --threads "$T" --repeats 11 --causal \
        --out "$OUT/j/c_${v}_t${T}_r$r.cjson" >/dev/null 2>&1 || echo "causal $v $T $r failed"
    done
  done
done
echo "runs $(($(date +%s) - t0)) s"
python3 - "$OUT/j" "$VARIANTS" <<'PY' | tee "$OUT/summary.txt"
import glob, json, os, statistics as st, sys
d, variants = sys.argv[1], [x.split(":")[0] for x in sys.argv[2].split()]
base = variants[-1]
ms = {}  # (tree, threads, dtype, hdim, seqlen, impl, round) -> ms
for f in glob.glob(d + "/*.json"):
    tree, _, r = os.path.basename(f)[:-5].split("_")
    for x in json.load(open(f))["records"]:
        ms[(tree, x["threads"], x["dtype"], x["hdim"], x["seqlen"], x["impl"], r)] = x["ms"]
for f in glob.glob(d + "/c_*.cjson"):
    _, tree, _, r = os.path.basename(f)[:-6].split("_")
    j = json.load(open(f))
    for x in j["rows"]:
        ms[(tree, j["threads"], "bf16-causal", j["hdim"], x["seqlen"], "flashmonoid", r)] = x["flash"]["ms"]
print(f"threads dtype d s | ours ms {' '.join(variants)} | speed over {base} per round: median [min, max] | "
      f"torch/ours per tree")
for k in sorted({k[1:5] for k in ms}, key=str):
    rounds = sorted({x[6] for x in ms if x[1:5] == k})
    g = lambda v, impl: [ms.get((v,) + k + (impl, r)) for r in rounds]
    meds = " ".join(f"{st.median([x for x in g(v, 'flashmonoid') if x]):.3f}" for v in variants)
    sp = []
    for v in variants[:-1]:
        xs = [b / a for a, b in zip(g(v, "flashmonoid"), g(base, "flashmonoid")) if a and b]
        sp.append(f"{v} {st.median(xs):.3f} [{min(xs):.3f}, {max(xs):.3f}]")
    tv = [[t / a for a, t in zip(g(v, "flashmonoid"), g(v, "torch_cpu")) if a and t] for v in variants]
    tv = " ".join(f"{st.median(x):.2f}" for x in tv if x) or "-"
    print(f"{k[0]} {k[1]} {k[2]} {k[3]} | {meds} | {'; '.join(sp)} | {tv}")
PY
(cd "$OUT" && tar czf /tmp/cpu_fwd_ab_j.tgz j && rm -rf j && mv /tmp/cpu_fwd_ab_j.tgz j.tgz)
