#!/usr/bin/env bash
# Issue 10 on one GPU (a short lease): build (sm_90) into build-device, the KV-cache GPU tests
# (ctest -R KvCache) and memcheck on the out-of-range and layout cases, gpu_bench --kvcache-only and
# --kvcache-host (the C++ host time per call) and --kv-eager (back-to-back calls, the call's kernels
# as a graph or one by one), the cuDNN peer on the same shapes, the Python host
# time of flash_attn_with_kvcache; JSON and logs under $OUT (default ./device_out), the bars' table
# printed last. Run from the repo root.
#   FM_PYTHON=0 skips the pip install and the host-time benchmark.
# $OUT gets the JSONs, serving_loop.txt, table.txt and logs.tgz (every log: the device tool returns few files).
set -uo pipefail
OUT=${OUT:-$PWD/device_out}
LOG=${FM_LOG_DIR:-/tmp/flashmonoid-kv-logs}
mkdir -p "$OUT" "$LOG"
status=0
step() { echo "== $* ($(date +%T))"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader || true

step build
cmake -S . -B build-device -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 >"$LOG/build.log" 2>&1 &&
  ninja -C build-device -k 0 >>"$LOG/build.log" 2>&1 || { status=1; grep -E "error|FAILED" "$LOG/build.log" | head; }
if ! grep -q "Building CUDA object" "$LOG/build.log"; then
  echo "check_spills: no CUDA object rebuilt (build-device's kernels were checked when they were compiled)"
else
  python3 tools/check_spills.py "$LOG/build.log" 2>&1 | tail -2 || status=1
fi

step "tests (KvCache)"
(cd build-device && timeout 240 ctest -R KvCache -j 1 --output-on-failure) >"$LOG/tests.log" 2>&1 || status=1
grep -E "tests passed|tests failed|\*\*\*Failed|Not Run" "$LOG/tests.log" | tail -8
timeout 240 compute-sanitizer --tool memcheck --error-exitcode 3 build-device/tests/cpp/test_kvcache_cuda \
  --gtest_filter='KvCacheCuda.DeviceOnlyValuesOutOfRangeAreClamped:KvCacheCuda.Layouts:KvCacheCuda.HeadMajorCaches:KvCacheCuda.LaunchModesAgree:KvCacheCuda.GraphNodesFollowEachCallsArguments:KvCacheCuda.GraphCallsFromTwoThreadsOnOneStream' \
  >"$LOG/memcheck.log" 2>&1 || status=1
echo "memcheck: $(grep 'ERROR SUMMARY' "$LOG/memcheck.log" | tail -1)"

step "gpu_bench --kvcache-only and --kvcache-host, cuDNN peer"
timeout 150 build-device/bench/gpu/flashmonoid-gpu-bench "$OUT/kv.json" --kvcache-only 2>"$LOG/kv_bench.log" || status=1
timeout 60 build-device/bench/gpu/flashmonoid-gpu-bench "$OUT/kv_host.json" --kvcache-host 2>"$LOG/kv_host.log" ||
  status=1
timeout 60 build-device/bench/gpu/flashmonoid-gpu-bench --kv-eager >"$LOG/kv_eager.txt" 2>&1 || status=1
FM_PEERS_KVCACHE=only PYTHONUNBUFFERED=1 timeout 150 python3 bench/peers.py "$OUT/peers_kv.json" 2>"$LOG/peers.log" ||
  status=1

if [ "${FM_PYTHON:-1}" != 0 ]; then
  step "python host time"
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) python3 -m pip install --no-build-isolation --no-deps \
    -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90 -C build-dir=/tmp/fm-pybuild . >"$LOG/pip.log" 2>&1 || status=1
  repo=$PWD
  (cd /tmp && timeout 120 python3 "$repo/bench/kvcache_host.py" "$OUT/kvcache_host.json" --breakdown) 2>"$LOG/kvcache_host.log" ||
    status=1
  step "serving loop end to end (examples/serving_loop.py: ours, flash-attn 3's packed-query form, SDPA's static cache)"
  for args in "--engine all" "--engine both --batch 32 --layers 4 --context 4096 --steps 32"; do
    (cd /tmp && timeout 150 python3 "$repo/examples/serving_loop.py" $args) >>"$OUT/serving_loop.txt" 2>&1 || status=1
  done
fi

step table
{
[ -f "$OUT/serving_loop.txt" ] && { echo "serving loop (examples/serving_loop.py):"; grep -v "^  " "$OUT/serving_loop.txt"; }
echo "back-to-back calls from C++ without a caller's graph (gpu_bench --kv-eager):"
cat "$LOG/kv_eager.txt"
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
def load(name):
    p = os.path.join(out, name)
    return json.load(open(p)) if os.path.exists(p) else []
kv, peers, host = load("kv.json"), load("peers_kv.json"), load("kvcache_host.json")
cpp_host = load("kv_host.json")
copy = next((r["copy_tbps"] for r in kv if "copy_tbps" in r), None)
fm = {(r["batch"], r["seqlen_k"], r.get("page_size", 0), r["seqlen_q"], r.get("append")): r["tbps"]
      for r in kv if r.get("pass") == "decode"}
cu = {(r["batch"], r["seqlen_k"], r["seqlen_q"]): r["tbps"] for r in peers if r.get("pass") == "decode"}
print(f"device copy {copy} TB/s; TB/s of K/V (graph); bars: paged >= 0.95x contiguous, >= 64 MB at "
      f">= 0.90 copy, s_q 4 >= 0.85 copy")
print("| b | s_k | MB | plain | contiguous | p1 | p16 | p64 | p256 | s_q=4 | cudnn | cudnn s_q=4 | contig/copy | "
      "min paged/contig (16-256) | p1/contig |")
print("|---" * 15 + "|")
for (b, sk) in sorted({(k[0], k[1]) for k in fm}):
    g = lambda page, sq, app=True: fm.get((b, sk, page, sq, app))
    c = g(0, 1)
    paged = [g(p, 1) for p in (16, 64, 256)]
    f = lambda x: "-" if x is None else f"{x:.3f}"
    ratio = min(p / c for p in paged if p) if c and all(paged) else None
    p1 = g(1, 1)
    mb = 2 * b * sk * 8 * 128 * 2 / 1e6
    print(f"| {b} | {sk // 1024}k | {mb:.0f} | {f(g(0, 1, False))} | {f(c)} | {f(p1)} | " +
          " | ".join(f(p) for p in paged) + f" | {f(g(0, 4))} | {f(cu.get((b, sk, 1)))} | {f(cu.get((b, sk, 4)))} | "
          f"{f(c / copy if c and copy else None)} | {f(ratio)} | {f(p1 / c if p1 and c else None)} |")
for r in cpp_host:
    print(f"C++ host ({r['impl']}, {r.get('call_launch', 'kernels')}, {r.get('launches')} launches): b {r['batch']} "
          f"page {r['page_size']} append {r.get('append')}: {r['host_us']} us/call")
for r in host:
    print(f"python host: b {r['batch']} page {r['page_size']} lse {r.get('return_softmax_lse', True)}: {r['host_us']} us/call (runs {r['host_us_runs']}); "
          f"layers {r.get('breakdown', {}).get('layers_us')}")
PY
} | tee "$OUT/table.txt"
tar -czf "$OUT/logs.tgz" -C "$LOG" . 2>/dev/null
echo "status $status"
exit $status
