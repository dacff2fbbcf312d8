#!/usr/bin/env bash
# A code change against the code before it, timed in training on two GPUs of one machine,
# counterbalanced: GPU 0 runs the working tree ("new") and then the base tree, GPU 1 the base
# and then the new one, both at once; each process times the same rows in alternation
# (benchmarks/train_interleaved.py). A change that moves both GPUs' rows the same way, past
# the rounds' spread, is real; one GPU alone is not enough (session 58 saw 3 ms of noise on one).
#
#   bash benchmarks/ab_interleaved.sh --prepare [REV]       here: REV's src/ and benchmarks/
#                                                           (default HEAD) into $AB_BASE
#   bash benchmarks/ab_interleaved.sh TAG ROWS [ARGS...]    on the device (nvidia-h200-x2)
#
# The base tree is made here, because the device's copy of the repository has no usable git
# history; it travels as an untracked folder (git-ignored: name it in the device call's carry).
# ARGS go to every train_interleaved.py process (e.g. --compile-options KEY=VALUE). What comes
# back: $OUT/ab_<TAG>.tar.gz with train_interleaved_<MODEL>_ours_<TAG>_{new,base}{0,1}_*.{md,json}
# and each process's log (a device call returns at most 8 files, so they are packed).
# Settings (environment): AB_BASE (ab_base), MODEL (1.3B), ROUNDS (3), STEPS (5), LIMIT (290 s a
# process, killed after), PY (python3), EXTRA (more arguments, e.g. the CPU test's --device cpu),
# NEW_ARGS (arguments for the new processes only: with a base tree of the same revision
# (--prepare HEAD), an A/B of options, e.g. NEW_ARGS="--compile-options KEY=VALUE"),
# HALF (on a one-GPU machine: 0 runs GPU 0's order, new then base, 1 runs GPU 1's, base then
# new, each on GPU 0; two calls, HALF=0 and HALF=1, make the counterbalanced pair in time).
# 1.3B rows take ~25-45 s each a process: 4 rows, two processes a GPU, ~6 minutes a call.
set -uo pipefail
cd "$(dirname "$0")/.."
AB_BASE="${AB_BASE:-ab_base}"
if [ "${1:-}" = "--prepare" ]; then
  rev="${2:-HEAD}"
  rm -rf "$AB_BASE" && mkdir -p "$AB_BASE" || exit 1
  git archive "$rev" src benchmarks | tar -x -C "$AB_BASE" || exit 1
  echo "$(git rev-parse --short "$rev")" > "$AB_BASE/REV"
  echo "base tree of $(cat "$AB_BASE/REV") in $AB_BASE"
  exit 0
fi
if [ $# -lt 2 ]; then
  echo "usage: bash benchmarks/ab_interleaved.sh --prepare [REV] | TAG ROWS [ARGS...]" >&2
  exit 2
fi
: "${OUT:?OUT must name the folder the results go to}"
[ -d "$AB_BASE/src" ] || { echo "no base tree in $AB_BASE: run --prepare here first" >&2; exit 2; }
tag=$1 rows=$2
shift 2
args=("$@")
work="$OUT/ab_$tag"
mkdir -p "$work"
base_rev="$(cat "$AB_BASE/REV" 2>/dev/null || echo unknown)"
echo "new: the working tree${NEW_ARGS:+ with $NEW_ARGS}; base: $base_rev ($AB_BASE)" \
  > "$work/trees.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
  > "$work/gpu.txt" 2>/dev/null || true

one() {  # GPU, tree, name: one train_interleaved.py process
  local gpu=$1 tree=$2 name=$3 own=""
  [ "${name#new}" != "$name" ] && own="${NEW_ARGS:-}"
  # shellcheck disable=SC2086  # EXTRA and NEW_ARGS are word lists
  CUDA_VISIBLE_DEVICES=$gpu PYTHONPATH="$tree/src" PYTHONUNBUFFERED=1 \
    timeout -s KILL "${LIMIT:-290}" "${PY:-python3}" "$tree/benchmarks/train_interleaved.py" \
    --model "${MODEL:-1.3B}" --rows "$rows" --rounds "${ROUNDS:-3}" --steps "${STEPS:-5}" \
    --tag "${tag}_$name" --out-dir "$work" ${EXTRA:-} $own ${args[@]+"${args[@]}"} \
    > "$work/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc" | tee -a "$work/status.txt"
}
case "${HALF:-}" in
  "") (one 0 . new0; one 0 "$AB_BASE" base0) &
      (one 1 "$AB_BASE" base1; one 1 . new1) &
      wait ;;
  0) one 0 . new0; one 0 "$AB_BASE" base0 ;;
  1) one 0 "$AB_BASE" base1; one 0 . new1 ;;
  *) echo "HALF must be 0 or 1, got $HALF" >&2; exit 2 ;;
esac
# The step times side by side (medians over all rounds), also packed as summary.txt.
"${PY:-python3}" - "$work" <<'PY' | tee "$work/summary.txt"
import json, pathlib, re, sys

rows = {}
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    name = re.search(r"_(new|base)([01])_", f.name)
    for r in json.loads(f.read_text()) if name else []:
        rows.setdefault(r["recipe"], {})[name[1] + name[2]] = (r["step_ms"], r["speedup_vs_bf16"])
for recipe, got in rows.items():
    cells = [f"{k} {got[k][0]:.1f} ms ({got[k][1] or 0:.3f}x)" for k in
             ("base0", "new0", "base1", "new1") if k in got]
    print(f"{recipe}: " + ", ".join(cells))
PY
failed=$(grep -vc ' rc=0$' "$work/status.txt" || true)
tar -czf "$OUT/ab_$tag.tar.gz" -C "$OUT" "ab_$tag" && rm -rf "$work"
[ "$failed" -eq 0 ]  # the exit status: 1 if any process failed (its log says why)
