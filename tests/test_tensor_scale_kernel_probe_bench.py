"""benchmarks/tensor_scale_kernel_probe.py: a tensor-scaled recipe's GEMMs of one block in two
forms (one-element scales, and the same scales as vectors), which must compute one product."""

from __future__ import annotations

import pytest
import torch

from scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("tensor_scale_kernel_probe")


@pytest.mark.parametrize("recipe", ["fp8-tensorwise", "fp8-delayed"])
def test_both_forms_compute_one_product(bench, recipe):
    made = bench.forms(recipe, 64, "cpu")
    assert {e["gemm"] for e in made} == {"fprop", "dgrad", "wgrad"}
    assert sum(len(e["linears"]) for e in made) == 7 * 3
    for e in made:
        tensor, row = e["fns"]["tensor"](), e["fns"]["row"]()
        assert tensor.shape == row.shape == tuple(e["shape"][:2])
        assert tensor.dtype == bench.OUT_DTYPE[e["gemm"]]
        torch.testing.assert_close(tensor.float(), row.float(), rtol=1e-6, atol=1e-6)


def test_recipes_with_row_scales_are_refused(bench):
    with pytest.raises(SystemExit, match="not tensor-scaled"):
        bench.forms("fp8-rowwise", 64, "cpu")


def test_cpu_smoke_run(bench, capsys):
    bench.main(["--device", "cpu"])
    assert "both forms of every GEMM built" in capsys.readouterr().out


def test_report_sums_count_each_linear(bench):
    rec = {"recipe": "fp8-tensorwise", "gemm": "fprop", "shape": [8, 8, 8], "linears": ["q", "k"],
           "fmts": ["e4m3", "e4m3"], "fast_accum": True, "rel_diff": 0.0,
           "ms": {"tensor": 1.0, "row": 0.5}, "tflops": {"tensor": 1.0, "row": 2.0},
           "kernel": {"tensor": "kt", "row": "kr"}}  # fmt: skip
    body = bench._body([rec], 8)
    assert "- fp8-tensorwise fprop: 2.000 / 1.000 / 1.000" in body
    assert "- fp8-tensorwise dgrad: 0.000 / 0.000 / 0.000" in body
    assert "| fp8-tensorwise | fprop | [8, 8, 8] | q,k | e4m3xe4m3, True | 1.000 (1) |" in body
