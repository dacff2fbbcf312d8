"""benchmarks/step_gemms.py: one step's linear GEMMs are the model's (their weights are the
blocks' linear parameters), every set runs on the CPU, and a row's bound swaps bf16's GEMMs for
the recipe's in bf16's step."""

from __future__ import annotations

import json

import pytest

from minifloat.models.llama import get_config
from scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("step_gemms")


@pytest.mark.parametrize("model", ["tiny", "1.3B", "7B"])
def test_linear_shapes_are_the_blocks_weights(bench, model):
    cfg = get_config(model)
    shapes = bench.linear_shapes(model)
    assert len(shapes) == 7
    assert sum(n * k for _, n, k in shapes) == cfg.layer_params() - 2 * cfg.dim  # minus norms


def test_bounds_swap_gemms_in_bf16s_step(bench):
    gemms = [{"set": "bf16", "ms": 170.0}, {"set": "fp8-tensorwise", "ms": 100.0}]
    steps = [{"recipe": "bf16", "step_ms": 270.0},
             {"recipe": "fp8-tensorwise", "step_ms": 220.0},
             {"recipe": "torchao-tensorwise", "step_ms": 230.0},
             {"recipe": "fp4", "error": "RuntimeError: x"}]  # fmt: skip
    found = {b["recipe"]: b for b in bench.bounds(gemms, steps)}
    assert sorted(found) == ["bf16", "fp8-tensorwise"]  # no GEMM set for torchao, errors skipped
    fp8 = found["fp8-tensorwise"]
    assert fp8["bound_ms"] == 200.0 and fp8["overhead_ms"] == 20.0
    assert fp8["bound"] == pytest.approx(270 / 200)
    assert fp8["measured_speedup"] == pytest.approx(270 / 220)
    assert found["bf16"]["bound"] == 1.0 and found["bf16"]["overhead_ms"] == 0.0


def test_every_set_runs_on_cpu(bench, tmp_path):
    bench.main(["--device", "cpu", "--out-dir", str(tmp_path), "--date", "2026-01-01"])
    records = json.loads(next(tmp_path.glob("step_gemms_tiny_*.json")).read_text())
    assert [r["set"] for r in records] == list(bench.SETS)
    assert all(r["tokens"] == 64 and r["ms"] is None for r in records)
