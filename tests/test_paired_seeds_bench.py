"""benchmarks/paired_seeds.py: each run's validation-loss gap to the reference of its own seed."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import paired_seeds  # noqa: E402


def _write(root: Path, seed: int, run: str, val: dict[int, float]) -> None:
    run_dir = root / f"seed{seed}" / run
    run_dir.mkdir(parents=True)
    lines = [{"step": 50, "loss": 9.0}]  # a train-only record: skipped
    lines += [{"step": s, "loss": 9.0, "val_loss": v} for s, v in val.items()]
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")


def test_gaps_pair_each_run_with_its_own_seeds_reference(tmp_path):
    _write(tmp_path, 0, "ref", {100: 4.0, 200: 3.0})
    _write(tmp_path, 0, "ref:v=on", {100: 4.04, 200: 2.97})
    _write(tmp_path, 1, "ref", {100: 5.0, 200: 2.0})
    _write(tmp_path, 1, "ref:v=on", {100: 5.0, 200: 2.02, 300: 1.0})  # 300: no reference
    records = paired_seeds.paired_gaps(tmp_path, "ref")
    assert [(r["seed"], r["run"], r["final_step"]) for r in records] == [
        (0, "ref:v=on", 200), (1, "ref:v=on", 200),
    ]  # fmt: skip
    assert records[0]["gaps_pct"] == pytest.approx({100: 1.0, 200: -1.0})
    assert records[1]["final_gap_pct"] == pytest.approx(1.0)
    (row,) = paired_seeds.summary(records)
    assert row["mean_pct"] == pytest.approx(0.0) and row["std_pct"] == pytest.approx(2**0.5)
    assert row["se_pct"] == pytest.approx(1.0) and row["t"] == pytest.approx(0.0)
    text = paired_seeds.markdown(records, [row], "ref")
    assert "| ref:v=on | 0 | 2.9700 (3.0000) | 100: +1.00, 200: -1.00 | -1.00 % |" in text
    assert "| ref:v=on | -1.00, +1.00 | +0.00 % | 1.41 % | 1.00 % | +0.0 (1) |" in text


def test_folders_pool_their_seeds_sorted_by_run_then_seed(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    # the second folder holds the lowest seed: pooling sorts, it does not concatenate
    for root, seed, gap_val in ((first, 1, 3.06), (first, 2, 3.09), (second, 0, 3.03)):
        _write(root, seed, "ref", {100: 3.0})
        _write(root, seed, "ref:v=on", {100: gap_val})
        _write(root, seed, "ref:a=on", {100: 3.3})
    records = paired_seeds.pooled_gaps([first, second], "ref")
    assert [(r["run"], r["seed"]) for r in records] == [
        ("ref:a=on", 0), ("ref:a=on", 1), ("ref:a=on", 2),
        ("ref:v=on", 0), ("ref:v=on", 1), ("ref:v=on", 2),
    ]  # fmt: skip
    same, varied = paired_seeds.summary(records)
    assert varied["final_gaps_pct"] == pytest.approx([1.0, 2.0, 3.0])
    assert varied["se_pct"] == pytest.approx(1 / 3**0.5)
    assert varied["t"] == pytest.approx(2 * 3**0.5)
    # the same gap at every seed: a standard error of zero and no t
    assert same["mean_pct"] == pytest.approx(10.0) and same["se_pct"] == pytest.approx(0.0)
    assert same["t"] is None


@pytest.mark.parametrize("clash", ["seed1", "seed01"])
def test_a_seed_in_two_folders_is_refused(tmp_path, clash):
    first, second = tmp_path / "a", tmp_path / "b"
    for root, seed in ((first, 1), (second, 2)):
        _write(root, seed, "ref", {100: 3.0})
        _write(root, seed, "ref:v=on", {100: 3.03})
    (second / clash / "ref").mkdir(parents=True)
    with pytest.raises(SystemExit, match="seed 1 is in"):
        paired_seeds.pooled_gaps([first, second], "ref")


def test_a_folder_without_seeds_is_refused(tmp_path):
    _write(tmp_path / "a", 0, "ref", {100: 3.0})
    with pytest.raises(SystemExit, match="no seed<S> folder under .*missing"):
        paired_seeds.pooled_gaps([tmp_path / "a", tmp_path / "missing"], "ref")


def test_main_pools_folders_into_one_results_file(tmp_path, monkeypatch):
    first, second, out = tmp_path / "a", tmp_path / "b", tmp_path / "out"
    for root, seed, gap_val in ((first, 3, 3.06), (first, 4, 3.09), (second, 6, 3.12)):
        _write(root, seed, "ref", {100: 3.0})
        _write(root, seed, "ref:v=on", {100: gap_val})
    argv = [str(first), str(second), "--ref", "ref", "--name", "x", "--out-dir", str(out)]
    monkeypatch.setattr(sys, "argv", ["paired_seeds", *argv])
    paired_seeds.main()
    text = (out / "x.md").read_text()
    assert f"`python benchmarks/paired_seeds.py {first} {second} --ref ref --name x`" in text
    # gaps 2, 3, 4 %: mean 3, standard error 1/sqrt(3), t = 3 sqrt(3) = 5.2 with 2 df
    assert "| ref:v=on | +2.00, +3.00, +4.00 | +3.00 % | 1.00 % | 0.58 % | +5.2 (2) |" in text
    (row,) = json.loads((out / "x.json").read_text())["summary"]
    assert [r["seed"] for r in json.loads((out / "x.json").read_text())["records"]] == [3, 4, 6]
    assert row["t"] == pytest.approx(3 * 3**0.5)


def test_one_seed_has_no_spread():
    (row,) = paired_seeds.summary([{"run": "r", "final_gap_pct": 0.5}])
    assert row["std_pct"] is None and row["se_pct"] is None and row["t"] is None


def test_a_folder_without_pairs_is_refused(tmp_path, monkeypatch):
    _write(tmp_path, 0, "ref", {100: 4.0})
    monkeypatch.setattr(sys, "argv", ["paired_seeds", str(tmp_path), "--ref", "ref", "--name", "x"])
    with pytest.raises(SystemExit, match="no run beside 'ref'"):
        paired_seeds.main()
