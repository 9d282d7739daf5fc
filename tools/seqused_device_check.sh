#!/usr/bin/env bash
# Varlen used lengths (Varlen::seqused_q / seqused_k, branch varlen-seqused) on a GPU machine, from the
# repo root: the build (sm_90, ptxas report), the used-length CUDA tests (forward grid cases 37-40 on
# both kernel families, the split-KV decoding case 9, the backward on both families) and
# compute-sanitizer memcheck, racecheck and synccheck on them; then pip install, pytest's CUDA cases of
# the used lengths and of flashmonoid.sdpa's padded routes, and hf_bench's training step (each task
# in its own process; FM_SQ_HF=0 skips it). FM_SQ_SUITE=1 also runs the whole GPU suite (ctest -L cuda, ~300 s on an H200).
set -uo pipefail
OUT=${OUT:-$PWD/seqused_out}
mkdir -p "$OUT"
repo=$PWD
start=$(date +%s)
cmake -S . -B build-sq -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 >"$OUT/build.log" 2>&1 &&
  ninja -C build-sq >>"$OUT/build.log" 2>&1 || { echo "build failed"; tail -20 "$OUT/build.log"; exit 1; }
echo "build $(($(date +%s) - start)) s; $(python3 tools/check_spills.py "$OUT/build.log" 2>&1 | tail -1)"
fwd=""
for c in 37 38 39 40; do
  for path in sm80 sm90; do fwd+="Grid/CudaForward.MatchesFloat64Reference/${path}_case$c:"; done
done
fwd+="Decode/CudaSplitKV.HeuristicForcedAndUnsplitMatchReference/case9"
bwd='Path/CudaBackward.UsedLengths/*'
run() {  # name, tool ("" for none), binary, filter
  local name=$1 tool=$2 bin=$3 filter=$4
  if [ -z "$tool" ]; then
    timeout 300 "build-sq/tests/cpp/$bin" --gtest_filter="$filter" >"$OUT/$name.log" 2>&1
  else
    timeout 300 compute-sanitizer --tool "$tool" --error-exitcode 3 "build-sq/tests/cpp/$bin" --gtest_filter="$filter" \
      >"$OUT/$name.log" 2>&1
  fi
  echo "$name rc=$?: $(grep -E '^\[  (PASSED|FAILED)|ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/$name.log" | tr '\n' ' ')"
}
run fwd "" test_fwd_cuda "$fwd"
run bwd "" test_bwd_cuda "$bwd"
for tool in memcheck racecheck synccheck; do
  run "fwd_$tool" $tool test_fwd_cuda "$fwd"
  run "bwd_$tool" $tool test_bwd_cuda "$bwd"
done
CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) python3 -m pip install --no-build-isolation --no-deps \
  -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90 -C build-dir=/tmp/fm-pybuild-sq . >"$OUT/pip.log" 2>&1
echo "pip install rc=$?"
(cd /tmp && timeout 200 python3 -m pytest -q -p no:cacheprovider "$repo/tests/python/test_torch.py" \
  "$repo/tests/python/test_sdpa.py" "$repo/tests/python/test_hf.py" -k "cuda and (used_lengths or padded or training)") \
  >"$OUT/pytest.log" 2>&1
echo "pytest rc=$?: $(tail -1 "$OUT/pytest.log")"
if [ "${FM_SQ_HF:-1}" = 1 ]; then
  (cd /tmp && PYTHONUNBUFFERED=1 timeout 150 python3 "$repo/bench/hf_bench.py" "$OUT/hf_train.json" --prompt 2048 \
    --layers 8 --rounds 7 --tasks train_step --processes each) >"$OUT/hf.log" 2>&1
  echo "hf_bench rc=$?: $(tail -1 "$OUT/hf.log")"
fi
if [ "${FM_SQ_SUITE:-0}" = 1 ]; then
  (cd build-sq && timeout 440 ctest -L cuda -j 4 --output-on-failure --timeout 400) >"$OUT/suite.log" 2>&1
  echo "ctest -L cuda rc=$?: $(grep -E 'tests passed|tests failed' "$OUT/suite.log")"
fi
echo "total $(($(date +%s) - start)) s"
