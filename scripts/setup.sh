#!/usr/bin/env bash
# Installs what `make demo` / `make test` need and is missing, and nothing else. Idempotent.
set -euo pipefail

need_apt=()
have_pkg() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
for pkg in cmake ninja-build g++ libgtest-dev libgmock-dev libbenchmark-dev libopenblas-dev; do
  have_pkg "$pkg" || need_apt+=("$pkg")
done
if ((${#need_apt[@]})); then
  echo "setup: installing ${need_apt[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
missing_py=()
for mod in numpy nanobind scikit_build_core pytest; do
  $PY -c "import $mod" 2>/dev/null || missing_py+=("$mod")
done
if ((${#missing_py[@]})); then
  pkgs=("${missing_py[@]/scikit_build_core/scikit-build-core}")
  echo "setup: pip installing ${pkgs[*]}"
  $PY -m pip install -q "${pkgs[@]}"
fi
