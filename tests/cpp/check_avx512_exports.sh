#!/bin/sh
# The AVX-512 object must define exactly one global symbol, kernels_avx512(), and no weak (inline,
# template) ones: a weak definition compiled with AVX-512 flags could be the copy the linker keeps
# for the x86-64-v3 code too, which would then fault on AVX2-only CPUs.
# usage: check_avx512_exports.sh OBJECT
syms=$(nm -g --defined-only -C "$1" | cut -d' ' -f2-)
if [ "$syms" != "T flashmonoid::cpu::kernels_avx512()" ]; then
  echo "unexpected global symbols in $1:"
  echo "$syms"
  exit 1
fi
echo "$1: only kernels_avx512()"
