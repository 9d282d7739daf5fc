#!/usr/bin/env bash
# A/B of a change to the flashmonoid package on transformers' workloads (bench/hf_bench.py, each run
# a process of its own), on the device machine or here:
#   tools/hf_ab.sh [PATCH ...]
# The installed package (or FM_AB_PKG, a folder holding the package `flashmonoid` with its _C
# extension) is copied twice, as the reference and as the new variant with the patches applied
# (Python-only; paths as in this repo: python/flashmonoid/...). FM_AB_NEW_PKG: the new variant's
# package instead, e.g. a branch installed with `pip install --target DIR .` (C++ changes too). The
# variants alternate FM_AB_ROUNDS times (default 3, the order reversed
# every other round), each an hf_bench run of FM_HF_TASKS (default train_step) with FM_HF_ARGS
# (default: the device script's model, 3 rounds), and a table of medians is printed last. FM_AB_PROBE=1
# also runs bench/experiments/hf_compile_then_train_probe.py once per variant. Logs and JSON go to $OUT.
set -euo pipefail
[ $# -ge 1 ] || [ -n "${FM_AB_NEW_PKG:-}" ] || { echo "usage: tools/hf_ab.sh PATCH [PATCH ...] (or FM_AB_NEW_PKG=DIR)" >&2; exit 2; }
repo=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$PWD/hf_ab_out}
mkdir -p "$OUT"
PKG=${FM_AB_PKG:-$(cd /tmp && python3 -c 'import flashmonoid, os; print(os.path.dirname(os.path.dirname(flashmonoid.__file__)))')}
ROUNDS=${FM_AB_ROUNDS:-3}
TASKS=${FM_HF_TASKS:-train_step}
ARGS=${FM_HF_ARGS:---prompt 2048 --layers 8 --rounds 3}
root=$(mktemp -d /tmp/fm-hf-ab.XXXXXX)
for v in ref new; do
  mkdir -p "$root/$v/python"
  src=$PKG
  [ $v = new ] && src=${FM_AB_NEW_PKG:-$PKG}
  cp -rL "$src/flashmonoid" "$root/$v/python/flashmonoid"
done
for p in "$@"; do
  patch -s -p1 -d "$root/new" <"$(realpath "$p")"
done
echo "reference: $PKG; new: ${FM_AB_NEW_PKG:-$PKG}, patched: ${*:-nothing}"
for v in ref new; do  # each variant imports its own copy
  (cd /tmp && PYTHONPATH="$root/$v/python" python3 -c 'import flashmonoid.sdpa as s; print(s.__file__)')
done
for r in $(seq "$ROUNDS"); do
  order="ref new"
  [ $((r % 2)) = 0 ] && order="new ref"
  for v in $order; do
    (cd /tmp && PYTHONPATH="$root/$v/python" PYTHONUNBUFFERED=1 python3 "$repo/bench/hf_bench.py" \
      "$OUT/hf_${v}_$r.json" $ARGS --tasks "$TASKS" --processes each) >"$OUT/hf_${v}_$r.log" 2>&1 ||
      { echo "hf_bench $v round $r failed"; tail -5 "$OUT/hf_${v}_$r.log"; exit 1; }
  done
done
if [ "${FM_AB_PROBE:-0}" = 1 ]; then
  for v in ref new; do
    (cd /tmp && PYTHONPATH="$root/$v/python" PYTHONUNBUFFERED=1 python3 \
      "$repo/bench/experiments/hf_compile_then_train_probe.py" "$OUT/probe_$v") >"$OUT/probe_$v.log" 2>&1 ||
      echo "probe $v failed"
    grep -E "^(fresh|after)" "$OUT/probe_$v.log" | sed "s/^/$v: /" | cut -c1-110
  done
fi
python3 - "$OUT" "$ROUNDS" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
val = {}
for v in ("ref", "new"):
    for r in range(1, rounds + 1):
        for rec in json.load(open(f"{out}/hf_{v}_{r}.json")):
            val.setdefault((rec["task"], rec["impl"]), {}).setdefault(v, []).append(rec["seconds"])
print(f"{'task':16s} {'impl':8s} {'ref s':>9s} {'new s':>9s}  new/ref  (medians of {rounds} alternated rounds)")
for (task, impl), d in val.items():
    a, b = statistics.median(d["ref"]), statistics.median(d["new"])
    print(f"{task:16s} {impl:8s} {a:9.4f} {b:9.4f}  {b / a:6.3f}")
PY
rm -rf "$root"
