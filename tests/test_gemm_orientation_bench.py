"""benchmarks/gemm_orientation.py: each GEMM of one block in the recipe's operand formats, as
called and with its operands swapped, computes the same product."""

from __future__ import annotations

import pytest
import torch

from scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("gemm_orientation")


@pytest.mark.parametrize("recipe", ["bf16", "fp8-tensorwise", "fp8-rowwise", "fp4-dge"])
def test_swapped_form_is_the_same_product(bench, recipe):
    m, n, k = 32, 48, 64
    made = bench.gemms(recipe, m, n, k, "cpu")
    assert sorted(made) == ["dgrad", "fprop", "wgrad"]
    for gemm, (called, swapped) in made.items():
        a, b = called(), swapped()
        rows_a, rows_b, _ = bench.DIMS[gemm](m, n, k)
        assert a.shape == b.shape == (rows_a, rows_b)
        assert b.stride() == (1, rows_a)  # the transposed view of the swapped GEMM's output
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2)


def test_the_cpu_smoke_run(bench, capsys):
    bench.main(["--device", "cpu", "--recipes", "fp8-tensorwise"])
    assert "every GEMM built and run once" in capsys.readouterr().out
