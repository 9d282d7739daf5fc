#!/usr/bin/env bash
# The CPU decoding path on a device machine's CPU (issue 10: bench/results/cpu_decode_*.txt): a
# CPU-only build of this tree, its CPU suite, then decode-cpu-bench (the tiled mainloop against the
# decoding one, bench/decode_cpu.cpp; the decoding one on head-major K/V too) and torch's CPU SDPA
# (bench/decode_cpu_torch.py, head-major K/V and views of our (b, s, h_k, d) layout) at 16 and 2
# threads. With FM_CPU_REF (a source tree: `git archive` of a commit), also an A/B of the decoding
# mainloop alone, this tree against that one, alternated FM_CPU_ROUNDS times (default 3; the order
# swapped every other round) at FM_CPU_AB_THREADS (default "16 2") on FM_CPU_SHAPES, on (b, s, h_k, d) K/V and, with
# FM_CPU_AB_HEAD_MAJOR=1, on head-major K/V too. The tables (tools/cpu_decode_table.py) in
# $OUT/summary.txt and on stdout; everything in $OUT/all.tgz; FM_CPU_TABLE=0 skips the full table,
# FM_CPU_CTEST=0 the CPU suite. OpenMP threads are pinned, one per core, in both libraries
# (OMP_PROC_BIND=spread, OMP_PLACES=cores unless set): between an unpinned and a pinned run a
# minute apart on one of these VMs, ours moved up to 1.5x and torch's up to 2x at 2 threads
# (bench/NOTES.md, 2026-11-29).
set -uo pipefail
OUT=${OUT:-$PWD/cpu_out}
mkdir -p "$OUT"
jobs=$(nproc)
build() {  # source dir, build dir, name
  cmake -S "$1" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHMONOID_CUDA=OFF >"$OUT/build_$3.log" 2>&1 &&
    ninja -C "$2" >>"$OUT/build_$3.log" 2>&1 || { echo "build $3 failed"; tail -20 "$OUT/build_$3.log"; return 1; }
}
start=$(date +%s)
build . build-cpudev new & pids=($!)
[ -n "${FM_CPU_REF:-}" ] && { build "$FM_CPU_REF" build-cpuref ref & pids+=($!); }
for pid in "${pids[@]}"; do wait "$pid" || exit 1; done
echo "builds: $(($(date +%s) - start)) s"
if [ "${FM_CPU_CTEST:-1}" != 0 ]; then
  (cd build-cpudev && timeout 300 ctest -L cpu -j "$jobs" --output-on-failure >"$OUT/ctest_cpu.log" 2>&1)
  echo "ctest -L cpu rc=$?: $(grep -E 'tests passed|tests failed' "$OUT/ctest_cpu.log")"
fi
lscpu | grep -E 'Model name|^CPU\(s\)|Flags' | cut -c1-200 >"$OUT/cpu.txt"
export OMP_PROC_BIND=${OMP_PROC_BIND:-spread} OMP_PLACES=${OMP_PLACES:-cores}  # the timings only
if [ -n "${FM_CPU_REF:-}" ]; then
  S=${FM_CPU_SHAPES:-"1,512,32,8,128,fp32,1 1,512,32,8,128,fp32,4 1,512,32,8,128,bf16,1 1,512,32,8,128,bf16,4 1,4096,32,8,128,fp32,1 1,32768,32,8,128,bf16,1 8,4096,32,8,128,fp32,1 1,4096,32,32,128,bf16,1"}
  layouts=(""); [ "${FM_CPU_AB_HEAD_MAJOR:-0}" = 1 ] && layouts+=(--head-major)
  for r in $(seq "${FM_CPU_ROUNDS:-3}"); do
    for t in ${FM_CPU_AB_THREADS:-16 2}; do
      for lay in "${layouts[@]}"; do
        order="new ref"; [ $((r % 2)) = 0 ] && order="ref new"  # the first of a pair ran ~8% faster at 2 threads
        for v in $order; do
          dir=build-cpudev; [ $v = ref ] && dir=build-cpuref
          name=ab_${v}${lay:+_hm}_t${t}_$r.txt
          $dir/bench/decode-cpu-bench --threads $t --repeats 9 --decode-only $lay $S >"$OUT/$name" 2>&1
        done
      done
    done
  done
  echo "A/B done: $(($(date +%s) - start)) s"
fi
if [ "${FM_CPU_TABLE:-1}" != 0 ]; then
  for t in 16 2; do
    build-cpudev/bench/decode-cpu-bench --threads $t --repeats 5 >"$OUT/table_t$t.txt" 2>&1
    build-cpudev/bench/decode-cpu-bench --threads $t --repeats 5 --decode-only --head-major >"$OUT/table_hm_t$t.txt" 2>&1
    THREADS=$t timeout 300 python3 bench/decode_cpu_torch.py 5 >"$OUT/torch_t$t.txt" 2>&1
    THREADS=$t LAYOUT=bshd timeout 300 python3 bench/decode_cpu_torch.py 5 >"$OUT/torchbshd_t$t.txt" 2>&1
  done
  echo "table done: $(($(date +%s) - start)) s"
fi
python3 tools/cpu_decode_table.py "$OUT" | tee "$OUT/summary.txt"
# One archive instead of many files (the device tool returns a limited number of files).
(cd "$OUT" && tar czf /tmp/cpu_decode_out.tgz --exclude=all.tgz . && find . -type f ! -name all.tgz -delete &&
  mv /tmp/cpu_decode_out.tgz all.tgz)
