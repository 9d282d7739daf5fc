#!/usr/bin/env bash
# A/B of KV-cache decoding (issue 10): this tree ("new") against reference source trees, on a GPU
# machine. Each reference (FM_AB_REF, space-separated folders, default .ab/ref) is a `git archive` of
# a commit to compare, or a patched copy of this tree, with this tree's bench/gpu/gpu_bench.cu copied
# in, so every binary runs the same `--kv-probe` (graph-replayed TB/s per variant,
# bench/gpu/gpu_bench.cu: kv_probe); the probes alternate FM_AB_ROUNDS times (default 2; the order
# reversed every other round) and a
# table of medians is printed last. FM_AB_TESTS: a gtest filter of
# test_kvcache_cuda and test_fwd_cuda run on this tree's build first (default: the KV-cache tests
# and the decoding cases), and under compute-sanitizer memcheck and racecheck (KV-cache tests;
# FM_AB_SANITIZERS: the tools, empty for none). FM_AB_PROBE: the probe's flag (default --kv-probe;
# --kv-probe-d256 for head dim 256).
set -uo pipefail
OUT=${OUT:-$PWD/ab_out}
REFS=${FM_AB_REF:-.ab/ref}
ROUNDS=${FM_AB_ROUNDS:-2}
TESTS=${FM_AB_TESTS:-'KvCacheCuda.*:Decode/*:*SplitKV*'}
PROBE=${FM_AB_PROBE:---kv-probe}
mkdir -p "$OUT"
build() {  # source dir, build dir, name, targets...
  local src=$1 dir=$2 name=$3
  shift 3
  cmake -S "$src" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 >"$OUT/build_$name.log" 2>&1 &&
    ninja -C "$dir" "$@" >>"$OUT/build_$name.log" 2>&1 || { echo "build $name failed"; tail -20 "$OUT/build_$name.log"; return 1; }
}
start=$(date +%s)
names=(new)
build . build-ab-new new flashmonoid-gpu-bench test_kvcache_cuda test_fwd_cuda & pids=($!)
for ref in $REFS; do
  name=$(basename "$ref")
  names+=("$name")
  build "$ref" "build-ab-$name" "$name" flashmonoid-gpu-bench & pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || exit 1; done
echo "builds: $(($(date +%s) - start)) s; spills: $(python3 tools/check_spills.py "$OUT/build_new.log" 2>&1 | tail -1)"
if [ "$TESTS" != none ]; then
  for t in kvcache fwd; do
    timeout 300 build-ab-new/tests/cpp/test_${t}_cuda --gtest_filter="$TESTS" >"$OUT/test_$t.log" 2>&1
    echo "test_${t}_cuda rc=$?: $(grep -E '^\[  (PASSED|FAILED)' "$OUT/test_$t.log" | tr '\n' ' ')"
  done
  for tool in ${FM_AB_SANITIZERS-memcheck racecheck}; do
    timeout 240 compute-sanitizer --tool $tool --error-exitcode 3 build-ab-new/tests/cpp/test_kvcache_cuda \
      --gtest_filter='KvCacheCuda.*' >"$OUT/sanitizer_$tool.log" 2>&1
    echo "$tool kvcache rc=$?: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer_$tool.log" | tail -1)"
  done
fi
for r in $(seq "$ROUNDS"); do
  order=("${names[@]}")  # reversed every other round: a fixed order times the first binary apart
  [ $((r % 2)) = 0 ] && for ((i = ${#names[@]} - 1, j = 0; i >= 0; i--, j++)); do order[j]=${names[i]}; done
  for v in "${order[@]}"; do
    build-ab-$v/bench/gpu/flashmonoid-gpu-bench "$PROBE" >"$OUT/probe_${v}_$r.txt" 2>"$OUT/probe_${v}_$r.err" ||
      { echo "probe $v failed"; tail -5 "$OUT/probe_${v}_$r.err"; }
  done
done
python3 - "$OUT" "$ROUNDS" "${names[@]}" <<'PY'
import statistics, sys
out, rounds, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
val = {}
for v in names:
    for r in range(1, rounds + 1):
        for line in open(f"{out}/probe_{v}_{r}.txt").read().splitlines()[1:]:
            f = line.split()
            if len(f) < 5:
                continue
            val.setdefault((f[0], f[1], " ".join(f[2:-2])), {}).setdefault(v, []).append(float(f[-1]))
print(f"{'b':>3} {'s_k':>7} {'variant':<22} " + " ".join(f"{v:>8}" for v in names) + "  (x copy)")
for (b, sk, name), d in val.items():
    m = {v: statistics.median(x) for v, x in d.items()}
    print(f"{b:>3} {sk:>7} {name:<22} " + " ".join(f"{m.get(v, 0):8.3f}" for v in names))
PY
