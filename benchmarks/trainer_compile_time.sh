#!/usr/bin/env bash
# How long a compiled trainer run takes to start, per variant, each with caches of its own (an
# inductor or Triton cache left by an earlier variant would make a later one look fast):
#
#   OUT=out bash benchmarks/trainer_compile_time.sh model block model-dynamic
#
# Variants: block (--compile-scope block, the default since session 57), model (--compile-scope
# model, the default before), model-dynamic (model scope with dynamo's automatic dynamic shapes,
# as before session 56's `dynamic=False`: a patched copy of src/). Each runs the $MODEL (125M)
# fp8-tensorwise trainer on $BATCH x $SEQ tokens (16 x 1024) for $STEPS steps with validation
# twice, TORCH_LOGS=recompiles, under a kill after $LIMIT s; its log, then one summary line
# (wall s, first step s, median step s, recompiles) go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_out}" STEPS="${STEPS:-30}" LIMIT="${LIMIT:-240}"
MODEL="${MODEL:-125M}" BATCH="${BATCH:-16}" SEQ="${SEQ:-1024}"
mkdir -p "$OUT"
summary="$OUT/compile_time_summary.txt"
for variant in "$@"; do
  src=src scope=model
  case "$variant" in
    model) ;;
    block) scope=block ;;
    model-dynamic)
      src=/tmp/src_dynamic; rm -rf "$src"; cp -r src "$src"
      sed -i 's/torch.compile(model, mode=config.compile_mode, dynamic=False)/torch.compile(model, mode=config.compile_mode)/' \
        "$src/minifloat/train/model.py"
      grep -q "compile_mode)$" "$src/minifloat/train/model.py" || { echo "patch failed"; exit 2; } ;;
    *) echo "unknown variant $variant"; exit 2 ;;
  esac
  export TORCHINDUCTOR_CACHE_DIR="/tmp/cache_$variant/inductor" TRITON_CACHE_DIR="/tmp/cache_$variant/triton"
  rm -rf "/tmp/cache_$variant" "runs/ct_$variant"
  log="$OUT/compile_time_$variant.log"
  cmd=(python3 -m minifloat train --model "$MODEL" --recipe fp8-tensorwise --compile
       --compile-scope "$scope" --batch-size "$BATCH" --seq-len "$SEQ" --steps "$STEPS"
       --eval-every $((STEPS / 2)) --log-every 1
       --data stdlib --out "runs/ct_$variant")
  echo "# PYTHONPATH=$src TORCH_LOGS=recompiles ${cmd[*]}" > "$log"
  start=$(date +%s.%N)
  PYTHONPATH="$src" TORCH_LOGS=recompiles timeout -s KILL "$LIMIT" "${cmd[@]}" >> "$log" 2>&1
  rc=$?
  wall=$(python3 -c "import time; print(f'{time.time() - $start:.1f}')")
  python3 - "$variant" "$rc" "$wall" "runs/ct_$variant/metrics.jsonl" "$log" "$((BATCH * SEQ))" \
    >> "$summary" <<'EOF'
import json, statistics, sys
from pathlib import Path
variant, rc, wall, metrics, log, tokens = sys.argv[1:]
tokens = int(tokens)  # a step's
rows = [json.loads(line) for line in Path(metrics).read_text().splitlines()] if Path(metrics).exists() else []
steps = {r["step"]: tokens / r["tokens_per_s"] for r in rows if r.get("tokens_per_s")}
first = f"{steps[1]:.1f}" if 1 in steps else "-"
rest = [t for s, t in steps.items() if s > 2]
median = f"{statistics.median(rest) * 1e3:.1f} ms" if rest else "-"
recompiles = sum("Recompiling function" in line for line in Path(log).read_text().splitlines())
print(f"{variant}: rc {rc}, wall {wall} s, first step {first} s, median step {median}, "
      f"steps logged {len(steps)}, recompiles {recompiles}")
EOF
  tail -1 "$summary"
done
