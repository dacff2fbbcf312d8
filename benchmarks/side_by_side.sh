#!/usr/bin/env bash
# Short training runs side by side on one GPU, for paired comparisons of numerics variants
# (session 37's fast-accumulation runs: results/fast_accum_125M_h200_2026-11-26.md). Every
# RUN x SEED is its own `minifloat train` process, all started at once: a 125M model leaves an
# H200 room for six, and one device call holds them all. They share the GPU, so their tokens/s
# mean nothing; their losses are what they would be alone.
#
#   SEEDS="0 1 2" bash benchmarks/side_by_side.sh RUN [RUN...]      (device; carry .carry)
#
# RUN: a recipe name with any variant keys (fp8-rowwise:dgrad_fast_accum=on). What comes back:
# $OUT/side_by_side.tar.gz with seed<S>/<RUN>/{metrics.jsonl,train.log} and summary.txt (exit
# status and seconds of each). Here, a seed's report:
#   python benchmarks/convergence_report.py DIR/seed0 --model 125M --name NAME --order REF,...
# and every run's gap to REF of its own seed, over all seeds:
#   python benchmarks/paired_seeds.py DIR [DIR...] --ref REF --name NAME   (folders pool seeds)
# Settings (environment): MODEL (125M), STEPS (600), EVAL (100: evaluation every EVAL
# steps), EVAL_BATCHES (20), BATCH (32), SEQ (1024), LR (6e-4), DATA (.carry/english.xz),
# LIMIT (520 s a run: a run cut off keeps the metrics it logged), COMPILE (default: per
# block; empty: eager), EXTRA (more train flags: the CPU test's --device cpu ...).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -eq 0 ]; then
  echo "usage: [SEEDS=...] bash benchmarks/side_by_side.sh RUN [RUN...]" >&2
  exit 2
fi
: "${OUT:?OUT must name the folder the results go to}"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
PY="${PY:-python}"
WORK="$(mktemp -d)"
SEEDS="${SEEDS:-0}"
for seed in $SEEDS; do
  for run in "$@"; do
    (
      dir="$WORK/seed$seed/$run"
      mkdir -p "$dir"
      t0=$SECONDS
      # shellcheck disable=SC2086  # COMPILE and EXTRA are word lists
      timeout "${LIMIT:-520}" "$PY" -m minifloat train --model "${MODEL:-125M}" --recipe "$run" \
        --data "${DATA:-.carry/english.xz}" --steps "${STEPS:-600}" --batch-size "${BATCH:-32}" \
        --seq-len "${SEQ:-1024}" --lr "${LR:-6e-4}" --eval-every "${EVAL:-100}" \
        --eval-batches "${EVAL_BATCHES:-20}" --log-every 25 --seed "$seed" --out "$dir" \
        --overwrite --quiet \
        ${COMPILE---compile --compile-scope block} ${EXTRA:-} > "$dir/train.log" 2>&1
      echo "seed $seed $run: rc=$? $((SECONDS - t0)) s" >> "$WORK/summary.txt"
    ) &
  done
done
wait
sort "$WORK/summary.txt"
mkdir -p "$OUT"
tar czf "$OUT/side_by_side.tar.gz" -C "$WORK" --exclude='*.pt' .
rm -rf "$WORK"
