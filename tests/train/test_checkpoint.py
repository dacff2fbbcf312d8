"""Tests for minifloat.train.checkpoint: atomic, verified, fingerprinted checkpoints."""

from __future__ import annotations

import datetime
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from minifloat.train.checkpoint import (
    CheckpointError,
    capture_rng_state,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from minifloat.train.checkpointer import read_stored_config

FIELDS = {"recipe": "bf16", "model": "tiny", "lr": 1e-3, "betas": (0.9, 0.95)}


def _state() -> dict:
    return {
        "model": {"w": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)},
        "step": 7,
        "losses": [3.5, 3.25],
    }


def test_round_trip(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path / "c.pt", _state(), fields=FIELDS)
    state = load_checkpoint(path, fields=dict(reversed(FIELDS.items())))
    assert state["step"] == 7 and state["losses"] == [3.5, 3.25]
    assert torch.equal(state["model"]["w"], _state()["model"]["w"])
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]  # no temp file left behind


def test_mismatched_fields_name_the_difference(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path / "c.pt", _state(), fields=FIELDS)
    with pytest.raises(CheckpointError, match=r"recipe: checkpoint='bf16', now='fp4'"):
        load_checkpoint(path, fields={**FIELDS, "recipe": "fp4"})


def test_missing_truncated_and_flipped_files_raise(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_checkpoint(tmp_path / "absent.pt")
    path = save_checkpoint(tmp_path / "c.pt", _state(), fields=FIELDS)
    data = path.read_bytes()
    (tmp_path / "trunc.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="trunc.pt is not a valid minifloat checkpoint"):
        load_checkpoint(tmp_path / "trunc.pt")
    # Flip one bit inside the tensor payload: the zip container still loads, the digest catches it.
    marker = bytes(torch.arange(12, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes())
    offset = data.index(marker) + 5
    flipped = bytearray(data)
    flipped[offset] ^= 0x01
    (tmp_path / "flip.pt").write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match="digest"):
        load_checkpoint(tmp_path / "flip.pt")


@pytest.mark.parametrize("content", ["garbage", "foreign pickle"])
def test_garbage_file_is_one_line_error(tmp_path: Path, content: str) -> None:
    path = tmp_path / "checkpoint.pt"
    if content == "garbage":
        path.write_bytes(b"not a checkpoint at all\n" * 10)
    else:  # a real torch file whose pickle holds a class weights_only refuses
        torch.save({"when": datetime.date(2026, 1, 1)}, path)
    for read in (load_checkpoint, read_stored_config):
        with pytest.raises(CheckpointError) as info:
            read(path)
        message = str(info.value)
        assert message.startswith(f"{path} is not a valid minifloat checkpoint (")
        assert message.endswith(")") and "\n" not in message
        assert "weights_only" not in message and len(message) < 250
    if content == "foreign pickle":
        assert "unsupported pickle content" in message and "datetime.date" in message


def test_foreign_torch_file_is_rejected(tmp_path: Path) -> None:
    torch.save({"weights": torch.zeros(2)}, tmp_path / "foreign.pt")
    with pytest.raises(CheckpointError, match="not a valid minifloat checkpoint .*header"):
        load_checkpoint(tmp_path / "foreign.pt")
    with pytest.raises(CheckpointError, match="not a valid minifloat checkpoint .*header"):
        read_stored_config(tmp_path / "foreign.pt")


def test_read_stored_config(tmp_path: Path) -> None:
    config = {"recipe": "fp4", "steps": 9, "model_overrides": {"dim": 32}}
    path = save_checkpoint(tmp_path / "c.pt", {**_state(), "config": config}, fields=FIELDS)
    assert read_stored_config(path) == config
    bare = save_checkpoint(tmp_path / "bare.pt", _state(), fields=FIELDS)
    with pytest.raises(CheckpointError, match="holds no run settings"):
        read_stored_config(bare)


def test_failed_save_keeps_previous_checkpoint(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path / "c.pt", _state(), fields=FIELDS)
    with pytest.raises(Exception):  # noqa: B017 - any pickling failure will do
        save_checkpoint(path, {"bad": lambda: None}, fields=FIELDS)
    assert load_checkpoint(path, fields=FIELDS)["step"] == 7
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]


def test_rng_state_round_trip() -> None:
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    state = capture_rng_state()
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    restore_rng_state(state)
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1]
    assert torch.equal(got[2], expected[2])


def test_rng_state_survives_save_and_load(tmp_path: Path) -> None:
    torch.manual_seed(5)
    path = save_checkpoint(tmp_path / "c.pt", {"rng": capture_rng_state()}, fields=FIELDS)
    expected = torch.rand(4)
    torch.manual_seed(0)
    restore_rng_state(load_checkpoint(path)["rng"])
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_read_stored_config_of_sharded_checkpoint(tmp_path: Path) -> None:
    from minifloat.train.sharded_checkpoint import save_sharded

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    config = {"recipe": "fp4", "parallel": "fsdp"}
    path = save_sharded(tmp_path / "checkpoint.dcp", model=model, optimizer=optimizer,
                        global_state={"step": 1, "config": config}, rank_state={},
                        fields=FIELDS)  # fmt: skip
    assert path.is_dir() and read_stored_config(path) == config
