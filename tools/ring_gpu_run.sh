#!/usr/bin/env bash
# Ring attention (issue 11) on a multi-GPU machine, one command: builds the NCCL target, runs the
# GPU tests with one process per GPU (C++ over NCCL; then the Python path under torchrun when torch
# and nanobind are importable), and benchmarks ring / single GPU / all-gather-K/V. Writes to $OUT
# (default ./ring_out): ring_tests.json, ring_bench.json, logs.tgz. Stages may be named to split
# the work over several calls (the build directory is reused):
#     tools/ring_gpu_run.sh                 # build test python bench
#     tools/ring_gpu_run.sh build test      # then: tools/ring_gpu_run.sh bench
# Environment: FM_WORLD (default: number of GPUs), FM_ARCH (default 90), FM_SEQLENS (default
# 131072,262144), FM_REPS (default 2), FM_CAUSAL (default 1,0), FM_HEADS (32), FM_HDIM (128),
# FM_SM_MARGIN (default 0: SMs the ring's persistent forwards leave to NCCL, Context::sm_margin; a list
# times each), FM_PASSES (default fwd,fwd_bwd),
# FM_NCCL_DEBUG (default INIT,P2P: NCCL_DEBUG=INFO for those subsystems, which name the transport and channels; none
# turns it off).
set -uo pipefail
# NVLink multicast (NVLS) stays off in every process this script starts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ "${FM_NCCL_DEBUG:-INIT,P2P}" != none ]; then export NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=${FM_NCCL_DEBUG:-INIT,P2P}; fi
OUT=${OUT:-$PWD/ring_out}
LOG=${FM_LOG_DIR:-/tmp/flashmonoid-ring-logs}
mkdir -p "$OUT" "$LOG"
BUILD=${FM_BUILD_DIR:-build-ring}  # FM_BUILD_DIR: a build made elsewhere (bench stage only)
WORLD=${FM_WORLD:-$(nvidia-smi -L 2>/dev/null | wc -l)}
STAGES=${*:-build test python bench}
status=0
step() { echo "== $* ($(date +%T))"; }
has() { [[ " $STAGES " == *" $1 "* ]]; }

# Launches the command once per rank with RANK / WORLD_SIZE / LOCAL_RANK and a fresh NCCL id file;
# each rank's output goes to $LOG/<name>.<rank>.log. Returns the worst exit status.
launch() {
  local name=$1 limit=$2
  shift 2
  local id="/tmp/flashmonoid-nccl-id.$$.$name" pids=() rc=0 seed=${FM_SEED:-$RANDOM}  # one seed for all ranks
  rm -f "$id"
  for ((r = 0; r < WORLD; r++)); do
    RANK=$r WORLD_SIZE=$WORLD LOCAL_RANK=$r FM_NCCL_ID_FILE=$id FM_SEED=$seed \
      timeout "$limit" "$@" >"$LOG/$name.$r.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  rm -f "$id"
  return $rc
}

step "device: $WORLD GPUs"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
if [ "$WORLD" -lt 2 ]; then echo "needs at least 2 GPUs"; exit 1; fi

if has build; then
  # googletest: the system's, else one built from .deps/googletest (as tools/device_run.sh does).
  GTEST_ARGS=()
  if [ ! -f /usr/lib/x86_64-linux-gnu/cmake/GTest/GTestConfig.cmake ]; then
    if [ ! -d /tmp/gtest/lib/cmake/GTest ] && [ -d .deps/googletest ]; then
      step "googletest from .deps"
      cmake -S .deps/googletest -B /tmp/gtest-build -G Ninja -DCMAKE_INSTALL_PREFIX=/tmp/gtest -DBUILD_GMOCK=OFF \
        -DCMAKE_BUILD_TYPE=Release >/dev/null && cmake --build /tmp/gtest-build -j "$(nproc)" >/dev/null &&
        cmake --install /tmp/gtest-build >/dev/null
    fi
    [ -d /tmp/gtest/lib/cmake/GTest ] && GTEST_ARGS=(-DGTest_ROOT=/tmp/gtest -DCMAKE_PREFIX_PATH=/tmp/gtest)
  fi
  step "build (CUDA archs ${FM_ARCH:-90})"
  start=$(date +%s)
  PY_ARGS=()
  if has python && python3 -c "import torch, nanobind" 2>/dev/null; then
    PY_ARGS=(-DFLASHMONOID_PYTHON=ON -DPython_EXECUTABLE="$(command -v python3)")
  fi
  cmake -S . -B $BUILD -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="${FM_ARCH:-90}" \
    -DFLASHMONOID_NCCL=ON "${GTEST_ARGS[@]}" "${PY_ARGS[@]}" >"$LOG/build.log" 2>&1 &&
    ninja -C $BUILD -j "$(nproc)" test_ring_nccl flashmonoid-ring-bench $([ ${#PY_ARGS[@]} -gt 0 ] && echo _C) \
      >>"$LOG/build.log" 2>&1
  rc=$?
  echo "build rc=$rc in $(($(date +%s) - start)) s"
  grep -E "error|FAILED" "$LOG/build.log" | head -20
  [ $rc -eq 0 ] || { tar -czf "$OUT/logs.tgz" -C "$LOG" .; exit 1; }
fi

if has test; then
  step "GPU tests: C++ ring over NCCL, $WORLD processes"
  launch test_ring_nccl 300 $BUILD/tests/dist/test_ring_nccl --gtest_output=json:"$LOG/ring_tests.%s.json" || status=1
  for ((r = 0; r < WORLD; r++)); do
    echo "rank $r: $(grep -E '^\[  (PASSED|FAILED)' "$LOG/test_ring_nccl.$r.log" | tr '\n' ' ')"
    grep -E "max \|ring|Failure|error" "$LOG/test_ring_nccl.$r.log" | head -12
  done
  python3 - "$LOG" "$OUT" "$WORLD" <<'PY'
import glob, json, os, sys
log, out, world = sys.argv[1], sys.argv[2], int(sys.argv[3])
ranks = []
for r in range(world):
    path = os.path.join(log, f"test_ring_nccl.{r}.log")
    text = open(path).read() if os.path.exists(path) else ""
    ranks.append({"rank": r, "passed": "[  PASSED  ]" in text and "[  FAILED  ]" not in text,
                  "lines": [l for l in text.splitlines() if l.startswith(("[  ", "[rank"))]})
json.dump({"world_size": world, "ranks": ranks}, open(os.path.join(out, "ring_tests.json"), "w"), indent=1)
PY
fi

if has python; then
  if ls $BUILD/python/flashmonoid/_C*.so >/dev/null 2>&1; then
    step "GPU tests: Python ring over torch.distributed (NCCL), torchrun $WORLD processes"
    PKG=$(mktemp -d)/pkg
    mkdir -p "$PKG/flashmonoid"
    ln -s "$PWD"/python/flashmonoid/*.py "$PKG/flashmonoid/"
    ln -s "$PWD"/$BUILD/python/flashmonoid/_C*.so "$PKG/flashmonoid/"
    FM_SEED=${FM_SEED:-$RANDOM} PYTHONPATH="$PKG" timeout 300 python3 -m torch.distributed.run --nproc-per-node "$WORLD" \
      tools/ring_torch_check.py "$OUT/ring_torch.json" >"$LOG/ring_torch.log" 2>&1 || status=1
    grep -v "NCCL INFO" "$LOG/ring_torch.log" | tail -15
  else
    echo "python: skipped (torch or nanobind missing, or _C not built)"
  fi
fi

if has bench; then
  step "benchmark: ring vs single GPU vs all-gather K/V"
  launch ring_bench 580 $BUILD/bench/gpu/flashmonoid-ring-bench "$OUT/ring_bench.json" \
    --seqlens "${FM_SEQLENS:-131072,262144}" --reps "${FM_REPS:-2}" --causal "${FM_CAUSAL:-1,0}" \
    --heads "${FM_HEADS:-32}" --hdim "${FM_HDIM:-128}" --sm-margin "${FM_SM_MARGIN:-0}" --passes "${FM_PASSES:-fwd,fwd_bwd}" || status=1
  grep -v "NCCL INFO" "$LOG/ring_bench.0.log"
  grep -E "NCCL INFO.*(via|Channel 00)" "$LOG/ring_bench.0.log" | head -4
fi

tar -czf "$OUT/logs.tgz" -C "$LOG" .
step "done, status $status"
exit $status
