"""Tests for minifloat.train.compare: several recipes, one plot, one table, one JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minifloat.train.compare import compare
from minifloat.train.config import ConfigError, TrainConfig


def _config(tmp_path: Path, **changes) -> TrainConfig:
    return TrainConfig(
        model="tiny",
        model_overrides={"dim": 32, "n_layers": 1, "n_heads": 2, "ffn_dim": 64},
        data="stdlib",
        tokenizer="byte",
        data_max_bytes=300_000,
        cache_dir=str(tmp_path / "cache"),
        device="cpu",
        **changes,
    )


def test_compare_writes_plot_table_and_json(tmp_path: Path) -> None:
    config = _config(tmp_path, steps=6, batch_size=4, seq_len=32, eval_every=3, eval_batches=2)
    result = compare(["fp32", "bf16"], config, out_dir=tmp_path / "out", progress=False)
    assert result.plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = result.markdown_path.read_text()
    assert "| fp32 |" in table and "| bf16 |" in table and "gap vs fp32" in table
    summary = json.loads(result.json_path.read_text())
    rows = {row["recipe"]: row for row in summary["results"]}
    assert rows["fp32"]["val_gap_percent"] == 0.0
    # val_gap_percent is computed from these two numbers in float64: pytest.approx's rel=1e-6
    assert rows["bf16"]["final_val_loss"] == pytest.approx(
        rows["fp32"]["final_val_loss"] * (1 + rows["bf16"]["val_gap_percent"] / 100)
    )
    assert len(summary["losses"]["bf16"]) == 6
    # Same data, seed and batches: the first step's loss agrees to bf16 accuracy (2^-8 relative
    # per rounding; measured 4e-6 relative).
    assert summary["losses"]["bf16"][0] == pytest.approx(summary["losses"]["fp32"][0], rel=1e-2)
    assert not (tmp_path / "out" / "fp32" / "checkpoint.pt").exists()


def test_compare_rejects_unknown_recipe_before_training(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown recipe"):
        compare(["bf16", "fp5"], TrainConfig(), out_dir=tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_compare_runs_recipe_variants_by_name(tmp_path: Path) -> None:
    names = ["fp4-direct", "fp4-direct:scaling=tensor", "fp4-direct:dge.k=3"]
    config = _config(tmp_path, steps=4, batch_size=2, seq_len=32, eval_every=0, eval_batches=1,
                     sqnr_every=4)  # fmt: skip
    result = compare(names, config, out_dir=tmp_path / "out", progress=False)
    assert [r.recipe for r in result.results] == names
    for name in names:  # one run directory per variant, named by the full string
        lines = (tmp_path / "out" / name / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(x) for x in lines]
        sqnr = [r["layer_sqnr"] for r in records if "layer_sqnr" in r]
        assert len(sqnr) == 1 and len(sqnr[0]) == 7
    # Per-tensor scaling of the FP4 operands loses signal against per-row scaling.
    last = {n: json.loads((tmp_path / "out" / n / "metrics.jsonl").read_text().splitlines()[-1])
            for n in names[:2]}  # fmt: skip
    row, tensor = (last[n]["layer_sqnr"]["layers.0.attention.wq"]["weight"] for n in names[:2])
    assert tensor < row
    # DGE changes the trajectory but not the first forward.
    losses = {r.recipe: r.losses for r in result.results}
    assert losses[names[2]][0] == losses[names[0]][0] and losses[names[2]] != losses[names[0]]


def test_compare_rejects_a_recipe_named_twice(tmp_path: Path) -> None:
    """`compare bf16,bf16` trained twice into one directory; now refused before any work."""
    with pytest.raises(ConfigError, match="recipe bf16 is named more than once"):
        compare(["bf16", "fp32", "bf16"], TrainConfig(), out_dir=tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_compare_takes_a_list_not_a_string(tmp_path: Path) -> None:
    """A string was iterated: "bf16,fp4" became the recipes 'b', 'f', ... ("unknown recipe 'b'")."""
    with pytest.raises(
        ConfigError, match=r"compare takes a list of recipes, e.g. \['bf16', 'fp4'\]"
    ):
        compare("bf16,fp4", _config(tmp_path), out_dir=tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_compare_warns_that_it_ignores_resume(tmp_path: Path) -> None:
    """A base config with resume=True was silently trained from scratch; now it says so."""
    config = _config(tmp_path, steps=2, batch_size=2, seq_len=16, eval_every=0, eval_batches=1,
                     resume=True)  # fmt: skip
    with pytest.warns(UserWarning, match="base.resume=True is ignored"):
        result = compare(["fp32"], config, out_dir=tmp_path / "out", progress=False)
    assert result.results[0].steps == 2
    assert json.loads(result.json_path.read_text())["config"]["resume"] is False
