#!/usr/bin/env bash
# Code variants profiled side by side, with inductor's generated code: each tree (the working
# tree, or a copy of it with one patch applied) runs benchmarks/train_e2e.py on a few layers
# under the profiler, and the large generated files come back with its records, to be read for
# what inductor made of the change (session 66 found a 3.4 ms loss that way: a pointwise node
# realized as float32 buffers, visible only in the GPU's code).
#
#   bash benchmarks/profile_trees.sh --prepare NAME PATCH    here: the working tree's src/ and
#                                                            benchmarks/, PATCH applied, into
#                                                            $TREES/NAME
#   bash benchmarks/profile_trees.sh ROW TREE[,TREE...]      on the device (carry .carry)
#
# PATCH: a path from the repository's root, or absolute (e.g. one `git diff` of a variant).
# TREE: a name given to --prepare, or "work" (the working tree itself). ROW: one train_e2e.py
# row (a recipe with variant keys). Trees alternate between the GPUs (tree i on GPU i mod
# GPUS), each GPU running its trees one after the other. What comes back:
# $OUT/profile_trees_<TAG>.tar.gz with train_e2e_<MODEL>_ours_<TAG>_<TREE>_*.{md,json},
# each tree's log, code/<TREE>/*.py (generated files over 20 kB), status.txt, and
# diff_<FIRST>_<TREE>.md: benchmarks/profile_diff.py's tables of the first tree against each
# other one (the step, the kernel time by kind, each kernel family that moved).
# Settings (environment): TREES (.carry/trees: git-ignored, so it travels with carry .carry),
# MODEL (1.3B), LAYERS (6), TAG (trees), GPUS (2), LIMIT (240 s a tree, killed after), PY
# (python3), EXTRA (more train_e2e.py arguments).
# 1.3B, 6 layers: ~70-90 s a tree (block compile ~30 s).
set -uo pipefail
cd "$(dirname "$0")/.."
TREES="${TREES:-.carry/trees}"
if [ "${1:-}" = "--prepare" ]; then
  name="${2:?usage: --prepare NAME PATCH}" patch="${3:?usage: --prepare NAME PATCH}"
  case "$name" in work|*/*|.*) echo "tree name $name is taken or not a plain name" >&2; exit 2 ;; esac
  dest="$TREES/$name"
  rm -rf "$dest" && mkdir -p "$dest" || exit 1
  mkdir "$dest/benchmarks" && cp -r src "$dest"/ \
    && cp benchmarks/*.py benchmarks/*.sh "$dest/benchmarks/" \
    && find "$dest" -name __pycache__ -prune -exec rm -rf {} + || exit 1
  patch=$(realpath "$patch") || exit 1
  # outside any repository's view (the tree may lie inside this one's working tree)
  (cd "$dest" && GIT_DIR=/nonexistent git apply "$patch") \
    || { echo "the patch does not apply: $patch" >&2; exit 1; }
  echo "tree $name in $dest (the working tree with $patch)"
  exit 0
fi
if [ $# -lt 2 ]; then
  echo "usage: bash benchmarks/profile_trees.sh --prepare NAME PATCH | ROW TREE[,TREE...]" >&2
  exit 2
fi
: "${OUT:?OUT must name the folder the results go to}"
row=$1
IFS=, read -r -a trees <<< "$2"
for t in "${trees[@]}"; do
  [ "$t" = work ] || [ -d "$TREES/$t/src" ] || {
    echo "no tree $t: run --prepare $t PATCH here first" >&2; exit 2; }
done
tag="${TAG:-trees}" gpus="${GPUS:-2}"
work="$(mktemp -d)"
mkdir -p "$work/out"

one() {  # GPU TREE: one profiled train_e2e.py process
  local gpu=$1 name=$2 tree="$TREES/$2"
  [ "$name" = work ] && tree=.
  # shellcheck disable=SC2086  # EXTRA is a word list
  CUDA_VISIBLE_DEVICES=$gpu TORCHINDUCTOR_CACHE_DIR="$work/ind_$name" PYTHONPATH="$tree/src" \
    PYTHONUNBUFFERED=1 timeout -s KILL "${LIMIT:-240}" "${PY:-python3}" \
    "$tree/benchmarks/train_e2e.py" --model "${MODEL:-1.3B}" --layers "${LAYERS:-6}" \
    --compile-scope block --warmup 4 --steps 6 --out-dir "$work/out" --rows "$row" \
    --profile "$row" --tag "${tag}_$name" ${EXTRA:-} > "$work/out/$name.log" 2>&1
  local rc=$?
  mkdir -p "$work/out/code/$name"
  [ -d "$work/ind_$name" ] && find "$work/ind_$name" -name "*.py" -size +20k \
    -exec cp {} "$work/out/code/$name/" \;
  echo "$name rc=$rc" | tee -a "$work/out/status.txt"
}
for ((g = 0; g < gpus; g++)); do
  (for ((i = g; i < ${#trees[@]}; i += gpus)); do one "$g" "${trees[$i]}"; done) &
done
wait
# the first tree against each other one (benchmarks/profile_diff.py), where both have a record
for t in "${trees[@]:1}"; do
  a=$(ls "$work/out"/train_e2e_*_"${tag}_${trees[0]}"_*.json 2>/dev/null | head -1)
  b=$(ls "$work/out"/train_e2e_*_"${tag}_$t"_*.json 2>/dev/null | head -1)
  [ -n "$a" ] && [ -n "$b" ] && "${PY:-python3}" benchmarks/profile_diff.py "$a" "$b" \
    > "$work/out/diff_${trees[0]}_$t.md" 2>&1
done
failed=$(grep -cv " rc=0$" "$work/out/status.txt")
mkdir -p "$OUT"
tar czf "$OUT/profile_trees_$tag.tar.gz" -C "$work/out" .
rm -rf "$work"
[ "$failed" -eq 0 ]
