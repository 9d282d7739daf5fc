#!/usr/bin/env bash
# The one GPU script: build, GPU tests, compute-sanitizer, benchmarks. Run from the repo root on a
# machine with a CUDA GPU; logs and bench.json go to $OUT (default ./device_out), a summary table
# is printed last. Environment:
#   FM_TESTS   ctest regex of GPU tests to run (default: every test labelled cuda)
#   FM_BENCH   0 skips the benchmarks;  FM_PEERS 0 skips the PyTorch peers
#   FM_ARCH    CUDA architectures to build (default 90: the H100; the library default is 80;90)
set -uo pipefail
OUT=${OUT:-$PWD/device_out}
mkdir -p "$OUT"
ARCH=${FM_ARCH:-90}
JOBS=$(nproc)
BUILD=build-device
status=0
step() { echo "== $* ($(date +%T))"; }

step "device"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader || true
nvcc --version | tail -1

# googletest: the system's if CMake finds it, else sources carried in .deps/googletest.
GTEST_ARGS=()
if [ -d .deps/googletest ] && [ ! -f /usr/lib/x86_64-linux-gnu/cmake/GTest/GTestConfig.cmake ]; then
  step "googletest from .deps"
  cmake -S .deps/googletest -B /tmp/gtest-build -G Ninja -DCMAKE_INSTALL_PREFIX=/tmp/gtest -DBUILD_GMOCK=OFF \
    -DCMAKE_BUILD_TYPE=Release >/dev/null && cmake --build /tmp/gtest-build -j "$JOBS" >/dev/null &&
    cmake --install /tmp/gtest-build >/dev/null
  GTEST_ARGS=(-DGTest_ROOT=/tmp/gtest -DCMAKE_PREFIX_PATH=/tmp/gtest)
fi

step "build (CUDA archs $ARCH, $JOBS jobs)"
start=$(date +%s)
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$ARCH" \
  "${GTEST_ARGS[@]}" >"$OUT/build.log" 2>&1 &&
  ninja -C "$BUILD" -j "$JOBS" -k 0 >>"$OUT/build.log" 2>&1
build_rc=$?
echo "build rc=$build_rc in $(($(date +%s) - start)) s"
grep -E "error|FAILED" "$OUT/build.log" | head -20
python3 tools/check_spills.py "$OUT/build.log" >"$OUT/spills.txt" 2>&1 || status=1
tail -3 "$OUT/spills.txt"
[ $build_rc -eq 0 ] || status=1

step "GPU tests"
(cd "$BUILD" && timeout ${FM_TEST_TIMEOUT:-240} ctest -L cuda ${FM_TESTS:+-R "$FM_TESTS"} -j 1 --output-on-failure --timeout 240) >"$OUT/tests.log" 2>&1 || status=1
grep -E "tests passed|tests failed|\*\*\*Failed|Not Run|Timeout" "$OUT/tests.log" | tail -25

step "compute-sanitizer (memcheck, racecheck) on small cases"
SAN_FILTER=${FM_SANITIZE_FILTER:-'Grid/CudaForward.*/case0:Grid/CudaForward.*/case1:Grid/CudaForward.*/case3:Decode/CudaSplitKV.*/case0:CudaDropout.*:CudaMerge.*'}
if [ -x "$BUILD/tests/cpp/test_fwd_cuda" ]; then
  for tool in memcheck racecheck; do
    timeout ${FM_SANITIZER_TIMEOUT:-120} compute-sanitizer --tool $tool --error-exitcode 3 "$BUILD/tests/cpp/test_fwd_cuda" \
      --gtest_filter="$SAN_FILTER" >"$OUT/sanitizer_$tool.log" 2>&1
    rc=$?
    echo "$tool rc=$rc: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer_$tool.log" | tail -1)"
    [ $rc -eq 0 ] || status=1
  done
fi

if [ "${FM_BENCH:-1}" != 0 ] && [ -x "$BUILD/bench/gpu/flashmonoid-gpu-bench" ]; then
  step "benchmarks"
  timeout 150 "$BUILD/bench/gpu/flashmonoid-gpu-bench" "$OUT/fm.json" ${FM_BENCH_ARGS:-} 2>"$OUT/bench.log" || status=1
  if [ "${FM_PEERS:-1}" != 0 ]; then
    PYTHONUNBUFFERED=1 timeout 180 python3 bench/peers.py "$OUT/peers.json" 2>>"$OUT/bench.log" || status=1
  fi
  python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
recs = []
for name in ("fm.json", "peers.json"):
    p = os.path.join(out, name)
    if os.path.exists(p):
        recs += json.load(open(p))
json.dump(recs, open(os.path.join(out, "bench.json"), "w"), indent=1)
key = lambda r: (r.get("pass"), r.get("hdim"), r.get("causal"), r.get("batch"), r.get("seqlen_q"), r.get("seqlen_k"))
by = {}
for r in recs:
    by.setdefault(key(r), {})[r["impl"]] = r
print(f"{'pass':4} {'d':>3} {'c':1} {'b':>3} {'s_q':>6} {'s_k':>6} | {'fm':>7} {'flash':>7} {'cudnn':>7} {'effic':>7} | fm/flash")
for k in sorted(by, key=lambda k: tuple(str(x) for x in k)):
    row = by[k]
    if k[0] not in ("fwd", "bwd"):
        continue
    m = "tflops" if "tflops" in next(iter(row.values())) else "tbps"
    g = lambda i: row[i][m] if i in row else float("nan")
    fm, fl = g("flashmonoid"), g("torch_flash")
    print(f"{k[0]:4} {k[1]:>3} {'y' if k[2] else 'n'} {k[3]:>3} {k[4]:>6} {k[5]:>6} | {fm:7.1f} {fl:7.1f} "
          f"{g('torch_cudnn'):7.1f} {g('torch_efficient'):7.1f} | {fm / fl if fl == fl and fl else float('nan'):.2f}  {m}")
for r in recs:
    if r.get("pass") in ("copy", "fwd_memory"):
        print(json.dumps({k: v for k, v in r.items() if k != "device"}))
PY
fi
step "done: status $status"
exit $status
