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


@pytest.mark.parametrize("recipe", ["fp4", "nvfp4", "mxfp4"])
def test_other_granularities_are_refused(bench, recipe):
    with pytest.raises(SystemExit, match="tensor- and row-scaled"):
        bench.gemms(recipe, 32, 48, 64, "cpu")


def test_blockwise_operands_carry_the_recipes_block_scales(bench, monkeypatch):
    """fp8-blockwise's forms (CUDA-only GEMMs, not run here): fprop and dgrad against a 128x128
    weight scale, wgrad two 1x128 tile scales, and the swapped fprop/dgrad through the 128x128
    lhs kernel with the operands exchanged."""
    calls = []
    monkeypatch.setattr(bench, "scaled_mm_blocks", lambda *a, **kw: calls.append(a) or a[0])
    monkeypatch.setattr(bench, "scaled_mm_blocks_lhs", lambda *a, **kw: calls.append(a) or a[0])
    m, n, k = 256, 384, 512
    made = bench.gemms("fp8-blockwise", m, n, k, "cpu")
    for gemm, (called, swapped) in made.items():
        calls.clear()
        called(), swapped()
        (a, sa, b, sb, *block), (b2, sb2, a2, sa2, *_) = calls
        rows_a, rows_b, kc = bench.DIMS[gemm](m, n, k)
        assert a.shape == (rows_a, kc) and sa.shape == (rows_a, kc // 128)
        want_b = (rows_b, kc // 128) if gemm == "wgrad" else (rows_b // 128, kc // 128)
        assert b.shape == (rows_b, kc) and sb.shape == want_b
        assert block == [(1, 128) if gemm == "wgrad" else (128, 128)]
        assert b2 is b and a2 is a and sb2 is sb and sa2 is sa
