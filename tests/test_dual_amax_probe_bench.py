"""benchmarks/dual_amax_probe.py: its reference is the quantizers' own maxima, its adversarial
inputs hold what the maxima must propagate, its bit comparison catches a differing maximum, and
its Triton kernel (both forms, in Triton's interpreter where installed) gives the same bits."""

from __future__ import annotations

import os

import pytest
import torch

from interpreter import interpreted
from minifloat.kernels.operand import _column_amax, row_amax
from scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("dual_amax_probe")


def test_reference_is_the_quantizers_maxima(bench):
    v = bench.inputs(300, 520, "cpu", adversarial=True)
    rows, cols = bench.reference(v)
    assert bench.same_maxima((rows, cols), (row_amax(v), _column_amax(v)))
    assert rows.shape == (300, 1) and cols.shape == (1, 520)
    assert rows[-1].isnan() and cols[0, -1].isnan()  # the NaN's row and column
    assert rows[3] == float("inf") and cols[0, 5] == float("inf")
    assert rows[1] == 0 and cols[0, 2] == 0  # the zeroed row and column
    assert rows[150] == cols[0, 173] == torch.tensor(-3.0e38).bfloat16().abs().float()


def test_bit_comparison_sees_one_differing_maximum(bench):
    v = bench.inputs(64, 96, "cpu", adversarial=False)
    rows, cols = bench.reference(v)
    other = cols.clone()
    other[0, 7] = torch.nextafter(other[0, 7], torch.tensor(1.0))
    assert bench.same_maxima((rows, cols), (rows, cols.clone()))
    assert not bench.same_maxima((rows, cols), (rows, other))


def test_cpu_smoke_run(bench, capsys):
    bench.main(["--device", "cpu"])
    interpreted = bench.triton is not None and os.environ.get("TRITON_INTERPRET") == "1"
    want = "kernel checked" if interpreted else "reference only"
    assert want in capsys.readouterr().out


@interpreted
@pytest.mark.parametrize("tile", [(32, 128, 4), (128, 64, 4, 1), (16, 32, 4, 1)])
def test_kernel_forms_in_the_interpreter(bench, tile):
    if bench.triton is None:
        pytest.skip("needs Triton")
    for adversarial in (False, True):
        v = bench.inputs(130, 300, "cpu", adversarial)
        assert bench.same_maxima(bench.dual_amax(v, tile), bench.reference(v))
