#!/usr/bin/env bash
# Scale-out benchmark driver (issue #7): ONE device job (<= ~9.5 minutes) of
# benchmarks/scale_out.py. It trains the listed recipes one after another, each run continuing
# from its checkpoint in runs/scale_out/ (kept on the machine only while it stays warm), until the
# runs are done or the job's time is up, then writes the report. Every chunk is started under
# `timeout`, so no job outlives JOB_S.
#
# Device commands (the repo root is the cwd; carry .carry for the corpus, .whl for torchao):
#
#   7B on 8 GPUs, sharded checkpoints (CKPT_FORMAT=sharded, the 7B default): the default list
#   (bf16, fp8-tensorwise, fp8-rowwise, torchao: one whole run each, no checkpoint) then fp4
#   (~6x slower) in chunks of 45 steps, each job resuming the last one's sharded checkpoint.
#   The same command continues where the last job stopped, about 9 times:
#     run(kind="nvidia-h200-x8", carry=[".carry", ".whl"], timeout_s=600,
#         command="MODEL=7B bash benchmarks/scale_out.sh")
#   Only fp4, shorter: command="MODEL=7B RECIPES=fp4:45 WARMUP=5 MEASURE=40 bash ..." (1 job).
#   Fallback, 1.3B on 2 GPUs (the default list, fp4 in chunks of 110 steps); the same command
#   continues where the last job stopped, about 4 times:
#     run(kind="nvidia-h200-x2", carry=[".carry", ".whl"], timeout_s=600,
#         command="MODEL=1.3B bash benchmarks/scale_out.sh")
#   Quantized weight all-gather (issue #17), 1.3B on 2 GPUs: QAG=1 queues each of fp8-tensorwise,
#   fp8-rowwise and fp4-dge plain and with --quantized-all-gather (NAME+qag, run directory
#   1.3B_NAME+qag), whole runs, so that the report sets every +qag run against its plain run of
#   the same job series; runs already DONE in RUNS are skipped. fp4 (OCC) is not in the list:
#   the quantized all-gather refuses OCC (it would need the weight quantized a second time), and
#   scale_out.py refuses fp4+qag, bf16+qag and torchao+qag at once. About 3 jobs:
#     run(kind="nvidia-h200-x2", carry=[".carry"], timeout_s=600,
#         command="MODEL=1.3B QAG=1 bash benchmarks/scale_out.sh")
#   Any recipe list can hold +qag entries, e.g. RECIPES=fp8-rowwise,fp8-rowwise+qag.
#   Issue each next call at once: a machine stays warm ~30 s after a call, and a fresh one has
#   lost runs/ (checkpoints; finished runs stay in the $OUT archives) and starts a run again.
#   Unsure of the estimates below? A first probe job: MEASURE=20 RUNS=runs/probe.
#
# What comes back in $OUT (5 files): scale_out_<gpu>_<date>.md/.json/.png, scale_out_runs.tgz
# (each run's metrics.jsonl and scale_out.jsonl; `python benchmarks/scale_out.py report --runs
# DIR` rebuilds the report from it) and scale_out_job.log. Copy the report into
# benchmarks/results/.
#
# A chunk that times out (rc=124) loses its steps since the last checkpoint: give that recipe a
# smaller chunk (e.g. fp4:60) or add EXTRA="--ckpt-every 50" (a save costs ~40 s at 1.3B with
# the full format; sharded saves are faster, see below).
#
# Knobs (environment): MODEL (7B | 1.3B | any preset), RECIPES (comma list of
# NAME[+qag][:CHUNK_STEPS]; +qag: the run with --quantized-all-gather; CHUNK_STEPS 0, the
# default, = the whole run in one go without a checkpoint; default lists in the `case` below),
# QAG=1 (default list: $QAG_STUDY below, the plain and +qag runs of the quantized all-gather),
# NGPU (all visible GPUs), BATCH (per GPU), SEQ (2048), WARMUP (20), MEASURE (200), JOB_S (570),
# MIN_START_S (do not start a run or chunk with less time left; after a run's first chunk, that
# chunk's wall time + 30 s is used if larger), MAX_CHUNKS (per recipe per job;
# default: as many as fit), DATA (.carry/english.xz), RUNS (runs/scale_out), EXTRA (more
# scale_out.py run flags, e.g. "--no-compile"), KEEP_CKPT=1 (keep finished runs' checkpoints),
# CKPT_FORMAT (full | sharded; default sharded for 7B, full otherwise: `--ckpt-format`).
#
# Estimates (from shared/ANCHORS.md and flops_per_token; to be replaced by the first job's log):
# - 7B (6.74B params, vocab 32000): 42.9 GFLOP/token at seq 2048. At 40-50 % MFU bf16 that is
#   9.2k-11.5k tokens/s per GPU, 0.7-0.9 s per step at batch 4 x 2048 per GPU. Memory per GPU:
#   12.6 GiB of FSDP shards (fp32 weights, gradients, AdamW m and v: 16 B/param / 8) + ~3 GiB of
#   unsharded fp32 layers in flight + ~5.3 MiB of activations per token (calibrated on the 1.3B
#   anchor: 55 GiB at batch 8 on one GPU, no activation checkpointing) = ~60 GiB at batch 4,
#   ~105-115 GiB at batch 8 (may fit 141 GB; fp4/fp8 keep extra quantized copies): BATCH=4.
#   One job: start + imports ~20 s, tokenizer/corpus (first job only) ~30 s, model built on
#   meta and each shard initialized on its GPU (the trainer's FSDP path; the full matrices are
#   drawn on every GPU, seconds), compile ~1.5 min, 220 steps ~3 min, final evaluation
#   (compiles a no-grad graph) ~45 s: ~6.5 min.
#   fp4 steps are ~6x slower (OCC; README: fp4 layers run at 0.14x bf16), ~5 s per step: 220
#   steps (~18 min) need ~5 jobs of 45 steps (~4 min of steps + ~4 min for start, compile,
#   loading and saving the checkpoint): fp4:45, about 7.5-8.5 min per job.
#   Checkpoints at 7B are sharded (--ckpt-format sharded; a full one is the fp32 state,
#   6.74B x 12 B = 81 GB, gathered to rank 0, hashed and written, ~2-3 min, and its resume has
#   EVERY rank torch.load the whole file: 8 x 81 GB > the 560 GiB of host memory). Sharded,
#   each rank writes its own ~10 GB (weights + AdamW moments of its FSDP shard) through
#   torch.distributed.checkpoint, in parallel, then hashes about one eighth of the files.
#   ESTIMATE, not measured: 81 GB at an aggregate 2-5 GB/s of local disk = 16-40 s, plus ~7 s
#   of SHA-256 (one ~10 GB file per rank at ~1.5 GB/s) = ~25-50 s per save, and about the same
#   per resume (verify, then each rank reads only its ~10 GB). Disk: a save keeps the old
#   checkpoint until the new one is complete, so ~162 GB at the peak of 235 GB (one run in
#   flight at a time; a finished run's checkpoint is deleted). bf16/fp8/torchao runs still fit
#   one job each and write no checkpoint (chunk 0).
# - 1.3B (1.36B params): 9.0 GFLOP/token; anchor 57.7k tokens/s on one H200 at batch 8 (52 %
#   MFU), so ~0.3 s per step at BATCH=8 per GPU, ~45 GiB per GPU. bf16/fp8/torchao: 220 steps
#   ~75 s + start/compile/evaluation ~2.5 min = ~4 min, so two runs per job, no checkpoint.
#   fp4: ~2 s per step, 220 steps do not fit one job: chunks of 110 steps (~4 min of steps +
#   ~3 min for start, compile, loading and saving the 16.4 GB checkpoint) = ~7 min each.
#   Whole 1.3B study: ~4 jobs, ~28 device minutes.
#   QAG=1 at 1.3B: fp4-dge trains at ~0.8x bf16 (train_e2e, docs/hopper.md), ~0.4 s per step,
#   so like the fp8 runs ~4 min each, no checkpoint; 6 runs, two per job: ~3 jobs, ~27 minutes.
#   ESTIMATE; the +qag runs' speed is what they measure. The all-gather bytes per step come
#   from the parameter shapes (scale_out.py allgather_bytes_per_step), not from a profiler.
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$SECONDS
MODEL="${MODEL:-1.3B}"
OUT="${OUT:-gpu_out}"
RUNS="${RUNS:-runs/scale_out}"
DATA="${DATA:-.carry/english.xz}"
SEQ="${SEQ:-2048}"
WARMUP="${WARMUP:-20}"
MEASURE="${MEASURE:-200}"
JOB_S="${JOB_S:-570}"
MAX_CHUNKS="${MAX_CHUNKS:-1000}"
EXTRA="${EXTRA:-}"
FAST="bf16,fp8-tensorwise,fp8-rowwise,torchao-float8-tensorwise"
QAG_STUDY="fp8-tensorwise,fp8-tensorwise+qag,fp8-rowwise,fp8-rowwise+qag,fp4-dge,fp4-dge+qag"
case "$MODEL" in
  7B) DEF_GPUS=8 DEF_BATCH=4 DEF_MIN_START=420 DEF_RECIPES="$FAST,fp4:45" DEF_CKPT=sharded ;;
  1.3B) DEF_GPUS=2 DEF_BATCH=8 DEF_MIN_START=240 DEF_RECIPES="$FAST,fp4:110" DEF_CKPT=full ;;
  *) DEF_GPUS=2 DEF_BATCH=8 DEF_MIN_START=120 DEF_RECIPES="$FAST,fp4" DEF_CKPT=full ;;
esac
[ -n "${QAG:-}" ] && DEF_RECIPES="$QAG_STUDY"
CKPT_FORMAT="${CKPT_FORMAT:-$DEF_CKPT}"
RECIPES="${RECIPES:-$DEF_RECIPES}"
NGPU="${NGPU:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}"
[ "$NGPU" -ge 2 ] 2>/dev/null || NGPU=$DEF_GPUS
BATCH="${BATCH:-$DEF_BATCH}"
MIN_START_S="${MIN_START_S:-$DEF_MIN_START}"
mkdir -p "$OUT" "$RUNS"
exec > >(tee -a "$OUT/scale_out_job.log") 2>&1
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# torchrun would set 1 thread per rank; the CPU-side model build and checkpoint work want more.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(($(nproc) / NGPU))}"
if [[ "$RECIPES" == *torchao* ]] && ls .whl/torchao-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/torchao-*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | sort | uniq -c
echo "$(date -u +%FT%TZ) MODEL=$MODEL RECIPES=$RECIPES NGPU=$NGPU BATCH=$BATCH SEQ=$SEQ" \
  "WARMUP=$WARMUP MEASURE=$MEASURE CKPT_FORMAT=$CKPT_FORMAT bash benchmarks/scale_out.sh" | tee -a "$RUNS/jobs.txt"

left() { echo $((JOB_S - (SECONDS - T0))); }
# Time to allow for a run's next chunk: its last chunk's wall time plus 30 s (interpreter start),
# or MIN_START_S before it has one.
need() {
  python3 - "$1/scale_out.jsonl" "$MIN_START_S" <<'PY'
import json, sys
from pathlib import Path
path, floor = Path(sys.argv[1]), int(sys.argv[2])
walls = [r["wall_s"] for r in map(json.loads, path.read_text().splitlines()) if r["event"] == "end"] if path.is_file() else []
print(max(floor, int(walls[-1]) + 30) if walls else floor)
PY
}
status=0
for spec in ${RECIPES//,/ }; do
  recipe="${spec%%:*}"  # NAME or NAME+qag: also the run directory's suffix (scale_out.py)
  chunk=$([ "$spec" = "$recipe" ] && echo 0 || echo "${spec#*:}")
  name="${recipe%+qag}"
  flags=(--chunk-steps "$chunk" --ckpt-format "$CKPT_FORMAT")
  [ "$chunk" = 0 ] && flags+=(--no-checkpoint)
  [ "$name" != "$recipe" ] && flags+=(--quantized-all-gather)
  dir="$RUNS/${MODEL}_${recipe}"
  for ((i = 0; i < MAX_CHUNKS; i++)); do
    [ -f "$dir/DONE" ] && break
    if [ "$(left)" -lt "$(need "$dir")" ]; then
      echo "scale_out.sh: $(left) s left < $(need "$dir") s needed; $recipe waits for the next job"
      break 2
    fi
    # Keep ~30 s for the report and the archive after the last chunk.
    timeout --kill-after=20 $(($(left) - 30)) torchrun --standalone --nproc-per-node "$NGPU" \
      benchmarks/scale_out.py run --model "$MODEL" --recipe "$name" --data "$DATA" \
      --seq-len "$SEQ" --batch-size "$BATCH" --warmup-steps "$WARMUP" \
      --measure-steps "$MEASURE" --runs "$RUNS" "${flags[@]}" $EXTRA
    rc=$?
    if [ $rc -ne 0 ]; then
      echo "scale_out.sh: $MODEL $recipe failed with rc=$rc (124: timed out)"; status=$rc
      break
    fi
  done
  if [ -f "$dir/DONE" ] && [ -z "${KEEP_CKPT:-}" ]; then
    rm -rf "$dir"/checkpoint*.pt "$dir"/checkpoint*.dcp  # 16-81 GB; a finished run needs none
  fi
done
python3 benchmarks/scale_out.py report --runs "$RUNS" --results-dir "$OUT" || status=1
tar czf "$OUT/scale_out_runs.tgz" --exclude='checkpoint*.pt' --exclude='.checkpoint.pt.*' \
  --exclude='checkpoint*.dcp' --exclude='.checkpoint.dcp.*' \
  --exclude='tensorboard' -C "$(dirname "$RUNS")" "$(basename "$RUNS")"
echo "scale_out.sh: job took $((SECONDS - T0)) s"
exit $status
