"""Tests for minifloat.train.schedule: warm-up then cosine decay to a floor."""

from __future__ import annotations

import math

import pytest

from minifloat.train.schedule import lr_at, warmup_steps


def test_warmup_rises_linearly_to_peak() -> None:
    kw = {"total_steps": 100, "peak_lr": 1e-3, "warmup_fraction": 0.05, "min_lr_ratio": 0.1}
    assert warmup_steps(100, 0.05) == 5
    # float64 closed forms, here and below: pytest.approx's default rel=1e-6 is rounding only
    assert [lr_at(s, **kw) for s in range(5)] == pytest.approx([2e-4, 4e-4, 6e-4, 8e-4, 1e-3])


def test_cosine_reaches_ten_percent_at_the_end() -> None:
    kw = {"total_steps": 100, "peak_lr": 1e-3, "warmup_fraction": 0.05, "min_lr_ratio": 0.1}
    assert lr_at(5, **kw) == pytest.approx(1e-3)
    assert lr_at(99, **kw) == pytest.approx(1e-4)
    midpoint = 5 + (99 - 5) / 2
    assert lr_at(int(midpoint), **kw) == pytest.approx(
        1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * (int(midpoint) - 5) / 94))
    )
    values = [lr_at(s, **kw) for s in range(5, 100)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))


def test_no_warmup_and_degenerate_lengths() -> None:
    assert lr_at(0, total_steps=10, peak_lr=1.0, warmup_fraction=0.0) == 1.0
    assert lr_at(0, total_steps=1, peak_lr=1.0) == 1.0
    with pytest.raises(ValueError):
        lr_at(0, total_steps=0, peak_lr=1.0)
