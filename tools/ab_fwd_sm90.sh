#!/usr/bin/env bash
# A/B of sm90 forward kernel variants in one device call: "cur" is the working tree's
# src/cuda/sm90/kernel_fwd_sm90.cuh, each name in FM_VARIANTS a file $FM_VARIANT_DIR/kernel_<name>.cuh
# (default build-probe/, an ignored folder: pass it in `carry`). Builds once, rebuilds only the forward
# for each variant, runs the sm90 forward tests (and racecheck with FM_RACE=1) on "cur", then times
# FM_CASES ("hdim causal seqlen;...") three times per variant, the order reversed each time (clocks
# drift within a call), and prints medians. Used for the early-S experiment (bench/NOTES.md).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
B=build-dev
start=$(date +%s)
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 >$OUT/build.log 2>&1 &&
  ninja -C $B test_fwd_cuda flashmonoid-gpu-bench >>$OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
echo "build cur: $(( $(date +%s) - start )) s"; grep -E "[1-9][0-9]* bytes spill" $OUT/build.log | head -3
cp $B/bench/gpu/flashmonoid-gpu-bench /tmp/bench_cur
timeout 240 $B/tests/cpp/test_fwd_cuda --gtest_filter='*sm90*:CudaForwardGrid*:CudaForwardPath*' --gtest_brief=1 >$OUT/tests.log 2>&1
echo "tests rc=$?"; grep -E "FAILED|PASSED|Failure" $OUT/tests.log | head -20
if [ -n "${FM_RACE:-}" ]; then
  timeout 200 compute-sanitizer --tool racecheck --error-exitcode 3 $B/tests/cpp/test_fwd_cuda --gtest_filter='Hopper/CudaForward.*/sm90_case1:Hopper/CudaForward.*/sm90_case0:CudaForwardGrid*' >$OUT/race.log 2>&1
  echo "racecheck rc=$?"; grep -E "RACECHECK SUMMARY|ERROR SUMMARY" $OUT/race.log | head
fi
cp src/cuda/sm90/kernel_fwd_sm90.cuh /tmp/kernel_cur.cuh
for v in ${FM_VARIANTS}; do
  cp ${FM_VARIANT_DIR:-build-probe}/kernel_$v.cuh src/cuda/sm90/kernel_fwd_sm90.cuh
  start=$(date +%s)
  ninja -C $B flashmonoid-gpu-bench >>$OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
  echo "build $v: $(( $(date +%s) - start )) s"
  cp $B/bench/gpu/flashmonoid-gpu-bench /tmp/bench_$v
done
cp /tmp/kernel_cur.cuh src/cuda/sm90/kernel_fwd_sm90.cuh
all="cur ${FM_VARIANTS}"
IFS=';' read -ra cases <<<"${FM_CASES}"
printf "%-12s" case; for v in $all; do printf " %14s" $v; done; echo
for c in "${cases[@]}"; do
  declare -A res=()
  order="$all"
  for rep in 1 2 3; do
    for v in $order; do
      t=$(timeout 60 /tmp/bench_$v --no-bwd --case $c 2>&1 | grep -o '"impl": "flashmonoid", "pass": "fwd".*"tflops": [0-9.]*' | grep -o '[0-9.]*$' | head -1)
      res[$v]="${res[$v]:-} ${t:-0}"
    done
    order=$(echo $order | awk '{for(i=NF;i>0;i--) printf "%s ", $i}')  # reverse each rep
  done
  printf "%-12s" "$(echo $c | tr ' ' /)"
  for v in $all; do printf " %14s" "$(echo ${res[$v]} | tr ' ' '\n' | sort -n | sed -n 2p)"; done
  echo "   ($(for v in $all; do echo -n "$v:${res[$v]} "; done))"
  unset res
done | tee $OUT/ab.txt
