#!/usr/bin/env bash
# A/B of kernel variants in one device call. "cur" is the working tree; each name in FM_VARIANTS is a
# file $FM_VARIANT_DIR/<name> (default build-probe/, an ignored folder: pass it in `carry`) copied over
# FM_VARIANT_FILE (default src/cuda/sm90/kernel_fwd_sm90.cuh) for its build. Builds once, rebuilds only
# the bench for each variant, runs FM_TEST_FILTER of test_fwd_cuda (default: the sm90 forward cases; and
# racecheck with FM_RACE=1; FM_TEST_BIN, FM_SANITIZER_TOOL pick others) on "cur", then times every case of FM_CASES ("hdim causal seqlen;...") in one
# bench process per variant, three rounds with the variant order reversed each round (clocks drift within
# a call), and prints the medians. FM_BENCH_ARGS: gpu_bench flags (default --no-bwd; "" times the
# backward too, reported as fwd/bwd).
# FM_PATCHES: patch files (e.g. bench/experiments/*.patch), each one more variant named after its file,
# whose patched files are written to $FM_VARIANT_DIR/<name>/ first (the tree itself stays unpatched).
# FM_ROUNDS: rounds of the timings (default 3). FM_TEST_EACH=1 runs the test filter on every variant's
# build as well; FM_TEST_TIMEOUT (default 240 s) bounds each test run (the sm90 backward filter takes
# ~4.5 min in one process); FM_TEST_SHARDS=n runs it as n gtest shards side by side.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
VDIR=${FM_VARIANT_DIR:-build-probe}
if command -v patch >/dev/null; then apply_patch() { patch -s -p1 "$@"; }; else apply_patch() { git apply "$@" -; }; fi
for pf in ${FM_PATCHES:-}; do
  name=$(basename "$pf" .patch)
  files=$(grep -E '^\+\+\+ b/' "$pf" | cut -c7-)
  apply_patch <"$pf" || { echo "patch $pf does not apply"; exit 1; }
  for f in $files; do mkdir -p "$VDIR/$name/$(dirname "$f")"; cp "$f" "$VDIR/$name/$f"; done
  apply_patch -R <"$pf"
  FM_VARIANTS="${FM_VARIANTS:-} $name"
done
B=build-dev
FILE=${FM_VARIANT_FILE:-src/cuda/sm90/kernel_fwd_sm90.cuh}
# The tree's copies of every file a variant replaces are touched, so that "cur" recompiles what they
# feed: on a warm machine a failed variant build can leave objects newer than the restored tree.
touch $FILE
for v in ${FM_VARIANTS:-}; do
  [ -d $VDIR/$v ] && (cd $VDIR/$v && find . -type f) | while read -r f; do [ -f "$f" ] && touch "$f"; done
done
start=$(date +%s)
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 >$OUT/build.log 2>&1 &&
  ninja -C $B ${FM_TEST_BIN:-test_fwd_cuda} flashmonoid-gpu-bench >>$OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
echo "build cur: $(( $(date +%s) - start )) s"; grep -E "[1-9][0-9]* bytes spill|C75[0-9][0-9]" $OUT/build.log | head -3
cp $B/bench/gpu/flashmonoid-gpu-bench /tmp/bench_cur; cp $B/tests/cpp/${FM_TEST_BIN:-test_fwd_cuda} /tmp/test_cur
# The test filter on the build of "cur" (FM_TEST_EACH=1: on every variant's build too).
run_tests() {
  [ "${FM_TEST_FILTER:-}" = none ] && return
  local n=${FM_TEST_SHARDS:-1} i pids=()
  for ((i = 0; i < n; i++)); do
    GTEST_TOTAL_SHARDS=$n GTEST_SHARD_INDEX=$i timeout ${FM_TEST_TIMEOUT:-240} stdbuf -oL \
      /tmp/test_$1 --gtest_filter="${FM_TEST_FILTER:-*sm90*:CudaForwardGrid*:CudaForwardPath*}" >$OUT/tests_$1_$i.log 2>&1 &
    pids+=($!)
  done
  for ((i = 0; i < n; i++)); do wait ${pids[$i]}; echo "tests $1 shard $i rc=$?"; done
  cat $OUT/tests_$1_*.log >$OUT/tests_$1.log; rm -f $OUT/tests_$1_*.log
  grep -E "FAILED|PASSED|Failure" $OUT/tests_$1.log | head -20
}
# FM_RACE=1: the sanitizer (FM_SANITIZER_TOOL, default racecheck) on FM_RACE_FILTER, alongside the tests.
if [ -n "${FM_RACE:-}" ]; then
  ( timeout ${FM_RACE_TIMEOUT:-200} compute-sanitizer --tool ${FM_SANITIZER_TOOL:-racecheck} --error-exitcode 3 /tmp/test_cur --gtest_filter="${FM_RACE_FILTER:-Hopper/CudaForward.*/sm90_case1:Hopper/CudaForward.*/sm90_case0:CudaForwardGrid*}" >$OUT/race.log 2>&1
    echo "racecheck rc=$?" >$OUT/race.rc ) &
  race_pid=$!
fi
# The tests of "cur" run from a copy of its (static) test binary while the variants build; their
# results print before the timings, which wait for them.
run_tests cur >$OUT/tests_cur.summary 2>&1 &
tests_pid=$!
# A variant that is a folder holds files at their repository paths, copied over the tree for its build
# and restored after it (a file variant is copied over FILE).
for v in ${FM_VARIANTS:-}; do
  files=$([ -d $VDIR/$v ] && (cd $VDIR/$v && find . -type f) || echo $FILE)
  for f in $files; do mkdir -p /tmp/ab_orig/$(dirname $f); cp $f /tmp/ab_orig/$f; done
  if [ -d $VDIR/$v ]; then cp -r $VDIR/$v/. .; else cp $VDIR/$v $FILE; fi
  start=$(date +%s)
  targets="flashmonoid-gpu-bench"; [ -n "${FM_TEST_EACH:-}" ] && targets="$targets ${FM_TEST_BIN:-test_fwd_cuda}"
  ninja -C $B $targets >>$OUT/build.log 2>&1 || { tail -30 $OUT/build.log; for f in $files; do cp /tmp/ab_orig/$f $f; done; exit 1; }
  echo "build $v: $(( $(date +%s) - start )) s"; grep -E "[1-9][0-9]* bytes spill|C75[0-9][0-9]" $OUT/build.log | sort -u | head -3
  cp $B/bench/gpu/flashmonoid-gpu-bench /tmp/bench_$v
  [ -n "${FM_TEST_EACH:-}" ] && cp $B/tests/cpp/${FM_TEST_BIN:-test_fwd_cuda} /tmp/test_$v && run_tests $v
  for f in $files; do cp /tmp/ab_orig/$f $f; done
done
wait $tests_pid; cat $OUT/tests_cur.summary
if [ -n "${FM_RACE:-}" ]; then
  wait $race_pid; cat $OUT/race.rc; grep -E "RACECHECK SUMMARY|ERROR SUMMARY" $OUT/race.log | head
fi
all="cur ${FM_VARIANTS:-}"
args=()
IFS=';' read -ra cases <<<"${FM_CASES}"
for c in "${cases[@]}"; do args+=(--case $c); done
order="$all"
for rep in $(seq ${FM_ROUNDS:-3}); do
  for v in $order; do
    timeout 300 /tmp/bench_$v ${FM_BENCH_ARGS---no-bwd} "${args[@]}" 2>&1 | grep '"impl": "flashmonoid"' |
      sed "s/^/$v /" >>$OUT/ab_raw.txt
  done
  order=$(echo $order | awk '{for(i=NF;i>0;i--) printf "%s ", $i}')
done
python3 - "$OUT/ab_raw.txt" $all <<'PY' | tee $OUT/ab.txt
import json, statistics, sys
raw, variants = sys.argv[1], sys.argv[2:]
res = {}
for line in open(raw):
    v, rec = line.split(" ", 1)
    r = json.loads(rec.strip().rstrip(","))
    key = (r["pass"], r["hdim"], r["causal"], r["seqlen_q"])
    res.setdefault(key, {}).setdefault(v, []).append(r["tflops"])
print("%-22s" % "pass/hdim/causal/s" + "".join(" %9s" % v for v in variants) + "   (each round)")
for key in sorted(res):
    row = res[key]
    med = [statistics.median(row[v]) if v in row else 0 for v in variants]
    print("%-22s" % "/".join(str(k) for k in key) + "".join(" %9.1f" % m for m in med) +
          "   " + " ".join("%s:%s" % (v, ",".join("%.0f" % x for x in row.get(v, []))) for v in variants))
PY
