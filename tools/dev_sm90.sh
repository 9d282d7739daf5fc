#!/usr/bin/env bash
# Development loop for the sm90 kernels on the device machine: build the forward test and the GPU
# bench only, run the sm90 test cases, time a few training shapes on both kernel families.
# FM_FILTER: gtest filter (default: every sm90 case); FM_CASES: "hdim causal seqlen;..." to time.
# FM_TEST: the test binary (default test_fwd_cuda); FM_BENCH_ARGS: gpu_bench flags (default --no-bwd);
# FM_SM80: empty to skip the forced-sm80 records (default --with-sm80).
set -uo pipefail
OUT=${OUT:-$PWD/device_out}
mkdir -p "$OUT"
# FM_BUILD: build directory; FM_CUDA_FLAGS: extra nvcc flags (e.g. a -D of an experiment).
B=${FM_BUILD:-build-dev}
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DCMAKE_CUDA_FLAGS="${FM_CUDA_FLAGS:-}" >"$OUT/build_$B.log" 2>&1 &&
  ninja -C $B ${FM_TARGETS:-test_fwd_cuda flashmonoid-gpu-bench} >>"$OUT/build_$B.log" 2>&1 || { tail -40 "$OUT/build_$B.log"; exit 1; }
grep -E "spill|stack frame" "$OUT/build_$B.log" | sort | uniq -c | sort -rn | head -5
T=${FM_TEST:-test_fwd_cuda}
if [ -x $B/tests/cpp/$T ] && [ "${FM_FILTER:-}" != none ]; then
  timeout ${FM_TEST_TIMEOUT:-200} $B/tests/cpp/$T --gtest_filter="${FM_FILTER:-*sm90*}" --gtest_brief=1 \
    >"$OUT/tests.log" 2>&1
  echo "tests rc=$?"; grep -E "FAILED|PASSED|Failure|error|Expected|Which is|out:|lse" "$OUT/tests.log" | head -${FM_FAIL_LINES:-40}
fi
if [ -n "${FM_SANITIZE:-}" ]; then
  timeout 200 compute-sanitizer --tool ${FM_SANITIZE} --error-exitcode 3 $B/tests/cpp/$T \
    --gtest_filter="${FM_SANITIZE_FILTER:-Hopper/CudaForward.*/sm90_case1}" >"$OUT/sanitizer.log" 2>&1
  echo "sanitizer rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Invalid|Race" "$OUT/sanitizer.log" | head -10
fi
IFS=';' read -ra cases <<<"${FM_CASES:-64 0 16384;128 0 16384;128 1 16384;256 0 16384;128 0 1024}"
for c in "${cases[@]}"; do
  timeout 60 $B/bench/gpu/flashmonoid-gpu-bench ${FM_SM80---with-sm80} ${FM_BENCH_ARGS---no-bwd} --case $c 2>&1 | grep -o '"impl": "[a-z_0-9]*".*"tflops": [0-9.]*' |
    sed 's/"pass": "\([a-z_]*\)".*"hdim"/\1 hdim/; s/"batch.*"ms"/ms/; s/"impl": //; s/"causal": //; s/"tflops": //' | grep -v "${FM_HIDE:-@}"
done
