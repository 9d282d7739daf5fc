#!/usr/bin/env bash
# Branch paged-seqused on a GPU machine, from the repo root: the build (sm_90, spill check), the KV-cache
# GPU tests (memcheck on the out-of-range cases), pip install, pytest's CUDA cases of the flash-attn 3
# interface, the serving loop and the KV-cache functions, and examples/serving_loop.py --engine all
# (flash-attn 3's packed-query form now passes cache_seqlens as seqused_k: compare its ms per step with
# main's run of the same command). Logs under $OUT.
set -uo pipefail
OUT=${OUT:-$PWD/pseq_out}
mkdir -p "$OUT"
repo=$PWD
start=$(date +%s)
cmake -S . -B build-pseq -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 >"$OUT/build.log" 2>&1 &&
  ninja -C build-pseq >>"$OUT/build.log" 2>&1 || { echo "build failed"; tail -20 "$OUT/build.log"; exit 1; }
echo "build $(($(date +%s) - start)) s; $(python3 tools/check_spills.py "$OUT/build.log" 2>&1 | tail -1)"
(cd build-pseq && timeout 240 ctest -R KvCache -j 1 --output-on-failure) >"$OUT/ctest.log" 2>&1
echo "ctest -R KvCache rc=$?: $(grep -E 'tests passed|tests failed' "$OUT/ctest.log")"
timeout 200 compute-sanitizer --tool memcheck --error-exitcode 3 build-pseq/tests/cpp/test_kvcache_cuda \
  --gtest_filter='KvCacheCuda.DeviceOnlyValuesOutOfRangeAreClamped:KvCacheCuda.Layouts' >"$OUT/memcheck.log" 2>&1
echo "memcheck rc=$?: $(grep 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1)"
CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) python3 -m pip install --no-build-isolation --no-deps \
  -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90 -C build-dir=/tmp/fm-pybuild-pseq . >"$OUT/pip.log" 2>&1
echo "pip install rc=$?"
(cd /tmp && timeout 300 python3 -m pytest -q -p no:cacheprovider "$repo/tests/python/test_flash_attn3_interface.py" \
  "$repo/tests/python/test_serving_loop.py" "$repo/tests/python/test_kvcache.py" -k cuda) >"$OUT/pytest.log" 2>&1
echo "pytest rc=$?: $(tail -1 "$OUT/pytest.log")"
(cd /tmp && timeout 200 python3 "$repo/examples/serving_loop.py" --engine all) >"$OUT/serving_loop.txt" 2>&1
echo "serving loop rc=$?:"; grep -v "^  " "$OUT/serving_loop.txt"
echo "total $(($(date +%s) - start)) s"
