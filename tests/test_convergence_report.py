"""benchmarks/convergence_report.py on real runs: a tiny model trained a few steps on the CPU
under bf16, fp4 and fp4 with a final-phase switch to bf16 (issue 15's report fields)."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from minifloat.train.compare import compare
from minifloat.train.config import TrainConfig
from scripts import load_benchmark

REQUIRED = ("recipe", "model", "tokens", "train_loss", "val_loss", "gap_pct", "tokens_per_s",
            "peak_mem_gib", "skipped_steps")  # fmt: skip
RUNS = ["bf16", "fp4", "fp4+switch=bf16+at=0.5"]


@pytest.fixture(scope="module")
def report() -> ModuleType:
    return load_benchmark("convergence_report")


def test_report_of_real_runs_with_a_switch(tmp_path: Path, report: ModuleType) -> None:
    base = TrainConfig(model="tiny", model_overrides={"dim": 32, "n_layers": 1, "n_heads": 2,
                       "ffn_dim": 64}, data="stdlib", tokenizer="byte", data_max_bytes=300_000,
                       cache_dir=str(tmp_path / "cache"), device="cpu", steps=6, batch_size=4,
                       seq_len=32, eval_every=3, eval_batches=1, log_every=2)  # fmt: skip
    runs = tmp_path / "runs"
    results = {r.recipe: r for r in compare(RUNS, base, out_dir=runs, progress=False).results}
    out = tmp_path / "report"
    report.main([str(runs), "--model", "tiny", "--tokens-per-step", str(4 * 32), "--order",
                 ",".join(RUNS), "--name", "convergence_cpu", "--out-dir", str(out)])  # fmt: skip
    records = {r["recipe"]: r for r in json.loads((out / "convergence_cpu.json").read_text())}
    assert list(records) == RUNS
    ref = results["bf16"].final_val_loss
    for name, rec in records.items():
        assert all(key in rec for key in REQUIRED), name
        result = results[name]
        assert rec["model"] == "tiny" and rec["tokens"] == result.tokens == 6 * 4 * 32
        assert rec["val_loss"] == result.final_val_loss and rec["val_step"] == 6
        assert rec["gap_pct"] == pytest.approx(100 * (result.final_val_loss - ref) / ref)
        assert rec["gap_step"] == 6 and rec["skipped_steps"] == result.skipped_steps
        assert rec["train_loss"] == pytest.approx(sum(result.losses[4:]) / 2)  # last window
        assert rec["tokens_per_s"] > 0 and rec["peak_mem_gib"] is None  # CPU: no peak
    assert records["bf16"]["gap_pct"] == 0.0 and records["fp4"]["gap_pct"] != 0.0
    assert "switch_recipe" not in records["fp4"]
    switched = records[RUNS[2]]
    assert (switched["switch_recipe"], switched["switch_at"], switched["switch_step"]) == (
        "bf16",
        0.5,
        3,
    )
    # compare branched the switched run from fp4 at its switch step.
    assert (switched["branched_from"], switched["branch_step"]) == ("fp4", 3)
    assert "branched_from" not in records["fp4"]
    assert (out / "convergence_cpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| fp4+switch=bf16+at=0.5 |" in (out / "convergence_cpu_table.md").read_text()
    titles = report.plot(report.load(runs), RUNS, tmp_path / "p.png", model="tiny",
                         tokens_per_step=128)  # fmt: skip
    assert all(str(tmp_path) not in t and "/" not in t for t in titles)
    assert "gap to bf16" in titles[1]


def test_gap_at_the_references_best_validation_step(report: ModuleType) -> None:
    # The reference overfits: its validation loss is lowest at step 2 and rises after; the
    # final gap (step 3) and the gap at the reference's best step (2) must both be reported.
    def rows(vals: dict[int, float]) -> list[dict]:
        return [{"step": s, "loss": 1.0, "tokens_per_s": 1.0} for s in vals] + [
            {"step": s, "val_loss": v} for s, v in vals.items()
        ]

    ref = rows({1: 3.0, 2: 2.0, 3: 2.5})
    run = rows({1: 3.1, 2: 2.1, 3: 2.4})
    rec = report.record("fp8", run, ref, common=3, model="tiny", tokens_per_step=1)
    assert rec["gap_step"] == 3 and rec["gap_pct"] == pytest.approx(100 * (2.4 - 2.5) / 2.5)
    assert rec["best_step"] == 2 and rec["best_gap_pct"] == pytest.approx(100 * 0.1 / 2.0)
    assert "+5.00% (2)" in report.markdown([rec])
    # Each run's own lowest (2.1 at step 2) against the reference's lowest (2.0).
    assert (rec["min_val_loss"], rec["min_val_step"]) == (2.1, 2)
    assert rec["min_gap_pct"] == pytest.approx(5.0)
    late = rows({1: 3.1, 2: 2.2, 3: 1.9})  # overfits later than the reference: lowest at 3
    rec = report.record("fp4", late, ref, common=3, model="tiny", tokens_per_step=1)
    assert rec["min_val_step"] == 3 and rec["min_gap_pct"] == pytest.approx(-5.0)
    assert "1.9000 (3): -5.00%" in report.markdown([rec])


def test_fp4_recipes_study_plans_its_six_runs() -> None:
    # issue 16's wrapper of convergence.sh: its queue at 50M, 3052 steps (100M tokens) each
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        ["bash", str(root / "benchmarks" / "fp4_recipes.sh"), "plan"],
        capture_output=True, text=True, check=True, cwd=root,
        # no done-runs file: a checkout's .carry/issue16_done.txt would drop its runs from plan
        env={"PATH": "/usr/bin:/bin", "PY": sys.executable, "DONE_FILE": "/nonexistent"},
    ).stdout  # fmt: skip
    planned = {w.removesuffix("(cont.)") for w in out.split() if w.startswith("a_50M/")}
    assert planned == {
        f"a_50M/{r}" for r in ("bf16", "fp4", "nvfp4", "mxfp4", "nvfp4:rht=off", "nvfp4:sr=off")
    }
    assert "h_125M" not in out


def test_common_step_is_the_last_one_every_run_logged(report: ModuleType) -> None:
    # A run stopped by a time limit logs its interrupted step (2901) off the others' grid of
    # 25: the train gap is taken at 2900, the last step both logged, not left empty at 2901.
    def rows(losses: dict[int, float]) -> list[dict]:
        return [{"step": s, "loss": v, "tokens_per_s": 1.0} for s, v in losses.items()]

    runs = {"bf16": rows({2875: 2.0, 2900: 2.0, 2925: 1.9}),
            "fp4": rows({2875: 2.2, 2900: 2.1, 2901: 1.0})}  # fmt: skip
    records = report.summarize(runs, ["bf16", "fp4"], tokens_per_step=1, model="50M")
    assert [r["common_step"] for r in records] == [2900, 2900]
    assert records[1]["train_gap_pct"] == pytest.approx(5.0)
    assert records[1]["tokens"] == 2901


@pytest.mark.parametrize(("seed", "fast_accum"), [("0", "0"), ("1", "0"), ("0", "1")])
def test_switch_study_plans_its_runs(seed: str, fast_accum: str) -> None:
    # issue 15's 100M-token switch study: fp4 with its switched run branched from it (one
    # lease), bf16, and fp8-tensorwise unless SEED names a rerun of the first three;
    # FAST_ACCUM=1 reruns the recipes with backward fast accumulation by default
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        ["bash", str(root / "benchmarks" / "switch_short.sh"), "plan"],
        capture_output=True, text=True, check=True, cwd=root,
        env={"PATH": "/usr/bin:/bin", "PY": sys.executable, "DONE_FILE": "/nonexistent",
             "PYTHONPATH": str(root / "src"), "SEED": seed,
             "FAST_ACCUM": fast_accum},
    ).stdout  # fmt: skip
    planned = {w.removesuffix("(cont.)") for w in out.split() if w.startswith("h_125M/")}
    want = {"h_125M/fp4+branch", "h_125M/bf16"}
    if seed == "0":
        want.add("h_125M/fp8-tensorwise")
    if fast_accum == "1":
        fast = ("fp8-tensorwise", "fp8-rowwise", "fp4-dge", "fp4-direct", "fp4")
        want = {f"h_125M/{r}" for r in fast}
    assert planned == want, out
    # FAST_ACCUM: fp4's run (~355 s) fits no call left in the first lease's three
    assert ("=> 2 leases" if fast_accum == "1" else "=> 1 leases") in out
