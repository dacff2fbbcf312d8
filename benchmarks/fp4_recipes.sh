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
# Planning speeds (tokens/s, eager, one H200) are guesses where nothing was measured yet: bf16 as
# the 50M pilot (637k); fp4 after the OCC redesign and the micro-block recipes (bf16 GEMMs of
# dequantized operands plus their quantizers, docs/recipes.md) at 150k. Each run's measured speed
# replaces its guess after its first chunk. EXTRA=--compile adds `train --compile` to every chunk.
set -euo pipefail
export STUDY=issue16 A_MODEL=50M A_STEPS=3052
export A_NAME="fp4_recipes_${GPU:-h200}" REPORT_DIR="${REPORT_DIR:-benchmarks/results}"
export QUEUE="
a bf16 637000
a fp4 150000
a nvfp4 150000
a mxfp4 150000
a nvfp4:rht=off 150000
a nvfp4:sr=off 150000
"
exec bash "$(dirname "$0")/convergence.sh" "$@"
