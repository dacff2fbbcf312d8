#!/usr/bin/env bash
# One GPU call for the trainer: a 125M bf16 throughput run on the carried `english` corpus, then a
# short same-seed convergence comparison of recipes on the 50M model. Results/logs go to $OUT.
#
#   minifloat data export english --out .carry/english.xz   # on the CPU machine (24 MB)
#   bash benchmarks/gpu_train.sh                      # on the GPU machine, carry .carry
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_out}"
DATA="${DATA:-.carry/english.xz}"
RECIPES="${RECIPES:-bf16,fp8-tensorwise,fp4-direct,fp4}"
STEPS="${STEPS:-400}"
mkdir -p "$OUT"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
timeout 200 python3 -m minifloat train --model 125M --data "$DATA" --recipe bf16 --steps 300 \
  --batch-size 32 --seq-len 1024 --compile --compile-scope model --log-every 50 --eval-every 0 \
  --eval-batches 10 --out "$OUT/train_125M" 2>&1 | tee "$OUT/train_125M.log"
timeout 420 python3 -m minifloat compare --recipes "$RECIPES" --model 50M --data "$DATA" \
  --steps "$STEPS" --batch-size 32 --seq-len 1024 --lr 1e-3 --log-every 50 --eval-every 0 \
  --eval-batches 20 --out "$OUT/compare_50M" 2>&1 | tee "$OUT/compare_50M.log"
