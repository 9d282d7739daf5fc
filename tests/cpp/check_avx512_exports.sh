#!/bin/sh
# An AVX-512 object must define exactly one global symbol, its kernel table (kernels_avx512(),
# kernels_avx512_bf16() or kernels_amx()), and no weak (inline, template) ones: a weak definition
# compiled with AVX-512 flags could be the copy the linker keeps for the x86-64-v3 code too, which
# would then fault on AVX2-only CPUs.
# usage: check_avx512_exports.sh OBJECT TABLE
syms=$(nm -g --defined-only -C "$1" | cut -d' ' -f2-)
if [ "$syms" != "T flashmonoid::cpu::$2()" ]; then
  echo "unexpected global symbols in $1 (want only $2()):"
  echo "$syms"
  exit 1
fi
echo "$1: only $2()"
