#!/usr/bin/env bash
# Builds the CUDA backward's test binary alone (no forward kernels, CPU library without BLAS) in
# build-bwd/NAME: test_bwd_cuda for sm_90 from tests/cuda/test_bwd_cuda.cu and the six backward
# instantiations, ptxas reports beside it. About 20 s on 2 cores, against minutes for the whole
# library, so a backward change can be built here and checked on a borrowed GPU in one short call.
#   tools/bwd_build.sh NAME [extra nvcc flags, e.g. -I<dir> to build another kernel_bwd_sm80.cuh]
set -euo pipefail
name=$1
shift
B=build-bwd
o=$B/$name
mkdir -p "$o"
jobs=$(nproc)
if [ ! -f $B/gtest-inst/lib/libgtest.a ]; then
  cmake -S .deps/googletest -B $B/gtest -G Ninja -DBUILD_GMOCK=OFF -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_INSTALL_PREFIX=$PWD/$B/gtest-inst >/dev/null
  cmake --build $B/gtest -j "$jobs" >/dev/null
  cmake --install $B/gtest >/dev/null
fi
if [ ! -f $B/cpu/libflashmonoid.a ]; then
  cmake -S . -B $B/cpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHMONOID_CUDA=OFF -DFLASHMONOID_TESTS=OFF \
    -DFLASHMONOID_BENCH=OFF -DCMAKE_DISABLE_FIND_PACKAGE_BLAS=ON >/dev/null
  ninja -C $B/cpu -j "$jobs" flashmonoid >/dev/null
fi
F=(-std=c++20 -O3 --expt-relaxed-constexpr -Xptxas=-v -lineinfo "$@" -Iinclude -Isrc -Isrc/cuda -Itests/cpp
   -I$B/gtest-inst/include -gencode arch=compute_90,code=sm_90)
pids=()
for t in bf16 fp16; do
  for d in 64 128 256; do
    nvcc "${F[@]}" -c src/cuda/generated/bwd_sm80_${t}_hdim$d.cu -o "$o/${t}_$d.o" >"$o/ptxas_${t}_$d.log" 2>&1 &
    pids+=($!)
  done
done
nvcc "${F[@]}" -c tests/cuda/test_bwd_cuda.cu -o "$o/test.o" >"$o/test.log" 2>&1
for pid in "${pids[@]}"; do wait "$pid"; done
nvcc -gencode arch=compute_90,code=sm_90 "$o"/*.o -o "$o/test_bwd_cuda" $B/cpu/libflashmonoid.a \
  $B/gtest-inst/lib/libgtest_main.a $B/gtest-inst/lib/libgtest.a -Xcompiler -fopenmp -lpthread
