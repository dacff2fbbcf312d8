#!/usr/bin/env bash
# The GPU machine's driver (H100/H200; torch, triton and transformers preinstalled): run the named
# stages in order, logs and results to $OUT (default ./gpu_out). torchao, for the comparison rows,
# is installed from the wheels in .whl/ if that folder exists (see shared/ANCHORS.md).
#
#   bash benchmarks/gpu_all.sh tests kernels linear e2e-1.3B e2e-125M e2e-hf
#
# Stages: tests (pytest -m gpu, six xdist workers if installed; tests-blocks and tests-rest split
# it in two: the model-width block tests, then the rest, for device calls with a 600 s limit:
# the whole suite took 390 s in session 49 and ~585 s on a fresh machine in session 50),
# kernels (benchmarks/quantizer_bandwidth.py),
# linear (one layer, compiled, 7B shapes), e2e-1.3B / e2e-125M / e2e-hf (benchmarks/train_e2e.py),
# optim (optimizer step time, benchmarks/optim_states.py --step-time), gradcomm (the fp8 gradient
# all-reduce's passes per bucket, eager vs compiled, benchmarks/grad_comm_codec.py; one GPU).
# Extra arguments for a stage's script follow it after "--" up to the next stage name, e.g.
#   bash benchmarks/gpu_all.sh e2e-1.3B -- --rows bf16,fp8-tensorwise --profile fp8-tensorwise
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_out}"
mkdir -p "$OUT"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt"
status=0
run_stage() {
  local stage=$1; shift
  case "$stage" in
    tests|tests-blocks|tests-rest)
           # workers share the GPU where pytest-xdist is installed: the 190 tests took 302 s
           # with four on an H200 (session 28), 256 took 441 s (session 41) and ~260 more than
           # 480 s (session 42), so six now (16 cores; each test mostly compiles on the CPU)
           local workers=(); python3 -c "import xdist" 2>/dev/null && workers=(-n 6)
           local blocks=tests/test_hopper_block.py targets=(tests)
           [ "$stage" = tests-blocks ] && targets=("$blocks")
           [ "$stage" = tests-rest ] && targets=(tests "--ignore=$blocks")
           python3 -m pytest -m gpu -q -p no:cacheprovider ${workers[@]+"${workers[@]}"} \
             --durations=10 "${targets[@]}" "$@" \
             2>&1 | tee "$OUT/pytest_gpu${stage#tests}.log" | tail -40 ;;
    kernels) python3 benchmarks/quantizer_bandwidth.py --out-dir "$OUT" "$@" 2>&1 | tail -60 ;;
    linear) python3 benchmarks/linear.py --out-dir "$OUT" --compile --shapes 7b "$@" \
              2>&1 | tail -60 ;;
    e2e-1.3B) python3 benchmarks/train_e2e.py --model 1.3B --out-dir "$OUT" "$@" 2>&1 | tail -60 ;;
    e2e-125M) python3 benchmarks/train_e2e.py --model 125M --out-dir "$OUT" "$@" 2>&1 | tail -60 ;;
    e2e-hf) python3 benchmarks/train_e2e.py --model 1.3B --impl hf --out-dir "$OUT" "$@" \
              2>&1 | tail -60 ;;
    optim) python3 benchmarks/optim_states.py --step-time --device cuda --fused --fused-inductor --unfused \
             --out "$OUT" "$@" 2>&1 | tail -30 ;;
    gradcomm) python3 benchmarks/grad_comm_codec.py --out "$OUT" "$@" 2>&1 | tail -30 ;;
    *) echo "unknown stage $stage"; return 2 ;;
  esac
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || status=$rc
}
while [ $# -gt 0 ]; do
  stage=$1; shift; args=()
  if [ "${1:-}" = "--" ]; then
    shift
    while [ $# -gt 0 ] && ! [[ "$1" =~ ^(tests(-blocks|-rest)?|kernels|linear|optim|gradcomm|e2e-.*)$ ]]; do args+=("$1"); shift; done
  fi
  echo "=== $stage ${args[*]:-}"
  run_stage "$stage" "${args[@]}"
done
exit "$status"
