"""benchmarks/seed_summary.py: gaps over seeds, the paired gain of a switched run, the targets."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from types import ModuleType

import pytest

from scripts import load_benchmark


@pytest.fixture(scope="module")
def summary() -> ModuleType:
    return load_benchmark("seed_summary")


def _report(path: Path, losses: dict[str, float]) -> Path:
    """A convergence_report-shaped JSON: records in order, bf16 (the reference) first."""
    ref = losses["bf16"]
    records = [{"recipe": k, "val_loss": v, "gap_pct": 100.0 * (v / ref - 1.0)}
               for k, v in losses.items()]  # fmt: skip
    path.write_text(json.dumps(records))
    return path


def test_gaps_over_seeds_paired_gain_and_targets(tmp_path: Path, summary: ModuleType) -> None:
    seeds = [
        {"bf16": 2.50, "fp8-tensorwise": 2.51, "fp4": 2.52, "fp4+switch=bf16+at=0.9": 2.49},
        {"bf16": 2.40, "fp4": 2.46, "fp4+switch=bf16+at=0.9": 2.42},
    ]
    paths = [_report(tmp_path / f"s{i}.json", s) for i, s in enumerate(seeds)]
    rows = {r["recipe"]: r for r in summary.main([*map(str, paths), "--name", "x",
                                                  "--out-dir", str(tmp_path / "out")])}  # fmt: skip
    fp4 = [100 * (2.52 / 2.50 - 1), 100 * (2.46 / 2.40 - 1)]
    assert rows["fp4"]["gaps_pct"] == pytest.approx(fp4)
    assert rows["fp4"]["mean_gap_pct"] == pytest.approx(statistics.fmean(fp4))
    assert rows["fp4"]["std_gap_pct"] == pytest.approx(statistics.stdev(fp4))
    assert rows["fp4"]["meets_target"] is False  # 0.8 % and 2.5 %: mean 1.65 % > 1.5 %
    assert rows["fp4+switch=bf16+at=0.9"]["meets_target"] is True  # -0.4 %, +0.83 %: mean 0.22 %
    # A seed without the run is left out, not counted as zero.
    fp8 = rows["fp8-tensorwise"]
    assert fp8["gaps_pct"][1] is None and fp8["seeds"] == 1 and fp8["std_gap_pct"] is None
    assert fp8["meets_target"] is False  # 0.4 % against 0.3 %
    sw = rows["fp4+switch=bf16+at=0.9"]
    assert sw["target_pct"] == 0.5 and sw["vs_plain_pct"] == pytest.approx(
        [100 * (2.49 / 2.52 - 1), 100 * (2.42 / 2.46 - 1)])  # fmt: skip
    text = (tmp_path / "out" / "x.md").read_text()
    assert "| fp4 |" in text and "paired per seed" in text and "(2.4000)" in text


def test_missing_report_is_one_line_error(tmp_path: Path, summary: ModuleType) -> None:
    with pytest.raises(SystemExit):
        summary.main([str(tmp_path / "nope.json"), "--name", "x"])
