# minifloat — `make demo` runs the main job, `make test` the CPU suite (what CI runs).
# Both build .venv from scratch on a machine with only Python >= 3.11 and pip.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# CPU machines take the local CPU wheel; a bare `torch` requirement would pull a CUDA build.
TORCH_SPEC ?= torch==2.13.0

# Triton for its interpreter (`interpret-test`): CPU torch brings none, and the main suite needs none
TRITON_SPEC ?= triton==3.6.0
TRITON_DIR := .triton

.PHONY: demo test interpret-test lint format gpu-test bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[train,dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -c "from minifloat.sqnr import main; main()"
	$(BIN)/minifloat compare --recipes bf16,fp8-tensorwise,fp4 --model tiny --data stdlib --steps 150 --out runs/demo --overwrite

# Two xdist workers, each test module on one of them (module fixtures run once): the suite is
# mostly compilation and subprocesses. Session 88, 2 cores: 1254 s with a warm inductor cache
# (~2450 s of tests), 2868 s with a mostly cold one, as on a fresh CI machine (CI: 986-2151 s
# over the last six runs). The 15 slowest tests are listed at the end, to keep the suite's
# ~20-minute budget in view.
test: $(STAMP) lint
	$(BIN)/python -m pytest -q -m "not gpu" -n 2 --dist loadscope --durations=15
	$(MAKE) --no-print-directory interpret-test

# The library's Triton kernels on the CPU, in Triton's interpreter (tests marked `interpret`,
# ~1 min): indexing, masks, reductions and stores as on the GPU, on inputs that need no rounding
# (tests/interpreter.py). Triton goes into .triton beside the venv, on this run's path only, so
# that the suite above sees the packages it always had.
$(TRITON_DIR)/.stamp:
	$(BIN)/pip install -q --no-deps --target $(TRITON_DIR) "$(TRITON_SPEC)"
	touch $@

interpret-test: $(STAMP) $(TRITON_DIR)/.stamp
	TRITON_INTERPRET=1 PYTHONPATH=$(TRITON_DIR) $(BIN)/python -m pytest -q -m interpret -n 2

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

format: $(STAMP)
	$(BIN)/ruff check --fix src tests benchmarks
	$(BIN)/ruff format src tests benchmarks

# On the GPU machine (torch and triton preinstalled there): CUDA tests, then the benchmarks.
gpu-test:
	PYTHONPATH=src $(PYTHON) -m pytest -q -m gpu tests

bench:
	bash benchmarks/gpu_all.sh tests kernels linear e2e-1.3B

clean:
	rm -rf $(VENV) $(TRITON_DIR) runs .pytest_cache .ruff_cache
