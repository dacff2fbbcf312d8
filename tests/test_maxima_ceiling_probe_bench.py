"""benchmarks/maxima_ceiling_probe.py without a GPU: its table names the best bit-exact Triton
tiling per shape and maxima kind, and the probe refuses to run without CUDA (the timings and
the Triton kernels need one; results: maxima_ceiling_probe_*_<gpu>_<date>.md)."""

from __future__ import annotations

import sys

import pytest

from scripts import load_benchmark

probe = load_benchmark("maxima_ceiling_probe")


def _rec(kind: str, form: str, frac: float, exact: bool = True) -> dict:
    return dict(shape="8x8", kind=kind, form=form, us=1.0, gb=0.1, frac_of_copy=frac,
                frac_of_same_copy=frac, exact=exact)  # fmt: skip


def test_table_takes_the_best_exact_tiling_against_inductor():
    records = [
        _rec("row", "inductor (row_amax)", 0.70),
        _rec("row", "triton rows=1 cols=1024 warps=4", 0.80),
        _rec("row", "triton rows=2 cols=1024 warps=4", 0.95, exact=False),  # not counted
        _rec("col", "inductor (_column_amax of x*s)", 0.60),
        _rec("col", "triton band=256 rows=32 cols=128 warps=4", 0.40),
    ]
    text = probe.table(records, 4000.0)
    assert "| 8x8 | row | 70% | 80% |" in text and "| 8x8 | col | 60% | 40% |" in text
    assert "| **no** |" in text  # the inexact tiling is shown as such


def test_without_a_gpu_it_exits_with_a_message(monkeypatch):
    monkeypatch.setattr(probe.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["maxima_ceiling_probe.py"])
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        probe.main()
