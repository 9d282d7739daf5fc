#!/bin/bash
# build.sh SRC BUILD [cmake flags...]: the CPU library of the tree SRC in BUILD, and BUILD/h, the
# timing harness (harness.cpp) linked against it. abi.py then pairs the calls of several BUILDs.
set -e
here=$(cd "$(dirname "$0")" && pwd)
src=$1; b=$2; shift 2
cmake -S "$src" -B "$b" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHMONOID_CUDA=OFF -DFLASHMONOID_TESTS=OFF \
  -DFLASHMONOID_BENCH=OFF -DFLASHMONOID_PYTHON=OFF "$@" >/dev/null
ninja -C "$b" flashmonoid >/dev/null
g++ -O2 -std=c++20 -march=x86-64-v3 -I "$src/include" "$here/harness.cpp" "$b/libflashmonoid.a" -fopenmp -o "$b/h"
