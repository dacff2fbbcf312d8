"""benchmarks/dge_step_size.py on a few CPU steps: same init and batches for every recipe, so the
first step's loss is the same under fp4-direct and fp4-dge (DGE acts only on dw), the later
ones are not, and the recorded update sizes and E2M1 flip fractions are proper fractions."""

from __future__ import annotations

import json
from pathlib import Path

from scripts import load_benchmark


def test_dge_changes_the_updates_not_the_first_forward(tmp_path: Path) -> None:
    bench = load_benchmark("dge_step_size")
    bench.main(["--recipes", "fp4-direct,fp4-dge", "--steps", "3", "--batch", "2", "--seq", "32",
                "--data-max-bytes", "300000", "--out-dir", str(tmp_path)])  # fmt: skip
    (records_file,) = tmp_path.glob("dge_step_size_*.json")
    records = json.loads(records_file.read_text())
    by = {(r["recipe"], r["step"]): r for r in records}
    assert len(records) == 6
    assert by["fp4-direct", 1]["loss"] == by["fp4-dge", 1]["loss"]
    assert by["fp4-direct", 3]["loss"] != by["fp4-dge", 3]["loss"]
    assert all(0 < r["rel_update"] < 1 and 0 <= r["flip_frac"] <= 1 for r in records)
    # AdamW moves every weight by about lr per step: in grid units, finite and positive
    assert all(0 < r["update_mid"] < 1e4 and 0 < r["update_grid"] < 1e4 for r in records)
    assert "| fp4-dge |" in next(tmp_path.glob("dge_step_size_*.md")).read_text()
