#!/usr/bin/env bash
# Issue 16's comparison of the FP4 recipes, as device calls of at most 10 minutes: the 50M preset,
# seq 1024, batch 32 (32,768 tokens/step), 3,052 steps = 100.0M tokens of the `english` corpus,
# one seed and data order for all: bf16, fp4 (2501.17116), nvfp4, mxfp4, nvfp4:rht=off,
# nvfp4:sr=off. benchmarks/convergence.sh does the scheduling, resuming and packing (its header
# has the call sequence); this only names the study and its queue:
#
#   bash benchmarks/fp4_recipes.sh plan               # estimates, no GPU
#   bash benchmarks/fp4_recipes.sh run N              # device call N of a lease (carry .carry)
#   after each call, here:  mkdir -p runs/issue16 && tar xzf FILES_AT/issue16_runs.tar.gz \
#                             -C runs/issue16 && cp FILES_AT/issue16_done.txt .carry/
#   at the end (CPU):       GPU=h200 bash benchmarks/fp4_recipes.sh report runs/issue16
#     -> benchmarks/results/fp4_recipes_h200_<date>.{json,png}, _table.md (records as the
#        convergence report's: recipe, model, tokens, val_loss, gap_pct, ...)
#
# Ran on 2026-11-23 (one H200, 5 calls): benchmarks/results/fp4_recipes_h200_2026-11-23.md.
# Planning speeds (tokens/s, compiled per block, one H200): the first four were guesses then
# (bf16 900k, FP4 recipes 300k), the last one nvfp4's measured speed; measured: bf16 1.05M, the
# FP4 recipes 456-529k. Each run's measured speed replaces its guess after its first chunk.
set -euo pipefail
export STUDY=issue16 A_MODEL=50M A_STEPS=3052 DONE_FILE="${DONE_FILE:-.carry/issue16_done.txt}"
export A_NAME="fp4_recipes_${GPU:-h200}" REPORT_DIR="${REPORT_DIR:-benchmarks/results}"
export QUEUE="
a bf16 900000
a fp4 300000
a nvfp4 300000
a mxfp4 300000
a nvfp4:rht=off 300000
a nvfp4:sr=off 450000
"
exec bash "$(dirname "$0")/convergence.sh" "$@"
