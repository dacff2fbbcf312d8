"""Tests for minifloat.train.checkpointer: the newest N checkpoints of a run, and the fallback
to an older one when the newest is damaged."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from minifloat.train import CheckpointError, TrainConfig, train
from minifloat.train.checkpoint import load_checkpoint
from minifloat.train.checkpointer import read_run_config
from minifloat.train.errors import CheckpointMismatchError, RunWarning

SMALL = {"dim": 32, "n_layers": 1, "n_heads": 2, "ffn_dim": 64}


def _config(tmp_path: Path, **changes) -> TrainConfig:
    base = TrainConfig(recipe="fp32", model="tiny", model_overrides=SMALL, steps=12,
                       batch_size=2, seq_len=32, eval_batches=0, log_every=1, ckpt_every=2,
                       device="cpu", out_dir=str(tmp_path / "run"))  # fmt: skip
    return dataclasses.replace(base, **changes)


def _steps(config: TrainConfig) -> list[int]:
    lines = (Path(config.out_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]


def test_keeps_the_newest_n_checkpoints(tmp_path: Path, dataset) -> None:
    config = _config(tmp_path, stop_after=6, keep_checkpoints=3)
    train(config, dataset=dataset, progress=False)
    out = Path(config.out_dir)
    names = sorted(p.name for p in out.iterdir())
    assert names == ["checkpoint.1.pt", "checkpoint.2.pt", "checkpoint.pt", "metrics.jsonl"]
    saved = [load_checkpoint(out / n)["step"] for n in names[:3]]
    assert saved == [4, 2, 6]  # checkpoint.1.pt: step 4, .2: step 2, newest: step 6
    path, stored = read_run_config(out, ("full",))  # what `--resume` takes its settings from
    assert path == out / "checkpoint.pt" and stored["keep_checkpoints"] == 3


def test_resume_falls_back_to_the_previous_checkpoint(tmp_path: Path, dataset) -> None:
    full = train(_config(tmp_path / "a"), dataset=dataset, progress=False)
    config = _config(tmp_path / "b", stop_after=6)
    train(config, dataset=dataset, progress=False)
    newest = Path(config.out_dir) / "checkpoint.pt"
    newest.write_bytes(newest.read_bytes()[:-200])  # torn
    expected = r"resuming from .*checkpoint.1.pt \(step 4\).*checkpoint.pt: .*not a valid"
    with pytest.warns(RunWarning, match=expected):
        resume = dataclasses.replace(config, resume=True, stop_after=None)
        rest = train(resume, dataset=dataset, progress=False)
    assert rest.losses == full.losses  # steps 5 and 6 trained again, identically
    assert _steps(config) == list(range(1, 13))  # each step logged once


def test_every_checkpoint_damaged_is_the_newest_ones_error(tmp_path: Path, dataset) -> None:
    config = _config(tmp_path, stop_after=4)
    train(config, dataset=dataset, progress=False)
    for name in ("checkpoint.pt", "checkpoint.1.pt"):
        (Path(config.out_dir) / name).write_bytes(b"\0" * 64)
    with pytest.raises(CheckpointError, match=r"checkpoint.pt is not a valid minifloat"):
        train(dataclasses.replace(config, resume=True), dataset=dataset, progress=False)


def test_a_checkpoint_of_another_run_is_no_reason_to_fall_back(tmp_path: Path, dataset) -> None:
    config = _config(tmp_path, stop_after=4)
    train(config, dataset=dataset, progress=False)
    with pytest.raises(CheckpointMismatchError, match="lr: checkpoint=0.001"):
        train(dataclasses.replace(config, resume=True, lr=2e-3), dataset=dataset,
              progress=False)  # fmt: skip
    assert {p.name for p in Path(config.out_dir).iterdir()} >= {"checkpoint.pt", "checkpoint.1.pt"}
