#!/usr/bin/env bash
# One command for the GPU machine (H100/H200, torch + triton preinstalled): the GPU tests, then the
# kernel probes and the linear-layer benchmark. Logs and results go to $OUT (default: ./gpu_out).
#
#   bash benchmarks/gpu_all.sh            # everything
#   SKIP_TESTS=1 bash benchmarks/gpu_all.sh
#   BENCH_ARGS="--shapes 7b" bash benchmarks/gpu_all.sh
#   SKIP_TESTS=1 SKIP_EAGER=1 bash benchmarks/gpu_all.sh    # compiled layer benchmark only
#
# torchao (for the comparison rows) is installed from wheels in .whl/ if that folder exists.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_out}"
mkdir -p "$OUT"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
status=0
if [ -z "${SKIP_TESTS:-}" ]; then
  python3 -m pytest -m gpu -q -p no:cacheprovider --durations=15 tests 2>&1 | tee "$OUT/pytest_gpu.log"
  status=${PIPESTATUS[0]}
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  python3 benchmarks/kernels.py 2>&1 | tee "$OUT/kernels.log"
  [ -z "${SKIP_EAGER:-}" ] && python3 benchmarks/linear.py --out-dir "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/linear.log"
  # Every layer compiled (the fair torchao comparison; host overhead removed), 7B shapes only.
  python3 benchmarks/linear.py --out-dir "$OUT" --compile --shapes 7b 2>&1 | tee "$OUT/linear_compiled.log"
fi
exit "$status"
