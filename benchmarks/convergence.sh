#!/usr/bin/env bash
# Issues #8 and #15, the convergence study, as device calls of at most 10 minutes that resume from
# checkpoints. Headline: 125M preset, seq 1024, batch 32 (32,768 tokens/step), 9,156 steps =
# 300.0M tokens, bf16 / fp8-tensorwise / fp8-blockwise / fp4 / fp4 with a final-phase switch to
# bf16 for the last 10 % of steps (run name fp4+switch=bf16+at=0.9: train --recipe fp4
# --switch-recipe bf16 --switch-at 0.9, docs/training.md). Ablations: 50M preset, same batch,
# 3,052 steps = 100.0M tokens (issue 15 asks >= 100M; the same runs as issue 16's 50M bf16 and
# fp4, benchmarks/fp4_recipes.sh), every run with --sqnr-every (per-layer quantization SQNR).
# Every run is compiled (`train --compile --compile-scope block`; COMPILE= for eager).
#
# Device commands (tool `run`, kind nvidia-h100-x1 or nvidia-h200, carry [".carry"], timeout_s 600):
#   once, on the CPU machine:  .venv/bin/minifloat data export english --out .carry/english.xz
#   each call:                 bash benchmarks/convergence.sh run N     (N = 1, 2, 3: call in lease)
#   after each call, here:     K=benchmarks/results/runs_issue8; mkdir -p $K && tar xzf \
#                                FILES_AT/issue8_runs.tar.gz -C $K --wildcards '*/metrics.jsonl' \
#                                '*/DONE' && cp FILES_AT/issue8_done.txt benchmarks/results/
#                              and commit both: a new machine (this one too) keeps no work tree
#   at the end, here (CPU):    bash benchmarks/convergence.sh report benchmarks/results/runs_issue8
# `bash benchmarks/convergence.sh plan` prints the estimates below (no GPU needed).
#
# Why this shape: a checkpoint lives only on the machine that wrote it (125M: ~1.2 GB, far over
# what comes back from $OUT or travels in carry), and a machine goes back after 30 s idle or 30
# minutes held. So a run must start and finish inside one lease of <= 3 back-to-back calls; the
# scheduler below starts a run only if its estimated time fits in what is left of the lease
# (3 - N + 1 calls of BUDGET s), resumes it on the next call with --resume, and sizes each chunk's
# --stop-after from the speed the run measured so far (the estimate before that). --ckpt-every
# bounds what a `timeout` kill loses. Finished runs go to issue8_done.txt, which comes back in
# $OUT and is committed (with the runs' metrics), so a fresh machine skips them.
#
# A switched run (fp4+switch=bf16+at=0.9) is bit for bit its plain run (fp4) up to the switch
# step S, so it does not train those steps again: the plain run's chunks stop at S (the chunk
# that would pass it is cut there), the switched run starts with `train --branch-from` from that
# checkpoint (docs/training.md, "Branching from the plain run") and trains only the steps after
# S, and then the plain run goes on past S. This needs the plain run (listed first) in the same
# queue and lease; if it finished in an earlier lease, the switched run trains from step 0. Its
# planning speed is that of the part it trains itself (the switch recipe's: bf16 for the
# headline), as is the work `plan` counts for it.
#
# Planning speeds: see the queue (TABLE) below; each run's measured speed replaces its estimate
# after its first chunk. Finished runs (DONE_FILE, committed with their metrics under
# benchmarks/results/runs_$STUDY) are skipped by `plan` and `run`. After session 11 every run
# has finished but h/fp4, which reached step 9,091 of 9,156 (its lease ran out; its metrics
# are committed and the report uses them): `plan` would train it again from step 0 (one lease,
# ~1,230 s of work, tight: session 11 needed 1,770 s of calls), for its last 65 steps and final
# evaluation only. The 50M metrics of sessions 8-9 were lost with their machine's work tree
# (their reports are committed).
# `run N fp4-125M` runs that one alone for what a lease allows (partial; the report compares all
# runs at the common step). NPROC=2 (kind nvidia-h200-x2) runs each job as DDP on two GPUs with
# the same global batch.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"  # venv: CPU side
OUT="${OUT:-gpu_out}"
STUDY="${STUDY:-issue8}"                        # names the run dirs and the files of each call
RUNS="${RUNS:-/tmp/minifloat_$STUDY}"           # run dirs with checkpoints (stay on the machine)
DONE_FILE="${DONE_FILE:-benchmarks/results/${STUDY}_done.txt}"  # committed: travels with the tree
DATA="${DATA:-.carry/english.xz}"
BUDGET="${BUDGET:-540}"                         # seconds of work per call (device limit: 600)
CALLS_PER_LEASE="${CALLS_PER_LEASE:-3}"
OVERHEAD="${OVERHEAD:-60}"                      # start, data, first-step JIT, final eval, save
MIN_LEFT="${MIN_LEFT:-90}"                      # start no chunk with less time left than this
BATCH="${BATCH:-32}" SEQ="${SEQ:-1024}"         # global batch (sequences) and sequence length
TOKENS_PER_STEP=$((BATCH * SEQ))
NPROC="${NPROC:-1}"                             # GPUs per run: >1 runs DDP under torchrun, with
                                                # BATCH/NPROC per rank (kind nvidia-h200-x2)
EXTRA="${EXTRA:-}"                              # more train flags (the CPU smoke test's --device)
# Compiled runs (each chunk compiles one block: ~10-40 s, inside OVERHEAD); COMPILE= runs eagerly.
COMPILE="${COMPILE---compile --compile-scope block}"
# Per group: model, steps, peak LR, eval/log/sqnr cadence.
H_MODEL="${H_MODEL:-125M}" H_STEPS="${H_STEPS:-9156}" H_LR=6e-4 H_EVAL="${H_EVAL:-1000}" H_LOG=50
H_SQNR="${H_SQNR:-500}"
A_MODEL="${A_MODEL:-50M}" A_STEPS="${A_STEPS:-3052}" A_LR=1e-3 A_EVAL=250 A_LOG=25 A_SQNR=100
# Queue order = priority. group recipe planning-tokens/s (compiled, one H200). Measured: the 50M
# runs of 2026-11-23 (results/fp4_recipes_h200_2026-11-23.md, ablations_50M_h200_...: bf16 1.05M,
# fp4-direct 607k, fp4-dge 610k, fp4 480k) and 125M train_e2e.py (bf16 619k, fp8-tensorwise 516k,
# fp4 268k; results/train_e2e_125M_ours_lib_h200_2026-11-23.md); guesses: the other 50M FP4
# variants as their measured base; fp8-blockwise 340k (its 125M run, 2026-11-24). DGE k is ablated on fp4-dge and the
# per-tensor scaling also on fp4-direct, each knob isolated. The 50M FP4 runs of 2026-11-24
# (ablations_50M_h200_2026-11-24.md) ran at 480k-700k tokens/s, ±20 % between calls for the same
# recipe. Done runs are listed in benchmarks/results/issue8_done.txt and skipped.
# a fp4+switch=fp4-occ+at=0.3 (DGE for the first 30 % of steps only) tests whether DGE's
# attraction to grid points, which helps early (results/dge_step_size_position_cpu_2026-11-24.md),
# is what costs later; a_50M/fp4 finished in an earlier lease, so it trains (and is planned) from
# step 0.
TABLE="
a bf16 1050000
a fp4-direct 600000
a fp4-dge 600000
a fp4-w4a8 600000
a fp4-w8a4 600000
a fp4-dge:dge.k=3 600000
a fp4-dge:dge.k=10 600000
a fp4-direct:scaling=tensor 600000
h bf16 619000
h fp8-tensorwise 516000
h fp8-blockwise 340000
a fp4 480000
a fp4-occ 480000
a fp4:occ.alpha=0.999 480000
a fp4:occ.alpha=0.97 480000
a fp4:scaling=tensor 480000
a fp4+switch=fp4-occ+at=0.3 480000
h fp4 268000
h fp4+switch=bf16+at=0.9 619000
"
# Smoke scale for a CPU check of this script (tiny model, stdlib corpus, a few steps).
if [ -n "${SMOKE:-}" ]; then
  DATA=stdlib BATCH=4 SEQ=64 TOKENS_PER_STEP=256 H_MODEL=tiny A_MODEL=tiny A_STEPS=6
  H_STEPS="${SMOKE_STEPS:-12}" H_EVAL=6 A_EVAL=3 H_LOG=2 A_LOG=2 H_SQNR=4 A_SQNR=3
  OVERHEAD=5 MIN_LEFT=15 COMPILE=""
  TABLE=$'\nh bf16 400\na fp4-dge:dge.k=3 300\nh fp4 20\nh fp4+switch=bf16+at=0.5 400\n'
  EXTRA="--device cpu --tokenizer byte --data-max-bytes 300000 $EXTRA"
fi
TABLE="${QUEUE:-$TABLE}"                        # another queue: lines "group recipe tokens/s"

g() { local v="${1^^}_$2"; echo "${!v}"; }     # g h STEPS -> $H_STEPS
# A planning speed for NPROC GPUs (90 % DDP scaling assumed; measured speeds replace it).
scaled() { echo $(( NPROC > 1 ? $1 * NPROC * 9 / 10 : $1 )); }
# Training seconds of a whole run at `speed`, and what a call of `left` seconds trains: its time
# minus OVERHEAD, 85 % of it (evaluations, SQNR probes and checkpoint saves are not in the
# trainer's tokens/s).
train_seconds() { echo $(( $(own_steps "$1" "$3") * TOKENS_PER_STEP / $2 )); }
capacity() { local c=$(( ($1 - OVERHEAD) * 85 / 100 )); echo $(( c > 0 ? c : 0 )); }
# Does run $5 (group $1, speed $2), not started, finish within `left` ($3) seconds plus $4 calls?
fits() {
  [ "$(train_seconds "$1" "$2" "$5")" -le $(( $(capacity "$3") + $4 * $(capacity "$BUDGET") )) ]
}
# Branching (see the top): the plain run of a switched run name, empty for a plain name.
base_of() { [[ "$1" == *+switch=* ]] && echo "${1%%+switch=*}"; }
in_table() { awk -v g="$1" -v r="$2" '$1 == g && $2 == r {f = 1} END {exit !f}' <<<"$TABLE"; }
# The switch step S of a switched run name in group $1 (minifloat's own rule, 0.9 x 9156 = 8240).
switch_step_of() {
  "$PY" -c 'import sys; from minifloat.train.switch import switch_step
print(switch_step(float(sys.argv[1]), int(sys.argv[2])))' "${2##*+at=}" "$(g "$1" STEPS)"
}
# Does switched run $2 of group $1 branch from its plain run? Only while that run is in the
# queue and not finished (a finished one's checkpoint went with its machine).
branches() {
  local base; base="$(base_of "$2")"
  [ -n "$base" ] && in_table "$1" "$base" && ! is_done "$1" "$base"
}
# Steps run $2 of group $1 trains itself: after the switch when it branches from its plain run.
own_steps() {
  if branches "$1" "$2"; then
    echo $(( $(g "$1" STEPS) - $(switch_step_of "$1" "$2") ))
  else
    g "$1" STEPS
  fi
}
# The smallest switch step >= $3 at which plain run $2 of group $1 must stop and wait: that of a
# switched run of it in the queue that has not branched yet (empty: none).
branch_pause() {
  local grp="$1" plain="$2" step="$3" r s best=""
  while read -r r; do
    [[ "$r" == "$plain+switch="* ]] || continue
    is_done "$grp" "$r" && continue
    [ -f "$RUNS/$(key "$grp" "$r")/checkpoint.pt" ] && continue
    s="$(switch_step_of "$grp" "$r")"
    [ "$s" -ge "$step" ] && { [ -z "$best" ] || [ "$s" -lt "$best" ]; } && best=$s
  done < <(awk -v g="$grp" '$1 == g {print $2}' <<<"$TABLE")
  echo "$best"
}
key() { echo "${1}_$(g "$1" MODEL)/$2"; }        # h_125M/bf16: the run's directory under RUNS
# The train flags of a run name: RECIPE, or RECIPE+switch=SWITCH+at=F (minifloat.train.switch).
recipe_flags() {
  if [[ "$1" == *+switch=* ]]; then
    local rest="${1#*+switch=}"
    echo "--recipe ${1%%+switch=*} --switch-recipe ${rest%+at=*} --switch-at ${rest##*+at=}"
  else
    echo "--recipe $1"
  fi
}
is_done() {
  local k; k="$(key "$1" "$2")"
  [ -f "$RUNS/$k/DONE" ] || { [ -f "$DONE_FILE" ] && grep -qxF "$k" "$DONE_FILE"; }
}

# "STEP TOKENS_PER_S" of a run dir: its checkpoint's step (0: none) and the median speed of its
# logged windows (0: none yet), of a branched run only those after its branch (the records before
# are its plain run's).
progress() {
  "$PY" - "$1" <<'EOF'
import json, statistics, sys
from pathlib import Path
import torch
run = Path(sys.argv[1])
step, speed = 0, 0
if (run / "checkpoint.pt").is_file():
    body = torch.load(run / "checkpoint.pt", map_location="cpu", mmap=True, weights_only=True)
    step = int(body["state"]["step"])
if (run / "metrics.jsonl").is_file():
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    since = max([r["step"] for r in rows if "branched_from" in r], default=0)
    speeds = [r["tokens_per_s"] for r in rows
              if "loss" in r and "skip_reason" not in r and r["step"] > since]
    speed = int(statistics.median(speeds[1:] or speeds)) if speeds else 0
print(step, speed)
EOF
}

# One chunk of one run, sized to fit `left` seconds. Returns 0 when the run is finished, 1 when
# it should go on, 2 when it cannot go on in this call (no time, or it failed), 3 when a plain
# run waits at a switch step for its switched run to branch, 4 when a switched run waits for its
# plain run to reach the switch step.
chunk() {
  local grp="$1" recipe="$2" speed="$3" left="$4" dir steps step measured fit stop every pause
  local base branch=()
  dir="$RUNS/$(key "$grp" "$recipe")" steps="$(g "$grp" STEPS)" base="$(base_of "$recipe")"
  read -r step measured < <(progress "$dir")
  [ "$step" -ge "$steps" ] && { touch "$dir/DONE"; return 0; }
  pause="$(branch_pause "$grp" "$recipe" "$step")"
  [ "$pause" = "$step" ] && return 3
  if [ ! -f "$dir/checkpoint.pt" ] && branches "$grp" "$recipe"; then
    local at_step; at_step="$(progress "$RUNS/$(key "$grp" "$base")" | cut -d' ' -f1)"
    [ "$at_step" != "$(switch_step_of "$grp" "$recipe")" ] && return 4
    branch=(--branch-from "$RUNS/$(key "$grp" "$base")") step=$at_step
  fi
  [ "$measured" -gt 0 ] && speed="$measured"
  # Better still: the speed of earlier chunks from wall time (start, evaluations, SQNR probes,
  # checkpoints and lost work included), scaled so that capacity()'s 85 % cancels.
  [ -f "$dir/wall_speed" ] && speed=$(( $(cat "$dir/wall_speed") * 100 / 85 ))
  fit=$(( $(capacity "$left") * speed / TOKENS_PER_STEP ))
  [ "$fit" -lt 1 ] && return 2
  stop=$(( step + fit < steps ? step + fit : steps ))
  [ -n "$pause" ] && [ "$stop" -gt "$pause" ] && stop=$pause
  every=$(( speed * 150 / TOKENS_PER_STEP ))       # a checkpoint every ~150 s of training,
  every=$(( every > fit / 3 ? fit / 3 : every ))   # at least three per chunk
  every=$(( every < 10 ? 10 : every ))
  local -a recipe_args; read -ra recipe_args <<<"$(recipe_flags "$recipe")"
  local args=(--model "$(g "$grp" MODEL)" "${recipe_args[@]}" --data "$DATA" --steps "$steps"
    --batch-size "$(( BATCH / NPROC ))" --seq-len "$SEQ" --lr "$(g "$grp" LR)"
    --eval-every "$(g "$grp" EVAL)"
    --eval-batches 20 --log-every "$(g "$grp" LOG)" --sqnr-every "$(g "$grp" SQNR)"
    --ckpt-every "$every" --stop-after "$stop" --out "$dir" --quiet "${branch[@]}")
  # No checkpoint yet (a new run, or a chunk cut before its first save): start (again) afresh.
  if [ -f "$dir/checkpoint.pt" ]; then args+=(--resume); else args+=(--overwrite); fi
  local launch=("$PY" -m minifloat)
  if [ "$NPROC" -gt 1 ]; then
    launch=("$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" -m minifloat)
    args+=(--parallel ddp)
  fi
  mkdir -p "$dir"
  local t0=$SECONDS
  echo "== $(date +%T) $grp $recipe: steps $step -> $stop of $steps (~$speed tok/s, ${left}s left)${branch:+ branched from $base}"
  # shellcheck disable=SC2086
  timeout $(( left > 15 ? left - 10 : 5 )) "${launch[@]}" train "${args[@]}" $COMPILE $EXTRA \
    >>"$dir/train.log" 2>&1 </dev/null
  local rc=$? done_step
  tail -n 2 "$dir/train.log"
  done_step="$(progress "$dir" | cut -d' ' -f1)"
  [ "$done_step" -gt "$step" ] && echo $(( (done_step - step) * TOKENS_PER_STEP /
    (SECONDS - t0 > 0 ? SECONDS - t0 : 1) )) >"$dir/wall_speed"
  if [ "$rc" -eq 0 ]; then
    [ "$stop" -lt "$steps" ] && return 1
    touch "$dir/DONE"
    return 0
  fi
  echo "   exit status $rc (124: time limit, resumes from its last checkpoint; else see train.log)"
  return 2
}

pack() {
  mkdir -p "$OUT" "$RUNS"
  { [ -f "$DONE_FILE" ] && cat "$DONE_FILE"
    (cd "$RUNS" && find . -name DONE | sed 's|^\./||; s|/DONE$||'); } |
    sort -u >"$OUT/${STUDY}_done.txt"
  tar czf "$OUT/${STUDY}_runs.tar.gz" -C "$RUNS" --exclude='checkpoint*.pt' --exclude='.checkpoint*' \
    --exclude=tensorboard .
  status | tee "$OUT/${STUDY}_status.txt"
}

status() {
  while read -r grp recipe speed; do
    [ -z "$grp" ] && continue
    local state="todo" dir; dir="$RUNS/$(key "$grp" "$recipe")"
    if is_done "$grp" "$recipe"; then state="done"
    elif [ -f "$dir/checkpoint.pt" ]; then state="at step $(progress "$dir" | cut -d' ' -f1)"; fi
    printf '%-4s %-6s %-28s %s\n' "$grp" "$(g "$grp" MODEL)" "$recipe" "$state"
  done <<<"$TABLE"
}

# The scheduler of `run`, simulated with the planning speeds: which runs each call of each lease
# does, and how many leases (sessions) the study takes. A switched run that branches from its
# plain run trains inside that run's lease, right after it reaches the switch step: its time is
# counted as the plain run's (shown as "+branch").
plan() {
  local -a grps recipes speeds rem
  local -A index=()
  local n=0 per_call base; per_call="$(capacity "$BUDGET")"
  while read -r grp recipe speed; do
    [ -z "$grp" ] && continue
    # finished runs (DONE_FILE, or a DONE mark on this machine) are not planned again
    is_done "$grp" "$recipe" && { echo "done: $(key "$grp" "$recipe")"; continue; }
    speed="$(scaled "$speed")" base="$(base_of "$recipe")"
    if branches "$grp" "$recipe" && [ -n "${index[$grp/$base]:-}" ]; then
      local j=${index[$grp/$base]}
      rem[j]=$(( rem[j] + $(train_seconds "$grp" "$speed" "$recipe") )) recipes[j]+="+branch"
      continue
    fi
    index[$grp/$recipe]=$n
    grps[n]=$grp recipes[n]=$recipe speeds[n]=$speed
    rem[n]=$(train_seconds "$grp" "$speed" "$recipe")
    n=$((n + 1))
  done <<<"$TABLE"
  for ((i = 0; i < n; i++)); do
    [ "${rem[i]}" -le $(( CALLS_PER_LEASE * per_call )) ] && continue
    echo "blocked: ${grps[i]} $(g "${grps[i]}" MODEL) ${recipes[i]} needs ${rem[i]}s of" \
      "training, a lease gives $(( CALLS_PER_LEASE * per_call ))s (run N fp4-125M runs it" \
      "partially)"
    rem[i]=0
  done
  local lease=0
  while :; do
    local todo=0 i; for ((i = 0; i < n; i++)); do [ "${rem[i]}" -gt 0 ] && todo=1; done
    [ "$todo" -eq 0 ] || [ "$lease" -ge 20 ] && break
    lease=$((lease + 1))
    local -a started=()
    for ((call = 1; call <= CALLS_PER_LEASE; call++)); do
      local left=$BUDGET line=""
      for ((i = 0; i < n; i++)); do
        [ "${rem[i]}" -le 0 ] && continue
        if [ -z "${started[i]:-}" ]; then
          [ "$left" -lt "$MIN_LEFT" ] && continue
          [ "${rem[i]}" -le $(( $(capacity "$left") + (CALLS_PER_LEASE - call) * per_call )) ] \
            || continue
          started[i]=${rem[i]}
        fi
        while [ "$left" -ge "$MIN_LEFT" ] && [ "${rem[i]}" -gt 0 ]; do
          local use; use=$(capacity "$left"); [ "$use" -gt "${rem[i]}" ] && use=${rem[i]}
          rem[i]=$(( rem[i] - use )) left=$(( left - OVERHEAD - use * 100 / 85 ))
        done
        line+=" $(key "${grps[i]}" "${recipes[i]}")"
        [ "${rem[i]}" -gt 0 ] && line+="(cont.)"
      done
      echo "lease $lease, call $call:${line:- (nothing fits)}"
    done
    for ((i = 0; i < n; i++)); do  # unfinished at the lease's end: its checkpoint is gone
      [ -n "${started[i]:-}" ] && [ "${rem[i]}" -gt 0 ] && rem[i]=${started[i]}
    done
  done
  echo "=> $lease leases (sessions) of $CALLS_PER_LEASE calls of ${BUDGET}s"
}

# run N [fp4-125M]: work through the queue for BUDGET seconds; N = this call's index in the lease.
# The queue is gone through again while a pass made progress: a plain run that stopped at a
# switch step goes on once its switched run has branched (listed after it).
run() {
  local call="${1:-1}" partial="${2:-}" start=$SECONDS progressed=1
  local -A stuck=()
  mkdir -p "$OUT" "$RUNS"
  [ "$DATA" != stdlib ] && [ ! -f "$DATA" ] && { echo "missing $DATA (carry .carry)"; exit 2; }
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv
  while [ "$progressed" -eq 1 ]; do
    progressed=0
    while read -r grp recipe speed; do
      [ -z "$grp" ] && continue
      local left=$(( BUDGET - (SECONDS - start) )) dir rc; dir="$RUNS/$(key "$grp" "$recipe")"
      speed="$(scaled "$speed")"
      [ "$left" -lt "$MIN_LEFT" ] && break
      is_done "$grp" "$recipe" && continue
      [ -n "${stuck[$grp/$recipe]:-}" ] && continue
      if [ -n "$partial" ]; then                  # only the fp4 headline (and its switched
        [[ "$grp/$recipe" != h/fp4 && "$grp/$recipe" != h/fp4+switch=* ]] && continue  # run)
      elif [ ! -f "$dir/checkpoint.pt" ] && \
           ! fits "$grp" "$speed" "$left" $(( CALLS_PER_LEASE - call )) "$recipe"; then
        continue                                  # would not finish before the lease ends
      fi
      # Keep chunking this run until it finishes, fails, waits, or the call's budget is spent.
      while [ $(( BUDGET - (SECONDS - start) )) -ge "$MIN_LEFT" ]; do
        chunk "$grp" "$recipe" "$speed" "$(( BUDGET - (SECONDS - start) ))"
        rc=$?
        [ "$rc" -le 1 ] && progressed=1
        [ "$rc" -eq 2 ] && stuck[$grp/$recipe]=1
        [ "$rc" -ne 1 ] && break
      done
    done <<<"$TABLE"
  done
  pack
}

report() {
  local dir="${1:-runs/$STUDY}" date; date="$(date +%F)"
  local h_order a_order
  # report order (the first run is the reference): H_ORDER, else the queue's
  h_order="${H_ORDER:-$(awk '$1 == "h" {print $2}' <<<"$TABLE" | paste -sd,)}"
  a_order="$(awk '$1 == "a" {print $2}' <<<"$TABLE" | paste -sd,)"
  for grp in h a; do
    local model runs name order=""; model="$(g "$grp" MODEL)" runs="$dir/${grp}_$(g "$grp" MODEL)"
    [ -d "$runs" ] || continue
    [ "$grp" = h ] && name="${H_NAME:-convergence_${model}}" || name="${A_NAME:-ablations_${model}}"
    for r in $( [ "$grp" = h ] && tr ',' ' ' <<<"$h_order" || tr ',' ' ' <<<"$a_order" ); do
      [ -f "$runs/$r/metrics.jsonl" ] && order="${order:+$order,}$r"
    done
    "$PY" benchmarks/convergence_report.py "$runs" --model "$model" --order "$order" \
      --tokens-per-step "$TOKENS_PER_STEP" --layer-sqnr --name "${name}_${date}" \
      ${REPORT_DIR:+--out-dir "$REPORT_DIR"}
    "$PY" benchmarks/layer_sqnr_report.py "$runs" --name "${name}_layer_sqnr_${date}" \
      ${REPORT_DIR:+--out-dir "$REPORT_DIR"} || true
  done
}

case "${1:-plan}" in
  plan) plan ;;
  status) status ;;
  run) shift; run "$@" ;;
  report) shift; report "$@" ;;
  *) echo "usage: $0 plan | status | run N [fp4-125M] | report RUNS_DIR" >&2; exit 2 ;;
esac
