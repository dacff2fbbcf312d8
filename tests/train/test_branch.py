"""Branching a switched run from its plain run (minifloat.train.branch): the branched run ends
bit for bit as the switched run trained from scratch, carries the shared records, resumes from
its own directory, refuses sources that do not fit with one line, and never writes the source."""

from __future__ import annotations

import hashlib
import json
import shutil
import warnings
from pathlib import Path

import pytest
from test_switch import _config, _records, _same_bits

from minifloat.train.branch import find_branch_point
from minifloat.train.checkpoint import load_checkpoint
from minifloat.train.cli import _train_config, build_parser, main
from minifloat.train.compare import compare
from minifloat.train.config import ConfigError, TrainConfig
from minifloat.train.errors import RunDirError
from minifloat.train.trainer import train

# fp4 for 8 steps, the last ones in bf16 after the switch: at 0.5 the switch step is 4.
SWITCH = {"switch_recipe": "bf16", "switch_at": 0.5}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, dataset) -> dict[str, Path]:
    """The plain fp4 run (checkpoints at steps 2, 4 and 8: ckpt_at and its end) and the
    switched runs from scratch that branches are compared with (switch after step 4 and 6)."""
    root = tmp_path_factory.mktemp("branch")
    plain = _config(root / "plain", ckpt_every=0, ckpt_at=(0.25, 0.5), keep_checkpoints=3)
    train(plain, dataset=dataset, progress=False)
    for name, at in (("at4", 0.5), ("at6", 6)):
        config = _config(root / name, switch_recipe="bf16", switch_at=at)
        train(config, dataset=dataset, progress=False)
    return {name: root / name / "run" for name in ("plain", "at4", "at6")}


def _snapshot(directory: Path) -> dict[str, tuple[str, int]]:
    """SHA-256 and mtime of every file under ``directory``: what must not change."""
    files = [p for p in sorted(directory.rglob("*")) if p.is_file()]
    digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
    return {str(p.relative_to(directory)): (digest(p), p.stat().st_mtime_ns) for p in files}


def _final_state(run: Path) -> dict:
    return load_checkpoint(run / "checkpoint.pt")


def _branch(tmp_path: Path, source: Path, dataset, **changes):  # noqa: ANN001, ANN202
    config = _config(tmp_path, **{**SWITCH, "branch_from": str(source), **changes})
    return train(config, dataset=dataset, progress=False)


@pytest.mark.parametrize(("at", "scratch", "branch_step"), [(0.5, "at4", 4), (6, "at6", 4)])
def test_a_branched_run_ends_as_the_switched_run_from_scratch(
    tmp_path: Path, dataset, runs: dict[str, Path], at: float, scratch: str, branch_step: int
) -> None:
    """At the switch step, or before it (then it trains the plain recipe up to the switch)."""
    before = _snapshot(runs["plain"])
    result = _branch(tmp_path, runs["plain"], dataset, switch_at=at)
    assert _snapshot(runs["plain"]) == before  # the source is only read
    want = _final_state(runs[scratch])
    got = _final_state(tmp_path / "run")
    assert got["losses"] == want["losses"] and got["val_losses"] == want["val_losses"]
    assert _same_bits(got["model"], want["model"])
    assert got["optimizer"]["state"].keys() == want["optimizer"]["state"].keys()
    for key, state in want["optimizer"]["state"].items():
        assert _same_bits(got["optimizer"]["state"][key], state), key
    assert got["branch"] == {"from": str(runs["plain"]), "step": branch_step}
    assert (result.branched_from, result.branch_step) == (str(runs["plain"]), branch_step)
    assert result.steps == 8 and list(result.losses) == want["losses"]
    # The shared records are the source's, then a record of the branch, then the run's own.
    source = [r for r in _records(runs["plain"] / "metrics.jsonl") if r["step"] <= branch_step]
    records = _records(result.metrics_path)
    marker = {"step": branch_step, "branched_from": str(runs["plain"]), "branch_step": branch_step}
    assert records[: len(source) + 1] == [*source, marker]
    own = [(r["step"], r["recipe"], r["loss"]) for r in records[len(source) + 1 :] if "loss" in r]
    reference = [(r["step"], r["recipe"], r["loss"]) for r in _records(runs[scratch] /
                 "metrics.jsonl") if "loss" in r and r["step"] > branch_step]  # fmt: skip
    assert own == reference


def test_a_branched_run_resumes_from_its_own_directory(
    tmp_path: Path, dataset, runs: dict[str, Path]
) -> None:
    """Stopped at the branch step itself, it has only branched: its own checkpoint is there,
    and `--resume` (which does not take branch-from over) finishes it exactly."""
    half = _branch(tmp_path, runs["plain"], dataset, stop_after=4)
    assert half.steps == 4 and half.checkpoint_path == tmp_path / "run" / "checkpoint.pt"
    args = build_parser().parse_args(["train", "--out", str(tmp_path / "run"), "--resume"])
    config = _train_config(args)
    assert config.branch_from is None and config.switch_recipe == "bf16"
    rest = train(config, dataset=dataset, progress=False)
    want = _final_state(runs["at4"])
    assert list(rest.losses) == want["losses"]
    assert _same_bits(_final_state(tmp_path / "run")["model"], want["model"])
    assert (rest.branched_from, rest.branch_step) == (str(runs["plain"]), 4)
    markers = [r for r in _records(rest.metrics_path) if "branched_from" in r]
    assert len(markers) == 1


def _truncate(data: bytes) -> bytes:
    return data[:-100]


def _flip(data: bytes) -> bytes:
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x01
    return bytes(flipped)


@pytest.mark.parametrize("damage", [_truncate, _flip])
def test_a_damaged_checkpoint_is_passed_over_and_left_alone(
    tmp_path: Path, dataset, runs: dict[str, Path], damage
) -> None:
    """A header that does not read is passed over when choosing; a digest that does not match,
    when loading: either way the branch starts from the next older checkpoint (step 2)."""
    source = tmp_path / "source"
    shutil.copytree(runs["plain"], source)
    damaged = source / "checkpoint.1.pt"  # step 4
    damaged.write_bytes(damage(damaged.read_bytes()))
    before = _snapshot(source)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = _branch(tmp_path / "b", source, dataset)
    assert any("checkpoint.1.pt" in str(w.message) for w in caught)
    assert _snapshot(source) == before
    assert result.branch_step == 2 and list(result.losses) == _final_state(runs["at4"])["losses"]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"lr": 1e-3}, "differs from this one in more than the switch (lr: checkpoint=0.003, now"),
        ({"seed": 1}, "(seed: checkpoint=0, now=1)"),
        ({"switch_at": 1}, "no checkpoint at or before the switch step 1 (its checkpoints are at "
                           "steps 8, 4, 2); checkpoint the plain run at that step"),
        ({"branch_from": "{plain}/checkpoint.pt"}, "its step 8 is after the switch step 4"),
        ({"branch_from": "{tmp}/missing"}, "no such run directory or checkpoint"),
        ({"branch_from": "{tmp}"}, "no checkpoint there (looked for checkpoint.pt and"),
        ({"branch_from": "{tmp}/run"}, "is this run's own --out"),
    ],
)  # fmt: skip
def test_a_source_that_does_not_fit_is_refused_in_one_line(
    tmp_path: Path, dataset, runs: dict[str, Path], changes: dict, message: str
) -> None:
    if "branch_from" in changes:
        where = changes["branch_from"].format(plain=runs["plain"], tmp=tmp_path)
        changes = {**changes, "branch_from": where}
        if where.endswith("/run"):
            (tmp_path / "run").mkdir()
    before = _snapshot(runs["plain"])
    with pytest.raises(ConfigError) as info:
        _branch(tmp_path, runs["plain"], dataset, **changes)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert _snapshot(runs["plain"]) == before
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_refused_branch_replaces_no_earlier_run(tmp_path: Path, dataset, runs) -> None:
    """The source is checked before the run directory is touched, --overwrite or not."""
    train(_config(tmp_path, steps=2), dataset=dataset, progress=False)
    before = _snapshot(tmp_path / "run")
    with pytest.raises(ConfigError, match="lr: checkpoint=0.003"):
        _branch(tmp_path, runs["plain"], dataset, lr=1e-3, overwrite=True)
    with pytest.raises(RunDirError, match="already holds a run"):
        _branch(tmp_path, runs["plain"], dataset)
    assert _snapshot(tmp_path / "run") == before


def test_the_command_line_refuses_in_one_line(tmp_path: Path, capsys) -> None:
    flags = ["train", "--recipe", "fp4", "--switch-recipe", "bf16", "--switch-at", "0.5",
             "--steps", "8", "--device", "cpu", "--out", str(tmp_path / "run")]  # fmt: skip
    args = build_parser().parse_args([*flags, "--branch-from", "runs/fp4"])
    assert _train_config(args).branch_from == "runs/fp4"
    assert main([*flags, "--branch-from", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("minifloat: error: branch-from ") and err.count("\n") == 1
    assert "no such run directory or checkpoint" in err and not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"branch_from": "x"}, "branch-from needs switch-recipe and switch-at"),
        ({**SWITCH, "branch_from": "x", "resume": True}, "give either resume or branch-from"),
        ({"ckpt_at": (1.5,)}, "ckpt-at must be a fraction in (0, 1) of the steps or a whole"),
        ({"ckpt_at": 0.5}, "ckpt-at must be a list of numbers, got 0.5"),
    ],
)
def test_branch_settings_are_checked_up_front(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        TrainConfig(recipe="fp4", steps=8, **changes)
    assert message in str(info.value)


def test_ckpt_at_reads_from_toml_and_stays_out_of_the_fingerprint(tmp_path: Path, dataset) -> None:
    config = TrainConfig.from_dict({"steps": 8, "ckpt_at": [0.5, 3]})
    assert config.ckpt_at == (0.5, 3.0)
    assert config.trajectory_fields(1) == TrainConfig(steps=8).trajectory_fields(1)
    with pytest.raises(ConfigError, match="ckpt-at step 9 is outside the run"):
        train(_config(tmp_path, ckpt_at=(9,)), dataset=dataset, progress=False)


def test_the_branch_point_is_chosen_by_step_among_both_formats(runs: dict[str, Path]) -> None:
    """Rank 0's choice (find_branch_point) reads headers only: newest step first."""
    config = _config(runs["plain"].parent / "x", **SWITCH, branch_from=str(runs["plain"]))
    point = find_branch_point(config, world_size=1)
    assert [step for _, step in point.candidates] == [4, 2]
    assert point.run_dir == runs["plain"]


def test_compare_branches_a_switched_run_from_its_plain_run(tmp_path: Path, dataset) -> None:
    base = TrainConfig(model="tiny", model_overrides={"dim": 32, "n_layers": 1, "n_heads": 2,
                       "ffn_dim": 64}, data="stdlib", tokenizer="byte", data_max_bytes=300_000,
                       cache_dir=str(tmp_path / "cache"), device="cpu", steps=4, batch_size=4,
                       seq_len=32, eval_every=2, eval_batches=1, log_every=1)  # fmt: skip
    names = ["fp4+switch=bf16+at=0.5", "fp4"]  # the plain run trains first all the same
    branched = compare(names, base, out_dir=tmp_path / "b", progress=False)
    scratch = compare(names, base, out_dir=tmp_path / "s", progress=False, branch=False)
    assert [r.recipe for r in branched.results] == names
    for got, want in zip(branched.results, scratch.results, strict=True):
        assert got.losses == want.losses and got.val_losses == want.val_losses
    assert branched.results[0].branch_step == 2 and scratch.results[0].branched_from is None
    rows = json.loads(branched.json_path.read_text())["results"]
    assert (rows[0]["branched_from"], rows[0]["branch_step"]) == ("fp4", 2)
    assert "branched_from" not in rows[1]
    assert "fp4+switch=bf16+at=0.5: branched from fp4 at step 2" in branched.table
    # The plain run kept its checkpoint at the switch step (and its end); the others save none.
    steps = [load_checkpoint(tmp_path / "b" / "fp4" / n)["step"]
             for n in ("checkpoint.pt", "checkpoint.1.pt")]  # fmt: skip
    assert steps == [4, 2]
    assert not list((tmp_path / "b" / names[0]).glob("checkpoint*"))
    assert not list((tmp_path / "s" / "fp4").glob("checkpoint*"))
