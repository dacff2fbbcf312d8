"""benchmarks/tunable_gemm_probe.py on the CPU: every GEMM of one block is built for each recipe
(the timing and TunableOp's tuning run on CUDA only)."""

from __future__ import annotations

import pytest

from scripts import load_benchmark


@pytest.mark.parametrize(("recipes", "gemms"), [("fp8-blockwise", 21), ("fp8-blockwise,bf16", 42)])
def test_cpu_smoke_run_builds_every_gemm(capsys, recipes, gemms):
    load_benchmark("tunable_gemm_probe").main(["--device", "cpu", "--recipes", recipes])
    assert f"cpu smoke run: {gemms} GEMMs built" in capsys.readouterr().out


def test_unknown_granularities_are_refused():
    with pytest.raises(SystemExit, match="tensor- and row-scaled"):
        load_benchmark("tunable_gemm_probe").main(["--device", "cpu", "--recipes", "fp4"])
