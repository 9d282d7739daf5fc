#!/usr/bin/env bash
# SASS of one generated kernel file, read on this (GPU-less) machine: compiles
# src/cuda/generated/<FILE>.cu for sm_90a with ptxas's report, then disassembles it with cuobjdump and
# nvdisasm, which the toolkit here lacks: they come from PyPI (nvidia-cuda-cuobjdump and
# nvidia-cuda-nvdisasm wheels, unpacked once into /tmp/fm-cuobjdump).
# Usage: tools/sass.sh fwd_sm90_bf16_hdim128 [extra nvcc flags]  ->  /tmp/<FILE>.sass, ptxas lines printed
set -euo pipefail
name=$1; shift
tools=/tmp/fm-cuobjdump/nvidia/cu13/bin
if [ ! -x $tools/nvdisasm ]; then
  mkdir -p /tmp/fm-cuobjdump/whl
  python3 -m pip download -q --no-deps -d /tmp/fm-cuobjdump/whl "nvidia-cuda-cuobjdump==13.2.51" "nvidia-cuda-nvdisasm==13.2.51"
  for w in /tmp/fm-cuobjdump/whl/*.whl; do python3 -m zipfile -e "$w" /tmp/fm-cuobjdump; done
  chmod +x $tools/*
fi
repo=$(cd "$(dirname "$0")/.." && pwd)
/usr/local/cuda/bin/nvcc -I"$repo/src/cuda" -I"$repo/src" -I"$repo/include" -O3 -DNDEBUG --expt-relaxed-constexpr \
  -Xptxas=-v -gencode=arch=compute_90a,code=sm_90a -std=c++20 "$@" -x cu -c "$repo/src/cuda/generated/$name.cu" \
  -o /tmp/$name.o 2>&1 | grep -E "error|spill|registers|C75" || true
PATH=$tools:$PATH cuobjdump -sass /tmp/$name.o >/tmp/$name.sass
echo "/tmp/$name.sass: $(grep -cE '^\s+/\*[0-9a-f]{4}\*/' /tmp/$name.sass) instructions"
