"""The final-phase precision switch (minifloat.train.switch): run names, the switch step, the
up-front checks, training across the switch, resume on either side of it, compare, compile."""

from __future__ import annotations

import copy
import dataclasses
import json
import warnings
from pathlib import Path

import pytest
import torch
from test_trainer import SMALL
from test_trainer import _config as _small_config
from torch import nn
from torch._dynamo.utils import counters

from minifloat.convert import convert, set_recipe
from minifloat.train.build import check_names
from minifloat.train.checkpoint import load_checkpoint
from minifloat.train.cli import _train_config, build_parser
from minifloat.train.compare import compare
from minifloat.train.config import ConfigError, TrainConfig
from minifloat.train.errors import CheckpointError
from minifloat.train.switch import parse_run_name, run_name, switch_step
from minifloat.train.trainer import train


def _config(tmp_path: Path, **changes) -> TrainConfig:
    """test_trainer's small CPU run, under fp4 unless `changes` say otherwise."""
    return _small_config(tmp_path, **{"recipe": "fp4", **changes})


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _same_bits(a: dict, b: dict) -> bool:
    """Two state dicts hold the same keys and bit-identical tensors."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- names and the switch step ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "fields"),
    [
        ("fp4", ("fp4", None, None)),
        ("fp4+switch=bf16+at=0.9", ("fp4", "bf16", 0.9)),
        ("fp4:dge.k=3+switch=fp4:dge.k=10+at=8240", ("fp4:dge.k=3", "fp4:dge.k=10", 8240.0)),
    ],
)
def test_run_names_round_trip(name: str, fields: tuple) -> None:
    parsed = parse_run_name(name)
    assert (parsed["recipe"], parsed["switch_recipe"], parsed["switch_at"]) == fields
    assert run_name(*fields) == name


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("fp4+switch=bf16", "expected RECIPE+switch=SWITCH_RECIPE+at=F"),
        ("+switch=bf16+at=0.9", "expected RECIPE+switch="),
        ("fp4+switch=+at=0.9", "expected RECIPE+switch="),
        ("fp4+switch=bf16+at=late", "switch-at must be a number, got 'late'"),
    ],
)
def test_malformed_run_names(name: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("+", r"\+")):
        parse_run_name(name)


@pytest.mark.parametrize(
    ("switch_at", "total", "step"),
    [(0.9, 10, 9), (0.9, 9156, 8240), (0.29, 100, 29), (0.5, 3, 1), (7, 10, 7), (7.0, 8, 7)],
)
def test_switch_step(switch_at: float, total: int, step: int) -> None:
    # 0.29 * 100 is 28.999999999999996 in binary floating point: the decimal value counts.
    assert switch_step(switch_at, total) == step


@pytest.mark.parametrize(
    ("switch_at", "total", "message"),
    [
        (0.05, 10, "leaves no step before the switch"),
        (10, 10, "switch-at step 10 is not before the last step (10 steps)"),
        (1, 1, "switch-at step 1 is not before the last step (1 steps)"),
    ],
)
def test_switch_step_needs_steps_on_both_sides(switch_at: float, total: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        switch_step(switch_at, total)


# ---- checks before any work ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"switch_recipe": "bf16"}, "switch-recipe bf16 needs switch-at"),
        ({"switch_at": 0.9}, "switch-at needs switch-recipe"),
        ({"switch_recipe": "fp4", "switch_at": 0.9}, "switch-recipe fp4 is the run's recipe"),
        ({"switch_recipe": "bf16", "switch_at": 1.5}, "switch-at must be a fraction in (0, 1)"),
        ({"switch_recipe": "bf16", "switch_at": -0.5}, "switch-at must be a fraction"),
        ({"switch_recipe": "bf16", "switch_at": float("nan")}, "switch-at must be a fraction"),
        ({"switch_recipe": "bf16", "switch_at": 10}, "switch-at step 10 is not before the last"),
        ({"switch_recipe": "bf16", "switch_at": 0.01}, "leaves no step before the switch"),
    ],
)
def test_invalid_switch_settings(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        TrainConfig(recipe="fp4", steps=10, **changes)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"switch_recipe": "fp5", "switch_at": 0.5}, "switch-recipe: unknown recipe 'fp5'"),
        ({"switch_recipe": "fp4:dge.k=5", "switch_at": 0.5}, "computes exactly as recipe fp4"),
        ({"switch_recipe": "fp16", "switch_at": 0.5}, "differ in fp16 loss scaling"),
        ({"recipe": "fp4+switch=bf16+at=0.9"}, "--switch-recipe bf16 --switch-at 0.9"),
    ],
)
def test_switch_recipe_names_fail_before_data_work(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("+", r"\+")):
        check_names(TrainConfig(**{"recipe": "fp4", **changes}))


def test_a_switch_the_layers_cannot_take_fails_at_the_start(tmp_path: Path, dataset) -> None:
    config = _config(tmp_path, switch_recipe="fp8-blockwise", switch_at=0.5)
    with pytest.raises(ConfigError, match="switch-recipe fp8-blockwise: layer .* not multiples"):
        train(config, dataset=dataset, progress=False)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_fingerprint_holds_the_switch_only_when_there_is_one() -> None:
    plain = TrainConfig(recipe="fp4", steps=10).trajectory_fields(1)
    assert "switch_recipe" not in plain and "switch_at" not in plain  # old checkpoints fit
    switched = TrainConfig(recipe="fp4", steps=10, switch_recipe="bf16", switch_at=0.9)
    assert switched.trajectory_fields(1) == {**plain, "switch_recipe": "bf16", "switch_at": 0.9}
    # A step number is the same setting whether given as 8 (Python) or 8.0 (flag, TOML).
    step = TrainConfig(recipe="fp4", steps=10, switch_recipe="bf16", switch_at=8)
    assert step.switch_at == 8.0 and type(step.switch_at) is float


# ---- training across the switch ---------------------------------------------------------------


def test_the_switch_takes_effect_after_its_step_and_is_logged(tmp_path: Path, dataset) -> None:
    common = {"eval_every": 0, "log_every": 3, "save_checkpoints": False}
    plain = train(_config(tmp_path / "p", **common), dataset=dataset, progress=False)
    config = _config(tmp_path / "s", **common, switch_recipe="bf16", switch_at=0.5)
    switched = train(config, dataset=dataset, progress=False)
    assert switched.losses[:4] == plain.losses[:4]  # fp4 up to the switch, bit for bit
    assert all(a != b for a, b in zip(switched.losses[4:], plain.losses[4:], strict=True))
    assert switched.recipe == "fp4+switch=bf16+at=0.5"
    assert (switched.switch_recipe, switched.switch_at) == ("bf16", 0.5)
    # A record closes the last fp4 window at the switch (step 4 is not on the log cadence).
    recipes = [(r["step"], r["recipe"]) for r in _records(switched.metrics_path)]
    assert recipes == [(3, "fp4"), (4, "fp4"), (6, "bf16"), (8, "bf16")]


def test_bf16_before_a_switch_computes_as_a_plain_bf16_run(tmp_path: Path, dataset) -> None:
    """bf16 -> fp4: the model is converted to fp4 and set to bf16 until the switch; its layers
    then compute exactly as a model never converted (the bf16 baseline), optimizer included."""
    common = {"recipe": "bf16", "eval_every": 0, "save_checkpoints": False}
    plain = train(_config(tmp_path / "p", **common), dataset=dataset, progress=False)
    config = _config(tmp_path / "s", **common, switch_recipe="fp4", switch_at=4)
    switched = train(config, dataset=dataset, progress=False)
    assert switched.losses[:4] == plain.losses[:4]
    assert switched.losses[4:] != plain.losses[4:]


# fp8-tensorwise -> fp8-delayed: a checkpoint after the switch holds amax histories the run's
# own recipe has no buffer for (the model takes the checkpoint step's recipe before loading);
# fp8-delayed -> fp4 drops them; bf16 -> fp4 starts from a converted model set to bf16.
@pytest.mark.parametrize(
    ("recipe", "switch", "stop"),
    [
        ("fp4", "bf16", 3),
        ("fp4", "bf16", 6),
        ("fp8-tensorwise", "fp8-delayed", 6),
        ("fp8-delayed", "fp4", 6),
        ("bf16", "fp4", 6),
    ],
)
def test_resume_across_the_switch_is_bit_exact(
    tmp_path: Path, dataset, recipe: str, switch: str, stop: int
) -> None:
    changes = {"recipe": recipe, "switch_recipe": switch, "switch_at": 0.5}
    straight = train(_config(tmp_path / "a", **changes), dataset=dataset, progress=False)
    config = _config(tmp_path / "b", **changes)
    half = train(dataclasses.replace(config, stop_after=stop), dataset=dataset, progress=False)
    assert half.losses == straight.losses[:stop]
    # `minifloat train --out DIR --resume` takes the switch from the checkpoint.
    args = build_parser().parse_args(["train", "--out", config.out_dir, "--resume"])
    assert (_train_config(args).switch_recipe, _train_config(args).switch_at) == (switch, 0.5)
    rest = train(dataclasses.replace(config, resume=True), dataset=dataset, progress=False)
    assert rest.losses == straight.losses and rest.val_losses == straight.val_losses
    a = load_checkpoint(tmp_path / "a" / "run" / "checkpoint.pt")
    b = load_checkpoint(tmp_path / "b" / "run" / "checkpoint.pt")
    assert _same_bits(a["model"], b["model"])  # parameters (and histories) bit for bit
    logged = [(r["step"], r["recipe"]) for r in _records(rest.metrics_path) if "loss" in r]
    steps = sorted({2, 4, 6, 8, stop})  # the log cadence, and a record at the stop's checkpoint
    assert logged == [(step, recipe if step <= 4 else switch) for step in steps]


def test_resume_falls_back_across_the_switch(tmp_path: Path, dataset) -> None:
    """The newest checkpoint (after the switch) is damaged: the run resumes from the one before
    the switch, back under its own recipe, and still ends bit for bit as the straight run."""
    changes = {"recipe": "fp8-tensorwise", "switch_recipe": "fp8-delayed", "switch_at": 5,
               "ckpt_every": 2}  # fmt: skip
    straight = train(_config(tmp_path / "a", **changes), dataset=dataset, progress=False)
    config = _config(tmp_path / "b", **changes)
    train(dataclasses.replace(config, stop_after=6), dataset=dataset, progress=False)
    newest = tmp_path / "b" / "run" / "checkpoint.pt"
    newest.write_bytes(newest.read_bytes()[:-100])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rest = train(dataclasses.replace(config, resume=True), dataset=dataset, progress=False)
    assert any("(step 4)" in str(w.message) for w in caught)
    assert rest.losses == straight.losses


def test_resume_with_another_switch_is_a_mismatch(tmp_path: Path, dataset) -> None:
    config = _config(tmp_path, switch_recipe="bf16", switch_at=0.5, stop_after=2)
    train(config, dataset=dataset, progress=False)
    other = dataclasses.replace(config, switch_at=0.75, stop_after=None, resume=True)
    with pytest.raises(CheckpointError, match="switch_at: checkpoint=0.5, now=0.75"):
        train(other, dataset=dataset, progress=False)


@pytest.mark.parametrize("scope", ["model", "block"])
def test_a_compiled_model_follows_the_switch(scope: str) -> None:
    """torch.compile guards on each layer's recipe: after set_recipe the compiled model (one
    graph, or each child compiled in place as the trainer's default scope does) recompiles and
    computes as the eager one, instead of replaying the old recipe's graph. (The trainer relies
    on this; dynamo's guards do not depend on the backend.)"""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    convert(eager, "fp4")
    model = copy.deepcopy(eager)
    if scope == "model":
        compiled = torch.compile(model, backend="eager")
    else:
        for child in model:
            child.compile(backend="eager")
        compiled = model
    x = torch.randn(16, 32)
    outputs, graphs = [], []
    for recipe in ("fp4", "bf16", "fp8-tensorwise", "fp4"):
        set_recipe(eager, recipe)
        set_recipe(model, recipe)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            want, got = eager(x), compiled(x)
        assert torch.equal(want, got), recipe
        outputs.append(want)
        graphs.append(counters["stats"]["unique_graphs"])
    assert not torch.equal(outputs[0], outputs[1]) and not torch.equal(outputs[0], outputs[2])
    # New graphs at each switch; back to fp4, the graphs compiled for it serve again.
    assert graphs[0] < graphs[1] < graphs[2] == graphs[3], graphs


# ---- compare ----------------------------------------------------------------------------------


def test_compare_trains_a_switched_run_beside_its_recipe(tmp_path: Path) -> None:
    base = TrainConfig(model="tiny", model_overrides=SMALL, data="stdlib", tokenizer="byte",
                       data_max_bytes=300_000, cache_dir=str(tmp_path / "cache"), device="cpu",
                       steps=4, batch_size=4, seq_len=32, eval_every=0,
                       eval_batches=1)  # fmt: skip
    names = ["fp4", "fp4+switch=bf16+at=0.5"]
    result = compare(names, base, out_dir=tmp_path / "out", progress=False)
    assert [r.recipe for r in result.results] == names
    assert (tmp_path / "out" / names[1] / "metrics.jsonl").is_file()
    summary = json.loads(result.json_path.read_text())
    rows = {row["recipe"]: row for row in summary["results"]}
    assert "switch_recipe" not in rows["fp4"]
    assert (rows[names[1]]["switch_recipe"], rows[names[1]]["switch_at"]) == ("bf16", 0.5)
    assert summary["losses"][names[1]][:2] == summary["losses"]["fp4"][:2]
    assert f"| {names[1]} |" in result.markdown_path.read_text()


@pytest.mark.parametrize(
    ("names", "changes", "message"),
    [
        (["fp4", "fp4+switch=bf16+at=0.5", "fp4+switch=bf16+at=0.50"], {}, "named more than"),
        (["fp4+switch=fp4+at=0.5"], {}, "run fp4+switch=fp4+at=0.5: switch-recipe fp4 is the"),
        (["fp4+switch=bf16+at=2.5"], {}, "switch-at must be a fraction"),
        (["fp4+switch=fp5+at=0.5"], {}, "switch-recipe: unknown recipe 'fp5'"),
        (
            ["fp4"],
            {"recipe": "fp4", "switch_recipe": "bf16", "switch_at": 0.5},
            "compare takes a switch per run",
        ),
    ],
)
def test_compare_refuses_bad_switched_runs_before_any_work(
    tmp_path: Path, names: list[str], changes: dict, message: str
) -> None:
    with pytest.raises(ConfigError, match=message.replace("+", r"\+")):
        compare(names, TrainConfig(steps=10, **changes), out_dir=tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []
