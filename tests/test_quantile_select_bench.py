"""benchmarks/quantile_select.py: its data kinds hold what they are named for, its comparison
sees one differing bit (and only ignores a zero's sign and NaN against NaN), and without a GPU
it exits with a one-line message."""

from __future__ import annotations

import pytest
import torch

from scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("quantile_select")


def test_inputs_hold_their_kinds(bench):
    data = bench.inputs(4096, "cpu")
    assert set(data) == {"heavy", "ties", "bf16", "nonfinite"}
    assert all(x.shape == (4096,) and x.dtype == torch.float32 for x in data.values())
    assert data["heavy"].abs().max() > 20 * data["heavy"].abs().median()  # outliers
    assert data["ties"].unique().numel() < 4096 // 10
    assert torch.equal(data["bf16"], data["bf16"].bfloat16().float())
    held = bench.inputs(4096, "cpu", torch.bfloat16)
    assert all(x.dtype == torch.bfloat16 for x in held.values())
    bad = data["nonfinite"]
    assert bad.isnan().any() and (bad == float("inf")).any() and (bad == float("-inf")).any()


def test_comparison_sees_one_bit(bench):
    a = torch.tensor([-2.5, 0.0, 3.0])
    assert bench.same_up_to_zero_sign(a, torch.tensor([-2.5, -0.0, 3.0]))
    assert not bench.same_up_to_zero_sign(a, torch.tensor([2.5, 0.0, 3.0]))  # a sign
    assert not bench.same_up_to_zero_sign(a, torch.tensor([-2.5, 0.0, torch.nextafter(a[2], a[0])]))
    nan = torch.tensor([float("nan")] * 2)
    assert bench.same_up_to_zero_sign(nan, -nan)
    assert not bench.same_up_to_zero_sign(nan, torch.tensor([float("nan"), 1.0]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU exit")
def test_exits_without_a_gpu(bench, monkeypatch):
    monkeypatch.setattr("sys.argv", ["quantile_select.py"])
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main()
