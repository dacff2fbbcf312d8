"""benchmarks/train_profile.py runs the real trainer and writes its tables (CPU smoke run)."""

from __future__ import annotations

import json
from pathlib import Path

from scripts import load_benchmark


def test_profiles_every_recipe_and_writes_results(tmp_path: Path) -> None:
    module = load_benchmark("train_profile")
    args = ["--data", "stdlib", "--model", "tiny", "--recipes", "bf16,fp8-rowwise",
            "--batch-size", "2", "--seq-len", "32", "--warmup", "1", "--steps", "2",
            "--profile-steps", "1", "--device", "cpu", "--out-dir", str(tmp_path)]  # fmt: skip
    module.main(args)
    (js,) = tmp_path.glob("train_profile_*.json")
    records = json.loads(js.read_text())
    assert [r["recipe"] for r in records] == ["bf16", "fp8-rowwise"]
    assert all(r["tokens_per_s"] > 0 and r["step_ms"] > 0 for r in records)
    # --prepend continues an earlier call's file: its records come first.
    module.main([*args[:5], "fp4-direct", *args[6:], "--prepend", str(js)])
    records = json.loads(js.read_text())
    assert [r["recipe"] for r in records] == ["bf16", "fp8-rowwise", "fp4-direct"]
    assert "| fp4-direct |" in js.with_suffix(".md").read_text()
