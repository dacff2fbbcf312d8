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


def test_called_form_is_the_scaled_product(bench, monkeypatch):
    """The GEMM the probe times is (a·s_a)·(b·s_b)ᵀ of the operands it made (float32 reference)."""
    made = {}

    def spy(a, sa, b, sb, **kw):
        made.update(a=a, sa=sa, b=b, sb=sb)
        return real(a, sa, b, sb, **kw)

    real = bench.scaled_mm_rowish
    monkeypatch.setattr(bench, "scaled_mm_rowish", spy)
    got = bench.gemms("fp8-rowwise", 32, 48, 64, "cpu")["fprop"][0]().float()
    want = (made["a"].float() * made["sa"]) @ (made["b"].float() * made["sb"]).t()
    assert made["sa"].shape == (32, 1) and made["sb"].shape == (48, 1)  # row scales, both
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-1)


def test_the_cpu_smoke_run(bench, capsys):
    bench.main(["--device", "cpu", "--recipes", "fp8-tensorwise"])
    assert "every GEMM built and run once" in capsys.readouterr().out


@pytest.mark.parametrize("recipe", ["fp8-blockwise", "fp4", "nvfp4"])
def test_other_granularities_are_refused(bench, recipe):
    with pytest.raises(SystemExit, match="tensor- and row-scaled"):
        bench.gemms(recipe, 32, 48, 64, "cpu")
