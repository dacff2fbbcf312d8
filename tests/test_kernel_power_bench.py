"""benchmarks/kernel_power.py: every workload runs on the CPU (smoke), the float32 cast it
uses as a power reference is a real E4M3 cast of the same tensor (values within one E4M3 step
of minifloat's float64-quotient cast), and the exact quotients it compares (FMA, bfloat16
table) give the float64 quotient's bits."""

from __future__ import annotations

import json

import pytest
import torch

from bits import bits_equal
from minifloat.exact import div_rn
from minifloat.kernels.operand import quantize_operand
from scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("kernel_power")


def test_every_workload_runs_on_cpu(bench, tmp_path):
    bench.main(["--device", "cpu", "--out-dir", str(tmp_path), "--date", "2026-01-01"])
    records = json.loads(next(tmp_path.glob("kernel_power_cpu_*.json")).read_text())
    assert [r["workload"] for r in records] == [
        "copy", "amax", "cast_f64", "cast_f32", "given_f64", "given_fma", "given_bf16",
        "given_mul",
        "gemm_fp8", "gemm_bf16"]  # fmt: skip


def test_float32_cast_is_an_e4m3_cast_of_the_same_values(bench):
    x = torch.randn(256, 384, generator=torch.Generator().manual_seed(0)).bfloat16()
    q32, scale = bench._cast_f32(x)
    q64, s64 = quantize_operand(x, "e4m3", "tensor")
    assert q32.dtype == q64.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(1 / scale, s64.reshape(()), rtol=1e-6, atol=0)
    a, b = q32.float(), q64.float()
    assert ((a - b).abs() <= a.abs().clamp_min(2**-6) / 8).all()  # at most one E4M3 step


def test_given_scale_casts_fma_equals_float64_compiled(bench):
    """Markstein's FMA quotient and the bfloat16 table's are exact: compiled, their E4M3 bytes
    equal the float64 quotient's (and `quantize_operand`'s), so the power of the three forms
    compares the same result."""
    x = torch.randn(512, 768, generator=torch.Generator().manual_seed(0)).bfloat16()
    x[0, :8] = torch.tensor([3.0, -7.5, 1e-8, 0.0, 448.0, -1.0, 2**-9, 100.0]).bfloat16()
    want, scale = quantize_operand(x, "e4m3", "tensor")
    cast = torch.compile(bench.cast_given)
    f64 = cast(x, scale, "f64")
    fma = cast(x, scale, "fma", bench.fma_factors(scale))
    assert torch.equal(f64.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(fma.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(cast(x, scale, "bf16").view(torch.uint8), want.view(torch.uint8))


def _scales() -> list[torch.Tensor]:
    """[1, 1] scales over float32's range: subnormal, extreme, near powers of two, amax-derived
    (448, 57344, 6), zero, inf, NaN and negative ones."""
    gen = torch.Generator().manual_seed(2)
    spread = torch.rand(120, generator=gen) * torch.exp2(
        torch.randint(-149, 127, (120,), generator=gen).float()
    )
    fixed = [
        1.0, 2.0**-149, 1e-40, 2.0**-126, 3.4028235e38, 2.0**127, 1.9999999, 1.0000001,
        1 / 448, 1 / 57344, 1 / 6, 3.0 / 448, 0.0, float("inf"), float("nan"), -3.0, -1e-40,
    ]  # fmt: skip
    return [torch.tensor([[v]]) for v in fixed + spread.tolist()]


def test_bf16_table_quotient_equals_div_rn_for_every_bfloat16(bench):
    """Every bfloat16 numerator (zeros, subnormals, inf, NaNs) against ~140 scales, eager and
    compiled on the CPU: `div_rn`'s bits wherever they are a normal float32 (the correctly
    rounded quotient), inf on overflow, and a zero of the same sign at or below the smallest
    normal, which every grid rounds to zero too."""
    a = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    a = a.view(torch.bfloat16).reshape(256, 256)
    compiled = torch.compile(bench.div_table_bf16, fullgraph=True)
    tiny = torch.finfo(torch.float32).tiny
    for s in _scales():
        want, got = div_rn(a.float(), s), bench.div_table_bf16(a, s)
        same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
        zeroed = (want.abs() <= tiny) & (got == 0) & (got.signbit() == want.signbit())
        assert bool((same | zeroed).all()), s.item()
        assert bits_equal(compiled(a, s), got), s.item()
