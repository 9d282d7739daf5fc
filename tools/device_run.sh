#!/usr/bin/env bash
# The one GPU script: build, GPU tests, benchmarks with the peers, compute-sanitizer (after the
# benchmarks, so that a short lease still gets its numbers), then the Python package (pip install,
# pytest with torch on the GPU, python -m flashmonoid.bench with its plots). Run from the repo root
# on a machine with a CUDA GPU. $OUT (default ./device_out) gets
# bench.json, python_gpu/ (benchmark_results.json and the plots) and logs.tgz (every log); a
# summary table is printed last. Environment:
#   FM_TESTS   ctest regex of GPU tests to run (default: every test labelled cuda; none skips them)
#   FM_TEST_JOBS  ctest -j (default 4: the tests share the GPU, so more overlaps their host work;
#              H100: 162 tests in 146 s at -j 4, over 240 s at -j 2); FM_TEST_TIMEOUT (default 420 s) for
#              the whole suite; one test may take 400 s (Path/CudaBackward.LongerSequences: 148-167 s
#              at -j 2, its CPU float64 references; over 240 s at -j 8, 2026-11-27)
# On one H100 the whole run (build 38 s, tests, benchmarks ~220 s, sanitizers ~260 s) is longer than one
# 600 s device call: split it, e.g. FM_SANITIZE=0 in one call and FM_TESTS=none FM_BENCH=0 in the next.
#   FM_BENCH   0 skips the benchmarks;  FM_SM80 0 the forced sm80 timings; FM_PEERS 0 the PyTorch peers;
#              FM_FLEX=1 adds FlexAttention
#              (bench/peers.py FM_PEERS_FLEX: seqlens 1k, 4k, 16k; each shape compiles, minutes: off by default)
#   FM_ARCH    CUDA architectures to build (default 90: the H100; the library default is 80;90)
#   FM_CPU     0 skips the CPU backend's suite (both ISAs) and cpu_vs_torch (FM_CPU_THREADS, default 16)
#   FM_PYTHON  0 skips the Python package steps; FM_TRAIN_STEP 0 the training step, FM_HF_BENCH 0
#              bench/hf_bench.py (transformers' generate and training step, sdpa against monoid), FM_MODS_BWD 0 the
#              score-modifier backward timings, FM_PYBENCH 0 the python -m flashmonoid.bench plots
#   FM_SANITIZE 0 skips compute-sanitizer; FM_SANITIZE_FWD / _SYNC / _BWD / _KV: gtest filters
#              (FM_SANITIZE_BWD=none, FM_SANITIZE_KV=none skip those binaries)
set -uo pipefail
OUT=${OUT:-$PWD/device_out}
LOG=${FM_LOG_DIR:-/tmp/flashmonoid-logs}  # logs travel back as one tarball: $OUT holds few files
mkdir -p "$OUT" "$LOG"
ARCH=${FM_ARCH:-90}
JOBS=$(nproc)
BUILD=build-device
status=0
repo=$PWD
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
  "${GTEST_ARGS[@]}" >"$LOG/build.log" 2>&1 &&
  ninja -C "$BUILD" -j "$JOBS" -k 0 >>"$LOG/build.log" 2>&1
build_rc=$?
echo "build rc=$build_rc in $(($(date +%s) - start)) s"
grep -E "error|FAILED" "$LOG/build.log" | head -20
# A warm machine's up-to-date build compiles no kernel, so its log has no ptxas reports to read (as
# in kvcache_device_run.sh); the library's SASS below is checked either way.
if grep -q "Building CUDA object" "$LOG/build.log"; then
  python3 tools/check_spills.py "$LOG/build.log" >"$LOG/spills.txt" 2>&1 || status=1
  tail -3 "$LOG/spills.txt"
else
  echo "check_spills: no CUDA object rebuilt (the build's kernels were checked when they were compiled)"
fi
# The library itself: local memory per kernel and wgmma waits per product, read from its SASS.
if [ -f "$BUILD/libflashmonoid.a" ] && PATH="$PATH:/usr/local/cuda/bin" command -v cuobjdump >/dev/null; then
  PATH="$PATH:/usr/local/cuda/bin" python3 tools/check_spills.py "$BUILD/libflashmonoid.a" >"$LOG/sass_check.txt" 2>&1 || status=1
  tail -3 "$LOG/sass_check.txt"
fi
[ $build_rc -eq 0 ] || status=1

if [ "${FM_TESTS:-}" != none ]; then
step "GPU tests"
(cd "$BUILD" && timeout ${FM_TEST_TIMEOUT:-420} ctest -L cuda ${FM_TESTS:+-R "$FM_TESTS"} -j ${FM_TEST_JOBS:-4} --output-on-failure --timeout 400) >"$LOG/tests.log" 2>&1 || status=1
grep -E "tests passed|tests failed|\*\*\*Failed|Not Run|Timeout" "$LOG/tests.log" | tail -25
fi

if [ "${FM_BENCH:-1}" != 0 ] && [ -x "$BUILD/bench/gpu/flashmonoid-gpu-bench" ]; then
  step "benchmarks"
  # Both kernel families: the default (sm90 on Hopper) and the sm80 one forced (FM_SM80=0 skips it).
  sm80=--with-sm80; [ "${FM_SM80:-1}" = 0 ] && sm80=
  timeout ${FM_BENCH_TIMEOUT:-360} "$BUILD/bench/gpu/flashmonoid-gpu-bench" "$LOG/fm.json" --no-kvcache $sm80 ${FM_BENCH_ARGS:-} 2>"$LOG/bench.log" || status=1
  if [ "${FM_PEERS:-1}" != 0 ]; then
    PYTHONUNBUFFERED=1 timeout ${FM_PEERS_TIMEOUT:-300} python3 bench/peers.py "$LOG/peers.json" 2>>"$LOG/bench.log" || status=1
  fi
  if [ "${FM_FLEX:-0}" = 1 ]; then
    FM_PEERS_FLEX=only PYTHONUNBUFFERED=1 timeout ${FM_FLEX_TIMEOUT:-480} python3 bench/peers.py "$LOG/flex.json" 2>>"$LOG/bench.log" || status=1
  fi
  if [ "${FM_KV_BENCH:-1}" != 0 ]; then  # KV-cache decoding shapes (issue 10), on their own clock
    timeout ${FM_KV_BENCH_TIMEOUT:-120} "$BUILD/bench/gpu/flashmonoid-gpu-bench" "$LOG/kv.json" --kvcache-only \
      2>>"$LOG/bench.log" || status=1
    # The C++ host time of one decoding call (the floor under the Python one).
    timeout 60 "$BUILD/bench/gpu/flashmonoid-gpu-bench" "$LOG/kv_host.json" --kvcache-host 2>>"$LOG/bench.log" || status=1
  fi
  if [ -x "$BUILD/tests/cpp/test_wgmma_sm90" ]; then  # the sm90 wrappers as a plain GEMM, next to cuBLAS
    timeout 60 "$BUILD/tests/cpp/test_wgmma_sm90" --gtest_also_run_disabled_tests --gtest_filter='*Throughput*' |
      grep '^{' >"$LOG/gemm.jsonl"
  fi
  python3 - "$LOG" "$OUT" <<'PY'
import json, os, sys
logs, out = sys.argv[1], sys.argv[2]
recs = []
for name in ("fm.json", "kv.json", "kv_host.json", "peers.json", "flex.json"):
    p = os.path.join(logs, name)
    if os.path.exists(p):
        recs += json.load(open(p))
p = os.path.join(logs, "gemm.jsonl")
if os.path.exists(p):
    recs += [json.loads(line) for line in open(p) if line.strip()]
json.dump(recs, open(os.path.join(out, "bench.json"), "w"), indent=1)
PY
  python3 bench/summarize.py "$OUT/bench.json"
  python3 bench/summarize.py "$OUT/bench.json" --markdown
fi
if [ "${FM_SANITIZE:-1}" != 0 ]; then
step "compute-sanitizer (memcheck, racecheck, synccheck) on small cases"
# Forward sm80: a few grid cases (case25: 2049 keys, hdim 128's two-tile stages), split-KV, dropout,
# merge. Forward sm90 (the persistent TMA/wgmma kernels, mbarrier rings, named barriers): hdim 64
# (3 consumers) and 128 causal, 257 and 1031 rows (several work tiles per block), GQA, windows, hdim
# 64/32 causal (the short_band variant; case18, case19), the hdim-96 and -192 buckets (case30: hdim 80
# in the 96 bucket, case31: 96 with dropout, case34: 160 in the 192 bucket, case37: 96's 192-row tiles,
# case42: hdim 224 with dropout on the head-split kernel),
# score modifiers, varlen (case21), varlen used lengths (Grid case37 on sm80, case38 on sm90; split-KV
# decoding's case9), and hdim 64/128/256 with many tiles per block or one block per tile
# (CudaForwardGrid: SM margin, persistent_kernels off). Backward (both families): odd seqlens, varlen
# and its used lengths, the boundary paths.
SAN_FWD=${FM_SANITIZE_FWD:-'Grid/CudaForward.*/sm80_case0:Grid/CudaForward.*/sm80_case1:Grid/CudaForward.*/sm80_case3:Grid/CudaForward.*/sm80_case25:Decode/CudaSplitKV.*/case0:CudaDropout.*:CudaMerge.*:Hopper/CudaForward.*/sm90_case0:Hopper/CudaForward.*/sm90_case1:Hopper/CudaForward.*/sm90_case8:Hopper/CudaForward.*/sm90_case9:Hopper/CudaForward.*/sm90_case13:Hopper/CudaForward.*/sm90_case18:Hopper/CudaForward.*/sm90_case19:Hopper/CudaForward.*/sm90_case30:Hopper/CudaForward.*/sm90_case31:Hopper/CudaForward.*/sm90_case34:Hopper/CudaForward.*/sm90_case37:Hopper/CudaForward.*/sm90_case42:Grid/CudaForward.*/sm90_case21:Grid/CudaForward.*/sm80_case37:Grid/CudaForward.*/sm90_case38:Decode/CudaSplitKV.*/case9:CudaForwardGrid.PersistentPerTileAndMarginGiveTheSameBits:CudaForwardGrid.SplitTailReplaysInAGraph'}
SAN_SYNC=${FM_SANITIZE_SYNC:-'Hopper/CudaForward.*/sm90_case0:Hopper/CudaForward.*/sm90_case7:Hopper/CudaForward.*/sm90_case30:Hopper/CudaForward.*/sm90_case34:Grid/CudaForward.*/sm90_case21:CudaForwardGrid.SplitTailReplaysInAGraph'}
# sm90 backward: GqaMqa/sm90 has the hdim-256 (head-split) kernel, Dropout/sm90 the modifier variant.
SAN_BWD=${FM_SANITIZE_BWD:-'Path/CudaBackward.SeqlensBothWays/*:Path/CudaBackward.Varlen/*:Path/CudaBackward.UsedLengths/*:Path/CudaBackward.GqaMqa/sm90:Path/CudaBackward.Dropout/sm90'}
# synccheck of the backward: the sm90 kernel's named barriers and mbarriers.
SAN_BWD_SYNC=${FM_SANITIZE_BWD_SYNC:-'Path/CudaBackward.SeqlensBothWays/sm90:Path/CudaBackward.CausalAndWindows/sm90:Path/CudaBackward.GqaMqa/sm90:Path/CudaBackward.Dropout/sm90'}
# KV cache: out-of-range seqlens / pages / batch indices (clamped, never dereferenced) and pages.
SAN_KV=${FM_SANITIZE_KV:-'KvCacheCuda.DeviceOnlyValuesOutOfRangeAreClamped:KvCacheCuda.Layouts'}
for tool in memcheck racecheck synccheck; do
  for t in fwd bwd kvcache; do
    bin="$BUILD/tests/cpp/test_${t}_cuda"
    [ -x "$bin" ] || continue
    [ $tool = synccheck ] && [ $t = kvcache ] && continue
    [ $t = bwd ] && [ "$SAN_BWD" = none ] && continue
    [ $t = kvcache ] && [ "$SAN_KV" = none ] && continue
    filter=$SAN_FWD
    [ $t = bwd ] && filter=$SAN_BWD
    [ $t = kvcache ] && filter=$SAN_KV
    [ $tool = synccheck ] && filter=$SAN_SYNC
    [ $tool = synccheck ] && [ $t = bwd ] && filter=$SAN_BWD_SYNC
    timeout ${FM_SANITIZER_TIMEOUT:-120} compute-sanitizer --tool $tool --error-exitcode 3 "$bin" \
      --gtest_filter="$filter" >"$LOG/sanitizer_${tool}_$t.log" 2>&1
    rc=$?
    echo "$tool $t rc=$rc: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$LOG/sanitizer_${tool}_$t.log" | tail -1)"
    [ $rc -eq 0 ] || status=1
  done
done
fi

if [ "${FM_PYTHON:-1}" != 0 ]; then
  step "python: pip install, pytest (torch, CUDA), flashmonoid.bench"
  start=$(date +%s)
  # Offline machine: no build isolation (scikit-build-core and nanobind are installed there).
  CMAKE_BUILD_PARALLEL_LEVEL=$JOBS python3 -m pip install --no-build-isolation --no-deps \
    -C cmake.define.CMAKE_CUDA_ARCHITECTURES="$ARCH" -C build-dir=/tmp/fm-pybuild . >"$LOG/pip.log" 2>&1
  pip_rc=$?
  echo "pip install rc=$pip_rc in $(($(date +%s) - start)) s"
  [ $pip_rc -eq 0 ] || status=1
  # From outside the tree, so that the installed package (with the CUDA extension) is imported.
  (cd /tmp && timeout ${FM_PYTEST_TIMEOUT:-300} python3 -m pytest -q -rs -p no:cacheprovider "$repo/tests/python") \
    >"$LOG/pytest.log" 2>&1 || status=1
  tail -3 "$LOG/pytest.log"
  # Host time of one flash_attn_with_kvcache call (issue 10: <= 15 us over 1000 calls, one sync),
  # and the share of each Python layer (--breakdown).
  (cd /tmp && timeout 120 python3 "$repo/bench/kvcache_host.py" "$OUT/kvcache_host.json" --breakdown --peers) >"$LOG/kvcache_host.log" 2>&1 ||
    status=1
  tail -3 "$LOG/kvcache_host.log"
  # One Llama training step through Hugging Face, flashmonoid against PyTorch's SDPA backends (issue 9).
  if [ "${FM_TRAIN_STEP:-1}" != 0 ]; then
    (cd /tmp && PYTHONUNBUFFERED=1 timeout 150 python3 "$repo/bench/train_step.py" "$OUT/train_step.json") \
      >"$LOG/train_step.log" 2>&1 || status=1
    tail -12 "$LOG/train_step.log"
  fi
  # transformers' generate and a training step, its sdpa against attn_implementation="monoid".
  if [ "${FM_HF_BENCH:-1}" != 0 ]; then
    # Each task in its own process (FM_HF_PROCESSES=one: all in one, as a user who compiles and then
    # trains eagerly would; a compiled generate raised our eager host time there, bench/NOTES.md).
    (cd /tmp && PYTHONUNBUFFERED=1 timeout 300 python3 "$repo/bench/hf_bench.py" "$OUT/hf_bench.json" \
      --prompt 2048 --layers 8 --processes ${FM_HF_PROCESSES:-each}) >"$LOG/hf_bench.log" 2>&1 || status=1
    tail -3 "$LOG/hf_bench.log"
  fi
  # The backward with softcap / ALiBi / dropout: sm90 against the forced sm80 kernels.
  if [ "${FM_MODS_BWD:-1}" != 0 ]; then
    (cd /tmp && PYTHONUNBUFFERED=1 timeout 150 python3 "$repo/bench/mods_bwd.py" "$OUT/mods_bwd.json") \
      >"$LOG/mods_bwd.log" 2>&1 || status=1
    tail -12 "$LOG/mods_bwd.log"
  fi
  if [ "${FM_PYBENCH:-1}" != 0 ]; then
    (cd /tmp && PYTHONUNBUFFERED=1 timeout ${FM_PYBENCH_TIMEOUT:-240} python3 -m flashmonoid.bench \
      --out "$OUT/python_gpu" ${FM_PYBENCH_ARGS:---head-dims 128 --causal off --budget 0.5}) >"$LOG/pybench.log" 2>&1 || status=1
    tail -3 "$LOG/pybench.log"
  fi
fi

# The CPU backend on this machine's CPU (AVX-512 where it has it; issue 13): the C++ CPU suite on
# both ISA paths, then flashmonoid (installed above) against torch's CPU SDPA at FM_CPU_THREADS.
if [ "${FM_CPU:-1}" != 0 ]; then
  step "CPU backend: C++ suite (both ISAs) and cpu_vs_torch"
  echo "$(lscpu | grep 'Model name' | sed 's/  */ /g'); $(grep -o 'avx512[a-z_0-9]*' /proc/cpuinfo | sort -u | tr '\n' ' ')"
  cmake -S . -B build-cpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHMONOID_CUDA=OFF "${GTEST_ARGS[@]}" >"$LOG/cpu_build.log" 2>&1 &&
    ninja -C build-cpu -j "$JOBS" >>"$LOG/cpu_build.log" 2>&1 || { status=1; tail -5 "$LOG/cpu_build.log"; }
  # ctest -L cpu runs the CPU suite twice: with the ISA the library picks, and forced to AVX2.
  (cd build-cpu && timeout ${FM_CPU_TEST_TIMEOUT:-150} ctest -L cpu -j "$JOBS") >"$LOG/cpu_tests.log" 2>&1 || status=1
  echo "CPU tests: $(grep -E 'tests passed|tests failed' "$LOG/cpu_tests.log" | tail -1)"
  if [ "${FM_PYTHON:-1}" != 0 ]; then
    for t in ${FM_CPU_THREADS:-16}; do
      (cd /tmp && timeout ${FM_CPU_BENCH_TIMEOUT:-150} python3 "$repo/bench/cpu_vs_torch.py" --installed --threads "$t" \
        --out "$OUT/cpu_vs_torch_${t}t.json" ${FM_CPU_BENCH_ARGS:-}) >"$LOG/cpu_bench_${t}t.log" 2>&1 || status=1
      tail -20 "$LOG/cpu_bench_${t}t.log"
    done
  fi
fi

tar czf "$OUT/logs.tgz" -C "$LOG" .
step "done: status $status"
exit $status
