#!/usr/bin/env bash
# Issue 15's final-phase switch on a horizon that does not overfit: the 125M headline's setup
# (seq 1024, batch 32, the `english` corpus, one seed and data order, AdamW (0.9, 0.95), weight
# decay 0.1, peak LR 6e-4, 5 % warm-up, cosine to 10 %) over 3,052 steps = 100.0M tokens, ~3
# passes over the corpus's 32.3M training tokens. The 300M-token headline passes over it ~9
# times: bf16's validation loss is lowest after ~4 passes and rises after, so a switch in its
# last 10 % measured how fast each run memorizes (results/convergence_125M_h200_2026-11-24.md).
# Runs: fp4, fp4 switched to bf16 for the last 10 % of steps (branched from fp4's checkpoint at
# step 2,746, so both share every step before it), bf16, fp8-tensorwise. Evaluation every 250
# steps. benchmarks/convergence.sh does the scheduling, resuming and packing (its header has
# the call sequence):
#
#   bash benchmarks/switch_short.sh plan              # estimates, no GPU
#   bash benchmarks/switch_short.sh run N             # device call N of a lease (carry .carry)
#   after each call, here:  K=benchmarks/results/runs_issue15s; mkdir -p $K && tar xzf \
#                             FILES_AT/issue15s_runs.tar.gz -C $K --wildcards '*/metrics.jsonl' \
#                             '*/DONE' && cp FILES_AT/issue15s_done.txt benchmarks/results/
#   the runs' checkpoints stay on the machine: make call N+1 right after call N (the machine
#   goes back after ~30 s idle, and a fresh one starts every unfinished run again; session 44)
#   at the end (CPU):       bash benchmarks/switch_short.sh report benchmarks/results/runs_issue15s
#     -> benchmarks/results/switch_125M_100M_h200_<date>.{md,json,png}
#
# Planning speeds: the headline's measured trainer speeds (fp4 282k, bf16 532k, fp8-tensorwise
# 470k tokens/s; the switched run trains its last 306 steps in bf16).
#
# SEED=N (N > 0) runs bf16, fp4 and the switched run again with `train --seed N` (another
# initialization and data order) as study issue15s_seedN (its own done list, run directories and
# report, switch_125M_100M_seedN_*): whether the switched run's lead over bf16 outlasts the seed.
# Seeds 1 and 2 ran (one lease each); benchmarks/seed_summary.py combines the reports:
#   python benchmarks/seed_summary.py benchmarks/results/switch_125M_100M{,_seed1,_seed2}_h200_<date>.json \
#     --name switch_125M_100M_seeds_h200_<date>
#
# FAST_ACCUM=1 trains the recipes whose backward GEMMs run with fast accumulation by default
# again (dgrad: fp8-tensorwise, fp8-rowwise, fp4; both: fp4-dge, fp4-direct; sessions 37, 39
# and 40, results/fast_accum_125M_h200_2026-11-26.md, fast_accum_*_125M_seeds_h200_2026-11-28.md;
# fp4-occ's dgrad is fp4's GEMM, so it is not run again) as
# study issue15s_fa, against the bf16 run above:
# before the report, copy it in (cp -r benchmarks/results/runs_issue15s/h_125M/bf16
# benchmarks/results/runs_issue15s_fa/h_125M/) -> fast_accum_125M_100M_h200_<date>.*
set -euo pipefail
SEED="${SEED:-0}"
export STUDY=issue15s H_MODEL=125M H_STEPS=3052 H_EVAL=250 H_SQNR=1000
export H_ORDER="bf16,fp8-tensorwise,fp4,fp4+switch=bf16+at=0.9"  # report: bf16 the reference
export H_NAME="switch_125M_100M_${GPU:-h200}" REPORT_DIR="${REPORT_DIR:-benchmarks/results}"
export QUEUE="
h fp4 282000
h fp4+switch=bf16+at=0.9 532000
h bf16 532000
h fp8-tensorwise 470000
"
if [ "$SEED" != 0 ]; then
  export STUDY="issue15s_seed$SEED" EXTRA="${EXTRA:+$EXTRA }--seed $SEED"
  export H_ORDER="bf16,fp4,fp4+switch=bf16+at=0.9" H_NAME="switch_125M_100M_seed${SEED}_${GPU:-h200}"
  QUEUE="$(grep -v fp8-tensorwise <<<"$QUEUE")"
fi
if [ "${FAST_ACCUM:-0}" = 1 ]; then
  export STUDY=issue15s_fa H_ORDER="bf16,fp8-tensorwise,fp8-rowwise,fp4-dge,fp4-direct,fp4"
  export H_NAME="fast_accum_125M_100M_${GPU:-h200}"
  QUEUE="
h fp8-tensorwise 470000
h fp4-dge 400000
h fp8-rowwise 400000
h fp4-direct 400000
h fp4 282000
"
fi
exec bash "$(dirname "$0")/convergence.sh" "$@"
