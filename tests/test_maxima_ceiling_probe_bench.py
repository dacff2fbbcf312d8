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


def test_table_takes_the_best_exact_tiling_and_first_stage_width_against_inductor():
    records = [
        _rec("row", "inductor (row_amax)", 0.70),
        _rec("row", "triton rows=1 cols=1024 warps=4", 0.80),
        _rec("row", "triton rows=2 cols=1024 warps=4", 0.95, exact=False),  # not counted
        _rec("col", "inductor (_column_amax of x*s)", 0.60),
        _rec("col", "triton band=256 rows=32 cols=128 warps=4", 0.40),
        _rec("row", "inductor partials=512", 0.75),
        _rec("row", "inductor no partials", 0.72),
        _rec("col", "inductor partials=1024", 0.99, exact=False),  # not counted
    ]
    text = probe.table(records, 4000.0)
    assert "| 8x8 | row | 70% | 75% (partials=512) | 80% |" in text
    assert "| 8x8 | col | 60% | — | 40% |" in text
    assert "| **no** |" in text  # the inexact tiling is shown as such


def test_without_a_gpu_it_exits_with_a_message(monkeypatch):
    monkeypatch.setattr(probe.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["maxima_ceiling_probe.py"])
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        probe.main()


def test_other_first_stage_widths_give_the_quantizers_maxima(monkeypatch):
    """Each swept width of inductor's two-stage maxima (and no partials) is rated only if it
    computes the default's maxima bit for bit, and a width that does not divide the reduced dim
    (which would run the no-partials code) is skipped; compiled on the CPU, timings stubbed."""
    import torch

    monkeypatch.setattr(probe, "PARTIALS", (128, 256, 0))  # 384 columns: 256 falls back
    monkeypatch.setattr(probe, "_bench", lambda fn: fn() is not None and 1.0)
    monkeypatch.setattr(probe, "same_size_copy_us", lambda gb, copies: 1.0)
    x = torch.randn(512, 384).bfloat16()
    x[7, 300] = -float("inf")
    s = torch.rand(512, 1) + 0.5
    want_row = probe.operand.row_amax(x).view(-1)
    want_col = probe._prescaled_column_amax(x, s).view(-1)
    records = probe._partial_records("512x384", x, s, want_row, want_col, (1, 1), 4000.0, {})
    assert [(r["kind"], r["form"]) for r in records] == [
        ("row", "inductor partials=128"), ("col", "inductor partials=128"),
        ("col", "inductor partials=256"),
        ("row", "inductor no partials"), ("col", "inductor no partials"),
    ]  # fmt: skip
    assert all(r["exact"] for r in records)
    skewed = probe._partial_records("512x384", x, s, want_row * 2, want_col, (1, 1), 4000.0, {})
    assert [r["exact"] for r in skewed] == [False, True, True, False, True]
